"""The x86 side of the aarch64 check (deploy/check_aarch64.sh, deploy/aarch64/): seconds, no
emulation. The emulated run itself is a separate command (docs/deploy.md, "aarch64")."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "check_aarch64.sh"
sys.path.insert(0, str(ROOT / "deploy" / "aarch64"))


def test_script_parses_and_rejects_bad_usage():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, timeout=30).returncode == 0
    r = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "--runner proot" in r.stdout and "qemu-aarch64-static -L" in r.stdout
    r = subprocess.run(["bash", str(SCRIPT), "--runner", "bogus"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--runner must be auto, binfmt or proot" in r.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_script_is_shellcheck_clean():
    r = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout


def test_mixed_ring_plan_covers_every_codec_and_birdplus_mode():
    from mixed_ring import configs

    from birdnet.codecs import get_codec, names
    cfgs = configs()
    assert set(names()) <= {c["codec"] for c in cfgs}
    modes = {(c["params"].get("mode", "local"), c["params"].get("value_dtype", "float32"))
             for c in cfgs if c["codec"] == "birdplus"}
    assert modes == {("local", "float32"), ("local", "float16"), ("shared", "float32"), ("shared", "float16")}
    for c in cfgs:  # every variant is a valid configuration (a typo would fail only under emulation)
        get_codec(c["codec"], **c["params"])
    assert len({c["label"] for c in cfgs}) == len(cfgs)
    # DiLoCo's defaults with Adam (what most training loops send) are run as they are
    from birdnet.client.diloco import ADAM_CODEC, ADAM_CODEC_PARAMS, ADAM_WARMUP_CODEC, ADAM_WARMUP_CODEC_PARAMS
    plan = [(c["codec"], c["params"]) for c in cfgs]
    assert (ADAM_CODEC, ADAM_CODEC_PARAMS) in plan and (ADAM_WARMUP_CODEC, ADAM_WARMUP_CODEC_PARAMS) in plan


def test_ring_inputs_are_pinned_bits():
    """The mixed ring's inputs come from integer arithmetic and power-of-two scaling only, so they
    are the same bits on every CPU (every mixed-ring run checks the emulated node's inputs against
    the x86 bits); pinned here so a change to the generator shows on x86 first."""
    from ring_worker import portable_input, sha
    x = portable_input(20261201, 1, 0, 4099)
    assert x.dtype.name == "float32" and x[0] == 0 and (x != 0).sum() > 4000
    assert sha(x) == PINNED_4099
    assert sha(portable_input(20261201, 2, 1, 7)) == PINNED_7


PINNED_4099 = "d79fbfda62286f8b3aa70779c859e7ec20908fe0298998fbd1a150560505885d"
PINNED_7 = "bea96fe9194a5777882c0c70cf9d7e5078a3cefd6395f81ba8f25eaea7442289"
