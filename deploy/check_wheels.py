#!/usr/bin/env python3
"""Check that PyPI has binary wheels of birdnet's compiled dependencies for the boards we support.

For every (platform, Python version) pair this asks pip to download each package as a wheel only
(``pip download --only-binary=:all: --platform P --python-version V --no-deps``). A package without
a matching wheel would have to be compiled on the board (numba/llvmlite: a full LLVM build, hours and
usually a failure on a 4 GB board), so a missing wheel means "this board is not supported from PyPI".

    python deploy/check_wheels.py                 # table on stdout, exit 1 if a required pair misses
    python deploy/check_wheels.py --markdown      # the table for docs/deploy.md
    python deploy/check_wheels.py --index-url https://www.piwheels.org/simple --platform linux_armv7l

Only the package index pip is configured for (plus ``--index-url``) is asked; by default that is PyPI.
Downloads go to a temporary directory that is deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

PACKAGES = ("numpy", "numba", "llvmlite", "pyzmq", "msgpack")

#: (label, pip --platform values tried in order, required?)
TARGETS = (
    ("aarch64 (Jetson JetPack 6, Raspberry Pi OS 64-bit)",
     ("manylinux2014_aarch64", "manylinux_2_28_aarch64", "manylinux_2_34_aarch64"), True),
    ("armv7l (Raspberry Pi OS 32-bit)",
     ("manylinux2014_armv7l", "manylinux_2_31_armv7l", "manylinux_2_35_armv7l", "linux_armv7l"), False),
    ("x86_64", ("manylinux2014_x86_64", "manylinux_2_28_x86_64"), True),
)
PYTHONS = ("3.10", "3.11")


@dataclass
class Result:
    package: str
    python: str
    target: str
    wheel: str | None  # file name of the wheel found, or None
    detail: str


def probe(package: str, python: str, platforms: tuple[str, ...], extra: list[str], timeout: float) -> tuple[str | None, str]:
    with tempfile.TemporaryDirectory(prefix="birdnet-wheels-") as dest:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "--dest", dest,
               "--disable-pip-version-check", "--quiet", *extra]
        for p in platforms:
            cmd += ["--platform", p]
        cmd.append(package)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"pip timed out after {timeout:.0f} s"
        wheels = [f for f in os.listdir(dest) if f.endswith(".whl")]
        if proc.returncode == 0 and wheels:
            return wheels[0], ""
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, re.sub(r"\s+", " ", last)[:160]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table")
    ap.add_argument("--index-url", help="ask this index instead of pip's configured one")
    ap.add_argument("--platform", action="append", help="check only these pip platform tags")
    ap.add_argument("--python", action="append", help=f"Python versions (default {', '.join(PYTHONS)})")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per pip download")
    args = ap.parse_args(argv)

    extra = ["--index-url", args.index_url] if args.index_url else []
    targets = TARGETS if not args.platform else (("custom", tuple(args.platform), True),)
    pythons = tuple(args.python or PYTHONS)
    results: list[Result] = []
    for label, platforms, _required in targets:
        for py in pythons:
            for pkg in PACKAGES:
                wheel, detail = probe(pkg, py, platforms, extra, args.timeout)
                results.append(Result(pkg, py, label, wheel, detail))
                if not args.markdown:
                    print(f"{label:55} py{py}  {pkg:9} {wheel or 'MISSING: ' + detail}", flush=True)

    if args.markdown:
        print("| target | Python | " + " | ".join(PACKAGES) + " |")
        print("|---|---|" + "---|" * len(PACKAGES))
        for label, _platforms, _required in targets:
            for py in pythons:
                row = {r.package: r for r in results if r.target == label and r.python == py}
                cells = []
                for pkg in PACKAGES:
                    w = row[pkg].wheel
                    cells.append(w.split("-")[1] if w else "**missing**")
                print(f"| {label} | {py} | " + " | ".join(cells) + " |")

    missing_required = [r for r in results
                        if r.wheel is None and any(t[0] == r.target and t[2] for t in targets)]
    for r in missing_required:
        print(f"required wheel missing: {r.package} for Python {r.python} on {r.target}: {r.detail}",
              file=sys.stderr)
    return 1 if missing_required else 0


if __name__ == "__main__":
    sys.exit(main())
