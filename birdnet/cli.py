"""``birdnet``: operator commands (status, demo, bench, keygen, codecs)."""
from __future__ import annotations

import argparse
import json
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


def cmd_codecs(args: argparse.Namespace) -> int:
    from birdnet.codecs import codec_class, names
    for n in names():
        try:
            cls = codec_class(n)
            print(f"{n:<12} {cls.pattern.value if hasattr(cls.pattern, 'value') else cls.pattern:<9} "
                  f"{', '.join(f'{k}={v!r}' for k, v in cls.defaults.items())}")
        except Exception as exc:  # noqa: BLE001
            print(f"{n:<12} (unavailable: {exc})")
    return 0


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
    s.add_argument("--socket", help="the daemon's socket (default as for the client)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the daemon")
    s.set_defaults(fn=cmd_status)
    c = sub.add_parser("codecs", help="list the codecs and their default parameters")
    c.set_defaults(fn=cmd_codecs)
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
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
