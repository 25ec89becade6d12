"""``birdnet demo``: a local cluster on an embedded default.

Starts N birdnetd daemons on loopback with their own hosts file and N training processes that train
an MLP on scikit-learn's handwritten digits data-parallel through birdnet, shows progress, and ends
with accuracy and bytes exchanged. Leaves no process, socket or shared-memory segment behind,
Ctrl-C included.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="birdnet demo", description=__doc__.split("\n\n")[1])
    p.add_argument("--nodes", type=int, default=4, help="daemons (one training process each), default 4")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--codec", default=None, help="codec for the gradients (default: the daemons' default, none)")
    p.add_argument("--codec-params", default="{}", help='JSON, e.g. \'{"density": 0.01, "momentum": 0.9}\'')
    p.add_argument("--data", default="digits", choices=["digits", "mnist1d"])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args(argv)
    try:
        import sklearn  # noqa: F401
    except ImportError:
        if a.data == "digits":
            print("birdnet demo needs scikit-learn for its data set: pip install 'birdnet[demo]'", file=sys.stderr)
            return 2
    from birdnet.bench.cluster import LocalCluster
    from birdnet.bench.trainlib import one_thread_per_worker, train_worker

    one_thread_per_worker()

    cfg = {"data": a.data, "seed": a.seed, "epochs": a.epochs, "lr": a.lr, "momentum": 0.9, "batch": 32,
           "hidden": (128, 128), "codec": a.codec, "params": json.loads(a.codec_params), "job": "demo"}
    with tempfile.TemporaryDirectory(prefix="birdnet-demo-") as tmp:
        cluster = LocalCluster(a.nodes, Path(tmp))
        print(f"birdnet demo: {a.nodes} daemons on loopback (hosts file {cluster.hosts}), "
              f"{a.nodes} training processes, data {a.data}, codec {a.codec or 'none'}")
        t0 = time.monotonic()
        workers = None
        try:
            cluster.start()
            cfg["progress"] = mp.get_context("spawn").Queue()
            workers = cluster.run_async(train_worker, cfg)
            while not workers.ready():
                try:
                    h = cfg["progress"].get(timeout=0.5)
                    bar = "#" * int(30 * h["epoch"] / a.epochs)
                    print(f"\r  epoch {h['epoch']:>3}/{a.epochs} [{bar:<30}] test accuracy {h['acc']:.3f} "
                          f"loss {h['loss']:.3f}", end="", flush=True)
                except queue.Empty:
                    pass
            results = workers.get(timeout=600)
        except KeyboardInterrupt:
            print("\ninterrupted; stopping the cluster", file=sys.stderr)
            if workers is not None:
                workers.terminate()
            return 130
        finally:
            codes = cluster.stop()
        print()
    same = len({r["params_digest"] for r in results}) == 1
    res = {"nodes": a.nodes, "sockets": cluster.sockets, "accuracy": results[0]["acc"], "loss": results[0]["loss"],
           "bytes_sent_per_worker": results[0]["bytes_sent"], "seconds": time.monotonic() - t0,
           "identical_parameters_on_all_nodes": same, "daemon_exit_codes": codes}
    if a.json:
        print(json.dumps(res))
    else:
        print(f"final test accuracy {res['accuracy']:.3f}, loss {res['loss']:.3f}; "
              f"{res['bytes_sent_per_worker'] / 1e6:.1f} MB sent per worker; {res['seconds']:.1f} s; "
              f"parameters identical on all nodes: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
