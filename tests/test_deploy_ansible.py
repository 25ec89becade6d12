"""The Ansible role: ansible-lint, the unit template against deploy/systemd, and the playbook really
run against this machine (``-c local``) into a throw-away prefix, followed by assertions on the
installed files, user, permissions and config, and an installed ``birdnetd`` answering
``birdnet status``.

Ansible is never a dependency of birdnet: it lives in its own virtual environment. The tests look for
``ansible-playbook`` in ``$BIRDNET_ANSIBLE_BIN`` (a bin directory), then on PATH, then in
/work/venv-ansible/bin, and skip with the reason when it is absent.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # CI runs it on the default Python only (.ci/run)

ROOT = Path(__file__).resolve().parents[1]
ANSIBLE_DIR = ROOT / "deploy" / "ansible"
ROLE = ANSIBLE_DIR / "roles" / "birdnet"


def _find(tool: str) -> str | None:
    candidates = []
    if os.environ.get("BIRDNET_ANSIBLE_BIN"):
        candidates.append(Path(os.environ["BIRDNET_ANSIBLE_BIN"]) / tool)
    on_path = shutil.which(tool)
    if on_path:
        candidates.append(Path(on_path))
    candidates.append(Path("/work/venv-ansible/bin") / tool)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


ANSIBLE_PLAYBOOK = _find("ansible-playbook")
ANSIBLE = _find("ansible")
ANSIBLE_LINT = _find("ansible-lint")
SKIP_NO_ANSIBLE = "ansible-playbook not found (set BIRDNET_ANSIBLE_BIN or pip install ansible-core into a venv)"


def ansible_python(tool: str) -> str:
    """The interpreter Ansible itself runs on (from the tool's shebang): with ``-c local`` the modules
    run there, so they find Ansible's own libraries whatever the system python lacks."""
    with open(tool, "rb") as fh:
        first = fh.readline().decode(errors="replace").strip()
    if first.startswith("#!"):
        parts = first[2:].split()
        if parts and os.path.basename(parts[0]) != "env" and os.access(parts[0], os.X_OK):
            return parts[0]
    return "/usr/bin/python3"


def ansible_env(tmp: Path) -> dict[str, str]:
    bindir = str(Path(ANSIBLE_PLAYBOOK or ANSIBLE_LINT or sys.executable).parent)
    env = dict(os.environ)
    env.update(
        PATH=bindir + os.pathsep + env.get("PATH", ""),
        ANSIBLE_NOCOLOR="1",
        ANSIBLE_FORCE_COLOR="0",
        ANSIBLE_HOST_KEY_CHECKING="False",
        ANSIBLE_RETRY_FILES_ENABLED="False",
        ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-local"),
        ANSIBLE_REMOTE_TEMP=str(tmp / "ansible-remote"),
        ANSIBLE_STDOUT_CALLBACK="default",
    )
    return env


@pytest.mark.skipif(ANSIBLE_LINT is None, reason="ansible-lint not found (pip install ansible-lint into the ansible venv)")
def test_ansible_lint_production_profile(tmp_path):
    proc = subprocess.run(
        [ANSIBLE_LINT, "--profile", "production", "--nocolor", "deploy/ansible"],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env=ansible_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.skipif(ANSIBLE is None, reason=SKIP_NO_ANSIBLE)
def test_unit_template_renders_the_static_unit(tmp_path):
    """The role's template with default variables equals deploy/systemd/birdnetd.service
    (comments aside), so the two cannot drift apart."""
    out = tmp_path / "birdnetd.service"
    defaults = ROLE / "defaults" / "main.yml"
    proc = subprocess.run(
        [ANSIBLE, "localhost", "-c", "local", "-i", "localhost,", "-e", f"@{defaults}",
         "-e", f"ansible_python_interpreter={ansible_python(ANSIBLE)}",
         "-m", "ansible.builtin.template",
         "-a", f"src={ROLE / 'templates' / 'birdnetd.service.j2'} dest={out} mode=0644"],
        capture_output=True, text=True, timeout=120, env=ansible_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def body(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]

    static = (ROOT / "deploy" / "systemd" / "birdnetd.service").read_text()
    assert body(out.read_text()) == body(static)


# --- the playbook, really run ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """One run of deploy/ansible/playbook.yml against this machine into ``root``."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.root = tmp / "root"
        self.user = "bnt" + secrets.token_hex(4)  # a real system user, removed at teardown
        self.port = free_port()
        self.prefix = self.root / "opt" / "birdnet"
        self.venv = self.prefix / "venv"
        self.config_dir = self.root / "etc" / "birdnet"
        self.unit_dir = self.root / "etc" / "systemd" / "system"
        self.cache_dir = self.root / "var" / "cache" / "birdnet"
        self.socket = self.root / "run" / "birdnet" / "birdnetd.sock"
        self.inventory = tmp / "inventory.yml"
        self.runs: list[subprocess.CompletedProcess] = []

    def write_inventory(self) -> None:
        # Ranks on purpose not in inventory-name order; two hosts outside the play (--limit here)
        # are still listed in the hosts file; one has an IPv6 address.
        py = ansible_python(ANSIBLE_PLAYBOOK)
        self.inventory.write_text(
            "all:\n  children:\n    birdnet:\n      hosts:\n"
            f"        zeta: {{birdnet_rank: 1, ansible_host: 10.0.0.3}}\n"
            f"        here: {{birdnet_rank: 0, ansible_connection: local, ansible_python_interpreter: '{py}',"
            f" birdnet_address: 127.0.0.1, birdnet_port: {self.port}}}\n"
            f"        alpha: {{birdnet_rank: 2, birdnet_address: 'fd00::1', birdnet_port: 5600}}\n"
        )

    def extra_vars(self, **more) -> str:
        values = {
            "birdnet_prefix": str(self.prefix),
            "birdnet_venv_dir": str(self.venv),
            "birdnet_config_dir": str(self.config_dir),
            "birdnet_unit_dir": str(self.unit_dir),
            "birdnet_cache_dir": str(self.cache_dir),
            "birdnet_socket": str(self.socket),
            "birdnet_user": self.user,
            "birdnet_group": self.user,
            "birdnet_service_manage": False,  # no systemd as PID 1 here
            "birdnet_install_system_packages": False,
            "birdnet_python": sys.executable,
            "birdnet_cluster": "ci",
            "birdnet_codec": "none",
            "birdnet_extra_config": {"round_timeout": 120.0, "codec_params": {}},
            "birdnet_peer_allowed_networks": "hosts, 192.168.7.0/24",
            # one configuration: the role's warm-up runs for real, without compiling all 23 here
            "birdnet_kernel_warmup_codecs": ["efsign"],
        }
        values.update(more)
        return json.dumps(values)

    def run(self, **more) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [ANSIBLE_PLAYBOOK, "-i", str(self.inventory), "--limit", "here",
             str(ANSIBLE_DIR / "playbook.yml"), "-e", self.extra_vars(**more)],
            capture_output=True, text=True, timeout=600, env=ansible_env(self.tmp),
        )
        self.runs.append(proc)
        assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
        return proc

    def remove_user(self) -> None:
        subprocess.run(["userdel", self.user], capture_output=True, timeout=30)
        subprocess.run(["groupdel", self.user], capture_output=True, timeout=30)


def copy_source(dest: Path) -> Path:
    """A copy of the checkout: `pip wheel` builds in-tree, which must not litter the working tree."""
    shutil.copytree(
        ROOT, dest,
        ignore=shutil.ignore_patterns(".git", "*.egg-info", "build", "dist", "__pycache__", ".pytest_cache",
                                      "*.so"),
    )
    return dest


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    if ANSIBLE_PLAYBOOK is None:
        pytest.skip(SKIP_NO_ANSIBLE)
    if os.geteuid() != 0:
        pytest.skip("the playbook creates a system user: run as root (CI does)")
    if not shutil.which("useradd"):
        pytest.skip("useradd not available")
    # Not pytest's tmp_path: /tmp/pytest-of-root is 0700 and the daemon runs as the role's user.
    tmp = Path(tempfile.mkdtemp(prefix="birdnet-deploy-", dir="/tmp"))
    tmp.chmod(0o755)
    d = Deployment(tmp)
    d.write_inventory()
    src = copy_source(tmp / "src")
    try:
        d.run(birdnet_source_dir=str(src), birdnet_python=node_python())
        yield d
    finally:
        d.remove_user()
        shutil.rmtree(tmp, ignore_errors=True)


def node_python() -> str:
    """The interpreter a real node would use: the system python3 (readable by a system user, unlike a
    pyenv build under /root), if it is 3.10+ and can create venvs; else this test's interpreter."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.access(candidate, os.X_OK):
            continue
        probe = subprocess.run(
            [candidate, "-c", "import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 10))"],
            capture_output=True, timeout=60,
        )
        if probe.returncode == 0:
            return candidate
    return sys.executable


def recap_changed(stdout: str, host: str) -> int:
    m = re.search(rf"^{host}\s*:.*?changed=(\d+)", stdout, re.M)
    assert m, stdout[-2000:]
    return int(m.group(1))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.slow
def test_user_and_group(deployment):
    pw = pwd.getpwnam(deployment.user)
    gr = grp.getgrnam(deployment.user)
    assert pw.pw_gid == gr.gr_gid
    assert pw.pw_uid < 1000, "must be a system user (logind's RemoveIPC spares only those)"
    assert pw.pw_shell in ("/usr/sbin/nologin", "/sbin/nologin")


@pytest.mark.slow
def test_files_and_permissions(deployment):
    d = deployment
    assert (d.venv / "bin" / "birdnetd").is_file()
    assert (d.venv / "bin" / "birdnet").is_file()
    for path, want in [
        (d.config_dir, 0o755),
        (d.config_dir / "birdnetd.toml", 0o644),
        (d.config_dir / "hosts.txt", 0o644),
        (d.unit_dir / "birdnetd.service", 0o644),
        (d.cache_dir, 0o750),
    ]:
        assert mode(path) == want, f"{path}: {oct(mode(path))} != {oct(want)}"
    # Config and code belong to root: the daemon's user cannot rewrite what it runs.
    for path in (d.config_dir / "birdnetd.toml", d.config_dir / "hosts.txt", d.venv / "bin" / "python"):
        assert path.stat().st_uid == 0, path
    assert pwd.getpwuid(d.cache_dir.stat().st_uid).pw_name == d.user
    assert list((d.prefix / "wheels").glob("birdnet-*.whl"))


@pytest.mark.slow
def test_hosts_file_in_rank_order(deployment):
    d = deployment
    lines = [ln for ln in (d.config_dir / "hosts.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines == [f"127.0.0.1:{d.port}", "10.0.0.3:5555", "[fd00::1]:5600"]
    # ... and birdnet's own parser agrees.
    out = subprocess.run(
        [str(d.venv / "bin" / "python"), "-c",
         "import sys; from birdnet.hosts import load_hosts; "
         "print(*[p.address for p in load_hosts(sys.argv[1])], sep='\\n')", str(d.config_dir / "hosts.txt")],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()
    assert out == [f"127.0.0.1:{d.port}", "10.0.0.3:5555", "[fd00::1]:5600"]


@pytest.mark.slow
def test_config_is_accepted_by_birdnet(deployment):
    d = deployment
    code = (
        "import json, sys; from birdnet.config import load_settings; "
        "s = load_settings(config=sys.argv[1], environ={}); "
        "print(json.dumps({k: getattr(s, k) for k in ('peers', 'rank', 'socket', 'cluster', 'codec', "
        "'shm_group', 'local_size', 'peer_timeout', 'round_timeout', 'metrics_port', 'curve_secret_key', "
        "'peer_allowed_networks')}))"
    )
    proc = subprocess.run([str(d.venv / "bin" / "python"), "-c", code, str(d.config_dir / "birdnetd.toml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert s == {
        "peers": str(d.config_dir / "hosts.txt"), "rank": 0, "socket": str(d.socket), "cluster": "ci",
        "codec": "none", "shm_group": d.user, "local_size": 1, "peer_timeout": 10.0, "round_timeout": 120.0,
        "metrics_port": None, "curve_secret_key": None, "peer_allowed_networks": "hosts, 192.168.7.0/24",
    }


@pytest.mark.slow
def test_unit_points_at_the_prefix(deployment):
    d = deployment
    text = (d.unit_dir / "birdnetd.service").read_text()
    assert f"ExecStart={d.venv}/bin/birdnetd --config {d.config_dir}/birdnetd.toml" in text
    assert f"User={d.user}\n" in text and f"Group={d.user}\n" in text
    assert f"Environment=NUMBA_CACHE_DIR={d.cache_dir}\n" in text
    # Paths outside /run, /var/cache, /etc cannot be systemd-managed directories.
    assert "RuntimeDirectory=" not in text and "CacheDirectory=" not in text


@pytest.mark.slow
def test_installed_birdnetd_version(deployment):
    proc = subprocess.run([str(deployment.venv / "bin" / "birdnetd"), "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"\d+\.\d+", proc.stdout + proc.stderr)


@pytest.mark.slow
def test_kernel_cache_is_warmed_as_the_service_user(deployment):
    """The role ran `birdnet warmup` as the daemon's user: the configuration's stamp is in the cache
    (the daemon then loads instead of compiling), and the files there belong to that user."""
    stamps = list(deployment.cache_dir.glob("birdnet-warm-*/*"))
    stamps = [p for p in stamps if not p.name.endswith(".lock")]
    assert len(stamps) == 1, sorted(p.name for p in deployment.cache_dir.rglob("*"))[:20]
    owners = {pwd.getpwuid(p.stat().st_uid).pw_name for p in deployment.cache_dir.rglob("*")}
    assert owners == {deployment.user}, owners
    assert any(p.suffix in (".nbi", ".nbc") for p in deployment.cache_dir.rglob("*")), "no Numba cache files"
    out = deployment.runs[0].stdout
    assert "Compile the codec kernels into the cache as the service user" in out


def test_second_run_changes_nothing(deployment):
    d = deployment
    wheel = next((d.prefix / "wheels").glob("birdnet-*.whl"))
    proc = d.run(birdnet_wheel=str(wheel), birdnet_python=node_python())
    assert recap_changed(proc.stdout, "here") == 0, proc.stdout[-6000:]


@pytest.mark.slow
def test_installed_daemon_answers_status(deployment):
    """The installed birdnetd, started as the role's user with the generated hosts file, answers
    `birdnet status`. Its two peers do not exist, so the ring is incomplete; status must still answer."""
    d = deployment
    tmp_path = d.tmp / "daemon"
    tmp_path.mkdir()
    tmp_path.chmod(0o755)
    rundir = tmp_path / "run"
    rundir.mkdir()
    os.chown(rundir, pwd.getpwnam(d.user).pw_uid, grp.getgrnam(d.user).gr_gid)
    rundir.chmod(0o750)
    sock = rundir / "birdnetd.sock"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(d.cache_dir), HOME=str(tmp_path))
    env.pop("NOTIFY_SOCKET", None)
    log = (tmp_path / "birdnetd.log").open("w")
    daemon = subprocess.Popen(
        [str(d.venv / "bin" / "birdnetd"), "--config", str(d.config_dir / "birdnetd.toml"),
         "--peers", str(d.config_dir / "hosts.txt"), "--rank", "0", "--socket", str(sock)],
        user=d.user, group=d.user, umask=0o007, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120.0  # first start compiles the kernels
        while not sock.exists():
            assert daemon.poll() is None, "birdnetd exited: " + (tmp_path / "birdnetd.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no socket after 120 s: " + (tmp_path / "birdnetd.log").read_text()[-3000:]
            time.sleep(0.2)
        assert stat.S_IMODE(sock.stat().st_mode) & 0o060 == 0o060, "socket not usable by the group"
        status = None
        while time.monotonic() < deadline:
            proc = subprocess.run([str(d.venv / "bin" / "birdnet"), "status", "--socket", str(sock), "--json"],
                                  capture_output=True, text=True, timeout=30)
            if proc.returncode == 0:
                status = json.loads(proc.stdout)
                break
            time.sleep(0.5)
        assert isinstance(status, dict), proc.stdout[-2000:] + proc.stderr[-2000:]
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait(timeout=30)
        log.close()
