#!/usr/bin/env python3
"""A mixed x86_64 + aarch64 birdnet ring on loopback, and the check that every node ends with the
same bits.

Node ``--arm-rank`` (default 1, the middle of a 3-node ring, so what it sends travels on through an
x86_64 hop) is an emulated aarch64 daemon with its own emulated training process, both in the arm64
root file system that deploy/check_aarch64.sh builds; the other nodes are x86_64 daemons and
processes of the Python running this script. All daemons share this machine's loopback (ring links
over TCP) and each node's process reaches its own daemon through its Unix socket and /dev/shm, as
on a real node. Every codec configuration of the plan (every codec of the registry, the birdplus
modes and options, marsit's compensations and scales, ...) runs on tensors of awkward sizes (1, 7,
4099, 1000003) for several rounds; then a short training run on scikit-learn's digits goes through
the ring.

It checks:
  1. every node's result of every call has the same SHA-256 (across architectures);
  2. the emulated node's inputs are the bits the x86_64 side computes for that rank (the inputs
     are portable, so a difference below is birdnet's);
  3. (unless --no-reference) the mixed ring's results equal those of an all-x86_64 ring run with
     the same plan first: the aarch64 node computed the same compressed payloads as an x86_64
     node would have;
  4. the training runs end with identical parameters on all nodes.

    python deploy/aarch64/mixed_ring.py --rootfs /var/cache/birdnet-aarch64/rootfs-bookworm-arm64
    python deploy/aarch64/mixed_ring.py --x86-only --quick      # the driver alone, no emulation

Normally started by ``deploy/check_aarch64.sh --mixed-ring``. Writes OUT/summary.json and the logs.
Exit status 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ring_worker import portable_input, sha  # noqa: E402  (the same generator as the workers)

SIZES = [1, 7, 4099, 1_000_003]


def configs() -> list[dict]:
    """Every codec of the registry with its defaults, and the variants whose arithmetic differs
    (the paths where x86 and ARM could part: float16 wire values, shared-mode float64 weights,
    gamma with square roots, scales, compensations)."""
    from birdnet.codecs import names

    out = [{"label": n, "codec": n, "params": {}} for n in names()]
    variants = [
        ("bird-shared", "bird", {"mode": "shared"}),
        ("birdplus-local-f16", "birdplus", {"value_dtype": "float16"}),
        ("birdplus-shared", "birdplus", {"mode": "shared"}),
        ("birdplus-shared-f16", "birdplus", {"mode": "shared", "value_dtype": "float16"}),
        ("birdplus-exact", "birdplus", {"scale": "exact"}),
        ("birdplus-noscale", "birdplus", {"scale": "none"}),
        ("birdplus-gamma2.75", "birdplus", {"gamma": 2.75}),
        ("birdplus-momentum", "birdplus", {"momentum": 0.9, "density": 0.05, "block": 4}),
        ("birdplus-shared-gamma1.5", "birdplus", {"mode": "shared", "gamma": 1.5, "block": 16}),
        ("qsgd-u2", "qsgd", {"levels": 1000}),
        ("randomk-ef", "randomk", {"scale": False, "error_feedback": True}),
        ("topk-momentum", "topk", {"momentum": 0.9, "density": 0.1}),
        ("marsit-global", "marsit", {"compensation": "global"}),
        ("marsit-none", "marsit", {"compensation": "none"}),
        ("marsit-rms", "marsit", {"scale": "rms"}),
        ("marsit-grad", "marsit", {"scale": "mean_abs_grad", "momentum": 0.9}),
        ("marsit-fixed-flush", "marsit", {"scale": "fixed", "flush": 2}),
        ("signcascade-local", "signcascade", {"compensation": "local"}),
        ("efsign-momentum", "efsign", {"momentum": 0.9}),
        ("lowbit-4", "lowbit", {"bits": 4}),
        ("lowbit-2-noef", "lowbit", {"bits": 2, "block": 8, "error_feedback": False}),
        ("lowbit-1", "lowbit", {"bits": 1}),  # the block's mean |x|, summed in float64
        # DiLoCo's default with Adam (birdnet.client.diloco.ADAM_CODEC_PARAMS): a decay below 1 multiplies
        ("sparseloco-adam", "sparseloco", {"chunk": 256, "k": 18, "beta": 0.95}),
        ("lowbit-1-256", "lowbit", {"bits": 1, "block": 256, "error_feedback": True}),  # its warm-up syncs
    ]
    known = set(names())
    out += [{"label": lab, "codec": c, "params": p} for lab, c, p in variants if c in known]
    return out


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Guest:
    """How a command runs in the arm64 root: proot -q qemu-aarch64-static, or chroot through a
    registered binfmt_misc handler (in a private mount namespace). Host directories are visible at
    the SAME paths inside (/tmp with the ring's hosts file, sockets and results; /dev with /dev/shm;
    the cache with the Numba cache): proot 5.1 does not translate faccessat2's path, which qemu 7.2
    uses for the guest's access(), so os.access() is only right where both paths agree (see
    deploy/check_aarch64.sh)."""

    def __init__(self, rootfs: str, runner: str, cpu: str, venv: str, share: str, numba_cache: str) -> None:
        self.rootfs, self.runner, self.cpu, self.venv = rootfs, runner, cpu, venv
        self.share, self.numba_cache = share, numba_cache

    def env(self) -> list[str]:
        return ["env", "-i", f"PATH={self.venv}/bin:/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8", "TMPDIR=/tmp",
                f"NUMBA_CACHE_DIR={self.numba_cache}", "NUMBA_NUM_THREADS=1",
                "OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1", "PYTHONUNBUFFERED=1", f"QEMU_CPU={self.cpu}"]

    def wrap(self, argv: list[str]) -> list[str]:
        # nice 10: the emulator keeps a core busy and this machine's cores are shared
        if self.runner == "proot":
            return ["nice", "-n", "10", "proot", "-q", "qemu-aarch64-static", "-r", self.rootfs, "-b", "/dev",
                    "-b", "/proc", "-b", "/sys", "-b", "/tmp", "-b", self.share, "-w", "/", *self.env(), *argv]
        script = ('r="$1"; s="$2"; shift 2; mount --bind /dev "$r/dev" && mount -t proc proc "$r/proc" && '
                  'mount --bind /sys "$r/sys" && mount --bind /tmp "$r/tmp" && mkdir -p "$r$s" && '
                  'mount --bind "$s" "$r$s" && exec chroot "$r" "$@"')
        return ["nice", "-n", "10", "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
                "sh", self.rootfs, self.share, *self.env(), *argv]

    def python(self) -> str:
        return f"{self.venv}/bin/python"


class Ring:
    """``arches[i]`` is "x86_64" or "aarch64" for node i; daemons and one process per node."""

    def __init__(self, arches: list[str], tmp: Path, guest: Guest | None, a) -> None:
        self.arches, self.tmp, self.guest, self.a = arches, tmp, guest, a
        self.n = len(arches)
        self.hosts = tmp / "hosts.txt"
        self.hosts.write_text("".join(f"127.0.0.1:{p}\n" for p in free_ports(self.n)))
        self.sockets = [str(tmp / f"node{i}.sock") for i in range(self.n)]
        self.daemons: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []

    def _cmd(self, i: int, argv_py: list[str]) -> tuple[list[str], dict]:
        if self.arches[i] == "aarch64":
            return self.guest.wrap([self.guest.python(), *argv_py]), {}
        env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        return [sys.executable, *argv_py], env

    def start_daemons(self) -> None:
        a = self.a
        for i in range(self.n):
            # the same cluster-wide settings on every node (equal fingerprints); the timeouts are
            # raised for all nodes alike, since each node judges its neighbours by its own values and an
            # emulated daemon compiling a kernel (holding the GIL) sends no heartbeat for a while
            argv = ["-m", "birdnet.daemon.main", "--peers", str(self.hosts), "--rank", str(i),
                    "--socket", self.sockets[i], "--dense-threshold", "0",
                    "--peer-timeout", str(a.peer_timeout), "--heartbeat-interval", str(a.heartbeat_interval),
                    "--round-timeout", str(a.round_timeout)]
            cmd, env = self._cmd(i, argv)
            log = open(self.tmp / f"daemon{i}-{self.arches[i]}.log", "wb")
            self.daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or None,
                                                 start_new_session=True))
        for i in range(self.n):
            self._wait_socket(i)

    def _wait_socket(self, i: int) -> None:
        from birdnet.osutil import unix_socket_accepts
        deadline = time.monotonic() + self.a.start_timeout
        while not unix_socket_accepts(self.sockets[i]):
            if self.daemons[i].poll() is not None:
                raise RuntimeError(f"daemon {i} ({self.arches[i]}) exited with {self.daemons[i].returncode}: "
                                   f"{self._tail(f'daemon{i}-{self.arches[i]}.log')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon {i} ({self.arches[i]}) did not open its socket within "
                                   f"{self.a.start_timeout} s: {self._tail(f'daemon{i}-{self.arches[i]}.log')}")
            time.sleep(0.2)

    def _tail(self, name: str) -> str:
        try:
            return (self.tmp / name).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def run_workers(self, plan_path: Path, worker: Path) -> list[dict]:
        for i in range(self.n):
            cmd, env = self._cmd(i, [str(worker), "--socket", self.sockets[i], "--plan", str(plan_path),
                                     "--out", str(self.tmp / f"result{i}.json")])
            log = open(self.tmp / f"worker{i}-{self.arches[i]}.log", "wb")
            self.workers.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or None,
                                                 start_new_session=True))
        deadline = time.monotonic() + self.a.run_timeout
        for i, w in enumerate(self.workers):
            try:
                w.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"worker {i} ({self.arches[i]}) still running after {self.a.run_timeout} s: "
                                   f"{self._tail(f'worker{i}-{self.arches[i]}.log')}") from None
        results = []
        for i in range(self.n):
            try:
                results.append(json.loads((self.tmp / f"result{i}.json").read_text()))
            except (OSError, ValueError) as exc:
                results.append({"fatal": f"no result from worker {i}: {exc}; "
                                         f"{self._tail(f'worker{i}-{self.arches[i]}.log')}"})
        return results

    def stop(self) -> list[int | None]:
        codes: list[int | None] = []
        for p in self.workers + self.daemons:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.workers + self.daemons:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            codes.append(p.returncode)
        return codes[len(self.workers):]


def run_ring(arches: list[str], plan: dict, out: Path, guest_args, a) -> dict:
    """One ring: daemons, workers, results; the share directory is under /tmp (visible in the
    guest at the same path), copied into ``out`` afterwards."""
    share = Path(tempfile.mkdtemp(prefix="birdnet-mixed-", dir="/tmp"))
    try:
        shutil.copy(HERE / "ring_worker.py", share / "ring_worker.py")
        plan_path = share / "plan.json"
        plan_path.write_text(json.dumps(plan))
        guest = Guest(*guest_args) if "aarch64" in arches else None
        ring = Ring(arches, share, guest, a)
        t0 = time.monotonic()
        try:
            ring.start_daemons()
            started = time.monotonic() - t0
            print(f"  {len(arches)} daemons up in {started:.0f} s ({', '.join(arches)})", flush=True)
            results = ring.run_workers(plan_path, share / "ring_worker.py")
        finally:
            codes = ring.stop()
        return {"arches": arches, "results": results, "daemon_exit_codes": codes,
                "start_seconds": round(started, 1), "seconds": round(time.monotonic() - t0, 1)}
    finally:
        out.mkdir(parents=True, exist_ok=True)
        for f in share.glob("*.log"):
            shutil.copy(f, out / f.name)
        for f in share.glob("result*.json"):
            shutil.copy(f, out / f.name)
        shutil.rmtree(share, ignore_errors=True)


def compare(run: dict, plan: dict, reference: dict | None, arm_ranks: list[int]) -> tuple[list[str], dict]:
    """Problems found (empty: all checks passed) and counts."""
    problems: list[str] = []
    res = run["results"]
    for i, r in enumerate(res):
        if "fatal" in r:
            problems.append(f"node {i} ({run['arches'][i]}): {r['fatal'][-600:]}")
    if problems:
        return problems, {}
    key = lambda row: (row["config"], row["size"], row["round"])  # noqa: E731
    rows = [{key(row): row for row in r["codecs"]} for r in res]
    refrows = [{key(row): row for row in r["codecs"]} for r in reference["results"]] if reference else None
    counts = {"calls": 0, "identical_across_nodes": 0, "equal_to_x86_ring": 0, "inputs_checked": 0}
    differing: dict[str, list[str]] = {}
    for k in rows[0]:
        counts["calls"] += 1
        per = [rows[i].get(k, {}) for i in range(len(rows))]
        errs = [p.get("error") for p in per if "error" in p or "output" not in p]
        if errs:
            problems.append(f"{k}: error {errs[0]}")
            continue
        outs = {p["output"] for p in per}
        if len(outs) == 1:
            counts["identical_across_nodes"] += 1
        else:
            differing.setdefault(k[0], []).append(f"n={k[1]} round {k[2]}: " + ", ".join(
                f"node {i} ({run['arches'][i]}) {p['output'][:12]} first {p['first']}" for i, p in enumerate(per)))
        if refrows is not None:
            ref = refrows[0].get(k, {}).get("output")
            if ref is not None and outs == {ref}:
                counts["equal_to_x86_ring"] += 1
            elif len(outs) == 1:
                differing.setdefault(k[0], []).append(
                    f"n={k[1]} round {k[2]}: mixed ring {next(iter(outs))[:12]} (first {per[0]['first']}) vs "
                    f"all-x86 ring {str(ref)[:12]} (first {refrows[0].get(k, {}).get('first')})")
    for r in arm_ranks:
        for (cfg, n, rnd), row in rows[r].items():
            if cfg == plan["configs"][0]["label"]:  # inputs do not depend on the codec
                if row["input"] != sha(portable_input(plan["seed"], r, rnd, n)):
                    problems.append(f"input of rank {r} (aarch64) n={n} round {rnd} differs from the x86 bits")
                counts["inputs_checked"] += 1
    for cfg, lines in differing.items():
        problems.append(f"{cfg}: {len(lines)} call(s) differ: " + "; ".join(lines[:3]))
    counts["train"] = []
    for j, t in enumerate(res[0].get("train", [])):
        digests = {r["train"][j]["params_digest"] for r in res}
        counts["train"].append({"label": t["label"], "identical_parameters": len(digests) == 1,
                                "accuracy": [r["train"][j]["acc"] for r in res],
                                "digest": sorted(digests)[0][:16],
                                "equal_to_x86_ring": bool(reference) and
                                reference["results"][0]["train"][j]["params_digest"] in digests})
        if len(digests) != 1:
            problems.append(f"training {t['label']}: parameters differ between nodes: {sorted(digests)}")
    return problems, counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rootfs", default="/var/cache/birdnet-aarch64/rootfs-bookworm-arm64")
    p.add_argument("--runner", choices=["proot", "binfmt"], default="proot")
    p.add_argument("--cpu", default="cortex-a72", help="qemu CPU model (QEMU_CPU) of the emulated node")
    p.add_argument("--venv", default="/opt/birdnet-venv", help="the venv inside the rootfs")
    p.add_argument("--share", default="/var/cache/birdnet-aarch64",
                   help="host directory seen at the same path in the guest (holds the Numba cache)")
    p.add_argument("--numba-cache", default="/var/cache/birdnet-aarch64/numba-cache",
                   help="NUMBA_CACHE_DIR of the emulated processes (under --share)")
    p.add_argument("--out", default=None, help="directory for summary.json and logs (default: a new temp dir)")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--arm-rank", type=int, action="append", help="rank(s) emulated as aarch64 (default 1)")
    p.add_argument("--x86-only", action="store_true", help="no emulated node (checks the driver itself)")
    p.add_argument("--no-reference", action="store_true", help="skip the all-x86_64 reference ring")
    p.add_argument("--quick", action="store_true", help="sizes 1, 7, 4099; one round; a few configurations")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-train", action="store_true")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--peer-timeout", type=float, default=600.0)
    p.add_argument("--heartbeat-interval", type=float, default=2.0)
    p.add_argument("--round-timeout", type=float, default=3600.0)
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a daemon to open its socket")
    p.add_argument("--run-timeout", type=float, default=5400.0, help="seconds for the workers of one ring")
    a = p.parse_args(argv)
    arm = [] if a.x86_only else (a.arm_rank or [1])
    if any(not 0 <= r < a.nodes for r in arm):
        p.error(f"--arm-rank must be in 0..{a.nodes - 1}")
    if arm and not os.path.isfile(os.path.join(a.rootfs, a.venv.lstrip("/"), "bin", "birdnetd")):
        p.error(f"no birdnet venv in {a.rootfs}{a.venv}: run deploy/check_aarch64.sh first")
    out = Path(a.out or tempfile.mkdtemp(prefix="birdnet-mixed-out-"))
    cfgs = configs()
    sizes = SIZES
    if a.quick:
        sizes = SIZES[:3]
        a.rounds = 1
    plan = {"seed": a.seed, "sizes": sizes, "rounds": a.rounds, "configs": cfgs, "job": "mixed",
            "call_timeout": a.round_timeout}
    if not a.no_train:
        base = {"data": "digits", "seed": a.seed % 1000, "epochs": 1, "lr": 0.05, "momentum": 0.9, "batch": 32,
                "hidden": [64], "params": {}}
        plan["train"] = [{**base, "job": "train-dense", "codec": None},
                         {**base, "job": "train-birdplus", "codec": "birdplus", "params": {"density": 0.1}}]
    arches = ["aarch64" if i in arm else "x86_64" for i in range(a.nodes)]
    guest_args = (a.rootfs, a.runner, a.cpu, a.venv, a.share, a.numba_cache)
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "arches": arches,
                     "cpu": a.cpu if arm else None, "runner": a.runner if arm else None, "sizes": sizes,
                     "rounds": a.rounds, "configs": [c["label"] for c in cfgs]}
    reference = None
    t0 = time.monotonic()
    if arm and not a.no_reference:
        print(f"mixed ring: all-x86_64 reference ring of {a.nodes} nodes", flush=True)
        reference = run_ring(["x86_64"] * a.nodes, plan, out / "reference", None, a)
        ref_problems, _ = compare(reference, plan, None, [])
        summary["reference_seconds"] = reference["seconds"]
        if ref_problems:
            print("the all-x86_64 reference ring itself failed:\n  " + "\n  ".join(ref_problems))
            summary["problems"] = ["reference: " + x for x in ref_problems]
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            return 1
    print(f"mixed ring: {a.nodes} nodes ({', '.join(arches)}), {len(cfgs)} codec configurations x sizes "
          f"{sizes} x {a.rounds} rounds", flush=True)
    run = run_ring(arches, plan, out / "mixed", guest_args, a)
    problems, counts = compare(run, plan, reference, arm)
    summary.update(counts=counts, problems=problems, seconds=round(time.monotonic() - t0, 1),
                   ring_seconds=run["seconds"], start_seconds=run["start_seconds"],
                   daemon_exit_codes=run["daemon_exit_codes"],
                   versions=[{k: r.get(k) for k in ("arch", "python", "numpy", "numba", "llvmlite")}
                             for r in run["results"]])
    if any(c not in (0, None) for c in run["daemon_exit_codes"]):
        problems.append(f"daemon exit codes {run['daemon_exit_codes']}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"results in {out}")
    if counts:
        print(f"  calls: {counts['calls']}, identical on all nodes: {counts['identical_across_nodes']}, "
              f"equal to the all-x86_64 ring: {counts['equal_to_x86_ring'] if reference else 'not run'}, "
              f"aarch64 inputs checked: {counts['inputs_checked']}")
        for t in counts["train"]:
            print(f"  training {t['label']}: identical parameters on all nodes: "
                  f"{'yes' if t['identical_parameters'] else 'NO'} ({t['digest']}), accuracy {t['accuracy']}, "
                  f"equal to the all-x86_64 ring: {t['equal_to_x86_ring']}")
    print(f"  time: {summary['seconds']:.0f} s (mixed ring {run['seconds']:.0f} s, daemons up in "
          f"{run['start_seconds']:.0f} s)")
    if problems:
        print("PROBLEMS:\n  " + "\n  ".join(problems))
        return 1
    print("mixed ring: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
