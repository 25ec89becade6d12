"""``birdnet bench chaos``: rounds in a loop on real daemons while faults hit at random points, and
what the training processes saw.

Three daemons on loopback (``--nodes``), one training process each calling ``allreduce`` in a loop
(``--floats`` float32, ``--codec``); a worker that gets an error calls ``Client.recover`` (wait for
the ring, broadcast the parameters from rank 0) and goes on. Faults, at random moments (``--seed``):

- ``kill-daemon``: SIGKILL of a daemon, restarted after a random pause;
- ``stop-daemon``: SIGSTOP of a daemon for ``--stop-seconds``, then SIGCONT;
- ``kill-process``: SIGKILL of a training process; the job's processes are then restarted;
- ``cut-link``: a node's link taken down (``ip link set eth0 down``) for a random time up to
  ``--link-seconds``, then up again. It needs network namespaces (root and iproute2): when any
  fault is ``cut-link`` and namespaces can be made, the whole run's daemons live in namespaces
  (birdnet.bench.netns, one per node, joined by a bridge); otherwise the run stays on loopback and
  the link faults are skipped (the result's ``skipped`` says why).

Every call's outcome is logged by every process (call number, result digest, parameters digest,
duration); at the end the logs are compared:

- **split**: a call that returned on some process and raised on another whose daemon survived
  (a process whose own daemon was killed loses its call with it: counted apart, ``lost_with_daemon``);
- **wrong**: a dense result that is not the exact sum, or results (or, after a successful call,
  the parameters) that differ between processes;
- **hang**: a call that took longer than its timeout plus a margin;
- **recovery**: seconds from the end of a fault (SIGCONT, the daemon restarted, the job
  restarted) until every process had a successful call again;
- **settlements**: how often a daemon settled a round's commit with the others (their logs), by outcome;
- **fail-fast**: after a process is killed, how long the others' failing calls took (they must fail
  within a second, the one in flight when it died aside);
- daemons' descriptors and RSS before and after.

``run_chaos`` is also what tests/test_chaos.py runs (short). Prints one JSON object; exit status 1
when a check failed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: what a call may take before it counts as a hang: the client's own timeout plus this margin (s)
HANG_MARGIN = 5.0
#: a failing call of a job whose process was killed must end within this (s)
FAIL_FAST = 1.0
FAULTS = ("kill-daemon", "stop-daemon", "kill-process", "cut-link")
#: fault kinds that need network namespaces (skipped on loopback)
NETNS_FAULTS = ("cut-link",)


# -- the training process ----------------------------------------------------------------------------
def worker(sock: str, job: str, n: int, codec: str, log_path: str, call_timeout: float, pause: float) -> None:
    """Call allreduce in a loop until killed; one JSON line per call into ``log_path``."""
    import numpy as np

    from birdnet.client import Client
    from birdnet.errors import BirdnetError
    c = Client(sock, job=job, connect_timeout=10.0)
    params = np.zeros(n, np.float32)
    steps = np.zeros(1, np.float64)  #: the loop's step, recovered with the parameters
    kw: dict[str, Any] = {} if codec == "none" else {"codec": codec}
    with open(log_path, "a", buffering=1) as log:
        log.write(json.dumps({"ready": True, "rank": c.rank, "size": c.size, "t": time.time()}) + "\n")
        while True:
            step = int(steps[0])
            seq = c._seq
            grad = np.full(n, float(c.rank + 1), np.float32) * np.float32(1 + step % 7)
            t0 = time.time()
            rec: dict[str, Any] = {"seq": seq, "step": step, "t0": t0}
            try:
                out = c.allreduce(grad, op="sum", name="w", timeout=call_timeout, **kw)
                rec["ok"] = True
                rec["digest"] = hashlib.blake2b(out.tobytes(), digest_size=8).hexdigest()
                if codec == "none":
                    want = float(c.size * (c.size + 1) // 2 * (1 + step % 7))
                    rec["exact"] = bool(np.all(out == np.float32(want)))
                params -= np.float32(1e-3) * out
                rec["params"] = hashlib.blake2b(params.tobytes(), digest_size=8).hexdigest()
                steps[0] += 1
            except BirdnetError as exc:
                rec["ok"] = False
                rec["error"] = type(exc).__name__
                rec["message"] = str(exc)[:300]
            rec["t1"] = time.time()
            log.write(json.dumps(rec) + "\n")
            if not rec["ok"]:
                if rec["error"] == "ProcessLostError":
                    time.sleep(0.05)
                    continue  # the job must be restarted: keep showing that calls fail at once
                t = time.time()
                try:
                    attempts = c.recover([params, steps], timeout=120.0)
                    log.write(json.dumps({"recovered": True, "t0": t, "t1": time.time(), "attempts": attempts,
                                          "next_seq": c._seq,
                                          "params": hashlib.blake2b(params.tobytes(), digest_size=8).hexdigest()})
                              + "\n")
                except BirdnetError as e2:
                    log.write(json.dumps({"recovered": False, "t0": t, "t1": time.time(), "error": type(e2).__name__,
                                          "message": str(e2)[:300]}) + "\n")
            time.sleep(pause)


# -- the harness --------------------------------------------------------------------------------------
def _proc_figures(pid: int) -> tuple[int, int]:
    """(open descriptors, RSS in KiB) of process ``pid``."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return fds, rss


class _Job:
    """One run of the job: a training process per node, each logging to its own file."""

    def __init__(self, cl, tmp: Path, run: int, job: str, n: int, codec: str, call_timeout: float, pause: float):
        self.run, self.logs, self.procs = run, [], []
        for i, sock in enumerate(cl.sockets):
            path = tmp / f"run{run}-node{i}.jsonl"
            self.logs.append(path)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "birdnet.bench.chaos", "--worker", sock, job, str(n), codec, str(path),
                 str(call_timeout), str(pause)], stdout=subprocess.DEVNULL, stderr=open(tmp / f"run{run}-node{i}.err", "ab")))
        deadline = time.monotonic() + 60
        while not all(p.exists() and p.read_text().strip() for p in self.logs):
            if time.monotonic() > deadline:
                raise TimeoutError("training processes did not start within 60 s")
            time.sleep(0.1)

    def kill(self, i: int | None = None) -> None:
        for j, p in enumerate(self.procs):
            if (i is None or i == j) and p.poll() is None:
                p.kill()
                p.wait(10)

    def records(self) -> list[list[dict]]:
        out = []
        for path in self.logs:
            rows = []
            for line in path.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by SIGKILL
            out.append(rows)
        return out


def _calls_ok_since(job: _Job, since: float) -> float | None:
    """The time by which every process of ``job`` had a successful call that began after ``since``."""
    last = []
    for rows in job.records():
        t = [r["t1"] for r in rows if r.get("ok") and r.get("t0", 0) >= since]
        if not t:
            return None
        last.append(min(t))
    return max(last)


def _wait_recovered(job: _Job, since: float, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t = _calls_ok_since(job, since)
        if t is not None:
            return t - since
        time.sleep(0.2)
    return None


def check(jobs: list[_Job], codec: str, call_timeout: float) -> dict[str, Any]:
    """Compare the processes' logs: splits, wrong results, diverged parameters, hangs."""
    splits, wrong, diverged, hangs, calls, failed = [], [], [], [], 0, 0
    lost_with_daemon: list[dict] = []
    for job in jobs:
        recs = job.records()
        by_seq: dict[int, dict[int, dict]] = {}
        for rank, rows in enumerate(recs):
            for r in rows:
                if "seq" in r:
                    by_seq.setdefault(r["seq"], {})[rank] = r
                    if r["t1"] - r["t0"] > call_timeout + HANG_MARGIN:
                        hangs.append({"run": job.run, "rank": rank, "seq": r["seq"], "seconds": r["t1"] - r["t0"]})
        for seq, rs in sorted(by_seq.items()):
            calls += 1
            oks = {k: v for k, v in rs.items() if v["ok"]}
            # a process whose own daemon was killed loses the call with it (DaemonUnavailableError),
            # whatever the ring decided: counted apart, the split is between surviving daemons
            survivors = {k: v for k, v in rs.items() if v.get("error") != "DaemonUnavailableError"}
            outcomes = {k: (v.get("error") or "ok") for k, v in sorted(rs.items())}
            if oks and len(oks) < len(survivors):
                splits.append({"run": job.run, "seq": seq, "outcomes": outcomes})
            elif oks and len(oks) < len(rs):
                lost_with_daemon.append({"run": job.run, "seq": seq, "outcomes": outcomes})
            if len(oks) < len(rs):
                failed += 1
            if len({v["digest"] for v in oks.values()}) > 1 or any(v.get("exact") is False for v in oks.values()):
                wrong.append({"run": job.run, "seq": seq})
            if len(oks) == len(rs) and len({v["params"] for v in oks.values()}) > 1:
                diverged.append({"run": job.run, "seq": seq})
    return {"calls": calls, "failed_calls": failed, "splits": splits, "wrong": wrong, "diverged": diverged,
            "hangs": hangs, "lost_with_daemon": lost_with_daemon}


def run_chaos(*, nodes: int = 3, floats: int = 20_000, codec: str = "none", faults: list[str] | None = None,
              rounds_between: tuple[float, float] = (1.0, 3.0), stop_seconds: float = 15.0, seed: int = 0,
              peer_timeout: float = 4.0, heartbeat_interval: float = 0.25, call_timeout: float = 30.0,
              pause: float = 0.005, recover_timeout: float = 60.0, link_seconds: float = 10.0,
              tmp: Path | None = None, echo=None, netns_always: bool = False) -> dict[str, Any]:
    """Run the chaos loop (see the module docstring) and return its figures (``netns_always``: the
    daemons in network namespaces whatever the faults, where they can be made)."""
    from contextlib import ExitStack

    from birdnet.bench import netns
    from birdnet.bench.cluster import LocalCluster
    rng = random.Random(seed)
    faults = list(faults if faults is not None else FAULTS)
    skipped: dict[str, str] = {}
    use_netns = netns_always or any(k in NETNS_FAULTS for k in faults)
    if use_netns:
        ok, why = netns.available()
        if not ok:
            use_netns = False
            for k in {k for k in faults if k in NETNS_FAULTS}:
                skipped[k] = f"{sum(f == k for f in faults)} fault(s) skipped on loopback: {why}"
            faults = [k for k in faults if k not in NETNS_FAULTS]
    own_tmp = tmp is None
    tdir = Path(tempfile.mkdtemp(prefix="birdnet-chaos-")) if tmp is None else Path(tmp)
    tdir.mkdir(parents=True, exist_ok=True)  # --logs names a directory that need not exist yet
    say = echo or (lambda *_a: None)
    events: list[dict[str, Any]] = []
    jobs: list[_Job] = []
    job_name = "chaos"
    with ExitStack() as stack:
        where: dict[str, Any] = {}
        nc = None
        if use_netns:
            nc = stack.enter_context(netns.NetnsCluster(nodes))
            where = {"addresses": nc.addresses, "prefixes": [nc.exec_prefix(i) for i in range(nodes)]}
        cl = stack.enter_context(LocalCluster(nodes, tdir, peer_timeout=peer_timeout,
                                              heartbeat_interval=heartbeat_interval,
                                              extra=["--round-timeout", str(call_timeout)], **where))
        job = _Job(cl, tdir, 0, job_name, floats, codec, call_timeout, pause)
        jobs.append(job)
        if _wait_recovered(job, 0.0, 120) is None:
            raise RuntimeError("the first calls did not succeed")
        before = [_proc_figures(p.pid) for p in cl.procs]
        try:
            for kind in faults:
                time.sleep(rng.uniform(*rounds_between))
                victim = rng.randrange(nodes)
                ev: dict[str, Any] = {"fault": kind, "node": victim, "t": time.time()}
                if kind == "kill-daemon":
                    cl.send_signal(victim, signal.SIGKILL)
                    cl.procs[victim].wait(10)
                    time.sleep(rng.uniform(0.0, 2.0))
                    cl.start_node(victim)
                    ev["end"] = time.time()
                elif kind == "stop-daemon":
                    cl.send_signal(victim, signal.SIGSTOP)
                    time.sleep(stop_seconds)
                    cl.send_signal(victim, signal.SIGCONT)
                    ev["end"] = time.time()
                elif kind == "cut-link":
                    assert nc is not None
                    ev["down_seconds"] = down = rng.uniform(1.0, link_seconds)
                    nc.link(victim, False)
                    try:
                        time.sleep(down)
                    finally:
                        nc.link(victim, True)
                    ev["end"] = time.time()
                elif kind == "kill-process":
                    job.kill(victim)
                    time.sleep(2.0)  # the others keep calling: each call must fail at once
                    ev["fail_fast"] = _fail_fast(job, victim, ev["t"])
                    job.kill()
                    job = _Job(cl, tdir, len(jobs), job_name, floats, codec, call_timeout, pause)
                    jobs.append(job)
                    ev["end"] = time.time()
                else:
                    raise ValueError(f"unknown fault {kind!r}; choose from {', '.join(FAULTS)}")
                rec = _wait_recovered(job, ev["end"], recover_timeout)
                ev["recovery_seconds"] = rec
                events.append(ev)
                say(json.dumps(ev))
                if rec is None:
                    break  # no recovery: the checks say so
            time.sleep(1.0)
        finally:
            job.kill()
        after = [_proc_figures(p.pid) if p is not None and p.poll() is None else None for p in cl.procs]
        # how often a daemon settled a round's commit with the others (daemon/settle.py), by outcome
        logs = "".join(cl.log(i) for i in range(nodes))
        settlements = {o: logs.count(f"settled among the surviving nodes: {o}") for o in ("commit", "abort")}
    result = check(jobs, codec, call_timeout)
    rec_times = [e["recovery_seconds"] for e in events]
    result.update(
        codec=codec, nodes=nodes, floats=floats, seed=seed, events=events, faults=len(events),
        network="namespaces" if use_netns else "loopback", skipped=skipped, settlements=settlements,
        not_recovered=sum(1 for r in rec_times if r is None),
        recovery_max=max((r for r in rec_times if r is not None), default=None),
        fail_fast_max=max((e["fail_fast"]["slowest"] for e in events if e.get("fail_fast")), default=None),
        descriptors=[[b[0], a[0] if a else None] for b, a in zip(before, after)],
        rss_kib=[[b[1], a[1] if a else None] for b, a in zip(before, after)])
    if own_tmp:
        import shutil
        shutil.rmtree(tdir, ignore_errors=True)
    return result


def _fail_fast(job: _Job, victim: int, since: float) -> dict[str, Any]:
    """How long the other processes' calls that began after the kill took to fail (the first of
    each, in flight when the process died, is reported apart)."""
    recs = job.records()
    slowest, first, count = 0.0, 0.0, 0
    for rank, rows in enumerate(recs):
        if rank == victim:
            continue
        seen_error = False
        for r in rows:
            if "seq" not in r or r["t1"] < since:
                continue
            d = r["t1"] - r["t0"]
            if not seen_error:
                first = max(first, r["t1"] - since)
                seen_error = not r["ok"]
                continue
            count += 1
            slowest = max(slowest, d)
    return {"first_error_after": first, "slowest": slowest, "calls": count}


def verdict(result: dict[str, Any]) -> list[str]:
    """What failed, as sentences (empty: every check passed)."""
    bad = []
    for k in ("splits", "wrong", "diverged", "hangs"):
        if result[k]:
            bad.append(f"{len(result[k])} {k}: {result[k][:3]}")
    if result["not_recovered"]:
        bad.append(f"{result['not_recovered']} fault(s) without recovery")
    ff = result["fail_fast_max"]
    if ff is not None and ff > FAIL_FAST:
        bad.append(f"a call of a job with a lost process took {ff:.2f} s to fail (> {FAIL_FAST} s)")
    for i, (b, a) in enumerate(result["descriptors"]):
        if a is not None and a > b + 32:
            bad.append(f"daemon {i}: descriptors {b} -> {a}")
    for i, (b, a) in enumerate(result["rss_kib"]):
        if a is not None and a > b * 1.5 + 65536:
            bad.append(f"daemon {i}: RSS {b} -> {a} KiB")
    return bad


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        sock, job, n, codec, log_path, call_timeout, pause = argv[1:8]
        worker(sock, job, int(n), codec, log_path, float(call_timeout), float(pause))
        return 0
    ap = argparse.ArgumentParser(prog="birdnet bench chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--floats", type=int, default=200_000, help="float32 per call (default 200000)")
    ap.add_argument("--codec", default="none", help="none (dense), marsit, birdplus, ...")
    ap.add_argument("--faults", type=int, default=30, help="faults of each kind (default 30)")
    ap.add_argument("--kinds", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--stop-seconds", type=float, default=15.0, help="how long a stopped daemon stays stopped")
    ap.add_argument("--link-seconds", type=float, default=10.0,
                    help="a cut link stays down for a random time from 1 s to this (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-timeout", type=float, default=4.0)
    ap.add_argument("--heartbeat-interval", type=float, default=0.25)
    ap.add_argument("--call-timeout", type=float, default=30.0, help="the client's timeout and round_timeout (s)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--netns", action="store_true",
                    help="run the daemons in network namespaces even without link faults (root)")
    ap.add_argument("--logs", help="keep the daemons' and processes' logs in this directory (default: removed)")
    a = ap.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    rng = random.Random(a.seed)
    faults = [k for k in kinds for _ in range(a.faults)]
    rng.shuffle(faults)
    res = run_chaos(nodes=a.nodes, floats=a.floats, codec=a.codec, faults=faults, stop_seconds=a.stop_seconds,
                    seed=a.seed, peer_timeout=a.peer_timeout, heartbeat_interval=a.heartbeat_interval,
                    call_timeout=a.call_timeout, link_seconds=a.link_seconds,
                    tmp=Path(a.logs) if a.logs else None, netns_always=a.netns, echo=lambda s: print(s, file=sys.stderr, flush=True))
    bad = verdict(res)
    res["failed_checks"] = bad
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
