"""The hosts file: one ``host:port`` per line, in ring order; ``#`` comments and blank lines ignored.

``host`` is a name, an IPv4 address or an IPv6 address in brackets (required: ``::1:29500`` is
refused, ``[::1]:29500`` is what it means); a link-local IPv6 address
names its interface after ``%`` (its scope id), inside the brackets::

    10.0.0.11:29500
    node2.example:29500          # a name: IPv4 or IPv6, whichever it resolves to first
    [fd00:bd::3]:29500
    [fe80::12%eth0]:29500        # link-local: the interface this node reaches it through

The interface is this machine's: a ring of link-local addresses needs every node to use the same
interface name (or each node its own hosts file, with the same entries in the same order and its
own interface names)."""
from __future__ import annotations

import dataclasses
import errno
import socket
from pathlib import Path

from birdnet.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Peer:
    rank: int
    host: str
    port: int

    @property
    def address(self) -> str:
        """``host:port`` as in the hosts file (an IPv6 host in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def endpoint(self) -> str:
        """The ZeroMQ endpoint to connect to (``tcp://[fe80::12%eth0]:29500`` keeps the scope id;
        the socket needs ZMQ_IPV6 for any IPv6 address or name that resolves to one)."""
        return f"tcp://{self.address}"


def parse_hosts(text: str, source: str = "<hosts>") -> list[Peer]:
    """Parse hosts-file text; :class:`ConfigError` names ``source`` and the line."""
    peers: list[Peer] = []
    seen: dict[tuple[str, int], int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        if line.startswith("["):  # [v6addr]:port or [v6addr%iface]:port
            host, sep, port_s = line[1:].partition("]:")
            if sep and not _is_ipv6(host):
                raise ConfigError(f"{where}: {host!r} in brackets is not an IPv6 address "
                                  "(e.g. [fd00::1]:29500, or [fe80::12%eth0]:29500 for a link-local one)")
        else:
            host, sep, port_s = line.rpartition(":")
            if ":" in host:  # without brackets the port cannot be told from the address's last group
                fix = f"[{host}]:{port_s}" if _is_ipv6(host) else "[fd00::1]:29500"
                raise ConfigError(f"{where}: {line!r}: write an IPv6 address in brackets, {fix} (without them "
                                  "its last group reads as the port)")
        if not sep or not host or " " in line:
            raise ConfigError(f"{where}: {raw.strip()!r} is not 'host:port' (one entry per line)")
        try:
            port = int(port_s)
        except ValueError:
            raise ConfigError(f"{where}: port {port_s!r} is not a number") from None
        if not 1 <= port <= 65535:
            raise ConfigError(f"{where}: port {port} is outside 1..65535")
        key = (host.lower(), port)
        if key in seen:
            raise ConfigError(f"{where}: {host}:{port} duplicates line {seen[key]}; each node appears once")
        seen[key] = lineno
        peers.append(Peer(len(peers), host, port))
    if not peers:
        raise ConfigError(f"{source}: no 'host:port' entries; list every node of the ring, one per line")
    return peers


def _is_ipv6(host: str) -> bool:
    addr, _, scope = host.partition("%")
    try:
        socket.inet_pton(socket.AF_INET6, addr)
    except OSError:
        return False
    return "%" not in host or bool(scope)


def load_hosts(path: str | Path) -> list[Peer]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read hosts file {p}: {exc.strerror or exc}") from None
    return parse_hosts(text, str(p))


def unresolved(peers: list[Peer]) -> dict[int, str]:
    """The peers whose name does not resolve now, by rank, each with what to say about it. A daemon
    checks at start and says so in its log and in ``birdnet status``: otherwise such a peer only
    shows as lost once peer_timeout has passed, with nothing naming the name."""
    out: dict[int, str] = {}
    for p in peers:
        if _is_ipv6(p.host):
            continue
        try:
            socket.inet_pton(socket.AF_INET, p.host)
            continue  # an address, not a name
        except OSError:
            pass
        try:
            socket.getaddrinfo(p.host, p.port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            why = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
            out[p.rank] = (f"hosts-file name {p.host!r} (rank {p.rank}) does not resolve ({why}); fix the name "
                           "or its DNS / /etc/hosts entry")
    return out


def _can_bind(host: str, port: int) -> bool:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, addr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
                return True
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue  # our address, but taken: not this daemon's slot
                continue
    return False


def find_own_rank(peers: list[Peer], source: str = "hosts file") -> int:
    """The rank whose address belongs to this machine and whose port can be bound."""
    matches = [p.rank for p in peers if _can_bind(p.host, p.port)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise ConfigError(f"no entry of {source} is an address of this machine with a free port; "
                          "check the file, or pass --rank N")
    listed = ", ".join(f"{peers[m].address} (rank {m})" for m in matches)
    raise ConfigError(f"several entries of {source} could be this node: {listed}; pass --rank N")
