"""The hosts file: one ``host:port`` per line, in ring order; ``#`` comments and blank lines ignored."""
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
        return f"{self.host}:{self.port}"

    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def parse_hosts(text: str, source: str = "<hosts>") -> list[Peer]:
    """Parse hosts-file text; :class:`ConfigError` names ``source`` and the line."""
    peers: list[Peer] = []
    seen: dict[tuple[str, int], int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        if line.startswith("["):  # [v6addr]:port
            host, sep, port_s = line[1:].partition("]:")
        else:
            host, sep, port_s = line.rpartition(":")
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


def load_hosts(path: str | Path) -> list[Peer]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read hosts file {p}: {exc.strerror or exc}") from None
    return parse_hosts(text, str(p))


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
