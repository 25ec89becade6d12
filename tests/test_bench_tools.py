"""The measuring tools behind docs/benchmarks.md (birdnet.bench.tools) stay runnable: each parses
its arguments with its imports resolved, and the table printer and the repeat statistics work on
the JSON the docs keep."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
ARGPARSE_TOOLS = ["loopcpu", "pyring", "rawring", "runnercpu", "sim", "sim_codec", "sim_shared",
                  "sparse_oracle", "threadcpu", "diloco_sim", "diloco_loop_sim", "lowbit_error", "stepprofile", "ringcalls"]


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"birdnet.bench.tools.{name}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ARGPARSE_TOOLS)
def test_tool_imports_and_parses(name):
    if name in ("sparse_oracle", "diloco_sim", "diloco_loop_sim"):
        pytest.importorskip("torch")
    if name in ("sim", "sim_shared"):
        pytest.importorskip("mnist1d")
    r = _tool(name, "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout


def test_tables_prints_the_docs_loop_table():
    r = _tool("tables", "loop", str(RESULTS / "loop_4_1gbit_lane.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "marsit" in r.stdout and "| 11,689,512 |" in r.stdout, r.stdout[:2000]


def test_repeat_stats_on_two_invocations():
    files = [str(RESULTS / "loop_4_1gbit_lane.json"), str(RESULTS / "loop_4_1gbit_cubic_lane.json")]
    r = _tool("repeat_stats", *files)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "invocations, codec none" in r.stdout and "loop  median" in r.stdout, r.stdout[:2000]
