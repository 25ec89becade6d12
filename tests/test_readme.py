"""The README's code is run, so it cannot drift from the code: its Python blocks as training
processes against real local daemons (2 daemons on loopback, one process each, as the quick start),
its shell blocks' commands and flags against the CLI's own ``--help``, and the links it names."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from birdnet.bench.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCK_TIMEOUT = 240.0  #: one block's two processes, a cold Numba cache compiling marsit included


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def _run_on_two_nodes(code: str, tmp_path: Path) -> list[str]:
    """Run ``code`` as a script in 2 processes, each pointed at its own daemon by $BIRDNET_SOCKET
    (the quick start's way); return their stdout."""
    script = tmp_path / "block.py"
    script.write_text(code)
    with LocalCluster(2, tmp_path) as cl:
        procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env={**__import__("os").environ, "BIRDNET_SOCKET": s})
                 for s in cl.sockets]
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=BLOCK_TIMEOUT)
                assert p.returncode == 0, f"README block failed:\n{code}\n--- stderr:\n{err[-3000:]}"
                outs.append(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return outs


def test_readme_has_the_blocks_these_tests_run():
    py = _blocks("python")
    assert len(py) == 2, "a README Python block was added or removed: run it here too"
    assert "from birdnet.client import Client" in py[0] and "birdnet.client.torch" in py[1]


@pytest.mark.timeout(BLOCK_TIMEOUT + 60)
def test_readme_numpy_quick_start_trains(tmp_path):
    outs = _run_on_two_nodes(_blocks("python")[0], tmp_path)
    losses = {}
    for out in outs:
        m = re.search(r"rank (\d) of 2: loss ([0-9.]+)", out)
        assert m, out
        losses[int(m.group(1))] = float(m.group(2))
    assert sorted(losses) == [0, 1]
    # y's mean square is 4096 * mean(linspace(-1, 1)^2) ~ 1366 at w = 0; 30 averaged steps, the last
    # 20 of them compressed to one bit per element, must bring each process's loss far below it
    for rank, loss in losses.items():
        assert loss < 300, f"rank {rank}: loss {loss} (from ~1366): the quick start does not train"


@pytest.mark.timeout(BLOCK_TIMEOUT + 60)
def test_readme_torch_block_runs(tmp_path):
    pytest.importorskip("torch")
    _run_on_two_nodes(_blocks("python")[1], tmp_path)


def _help(cmd: list[str]) -> str:
    r = subprocess.run([sys.executable, "-m", *cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{' '.join(cmd)} --help failed: {r.stderr[-2000:]}"
    return r.stdout


_MODULE = {"birdnetd": ["birdnet.daemon.main"], "birdnet": ["birdnet.cli"]}


def test_readme_shell_commands_and_flags_exist():
    """Every ``birdnetd``/``birdnet`` command in a shell block: its subcommand and its flags are in
    the CLI's ``--help``."""
    seen = 0
    for block in _blocks("sh"):
        for line in block.splitlines():
            for part in re.split(r"&&|&|;|\|", line.split("#")[0]):
                words = shlex.split(part)
                # the command may follow VAR=value, ssh HOST or a path (/opt/birdnet/venv/bin/birdnet)
                at = [i for i, w in enumerate(words) if Path(w).name in _MODULE]
                if not at:
                    continue
                words = [Path(words[at[0]]).name, *words[at[0] + 1:]]
                # birdnet's subcommand, and bench's own (`birdnet bench allreduce`)
                sub = words[1:3] if words[0] == "birdnet" and words[1:2] == ["bench"] else words[1:2]
                cmd = _MODULE[words[0]] + (sub if words[0] == "birdnet" else [])
                text = _help(cmd)
                for flag in (w.split("=")[0] for w in words if w.startswith("--")):
                    assert flag in text, f"README: `{part.strip()}`: {flag} is not an option of {' '.join(cmd)}"
                seen += 1
    assert seen >= 4


def test_readme_links_exist():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target and target != "docs/slowlink.md":  # slowlink.md: the DiLoCo work's
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
