"""Test hosts in network namespaces: one namespace per node, joined by veth pairs to a bridge that
lives in a hub namespace of its own (nothing is added to the machine's own network), each node's
link optionally shaped with a token bucket (``tc qdisc ... tbf``; netem is not assumed).

Needs root and ``ip`` (iproute2). Used by ``birdnet bench allreduce --netns`` and by the tests.
Everything is torn down on exit, also on Ctrl-C, and :func:`cleanup_stale` removes what a killed
run left behind.
"""
from __future__ import annotations

import os
import shutil
import subprocess

PREFIX = "bn"


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be made here, else (False, the reason)."""
    if os.geteuid() != 0:
        return False, "needs root (ip netns)"
    if shutil.which("ip") is None:
        return False, "needs iproute2's ip"
    probe = f"{PREFIX}probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _run(*cmd: str) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def ipv4_sysctl(name: str) -> list[str]:
    """The words of /proc/sys/net/ipv4/``name`` in this process's namespace ([] if unreadable)."""
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return f.read().split()
    except OSError:
        return []


def cleanup_stale() -> None:
    """Delete namespaces of earlier runs whose process is gone."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(PREFIX) and "-" in name:
            pid = name[len(PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
                shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)


class NetnsCluster:
    """``n`` namespaces ``bn<pid>-<i>`` with addresses ``10.213.<k>.<i+1>``; ``rate`` like "1gbit";
    ``tcp_cc`` the TCP congestion control of every namespace (e.g. "cubic"; None: the machine's).

    Each node's ``eth0`` also has IPv6 addresses: ``fd00:bd:<k>::<i+1>`` (``ipv6``, a unique local
    address) and ``fe80::bd:<i+1>`` (``link_local``, reached as ``fe80::bd:<i+1>%eth0``), both
    without duplicate address detection so they are usable at once; and ``names``-file entries
    ``node<i>`` resolving to the ULA inside the namespaces (``ip netns exec`` bind-mounts
    /etc/netns/NS/hosts over /etc/hosts), removed on teardown."""

    def __init__(self, n: int, rate: str | None = None, *, subnet: int | None = None,
                 tcp_cc: str | None = None) -> None:
        self.n, self.rate, self.tcp_cc = n, rate, tcp_cc
        self.tag = f"{PREFIX}{os.getpid()}"
        self.subnet = subnet if subnet is not None else os.getpid() % 250
        self.hub = f"{self.tag}-hub"
        self.names = [f"{self.tag}-{i}" for i in range(n)]
        self.addresses = [f"10.213.{self.subnet}.{i + 1}" for i in range(n)]
        self.ipv6 = [f"fd00:bd:{self.subnet:x}::{i + 1:x}" for i in range(n)]
        self.link_local = [f"fe80::bd:{i + 1:x}" for i in range(n)]
        self.host_names = [f"node{i}" for i in range(n)]
        self.created: list[str] = []

    def __enter__(self) -> "NetnsCluster":
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> None:
        cleanup_stale()
        _run("ip", "netns", "add", self.hub)
        self.created.append(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        _run("ip", "-n", self.hub, "link", "set", "lo", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addresses)):
            _run("ip", "netns", "add", ns)
            self.created.append(ns)
            # create the pair inside the hub, then move one end into the node's namespace
            _run("ip", "-n", self.hub, "link", "add", f"p{i}", "mtu", "1500", "type", "veth", "peer", "name", "eth0", "mtu", "1500")
            _run("ip", "-n", self.hub, "link", "set", "eth0", "netns", ns)
            _run("ip", "-n", self.hub, "link", "set", f"p{i}", "master", "br0")
            _run("ip", "-n", self.hub, "link", "set", f"p{i}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            self._add_ipv6(i, ns)
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.tcp_cc:
                self.set_tcp_cc(ns, self.tcp_cc)
            if self.rate:
                self.shape(i, self.rate)

    def _add_ipv6(self, i: int, ns: str) -> None:
        _run("ip", "-n", ns, "addr", "add", f"{self.ipv6[i]}/64", "dev", "eth0", "nodad")
        _run("ip", "-n", ns, "addr", "add", f"{self.link_local[i]}/64", "dev", "eth0", "nodad")
        etc = f"/etc/netns/{ns}"
        os.makedirs(etc, exist_ok=True)
        with open(f"{etc}/hosts", "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n"
                    + "".join(f"{a} {name}\n" for a, name in zip(self.ipv6, self.host_names)))

    @staticmethod
    def set_tcp_cc(ns: str, name: str) -> None:
        """Set the TCP congestion control of namespace ``ns`` (a new namespace starts with the
        machine's). Outside the machine's own namespace the kernel only takes the algorithms listed
        in net.ipv4.tcp_allowed_congestion_control, which only the machine's namespace can change."""
        r = subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                            f"net.ipv4.tcp_congestion_control={name}"], capture_output=True, text=True)
        if r.returncode == 0:
            return
        available, allowed = (ipv4_sysctl(f"tcp_{k}_congestion_control") for k in ("available", "allowed"))
        if available and name not in available:
            raise RuntimeError(f"TCP congestion control {name!r} is not available in this kernel "
                               f"(available: {' '.join(available)}; a module may need loading: modprobe tcp_{name})")
        if allowed and name not in allowed:
            raise RuntimeError(f"TCP congestion control {name!r} is not allowed in network namespaces here "
                               f"(net.ipv4.tcp_allowed_congestion_control = {' '.join(allowed)}); allow it with "
                               f"`sysctl -w net.ipv4.tcp_allowed_congestion_control=\"{' '.join([*allowed, name])}\"`"
                               " or pick one of those")
        raise RuntimeError(f"cannot set TCP congestion control {name!r} in {ns}: {r.stderr.strip()}")

    def shape(self, i: int, rate: str) -> None:
        """Token-bucket shaping of node i's egress (in a ring each node's ingress is its left
        neighbour's egress, so every link direction in use is shaped)."""
        subprocess.run(["tc", "-n", self.names[i], "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
        _run("tc", "-n", self.names[i], "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
             "burst", "512kb", "latency", "50ms")

    def link(self, i: int, up: bool) -> None:
        """Cut (``up=False``) or restore node i's link."""
        _run("ip", "-n", self.names[i], "link", "set", "eth0", "up" if up else "down")

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def teardown(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        self.created.clear()
