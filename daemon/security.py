"""Peer authentication and encryption with ZeroMQ CURVE, and ``birdnet keygen``.

Each daemon has a key pair (``birdnet keygen --out DIR`` writes ``DIR/birdnet.key``, the secret
key, mode 0600, and ``DIR/birdnet.pub``, the public key; both are one Z85 line, 40 characters).
Settings:

``curve_secret_key``
    this node's ``birdnet.key``. Setting it turns CURVE on: the peer ROUTER becomes a CURVE server
    and the DEALER to the right neighbour a CURVE client.
``curve_allowed_keys``
    the peers' public keys, one per line (``#`` comments and blank lines ignored), in one of two
    forms, not mixed:

    * ``KEY`` lines in ring order: line *i* is the key of the hosts file's rank *i* (what the
      Ansible role writes: the nodes' ``birdnet.pub`` files concatenated in ring order);
    * ``host:port KEY`` lines naming the hosts-file entry each key belongs to (any order).

    Every ring node must have a key (the DEALER needs its right neighbour's key to connect). A
    connection from a key not in the file, or without CURVE at all, is refused before any birdnet
    message is read and logged (``birdnet.security``), and the refused side names the reason in
    ``birdnet status`` and in the errors its clients get.

The allow-list is checked by a ZAP handler (ZeroMQ RFC 27) running on a thread of the daemon's
context, bound before any socket uses CURVE.

``peer_allowed_networks`` (with or without CURVE)
    addresses and networks (``10.0.0.0/24``, ``fd00::/64``, ``192.168.1.7``, comma- or
    space-separated) that may connect to the peer port, and the word ``hosts`` for every hosts-file
    address (names resolved at start-up). The same ZAP handler refuses a connection from any other
    address during the handshake, before libzmq takes a single frame of a message from it: without
    CURVE the one bound on what a stranger can make the daemon hold (docs/security.md, "a multipart
    message without end"). Empty (the default): any address.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.z85

from birdnet.errors import ConfigError
from birdnet.osutil import name_os_thread

log = logging.getLogger("birdnet.security")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "birdnet"
KEY_CHARS = 40
_Z85 = set("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")


def _check_key(text: str, where: str) -> bytes:
    if len(text) != KEY_CHARS or not set(text) <= _Z85:
        raise ConfigError(f"{where}: {text[:50]!r} is not a Z85 CURVE key (40 characters, as written by "
                          "`birdnet keygen`)")
    return text.encode("ascii")


def _key_lines(path: str) -> list[tuple[int, str]]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read CURVE key file {path}: {exc.strerror or exc}") from None
    out = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        # '#' is a Z85 character, so only whole-line comments exist
        line = "" if raw.lstrip().startswith("#") else raw.strip()
        if line:
            out.append((lineno, line))
    return out


def read_secret_key(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``birdnet.key`` file; refuses a file others can read."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"cannot read CURVE secret key {path}: {exc.strerror or exc}") from None
    if st.st_mode & 0o077:
        raise ConfigError(f"CURVE secret key {path} is readable by others (mode {st.st_mode & 0o777:o}); "
                          f"chmod 600 {path}")
    lines = _key_lines(path)
    if len(lines) != 1:
        raise ConfigError(f"{path}: expected one secret key line, found {len(lines)}")
    secret = _check_key(lines[0][1], f"{path}:{lines[0][0]}")
    return zmq.curve_public(secret), secret


def read_allowed_keys(path: str, peers: Sequence[Any]) -> dict[int, bytes]:
    """rank -> public key for every ring node (see the module docstring for the format)."""
    lines = _key_lines(path)
    by_address = {p.address.lower(): p.rank for p in peers}
    keys: dict[int, bytes] = {}
    with_address = [len(line.split()) == 2 for _, line in lines]
    if any(with_address) and not all(with_address):
        raise ConfigError(f"{path}: mix of 'KEY' and 'host:port KEY' lines; use one form")
    if lines and all(with_address):
        for lineno, line in lines:
            addr, key = line.split()
            rank = by_address.get(addr.lower())
            if rank is None and not addr.startswith("["):  # an IPv6 address without brackets
                rank = by_address.get(f"[{addr.rpartition(':')[0]}]:{addr.rpartition(':')[2]}".lower())
            if rank is None:
                raise ConfigError(f"{path}:{lineno}: {addr} is not an entry of the hosts file "
                                  f"({', '.join(p.address for p in peers)})")
            keys[rank] = _check_key(key, f"{path}:{lineno}")
    else:
        for lineno, line in lines:
            if len(line.split()) != 1:
                raise ConfigError(f"{path}:{lineno}: {line[:60]!r} is neither 'KEY' nor 'host:port KEY'")
        if len(lines) != len(peers):
            raise ConfigError(f"{path} lists {len(lines)} bare key(s) but the ring has {len(peers)} nodes; "
                              "bare keys are in ring order, one per hosts-file line (or use 'host:port KEY')")
        for (lineno, line), p in zip(lines, peers):
            keys[p.rank] = _check_key(line, f"{path}:{lineno}")
    missing = [p.address for p in peers if p.rank not in keys]
    if missing:
        raise ConfigError(f"{path} has no key for {', '.join(missing)}; every ring node needs one")
    _check_distinct(keys, peers, path)
    return keys


def _check_distinct(keys: dict[int, bytes], peers: Sequence[Any], path: str) -> None:
    """One key for two ranks would let either node pose as the other (the ZAP handler names a
    connection by its key): each node needs its own `birdnet keygen` key pair."""
    first: dict[bytes, int] = {}
    for rank in sorted(keys):
        other = first.setdefault(keys[rank], rank)
        if other != rank:
            raise ConfigError(f"{path} lists the same CURVE key for rank {other} ({peers[other].address}) and "
                              f"rank {rank} ({peers[rank].address}); give every node its own key pair "
                              "(birdnet keygen) and list each node's birdnet.pub")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def read_allowed_networks(text: str, peers: Sequence[Any]) -> list[Network]:
    """The networks of a ``peer_allowed_networks`` value (see the module docstring); [] = any address."""
    out: list[Network] = []
    for word in text.replace(",", " ").split():
        if word == "hosts":
            for p in peers:
                host = p.host.split("%", 1)[0]  # a link-local address's interface is no part of it
                try:
                    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
                except socket.gaierror as exc:
                    raise ConfigError(f"peer_allowed_networks: cannot resolve hosts-file entry {p.address} "
                                      f"({exc.strerror}); list its address instead of 'hosts'") from None
                out += [ipaddress.ip_network(str(i[4][0]).split("%", 1)[0]) for i in infos]
            continue
        try:
            out.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            raise ConfigError(f"peer_allowed_networks: {word!r} is not an address or a network (write e.g. "
                              "10.0.0.0/24, fd00::/64, 192.168.1.7, or 'hosts' for the hosts file's addresses)") from None
    return sorted(set(out), key=str)


def plain_address(address: str) -> str:
    """A ZAP request's address as an operator writes it (an IPv4 peer of a dual-stack listener
    arrives as ``::ffff:a.b.c.d``)."""
    try:
        mapped = getattr(ipaddress.ip_address(address), "ipv4_mapped", None)
    except ValueError:
        return address
    return str(mapped) if mapped is not None else address


def address_allowed(address: str, networks: Sequence[Network]) -> bool:
    """Whether a ZAP request's peer address (an IP without port; an IPv4 peer of a dual-stack
    listener shows as ``::ffff:a.b.c.d``) is in one of ``networks``."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return any(ip in n or (mapped is not None and mapped in n) for n in networks)


class ZapHandler:
    """The peer port's ZAP handler (RFC 27) on a thread of the daemon's context: refuses connections
    from outside ``networks`` (when given); subclasses check more (Curve: the key). ``close`` stops
    it (before the context is terminated)."""

    def __init__(self, ctx: zmq.Context, networks: Sequence[Network] = ()) -> None:
        self.ctx = ctx
        self.networks = list(networks)
        self.refused = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="birdnet-zap", daemon=True)
        self._thread.start()
        self._ready.wait(5)
        if self._error is not None:
            raise ConfigError(f"cannot start the peer port's authenticator (ZAP): {self._error}")

    def _note_refusal(self, text: str, *args: Any) -> None:
        self.refused += 1
        if self.refused <= 20 or self.refused % 1000 == 0:
            log.warning(text + " (%d refused so far)", *args, self.refused)

    def _address_refusal(self, version: bytes, request_id: bytes, address: bytes) -> list[bytes] | None:
        who = plain_address(address.decode(errors="replace")) or "?"
        if self.networks and not address_allowed(who, self.networks):
            self._note_refusal("refused a peer connection from %s: not in peer_allowed_networks (%s)", who,
                               ", ".join(map(str, self.networks)))
            return [version, request_id, b"400", b"address not allowed", b"", b""]
        return None

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"bad ZAP request", b"", b""]
        version, request_id, domain, address = frames[:4]
        if domain != ZAP_DOMAIN.encode():
            return [version, request_id, b"200", b"OK", b"", b""]  # another socket of this context: not ours
        return self._address_refusal(version, request_id, address) or [version, request_id, b"200", b"OK", b"", b""]

    # -- the handler's thread ------------------------------------------------------------------------
    def _serve(self) -> None:
        name_os_thread("birdnet-zap")
        try:
            sock = self.ctx.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                sock.send_multipart(self._answer(frames))
        finally:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


def configure_zap(sock: zmq.Socket) -> None:
    """Have the peer ROUTER ask the ZAP handler about every connection (with the NULL mechanism too)."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    # Without this, a missing ZAP handler would mean "accept everyone" (libzmq < 4.3 behaviour).
    try:
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except (AttributeError, zmq.ZMQError):
        pass  # a libzmq without draft options: the handler is bound before the socket anyway


class Curve(ZapHandler):
    """Keys plus the ZAP handler (address, then key). ``configure_server``/``configure_client`` set
    up sockets."""

    def __init__(self, ctx: zmq.Context, public: bytes, secret: bytes, allowed: dict[int, bytes],
                 peers: Sequence[Any], networks: Sequence[Network] = ()) -> None:
        self.public, self.secret = public, secret
        self.allowed = allowed
        self.peers = list(peers)
        self.names = {k: f"rank {r} ({self.peers[r].address})" for r, k in allowed.items()}
        super().__init__(ctx, networks)

    @classmethod
    def from_settings(cls, settings, ctx: zmq.Context, peers: Sequence[Any] | None = None) -> "Curve":
        if not zmq.has("curve"):
            raise ConfigError("curve_secret_key is set but this libzmq has no CURVE support")
        if not settings.curve_allowed_keys:
            raise ConfigError("curve_secret_key is set but curve_allowed_keys is not; list the ring's public keys")
        if peers is None:
            from birdnet.hosts import load_hosts
            peers = load_hosts(settings.peers)
        public, secret = read_secret_key(settings.curve_secret_key)
        allowed = read_allowed_keys(settings.curve_allowed_keys, peers)
        return cls(ctx, public, secret, allowed, peers, read_allowed_networks(settings.peer_allowed_networks, peers))

    def configure_server(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        configure_zap(sock)

    def configure_client(self, sock: zmq.Socket, server: Any) -> None:
        key = self.allowed.get(server.rank)
        if key is None:  # pragma: no cover - read_allowed_keys guarantees one per rank
            raise ConfigError(f"no CURVE public key for rank {server.rank} ({server.address})")
        sock.setsockopt(zmq.CURVE_SERVERKEY, key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"bad ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = frames[:6]
        creds = frames[6:]
        who = address.decode(errors="replace") or "?"
        if domain != ZAP_DOMAIN.encode() and mechanism != b"CURVE":
            # Another socket of this context without CURVE (e.g. the local client socket): not ours.
            return [version, request_id, b"200", b"OK", b"", b""]
        refusal = self._address_refusal(version, request_id, address)
        if refusal is not None:
            return refusal
        if mechanism == b"CURVE" and creds and len(creds[0]) == 32:
            key = zmq.utils.z85.encode(creds[0])
            name = self.names.get(key)
            if name is not None:
                return [version, request_id, b"200", b"OK", name.encode(), b""]
            self._note_refusal("refused a peer connection from %s: CURVE key %s is not in the allow-list", who,
                               key.decode())
            return [version, request_id, b"400", b"unknown CURVE key", b"", b""]
        self._note_refusal("refused a peer connection from %s: mechanism %s, CURVE required", who,
                           mechanism.decode(errors="replace"))
        return [version, request_id, b"400", b"CURVE required", b"", b""]


# -- birdnet keygen ------------------------------------------------------------------------------
def keygen(out: str, force: bool = False) -> tuple[Path, Path]:
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    key, pub = d / "birdnet.key", d / "birdnet.pub"
    if key.exists() and not force:
        raise ConfigError(f"{key} exists; pass --force to replace it (peers must then get the new public key)")
    public, secret = zmq.curve_keypair()
    tmp = d / ".birdnet.key.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret + b"\n")
    finally:
        os.close(fd)
    os.replace(tmp, key)
    pub.write_text(public.decode() + "\n")
    os.chmod(pub, 0o644)
    return key, pub


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="birdnet keygen",
                                description="Make a CURVE key pair for birdnetd peer authentication: "
                                            "DIR/birdnet.key (secret, mode 0600) and DIR/birdnet.pub (public).")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for birdnet.key and birdnet.pub")
    p.add_argument("--force", action="store_true", help="replace an existing key pair")
    args = p.parse_args(argv)
    if not zmq.has("curve"):
        print("birdnet keygen: this libzmq has no CURVE support", file=sys.stderr)
        return 1
    try:
        key, pub = keygen(args.out, args.force)
    except (ConfigError, OSError) as exc:
        print(f"birdnet keygen: {exc}", file=sys.stderr)
        return 1
    print(f"secret key: {key} (keep it on this node)\npublic key: {pub}: {pub.read_text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
