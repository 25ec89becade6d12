"""The examples run, in their short mode (one epoch, 2 daemons on loopback, one process each), so
they cannot drift from the API: each ends with exit status 0, an accuracy line and every process
holding identical parameters."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE_TIMEOUT = 240.0  #: one epoch of digits on 2 processes, kernel compiles on a loaded machine included


@pytest.mark.slow
@pytest.mark.timeout(EXAMPLE_TIMEOUT + 30)
@pytest.mark.parametrize("script, extra", [
    ("train_torch_cnn.py", ["--codec", "marsit"]),
    ("train_torch_ddp.py", []),
])
def test_example_short_mode(script, extra, tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / script), "--nodes", "2", "--epochs", "1", *extra],
                       cwd=tmp_path, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT)
    assert r.returncode == 0, f"{script} {extra}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    m = re.search(r"final test accuracy ([0-9.]+) after 1 epochs", r.stdout)
    assert m, r.stdout[-2000:]
    assert float(m.group(1)) > 0.2, f"{script} {extra}: accuracy {m.group(1)} after one epoch (chance is 0.1)"
    assert "parameters identical on every process" in r.stdout, r.stdout[-2000:]
