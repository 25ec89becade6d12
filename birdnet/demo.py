"""``birdnet demo``: dense and compressed training side by side on a local cluster.

Starts N birdnetd daemons with their own hosts file and N training processes that train an MLP on
scikit-learn's handwritten digits data-parallel through birdnet, once per codec (dense, marsit,
birdplus), and prints one table: accuracy, bytes sent per worker, how many times fewer than
dense, time, and whether every node ended with bit-identical parameters. As root (where 'ip
netns' works) each daemon runs in a network namespace of its own on a link shaped to --rate
(100 Mbit/s), so the time column shows what compression is for; on loopback, which has no
bandwidth limit, the compressed codecs save bytes but not time. Leaves no process, socket,
namespace or shared-memory segment behind, Ctrl-C included.

Each codec trains with the recipe the benchmarks and the PyTorch adapter use: a codec with a
momentum parameter (marsit, birdplus) carries SGD's momentum itself (momentum correction) and the
workers apply plain SGD to its result; dense runs momentum SGD. --codec-params '{"momentum": 0}'
turns the recipe off (the workers' momentum then runs on the decompressed average, which trains
worse: marsit 0.821 against 0.967 with --hidden 128,128).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: the codecs the demo compares, with the parameters the benchmarks train them at (docs/benchmarks.md)
CODECS: dict[str, dict[str, Any]] = {"none": {}, "marsit": {}, "birdplus": {"density": 0.01}}
#: SGD's momentum: in the workers for dense, in the codec for the compressed codecs (the recipe)
MOMENTUM = 0.9
#: link rate of every node's namespace when the demo runs as root
RATE = "100mbit"
#: the longest one codec's training may take before the demo gives up on it
RUN_TIMEOUT = 900.0
#: the longest the daemons may take to compile the compressed codecs' kernels (a cold Numba cache)
KERNEL_TIMEOUT = 600.0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="birdnet demo", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n")[2])
    p.add_argument("--nodes", type=int, default=4, help="daemons (one training process each), default 4")
    p.add_argument("--epochs", type=int, default=10, help="epochs per codec, default 10")
    p.add_argument("--codecs", default=",".join(CODECS),
                   help="comma-separated codecs to compare (default: none,marsit,birdplus; none = dense)")
    p.add_argument("--codec", default=None, help="train this one codec only (same as --codecs CODEC)")
    p.add_argument("--codec-params", default="{}",
                   help='JSON parameters for every compressed codec, e.g. \'{"density": 0.05}\'')
    p.add_argument("--data", default="digits", choices=["digits", "mnist1d"])
    p.add_argument("--hidden", default="512,512", help="hidden layer widths of the MLP (default 512,512)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate, default 0.05")
    p.add_argument("--seed", type=int, default=0, help="data order and initial parameters, default 0")
    p.add_argument("--network", default="auto", choices=["auto", "netns", "loopback"],
                   help="auto (default): network namespaces on shaped links when run as root, else loopback")
    p.add_argument("--rate", default=RATE, help=f"link rate in network namespaces (default {RATE}; tc tbf syntax)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (one line) instead of the table")
    a = p.parse_args(argv)
    names = [a.codec] if a.codec else [c.strip() for c in a.codecs.split(",") if c.strip()]
    if not names:
        p.error("--codecs names no codec")
    a.names = ["none" if n in ("dense", "none") else n for n in names]
    from birdnet.codecs import names as codec_names
    unknown = [n for n in a.names if n not in codec_names()]
    if unknown:
        p.error(f"unknown codec {unknown[0]!r}; choose from: dense, {', '.join(codec_names())}")
    try:
        a.params = json.loads(a.codec_params)
    except json.JSONDecodeError as exc:
        p.error(f"--codec-params is not JSON ({exc}); e.g. --codec-params '{{\"density\": 0.05}}'")
    if not isinstance(a.params, dict):
        p.error("--codec-params must be a JSON object, e.g. '{\"density\": 0.05}'")
    try:
        a.hidden_sizes = tuple(int(h) for h in a.hidden.split(","))
    except ValueError:
        p.error(f"--hidden takes comma-separated integers such as 512,512, not {a.hidden!r}")
    if a.nodes < 1 or a.epochs < 1 or any(h < 1 for h in a.hidden_sizes):
        p.error("--nodes, --epochs and the --hidden widths must be at least 1")
    return a


def recipe(codec: str, params: dict[str, Any], momentum: float = MOMENTUM) -> dict[str, Any]:
    """The parameters ``codec`` trains with: its demo parameters, the user's, and the momentum
    when the codec has a momentum parameter and none was given (the recipe, module docstring)."""
    from birdnet.bench.trainlib import recipe as sgd_recipe
    if codec == "none":
        return {}
    return sgd_recipe(codec, {**CODECS.get(codec, {}), **params}, momentum)


def _network(a: argparse.Namespace) -> tuple[str, str]:
    """("netns" or "loopback", why loopback when namespaces were wanted but are not possible)."""
    if a.network == "loopback":
        return "loopback", ""
    from birdnet.bench import netns
    ok, why = netns.available()
    if ok:
        return "netns", ""
    if a.network == "netns":
        raise SystemExit(f"birdnet demo: --network netns: {why}")
    return "loopback", why


def _warm_worker(sock: str, node: int, local: int, configs: list[tuple[str, dict[str, Any]]]) -> float:
    """One call per codec configuration, all in flight at once: each daemon loads (or, with a cold
    Numba cache, compiles) the kernels before the timed training starts."""
    import numpy as np

    from birdnet.client import Client
    t0 = time.perf_counter()
    with Client(sock, job="demo-kernels") as c:
        x = np.ones(4096, np.float32)
        hs = [c.allreduce_async(x, name=f"warm/{codec}", codec=codec, **params) for codec, params in configs]
        for h in hs:
            h.wait(KERNEL_TIMEOUT)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    a = _parse_args(argv)
    try:
        import sklearn  # noqa: F401
    except ImportError:
        if a.data == "digits":
            print("birdnet demo needs scikit-learn for its data set: pip install 'birdnet[demo]'", file=sys.stderr)
            return 2
    from birdnet.bench.trainlib import load, one_thread_per_worker, train_worker
    from birdnet.cluster import LocalCluster
    from birdnet.errors import BirdnetError

    one_thread_per_worker()
    runs = [(name, recipe(name, a.params)) for name in a.names]
    network, why = _network(a)
    data = load(a.data, a.seed)  # once here, not in every worker
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="birdnet-demo-") as tmp:
        nsc, namespaces = None, []
        try:
            if network == "netns":
                from birdnet.bench import netns
                try:
                    nsc = netns.NetnsCluster(a.nodes, a.rate).__enter__()
                except RuntimeError as exc:  # __enter__ removed what it had made
                    print(f"birdnet demo: cannot set up network namespaces ({exc}); running on loopback",
                          file=sys.stderr)
                    network, why, nsc = "loopback", str(exc), None
            if nsc is not None:
                namespaces = list(nsc.names)
                cluster = LocalCluster(a.nodes, Path(tmp), addresses=nsc.addresses,
                                       prefixes=[nsc.exec_prefix(i) for i in range(a.nodes)],
                                       peer_timeout=60.0, heartbeat_interval=1.0)
                where = f"in network namespaces on {a.rate} links"
            else:
                cluster = LocalCluster(a.nodes, Path(tmp), peer_timeout=60.0, heartbeat_interval=1.0)
                where = "on loopback"
            print(f"birdnet demo: {a.nodes} daemons {where} (hosts file {cluster.hosts}), {a.nodes} training "
                  f"processes, data {a.data}, MLP {a.hidden}, {a.epochs} epochs", flush=True)
            if network == "loopback" and len(runs) > 1:
                hint = (f"network namespaces on shaped links would show the time saved: {why}" if why
                        else "as root, without --network loopback, the nodes run on shaped links")
                print(f"  loopback has no bandwidth limit, so the compressed codecs save bytes here but not time ({hint})",
                      flush=True)
            rows, codes, warm_s = _train_all(a, cluster, runs, data, train_worker)
        except BirdnetError as exc:  # e.g. a codec parameter the daemons refuse
            print(f"birdnet demo: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\ninterrupted; stopping the cluster", file=sys.stderr)
            return 130
        finally:
            if nsc is not None:
                nsc.__exit__(None, None, None)
    dense = next((r for r in rows if r["codec"] == "none"), None)
    for r in rows:
        r["ratio_to_dense"] = (dense["bytes_sent_per_worker"] / r["bytes_sent_per_worker"]
                               if dense and r["bytes_sent_per_worker"] else None)
    same = all(r["identical_parameters_on_all_nodes"] for r in rows)
    res = {"nodes": a.nodes, "network": network, "rate": a.rate if network == "netns" else None,
           "namespaces": namespaces, "sockets": cluster.sockets, "rows": rows, "kernel_warmup_seconds": warm_s,
           "seconds": time.monotonic() - t_all, "daemon_exit_codes": codes,
           "identical_parameters_on_all_nodes": same,
           # the first run's figures, as the demo printed them when it trained one codec only
           **{k: rows[0][k] for k in ("accuracy", "loss", "bytes_sent_per_worker")}}
    if a.json:
        print(json.dumps(res))
    else:
        print(table(res))
    return 0 if same and all(c == 0 for c in codes) else 1


def _train_all(a, cluster, runs, data, train_worker):
    """Start the cluster, warm the kernels, train once per codec; (rows, daemon exit codes,
    seconds the kernels took). The cluster is stopped on every way out."""
    from birdnet.bench.progress import bar as progress_bar

    rows: list[dict[str, Any]] = []
    workers = None
    warm_s = 0.0
    try:
        cluster.start()
        compressed = [(n, p) for n, p in runs if n != "none"]
        if compressed:
            print(f"  loading the kernels of {', '.join(n for n, _ in compressed)} (a cold Numba cache compiles "
                  "them once per machine, a minute or more)", flush=True)
            t0 = time.monotonic()
            workers = cluster.run_async(_warm_worker, compressed)
            workers.get(timeout=KERNEL_TIMEOUT + 60)
            warm_s = time.monotonic() - t0
        ctx = mp.get_context("spawn")
        for name, params in runs:
            cfg = {"data": a.data, "seed": a.seed, "epochs": a.epochs, "lr": a.lr, "momentum": MOMENTUM,
                   "batch": 32, "hidden": a.hidden_sizes, "codec": None if name == "none" else name,
                   "params": params, "job": f"demo-{name}", "arrays": data, "progress": ctx.Queue()}
            label = _label(name, params)
            bar = progress_bar(a.epochs, f"  {label}", unit="epoch")  # on a terminal only
            if bar.disable:
                print(f"  {label}: training", flush=True)
            workers = cluster.run_async(train_worker, cfg)
            try:
                while not workers.ready():
                    try:
                        h = cfg["progress"].get(timeout=0.5)
                    except queue.Empty:
                        continue
                    bar.set_postfix_str(f"accuracy {h['acc']:.3f} loss {h['loss']:.3f}", refresh=False)
                    bar.update(h["epoch"] - bar.n)
                results = workers.get(timeout=RUN_TIMEOUT)
            finally:
                bar.close()
            r0 = results[0]
            row = {"codec": name, "params": params, "accuracy": r0["acc"], "loss": r0["loss"],
                   "bytes_sent_per_worker": r0["bytes_sent"],
                   "seconds": max(r["seconds"] for r in results),
                   "identical_parameters_on_all_nodes": len({r["params_digest"] for r in results}) == 1}
            rows.append(row)
            print(f"  {label}: accuracy {row['accuracy']:.3f}, {row['bytes_sent_per_worker'] / 1e6:.2f} MB per "
                  f"worker, {row['seconds']:.1f} s", flush=True)
    except BaseException:
        if workers is not None:
            workers.terminate()
        raise
    finally:
        codes = cluster.stop()
    return rows, codes, warm_s


def _label(name: str, params: dict[str, Any]) -> str:
    if name == "none":
        return "dense"
    return ":".join([name, *(f"{k}={v}" for k, v in params.items())])


def table(res: dict[str, Any]) -> str:
    """The demo's table, one row per codec."""
    rows = res["rows"]
    w = max(len("codec"), *(len(_label(r["codec"], r["params"])) for r in rows))
    lines = [f"{'codec':<{w}}  {'accuracy':>8}  {'MB per worker':>13}  {'x fewer than dense':>18}  {'time s':>6}  "
             "parameters identical on all nodes"]
    for r in rows:
        ratio = "-" if r["ratio_to_dense"] is None else f"{r['ratio_to_dense']:.1f}"
        lines.append(f"{_label(r['codec'], r['params']):<{w}}  {r['accuracy']:>8.3f}  "
                     f"{r['bytes_sent_per_worker'] / 1e6:>13.2f}  {ratio:>18}  {r['seconds']:>6.1f}  "
                     f"{'yes' if r['identical_parameters_on_all_nodes'] else 'NO'}")
    where = (f"{res['nodes']} nodes in network namespaces, links shaped to {res['rate']}" if res["network"] == "netns"
             else f"{res['nodes']} nodes on loopback (no bandwidth limit: compression saves bytes, not time)")
    lines.append(f"{where}; {os.cpu_count()} cores shared by all nodes; kernels ready in "
                 f"{res['kernel_warmup_seconds']:.0f} s; {res['seconds']:.0f} s in all")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
