"""``birdnet``: operator commands (status, demo, bench, keygen, codecs, warmup)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def cmd_status(args: argparse.Namespace) -> int:
    from birdnet.client import Client
    from birdnet.errors import BirdnetError
    try:
        with Client(socket=args.socket, job="__status__", connect_timeout=args.timeout) as c:
            st = c.status()
    except BirdnetError as exc:
        print(f"birdnet status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    print(f"birdnetd {st['version']}  rank {st['rank']} of {st['world']}  cluster {st['cluster']}  "
          f"default codec {st['codec']}  socket {st['socket']}")
    print("peers:")
    for p in st["peers"]:
        extra = f"  ({p['reason']})" if p.get("reason") else ""
        print(f"  rank {p['rank']:>3}  {p['address']:<28} {p['state']}{extra}")
    jobs = {k: v for k, v in st["jobs"].items() if k != "__status__"}
    print("jobs:" if jobs else "jobs: none")
    for name, j in jobs.items():
        pids = ", ".join(f"local rank {p['local_rank']} pid {p['pid']}" for p in j["processes"])
        state = st.get("states", {}).get(name)
        print(f"  {name}: {pids}" + (f"; codec state {state['tensors']} tensor(s), {state['bytes']} bytes" if state else ""))
    print(f"rounds done {st['rounds_done']}, failed {st['rounds_failed']}, last round {st['last_round_seconds']:.4f} s; "
          f"start/go agreements {st.get('round_agreements', 0)}, in the dense lane {st.get('lane_rounds', 0)} "
          f"(given up {st.get('lane_rounds_given_up', 0)})")
    print(f"bytes sent {st['bytes_sent']}, received {st['bytes_received']}, codec state {st['state_bytes']} bytes"
          + (f" ({st['states_evicted']} state(s) dropped under state_limit_bytes)" if st.get("states_evicted") else ""))
    if st.get("messages_lost"):  # on TCP connections that broke and reconnected (docs/reliability.md)
        if "elastic" in st:
            print(f"messages lost from peers: {st['messages_lost']} (a TCP connection broke and reconnected; "
                  "each loss failed one round or started an agreement again)")
        else:
            print(f"messages lost from the left neighbour: {st['messages_lost']} (a TCP connection broke and "
                  "reconnected; each loss failed one round)")
    k = st.get("kernels")
    if k:
        proc = k.get("process", "-")
        if proc == "compiling":
            proc = f"compiling {k.get('process_done', 0)} of {k.get('process_configurations', 0)} configurations"
        print(f"kernels: warm-up process {proc}; loaded {len(k.get('loaded', []))} configuration(s)"
              + (f", loading {k['loading']}" if k.get("loading") else "")
              + (f"; {k['parked_calls']} call(s) waiting for their kernels" if k.get("parked_calls") else "")
              + (f"; compiled on the ring thread {k['ring_thread_compiles']} time(s)" if k.get("ring_thread_compiles")
                 else ""))
    ratio = st.get("last_ratio")
    print(f"last compression ratio {ratio:.1f}" if ratio is not None else "last compression ratio -",
          f", codec time {st.get('compress_seconds_total', 0.0):.3f} s", sep="")
    if st.get("round_seconds_count"):
        mean = st["round_seconds_sum"] / st["round_seconds_count"]
        print(f"round time: mean {mean:.4f} s over {st['round_seconds_count']} rounds; buckets (s<=: count) "
              + ", ".join(f"{le}: {c}" for le, c in st["round_seconds_buckets"] if c))
    return 0


#: the momentum the README and docs/adapters.md train with (SGD's, moved into the codec)
RECOMMENDED_MOMENTUM = 0.9


def cmd_codecs(args: argparse.Namespace) -> int:
    """Each codec's pattern and defaults, and what to run it with: the defaults leave momentum at 0
    because the codec cannot know the optimizer's; the PyTorch adapter's automatic recipe sets it."""
    from birdnet.codecs import codec_class, names
    print(f"{'codec':<12} {'pattern':<9} {'with SGD(momentum=0.9)':<32} defaults")
    for n in names():
        try:
            cls = codec_class(n)
        except Exception as exc:  # noqa: BLE001
            print(f"{n:<12} (unavailable: {exc})")
            continue
        pattern = cls.pattern.value if hasattr(cls.pattern, "value") else cls.pattern
        if "momentum" in cls.defaults:
            extra = ", error_feedback=True" if cls.defaults.get("error_feedback") is False else ""
            sgd = f"momentum={RECOMMENDED_MOMENTUM}{extra}"
        else:
            sgd = "as is (SGD keeps momentum)"
        print(f"{n:<12} {pattern:<9} {sgd:<32} {', '.join(f'{k}={v!r}' for k, v in cls.defaults.items())}")
    print(f"""
Recommended settings per optimizer (docs/adapters.md, "Optimizer recipes"):
  PyTorch, DistributedOptimizer(opt, codec=...) with the default momentum_in_codec=None: the recipe is
    automatic. SGD(momentum={RECOMMENDED_MOMENTUM}): the codec gets momentum={RECOMMENDED_MOMENTUM} (the column above) and SGD steps
    without momentum. Adam/AdamW: a warm-up dense, then marsit, signcascade and efsign get
    momentum=beta1; topk, dgc, randomk, bird and birdplus keep error feedback (bird/birdplus cap=30)
    and the adapter keeps Adam's first moment. Pass nothing else.
  client.allreduce(grad, name=..., codec=..., momentum={RECOMMENDED_MOMENTUM}) by hand: apply the result with plain SGD
    (params -= lr * result): the momentum lives in the codec.
  Defaults above are for no momentum in the codec (momentum=0.0), e.g. an optimizer birdnet does not
    know, which then steps on the decompressed average.""")
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    """Compile every codec's Numba kernels into the on-disk cache (what birdnetd does at start, in
    a subprocess), reporting the time each configuration took."""
    import subprocess
    argv = [sys.executable, "-m", "birdnet.daemon.warmup"] + (["--force"] if args.force else [])
    for c in args.codec:
        argv += ["--codec", c]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    failed = 0
    for line in proc.stdout:
        try:
            m = json.loads(line)
        except ValueError:
            print(line, end="")
            continue
        if args.json:
            print(line, end="", flush=True)
            continue
        if m.get("t") == "plan":
            print(f"warming {m['configurations']} codec configurations into {m.get('cache_dir') or 'no cache'} "
                  f"({m['cached']} done already)", flush=True)
        elif m.get("t") == "warmed":
            what = f"{m['codec']} {json.dumps(m['params'])}" if m["params"] else m["codec"]
            how = "cached already" if m.get("stamped") else f"{m['seconds']:.1f} s, {m['compiled']} kernel(s) compiled"
            print(f"  [{m['i']:>2}/{m['of']}] {what:<44} {how}", flush=True)
        elif m.get("t") == "failed":
            failed += 1
            print(f"  [{m['i']:>2}/{m['of']}] {m['codec']} {json.dumps(m['params'])} FAILED: {m['error']}", flush=True)
        elif m.get("t") == "done":
            print(f"done in {m['seconds']:.1f} s: {m['compiled']} kernel(s) compiled"
                  + (f", {m['failed']} configuration(s) failed" if m["failed"] else ""), flush=True)
    rc = proc.wait()
    return rc if rc else (1 if failed else 0)


def _delegate(module: str, argv: list[str]) -> int:
    import importlib
    return int(importlib.import_module(module).main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="birdnet", description="birdnet operator commands")
    from birdnet import __version__
    p.add_argument("--version", action="version", version=f"birdnet {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("status", help="state of the local daemon: peers, jobs, rounds, bytes")
    from birdnet.config import socket_help
    s.add_argument("--socket", metavar="PATH", help=f"the daemon's socket ({socket_help()})".replace("%", "%%"))
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the daemon")
    s.set_defaults(fn=cmd_status)
    c = sub.add_parser("codecs", help="list the codecs, their default parameters and the recommended settings")
    c.set_defaults(fn=cmd_codecs)
    w = sub.add_parser("warmup", help="compile every codec's Numba kernels into the on-disk cache now "
                                      "(NUMBA_CACHE_DIR), so no first call waits for them")
    w.add_argument("--codec", action="append", default=[], metavar="NAME[:JSON]",
                   help="only this codec configuration (repeatable); default: every one birdnetd warms")
    w.add_argument("--force", action="store_true", help="compile again what the cache holds already")
    w.add_argument("--json", action="store_true", help="one JSON line per configuration")
    w.set_defaults(fn=cmd_warmup)
    sub.add_parser("demo", help="start a local cluster and train a small model through it", add_help=False)
    sub.add_parser("bench", help="benchmarks: allreduce, codecs, train, overlap, chaos", add_help=False)
    sub.add_parser("keygen", help="make a CURVE key pair for peer authentication", add_help=False)
    if argv and argv[0] in ("demo", "bench", "keygen"):
        rest = argv[1:]
        if argv[0] == "demo":
            return _delegate("birdnet.demo", rest)
        if argv[0] == "keygen":
            return _delegate("birdnet.daemon.security", rest)
        if not rest or rest[0] not in ("allreduce", "codecs", "train", "overlap", "chaos"):
            print("usage: birdnet bench {allreduce,codecs,train,overlap,chaos} [options]", file=sys.stderr)
            return 2
        return _delegate(f"birdnet.bench.{rest[0]}", rest[1:])
    args = p.parse_args(argv)
    try:
        rc = int(args.fn(args) or 0)
        sys.stdout.flush()  # a broken pipe shows here, not in the interpreter's flush at exit
        return rc
    except BrokenPipeError:
        # the reader went away (`birdnet status | head`): no traceback. Python's own recipe: point
        # stdout at /dev/null so the interpreter's final flush does not fail a second time
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
