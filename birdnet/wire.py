"""The wire format, shared by peer links and the client socket.

Every message is a ZeroMQ multipart message (a ROUTER socket prepends the sender's identity frame,
which is not part of the format):

=======  ==========================  ===============================================================
frame    content                     checks on receipt (before anything is allocated or trusted)
=======  ==========================  ===============================================================
0        protocol id ``b"birdnet/N"``  exact match (N: PROTOCOL_VERSION), else :class:`VersionMismatchError`
1        header: a msgpack map        at most ``MAX_HEADER_BYTES``; str keys; ``nbuf`` and ``sizes``
                                     present and consistent with the frames that follow
2..      raw buffers (``nbuf``)       each frame's length equals ``sizes[i]``; the sum is at most
                                     the socket's limit (also set as ZMQ_MAXMSGSIZE, so ZeroMQ
                                     refuses oversized frames before allocating them)
=======  ==========================  ===============================================================

Peer messages (birdnet.daemon.peers) then pass :func:`check_peer`: the header keys that have a
meaning of their own (round key, origin rank, incarnation, reasons; the check column of
:data:`HEADER_KEYS`) are checked or made safe once, there, so no handler downstream meets a forged
rank or a log-injecting string.

Buffers are handed to ZeroMQ as they are (large ones without copying:
birdnet.daemon.links.send_frames) and received as zero-copy ``memoryview`` s.

Every header has ``t`` (message type), ``nbuf`` and ``sizes``. The keys of peer messages are listed
once, in :data:`HEADER_KEYS` (which messages carry each and what it means); the message types are
in birdnet.daemon.peers, their records (built once from a received header) in birdnet.messages.
The client socket's messages (hello, welcome, alloc, shm, submit, done, error, status, bye) are
records in birdnet.requests (shared by the client and the daemon), their table in
birdnet.daemon.service.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import msgpack

from birdnet import PROTOCOL_VERSION
from birdnet.errors import ProtocolError, VersionMismatchError

PROTOCOL_ID = f"birdnet/{PROTOCOL_VERSION}".encode()

#: Every key a peer message's header may carry: key -> (the messages that carry it, the check
#: :func:`check_peer` makes of it where bytes become a message, what it is). Checks: ``key`` a round
#: key "job/seq"; ``rank`` a rank of the ring; ``int`` an integer (its range is the handler's, which
#: names the difference); ``count`` a non-negative integer; ``token`` a printable word (logged);
#: ``text`` made printable (shown to users and logged). Keys are short because a dense round sends
#: 2(N-1) headers per node; this table is their legend.
HEADER_KEYS: dict[str, tuple[str, str, str]] = {
    "t": ("all", "", "message type"),
    "nbuf": ("all", "", "number of buffer frames after the header"),
    "sizes": ("all", "", "byte length of each buffer frame"),
    "q": ("all peer messages", "count", "number on this connection, one more than the last (a jump: messages lost)"),
    "qr": ("all peer messages", "", "1: numbering restarts at this q (the sender dropped what it had queued for a peer that answered nothing)"),
    "k": ("start go abort lane data commit settle settled", "key", 'round key "job/seq" (birdnet.wire.round_key)'),
    "proto": ("ping", "", "PROTOCOL_VERSION of the sender"),
    "cw": ("ping", "", "the sender's cluster-wide settings (Settings.cluster_wide)"),
    "world": ("ping", "int", "nodes in the sender's hosts file"),
    "rank": ("ping pong settle settled", "int", "the sender's rank in the hosts file"),
    "inc": ("ping pong settle", "token", "the sender's incarnation (a new one after every restart)"),
    "lost": ("ping", "", "ranks the sender believes lost"),
    "ep": ("ping pong start go", "count", "elastic: membership epoch"),
    "want": ("ping pong", "", "elastic: the sender has rounds waiting (wants to be in the ring)"),
    "reason": ("refuse abort", "text", "why (a message for the error or the log)"),
    "descs": ("start", "", "[[rank, round description], ...], one per node the start passed"),
    "more": ("start go", "", "the batch's other rounds: [[key, descs], ...] in a start, verdicts in a go"),
    "ok": ("go", "", "the leader's verdict on round k: it runs"),
    "err": ("go data", "text", "go: why round k fails; data: the error a node found (travels with the data)"),
    "errc": ("go", "", "the error class round k fails with"),
    "counts": ("go", "", "process count per ring position"),
    "lane": ("go", "", "[job, seq]: the round the dense lane opens for"),
    "o": ("abort", "rank", "origin: the rank that failed the round first (fixed ring)"),
    "c": ("abort data commit", "", "abort: the error class of the origin; data: dense ring chunk index; "
          "commit: how many consecutive nodes ending with the sender hold round k's result"),
    "retry": ("abort", "", "elastic: start the round again on the re-formed ring instead of failing it"),
    "req": ("lane", "text", "a node asks the leader to close the lane (why)"),
    "ln": ("data", "", "1: the data of a lane round (started without an agreement)"),
    "S": ("start go", "", "elastic: the sorted ranks of the live ring"),
    "L": ("start go", "", "elastic: the leader's rank"),
    "J": ("start go", "", "elastic: joiners being admitted"),
    "I": ("start go", "", "elastic: str(rank) -> incarnation of each member"),
    "p": ("data", "", "ring phase: rs / ag (dense), gather, mrs / mag (merged)"),
    "s": ("data", "", "ring step"),
    "n": ("data", "", "dense lane: process count summed so far round the ring; merged ring: tensor size"),
    "codec": ("data", "", "merged ring: the codec's name"),
    "tag": ("data", "", "what every node must agree on for the round (checked at each hop)"),
    "src": ("data", "", "all-gather: whose payload this is"),
    "h": ("data", "", "all-gather: the payload's own header"),
    "seg": ("data", "", "merged ring: segment index"),
    "w": ("data", "", "merged ring: the weight (nodes merged so far) the bits stand for"),
    "scale": ("data", "", "merged ring: the scale of rank src"),
    "meta": ("data", "", "merged ring: the codec's per-segment metadata"),
    "st": ("settled", "", "what the sender knows of round k: released, aborted, holds (the result), pending"),
    "kn": ("settled", "", "the ranks the sender knows held round k's result (itself, its commit count's)"),
}
MAX_HEADER_BYTES = 64 * 1024
MAX_BUFFERS = 64


def encode(header: dict[str, Any], buffers: Sequence[Any] = (), **fields: Any) -> list[Any]:
    """Frames for ``header`` plus ``fields`` and ``buffers`` (buffers are passed through, not
    copied). A buffer that is a frame of the transport (anything with a ``buffer`` view, as a
    received ZeroMQ frame has) stays itself, so the transport can send it on without copying it."""
    # a plain loop, not comprehensions: this runs for every message a ring sends, and each
    # comprehension is a Python call of its own
    frames: list[Any] = [PROTOCOL_ID, None]
    sizes = []
    for b in buffers:
        if not hasattr(b, "buffer") or isinstance(b, memoryview):
            b = memoryview(b).cast("B")
            sizes.append(b.nbytes)
        else:
            sizes.append(len(b))  # a frame's len: bytes
        frames.append(b)
    h = {**header, **fields}
    h["nbuf"] = len(sizes)
    h["sizes"] = sizes
    frames[1] = (getattr(_local, "packer", None) or _packer()).pack(h)
    return frames


_local = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's msgpack Packer. msgpack.packb builds a new Packer, with a fresh 1 MiB buffer,
    for every call: on the data path of a busy daemon that was a sixth of its time holding the GIL.
    A Packer is not thread-safe, hence one per thread (it resets itself after each pack)."""
    p = getattr(_local, "packer", None)
    if p is None:
        p = _local.packer = msgpack.Packer(use_bin_type=True)
    return p


def decode(frames: Sequence[Any], *, max_bytes: int) -> tuple[dict[str, Any], list[memoryview]]:
    """Check and split received frames. Raises :class:`ProtocolError` (or its subclass
    :class:`VersionMismatchError`) with a message saying what is wrong; never asserts."""
    if len(frames) < 2:
        raise ProtocolError(f"message has {len(frames)} frame(s); at least 2 (protocol id, header) expected")
    # a ZeroMQ frame's bytes without a call of _bytes (every peer message comes here)
    pid = frames[0]
    pid = pid.bytes if hasattr(pid, "bytes") else _bytes(pid)
    if pid != PROTOCOL_ID:
        if pid.startswith(b"birdnet/"):
            raise VersionMismatchError(
                f"peer speaks protocol {pid.decode(errors='replace')!r}, this daemon speaks "
                f"{PROTOCOL_ID.decode()!r}; install the same birdnet version on every node")
        raise ProtocolError(f"bad protocol id {pid[:16]!r}; not a birdnet message")
    raw = frames[1]
    raw = raw.bytes if hasattr(raw, "bytes") else _bytes(raw)
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                                 max_array_len=4096, max_map_len=256, max_str_len=MAX_HEADER_BYTES,
                                 max_bin_len=MAX_HEADER_BYTES)
    except Exception as exc:  # msgpack raises several types on garbage
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    # map() runs isinstance without a Python frame per key: this runs for every peer message
    if not isinstance(header, dict) or not all(map(isinstance, header, repeat(str))):
        raise ProtocolError("header is not a map with string keys")
    nbuf, sizes = header.get("nbuf"), header.get("sizes")
    if not isinstance(nbuf, int) or not isinstance(sizes, list) or len(sizes) != nbuf:
        raise ProtocolError("header lacks consistent 'nbuf' and 'sizes'")
    if nbuf != len(frames) - 2 or nbuf > MAX_BUFFERS:
        raise ProtocolError(f"header announces {nbuf} buffers, message has {len(frames) - 2}")
    total = 0
    bufs = []
    for i, (size, frame) in enumerate(zip(sizes, frames[2:])):
        if not isinstance(size, int) or size < 0:
            raise ProtocolError(f"buffer {i} size {size!r} is not a non-negative integer")
        total += size
        if total > max_bytes:
            raise ProtocolError(f"message of over {total} bytes exceeds the {max_bytes}-byte limit")
        view = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        if view.nbytes != size:
            raise ProtocolError(f"buffer {i} has {view.nbytes} bytes, header says {size}")
        bufs.append(view.cast("B") if view.format != "B" else view)
    if not isinstance(header.get("t"), str):
        raise ProtocolError("header has no message type 't'")
    return header, bufs


#: longest round key, incarnation and text field a peer may send (our own are far shorter)
MAX_KEY_CHARS = 512
MAX_TEXT_CHARS = 4096
#: header keys of peer messages with a meaning of their own -> what they must be (check_peer)
PEER_FIELDS: dict[str, str] = {k: check for k, (_m, check, _w) in HEADER_KEYS.items() if check}
#: message types whose round key is required
KEYED = frozenset(("start", "go", "abort", "data", "lane", "commit", "settle", "settled"))
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` with control characters (newlines too) escaped and cut to ``limit`` characters:
    safe to log and to show (a peer's string must not forge log lines)."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return _UNSAFE.sub(lambda m: repr(m.group())[1:-1], text) if _UNSAFE.search(text) else text


def check_peer(header: dict[str, Any], world: int) -> None:
    """Check the fields of a decoded peer message that name ranks, rounds and incarnations, and make
    its text fields printable (in place). Raises :class:`ProtocolError` naming the field: the
    message is dropped where it arrived (an ``abort`` whose origin is no rank of the ring would
    otherwise travel round it for good)."""
    t = header["t"]
    if t in KEYED and "k" not in header:
        raise ProtocolError(f"{t!r} message without a round key 'k'")
    for name in PEER_FIELDS.keys() & header.keys():
        v, kind = header[name], PEER_FIELDS[name]
        if kind == "text":
            if not isinstance(v, str):
                if v is None:
                    continue
                v = header[name] = str(v)
            if len(v) > MAX_TEXT_CHARS or _UNSAFE.search(v):
                header[name] = printable(v)
            continue
        if kind == "key":
            # split_key's test, inline: every data message has a key
            if (not isinstance(v, str) or len(v) > MAX_KEY_CHARS or "/" not in v
                    or not (seq := v.rpartition("/")[2]).isdigit() or not seq.isascii()):
                raise ProtocolError(f"{t!r} message: round key {str(v)[:80]!r} is not 'job/seq'")
            continue
        if kind == "token":
            if not isinstance(v, str) or not 0 < len(v) <= 64 or not v.isprintable() or " " in v:
                raise ProtocolError(f"{t!r} message: incarnation {str(v)[:80]!r} is not a printable "
                                    "token of at most 64 characters")
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(f"{t!r} message: field {name!r} is {type(v).__name__}, expected an integer")
        if kind == "rank" and not 0 <= v < world:
            raise ProtocolError(f"{t!r} message: rank {v} in field {name!r} is not a rank of the {world}-node ring")
        if kind == "count" and v < 0:
            raise ProtocolError(f"{t!r} message: field {name!r} is {v}, expected a non-negative integer")


def _bytes(frame: Any) -> bytes:
    if isinstance(frame, bytes):
        return frame
    if hasattr(frame, "bytes"):
        return frame.bytes
    return bytes(frame)


def field(header: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str = "message") -> Any:
    """``header[key]`` checked against ``kind``; a :class:`ProtocolError` names what is wrong."""
    v = header.get(key)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ProtocolError(f"{what}: field {key!r} is {type(v).__name__}, expected "
                            f"{getattr(kind, '__name__', kind)}")
    return v


def round_key(job: str, seq: int) -> str:
    """The key every peer message of a round carries: ``"job/seq"`` (a job name may contain "/";
    the call number is what follows the last one)."""
    return f"{job}/{seq}"


def split_key(key: Any) -> tuple[str, int] | None:
    """``(job, seq)`` of a round key, or None when ``key`` (from the network) is not one."""
    if not isinstance(key, str):
        return None
    job, sep, seq = key.rpartition("/")
    if not sep or not seq.isdigit() or not seq.isascii():  # "²" is a digit to isdigit(), not to int()
        return None
    return job, int(seq)
