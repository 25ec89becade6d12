"""Core and tools apart: birdnet's core (codecs, kernels, ring, wire, shm, config, errors, daemon,
client, the local cluster helper) imports none of the tools' packages (the benchmarks, torch,
scikit-learn, matplotlib, tqdm), and the ``birdnet`` command imports the benchmarks and the demo
only in their own subcommands.

Each check runs in a fresh interpreter with a meta-path finder in front that records every attempt
to import a blocked package, then refuses it: a core module that tried (even inside ``try: ...
except ImportError``) is named, with the package it asked for."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: what the core may not import: the tools' packages (and the data sets they train on)
TOOLS = ("birdnet.bench", "birdnet.demo", "torch", "sklearn", "matplotlib", "tqdm", "mnist1d", "jax")
#: modules that are tools themselves, or a framework's adapter (which imports its framework)
NOT_CORE = ("birdnet.bench", "birdnet.cli", "birdnet.demo")
ADAPTERS = ("birdnet.client.torch", "birdnet.client.torch_dist", "birdnet.client.jax")


def _under(module: str, names) -> bool:
    """Whether ``module`` is one of ``names`` or inside one of them (the torch adapter's private
    modules, ``birdnet.client._torch_*``, count as the adapter)."""
    return (any(module == n or module.startswith(n + ".") for n in names)
            or ("birdnet.client.torch" in names and module.startswith("birdnet.client._torch_")))


_PROBE = textwrap.dedent("""
    import importlib, json, sys

    BLOCKED = tuple(json.loads(sys.argv[1]))
    tried = []

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                tried.append(name)
                raise ImportError(f"{name} is blocked in this check")
            return None

    sys.meta_path.insert(0, Blocker())
    culprits = {}
    for mod in json.loads(sys.argv[2]):
        before = len(tried)
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            culprits[mod] = f"ImportError: {exc}"
        if len(tried) > before:
            culprits[mod] = sorted(set(tried[before:]))
    for argv in json.loads(sys.argv[3]):  # `birdnet ARGS` run in this process
        from birdnet.cli import main
        before = len(tried)
        try:
            main(argv)
        except (SystemExit, ImportError):
            pass
        if len(tried) > before:
            culprits["birdnet " + " ".join(argv)] = sorted(set(tried[before:]))
    print(json.dumps(culprits))
""")


def _modules() -> list[str]:
    import pkgutil

    import birdnet.client
    import birdnet.daemon

    import birdnet
    out = []
    for pkg in (birdnet, birdnet.daemon, birdnet.client):
        out.append(pkg.__name__)
        out += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    return sorted(set(out))


def _probe(blocked, modules, commands=()) -> dict:
    # NUMBA_DISABLE_JIT: kernel modules with explicit signatures compile at import, which this
    # check does not need (it is about what gets imported, and takes a second this way)
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_DISABLE_JIT="1")
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(blocked), json.dumps(modules), json.dumps(commands)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_core_modules_import_no_tool():
    core = [m for m in _modules() if not _under(m, NOT_CORE + ADAPTERS)]
    # the layers the core is made of are all in the list, so a module moved or renamed is noticed
    for layer in ("birdnet.codecs.marsit", "birdnet.kernels.signbits", "birdnet.ring.dense", "birdnet.wire",
                  "birdnet.shm", "birdnet.config", "birdnet.errors", "birdnet.daemon.engine",
                  "birdnet.daemon.main", "birdnet.client", "birdnet.client._connection", "birdnet.cluster"):
        assert layer in core
    assert _probe(TOOLS, core) == {}


def test_the_framework_adapters_import_no_tool_but_their_framework():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    adapters = [m for m in _modules() if _under(m, ADAPTERS) and m != "birdnet.client.jax"]
    assert "birdnet.client.torch" in adapters
    # torch itself looks for tqdm (torch.hub's download bar), so tqdm is not counted here
    assert _probe([t for t in TOOLS if t not in ("torch", "jax", "tqdm")], adapters) == {}


def test_the_command_imports_the_tools_only_in_their_subcommands():
    # `birdnet codecs` and `birdnet status` (no daemon there: it says so and returns) need no tool;
    # `birdnet demo --help` does import the demo: the finder sees it, so the check can fail
    got = _probe(TOOLS, ["birdnet.cli"], [["codecs"], ["status", "--socket", "/nonexistent/birdnet.sock"],
                                          ["demo", "--help"]])
    assert set(got) == {"birdnet demo --help"}, got
    assert "birdnet.demo" in got["birdnet demo --help"]


def test_the_cluster_helper_keeps_its_old_name():
    from birdnet import cluster as new
    from birdnet.bench import cluster as old
    assert old.LocalCluster is new.LocalCluster and old.Workers is new.Workers
    assert old.free_ports is new.free_ports and old.rank_results is new.rank_results
