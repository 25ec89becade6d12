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


@pytest.mark.timeout(150)
def test_rawring_with_the_commit_count_and_headers_runs_round_after_round():
    # the bare ring's variants behind docs/benchmarks.md's floor: a count that never reached world - 1,
    # or a header out of step, would hang (the ranks' 120 s receive timeout) or raise
    pytest.importorskip("torch")  # the Gloo ranks beside it
    r = _tool("rawring", "--zmq", "--commit", "--headers", "--sizes", "1000,100000", "--calls", "20,5", "--gloo-calls", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("bare ZeroMQ ring + commit + headers") == 2, r.stderr[-2000:]


def test_tables_prints_the_docs_loop_table():
    r = _tool("tables", "loop", str(RESULTS / "loop_4_1gbit_lane.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "marsit" in r.stdout and "| 11,689,512 |" in r.stdout, r.stdout[:2000]


def test_repeat_stats_on_two_invocations():
    files = [str(RESULTS / "loop_4_1gbit_lane.json"), str(RESULTS / "loop_4_1gbit_cubic_lane.json")]
    r = _tool("repeat_stats", *files)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "invocations, codec none" in r.stdout and "loop  median" in r.stdout, r.stdout[:2000]


@pytest.mark.parametrize("variant,gauss,laplace", [("mean", 0.13, 0.21), ("twomag", 0.12, 0.19)])
def test_lowbit2_variants_decode_what_they_encode_with_the_error_they_state(variant, gauss, laplace, monkeypatch):
    # docs/slowlink.md's emulated 2-bit rows: the codes must round-trip and have the squared error
    # the tool's docstring states (lowbit's absmax midrise levels: 0.36 and 1.10 on the same data)
    import numpy as np

    from birdnet.bench.tools import lowbit2_variants as V
    from birdnet.kernels import lowbit as K

    rng = np.random.default_rng(0)
    code = V.VARIANTS[variant]()
    for x, bound, absmax_err in ((rng.standard_normal(256 * 100 + 5), gauss, 0.35),
                                 (rng.laplace(size=256 * 100 + 5), laplace, 1.0)):
        x = x.astype(np.float32)
        buf, vals = code.encode(x, 256)
        assert buf.shape[0] == code.nbytes(x.shape[0], 256)
        np.testing.assert_array_equal(code.decode(buf, x.shape[0], 256), vals)
        assert np.mean((vals - x) ** 2) / np.mean(x ** 2) < bound
        ref = np.empty_like(x)
        K.encode(x, 2, 256, deq=ref, midrise=True)
        assert np.mean((ref - x) ** 2) / np.mean(x ** 2) > absmax_err
    # installed, it takes lowbit's 2-bit midrise blocks of >= 128 and nothing else
    for attr in ("encode", "decode", "nbytes"):
        monkeypatch.setattr(K, attr, getattr(K, attr))
    x = rng.standard_normal(1000).astype(np.float32)
    four = K.encode(x, 4, 64)
    V.install(code)
    np.testing.assert_array_equal(K.encode(x, 4, 64), four)
    res = np.zeros(1000, np.float32)
    buf = K.encode(x, 2, 256, midrise=True, residual=res)
    out = np.empty(1000, np.float32)
    K.decode(buf, 2, 256, out, midrise=True)
    np.testing.assert_array_equal(out, code.encode(x, 256)[1])
    np.testing.assert_array_equal(res, x - out)
    assert K.nbytes(1000, 2, 256) == buf.shape[0]


def test_lowbit2_variants_passes_on_to_the_loop_simulation():
    pytest.importorskip("torch")
    r = _tool("lowbit2_variants", "--variant", "mean", "--help")
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]
    r = _tool("lowbit2_variants", "--steps", "10")
    assert r.returncode != 0 and "--variant" in r.stderr


def test_sparseloco_sim_emulates_the_codec_it_stands_for():
    # docs/slowlink.md's sparse rows: on the same accumulator the emulation keeps the positions and
    # sends the values the sparseloco codec's kernel does, and counts the bytes its payload has
    import numpy as np

    from birdnet.bench.tools import sparseloco_sim as S
    from birdnet.kernels import chunktopk as K

    rng = np.random.default_rng(0)
    for chunk, k in ((4096, 256), (256, 18), (1024, 200)):  # 200 of 1024: a bitmap
        n = 3 * chunk + 77
        e = (rng.standard_normal(n) * rng.exponential(1.0, n)).astype(np.float32)
        sent = np.empty(n, np.float32)
        scales, body = K.encode(e, chunk, k, sent)
        p = S.params_of({"chunk": chunk, "k": k})
        np.testing.assert_array_equal(S.compress(e, p), sent)
        assert S.payload_bytes(n, p) == scales.nbytes + body.nbytes


def test_sparseloco_sim_passes_on_to_the_loop_simulation():
    pytest.importorskip("torch")
    r = _tool("sparseloco_sim", "--help")
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]
