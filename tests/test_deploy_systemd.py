"""deploy/systemd/birdnetd.service: `systemd-analyze verify`, the offline security score and the
hardening choices that must not break /dev/shm sharing, Numba's JIT or the watchdog.

These machines do not run systemd as PID 1; `systemd-analyze verify` and `security --offline` work
without it. Booting the unit for real (systemd-nspawn, by hand): docs/deploy.md, "Tests".
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "deploy" / "systemd" / "birdnetd.service"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)"
)


def directives(text: str) -> dict[str, list[str]]:
    """``Key -> [values]`` of a unit file (keys may repeat, e.g. Environment=)."""
    found: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def one(d: dict[str, list[str]], key: str) -> str:
    assert key in d, f"{key}= missing from the unit"
    assert len(d[key]) == 1, f"{key}= given {len(d[key])} times"
    return d[key][0]


@pytest.fixture
def verifiable_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at an executable stub: verify checks that the binary exists,
    and /opt/birdnet/venv is not installed on a CI box."""
    stub = tmp_path / "venv" / "bin" / "birdnetd"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = UNIT.read_text().replace("/opt/birdnet/venv/bin/birdnetd", str(stub))
    assert str(stub) in text
    unit = tmp_path / "birdnetd.service"
    unit.write_text(text)
    return unit


@needs_analyze
def test_systemd_analyze_verify_is_clean(verifiable_unit: Path):
    proc = subprocess.run(
        [ANALYZE, "verify", "--man=no", str(verifiable_unit)],
        capture_output=True, text=True, timeout=60,
    )
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, out
    # Unknown or misspelt directives are only warnings (exit status 0): fail on any output about us.
    assert "birdnetd.service" not in out, out


@needs_analyze
def test_offline_security_exposure_is_low(verifiable_unit: Path):
    # systemd-analyze prints 0.0 (locked down) .. 10.0 (unprotected); --threshold uses the same scale
    # times 10. 2.5 leaves room only for the deliberate exceptions (JIT memory, network, /dev/shm).
    proc = subprocess.run(
        [ANALYZE, "security", "--offline=yes", "--no-pager", "--threshold=25", str(verifiable_unit)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Overall exposure level" in proc.stdout


def test_service_contract():
    d = directives(UNIT.read_text())
    assert one(d, "Type") == "notify"
    assert one(d, "NotifyAccess") == "main"
    assert one(d, "Restart") == "on-failure"
    assert one(d, "WatchdogSec").rstrip("s").isdigit()
    assert one(d, "ExecStart") == "/opt/birdnet/venv/bin/birdnetd --config /etc/birdnet/birdnetd.toml"
    assert one(d, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one(d, "User") == "birdnet" and one(d, "Group") == "birdnet"
    assert one(d, "RuntimeDirectory") == "birdnet"
    assert one(d, "CacheDirectory") == "birdnet"
    assert one(d, "ConfigurationDirectory") == "birdnet"
    assert "NUMBA_CACHE_DIR=/var/cache/birdnet" in d["Environment"]
    assert one(d, "UMask") == "0007"
    assert one(d, "WantedBy") == "multi-user.target"


def test_descriptor_limit_fits_the_session_cap():
    """LimitNOFILE holds the daemon's session cap at its descriptors per session plus the reserve
    (issue 19: enough sessions and the node dropped out of the ring)."""
    from birdnet.daemon.service import FDS_PER_SESSION, MAX_SESSIONS, RESERVED_FDS
    limit = int(one(directives(UNIT.read_text()), "LimitNOFILE"))
    assert limit >= MAX_SESSIONS * FDS_PER_SESSION + RESERVED_FDS + 8 * 64  # up to 64 peers


def test_hardening_keeps_shared_memory_and_jit_working():
    d = directives(UNIT.read_text())
    # /dev stays the host's (or, with PrivateDevices=yes, a private /dev with the host's /dev/shm
    # bind-mounted into it): nothing may hide, replace or make /dev/shm read-only.
    for key in ("InaccessiblePaths", "TemporaryFileSystem", "ReadOnlyPaths", "BindPaths", "BindReadOnlyPaths"):
        for value in d.get(key, []):
            assert "/dev/shm" not in value and value.split()[0] not in ("/dev", "/"), (key, value)
    assert "PrivateIPC" not in d, "a private IPC namespace hides SysV shm from training processes"
    assert one(d, "ProtectSystem") == "strict"  # leaves /dev, /proc, /sys writable
    assert d.get("DynamicUser", ["no"]) == ["no"], "a dynamic uid cannot be a stable group member"
    # Numba/LLVM JIT needs writable+executable memory; LLVM reads /proc/cpuinfo for CPU features.
    assert one(d, "MemoryDenyWriteExecute") == "no"
    assert "ProcSubset" not in d
    assert d.get("ProtectProc", ["default"]) != ["invisible"]
    families = set(one(d, "RestrictAddressFamilies").split())
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= families
    assert one(d, "NoNewPrivileges") == "yes"
    assert one(d, "CapabilityBoundingSet") == ""
