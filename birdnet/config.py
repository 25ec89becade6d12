"""Daemon settings: command-line flags, then environment (``BIRDNET_*``), then a TOML file
(``--config``), then defaults.

Timeouts are in seconds and named after what they guard (hivemind's lesson); their relationships
are checked here, once, so a bad combination fails at start-up rather than mid-round.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from birdnet.codecs import WIRE_FORMATS
from birdnet.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib


def default_socket_path() -> str:
    """``/run/birdnet/birdnetd.sock`` for the system service (root or the ``birdnet`` system user
    with /run/birdnet present), else a per-user runtime directory."""
    if os.path.isdir("/run/birdnet") and os.access("/run/birdnet", os.W_OK):
        return "/run/birdnet/birdnetd.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "birdnet", "birdnetd.sock")
    return os.path.join("/tmp", f"birdnet-{os.getuid()}", "birdnetd.sock")


def socket_path() -> str:
    """The socket a daemon serves and a client or ``birdnet status`` looks for when none is given:
    ``$BIRDNET_SOCKET``, else :func:`default_socket_path`."""
    return os.environ.get("BIRDNET_SOCKET") or default_socket_path()


def socket_help() -> str:
    """How the default socket is chosen, with what it is here and now (for --help texts)."""
    return (f"default here: {socket_path()}; chosen as $BIRDNET_SOCKET, else /run/birdnet/birdnetd.sock when "
            "/run/birdnet is writable (the system service), else $XDG_RUNTIME_DIR/birdnet/birdnetd.sock, else "
            "/tmp/birdnet-UID/birdnetd.sock")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a daemon is configured with. Fields marked *cluster-wide* go into the handshake
    fingerprint: peers whose fingerprints differ refuse each other and log the difference."""

    peers: str | None = None  #: hosts file; None = a one-node ring
    rank: int | None = None  #: this node's line in the hosts file (0-based); None = detect
    socket: str = ""  #: client Unix socket path ("" = default_socket_path())
    local_size: int = 1  #: training processes per job on this node
    cluster: str = "birdnet"  #: cluster-wide name
    cluster_seed: int = 0  #: cluster-wide seed for shared random selections
    codec: str = "none"  #: cluster-wide default codec
    codec_params: dict = dataclasses.field(default_factory=dict)  #: cluster-wide default parameters
    dense_threshold: int = 1024  #: cluster-wide: tensors with fewer elements travel dense (float32; fp16 when a call names it)
    #: cluster-wide: pipelining unit of the dense ring, its smallest chunk. 1 MiB: fewer messages than
    #: 256 KiB, each of which costs Python and thread hand-offs on every node; measured in CHANGELOG.md,
    #: "History of measurements"
    chunk_bytes: int = 1 << 20
    #: cluster-wide: a large tensor's chunks grow from chunk_bytes up to this, so that each ring
    #: segment travels in about four of them (birdnet.ring.dense.chunk_elements): a message costs the
    #: ring thread the same whatever its size. At or below chunk_bytes (0 too): chunk_bytes always
    max_chunk_bytes: int = 4 << 20
    #: cluster-wide: the bytes a link carries in the time one ring hop costs beyond its bytes (the
    #: thread hand-offs on both daemons). An all-reduce small enough by it (at most chunk_bytes)
    #: goes round the ring gathered, N-1 hops of the whole vector instead of 2(N-1) hops of 1/N of
    #: it (birdnet.ring.small.use_gathered); 0: always the ring
    hop_latency_bytes: int = 1 << 17
    peer_timeout: float = 10.0  #: no sign of life (data or heartbeat) from a neighbour for this long = lost
    heartbeat_interval: float = 0.5  #: how often neighbours ping each other when idle
    round_timeout: float = 600.0  #: a round whose participants never all arrive is abandoned after this
    hello_timeout: float = 5.0  #: a client connection that says nothing for this long is dropped (local)
    state_limit_bytes: int = 4 << 30  #: cap on codec state (error feedback, compensation) per daemon
    max_message_bytes: int = 1 << 30  #: largest message accepted from a peer or client
    nan_policy: str = "propagate"  #: "propagate" or "reject" NaN/Inf in contributions
    metrics_port: int | None = None  #: serve Prometheus /metrics on this port (loopback unless metrics_host)
    metrics_host: str = "127.0.0.1"
    curve_secret_key: str | None = None  #: file with this node's CURVE secret key (enables CURVE)
    curve_allowed_keys: str | None = None  #: file with allowed peer public keys, one per line
    #: addresses and networks that may connect to the peer port ("10.0.0.0/24 fd00::/64", "hosts" for
    #: the hosts file's addresses); "" = any. Checked in the handshake, before any message is taken
    #: (daemon/security.py); without CURVE the one bound on what strangers can send
    peer_allowed_networks: str = ""
    shm_group: str | None = None  #: group that may use the client socket and shared memory
    log_level: str = "INFO"
    #: cluster-wide when on: go on without a lost node (the ring re-forms among the live nodes once a
    #: majority is live, and takes a returning node back); docs/architecture.md "Elastic mode"
    elastic: bool = False
    #: cluster-wide: after an agreed round, a job's next dense all-reduce starts without an agreement
    #: (daemon/lane.py); off, every round waits for the leader's start/go
    dense_lane: bool = True
    #: "all": at start a subprocess compiles every registry codec's kernels into Numba's on-disk
    #: cache; "used": only a codec's first call has them compiled. Either way a call waits until
    #: its kernels are loaded, never compiling on the ring thread (daemon/warmup.py)
    kernel_warmup: str = "all"
    #: a call whose codec's kernels are still being compiled waits at most this long (the ring keeps
    #: its heartbeats meanwhile), then fails with RoundTimeoutError naming the codec
    warmup_timeout: float = 600.0

    # local_size too: a process's global rank is node rank x local_size + local rank, so nodes
    # with different local sizes would hand out colliding ranks and a wrong job size
    # heartbeat_interval and peer_timeout too: a node that pings less often than its neighbour's
    # peer_timeout expects is declared lost while it is alive, and the two sides disagree on when a
    # peer is lost (one fails a round the other still waits for). state_limit_bytes too: codec state
    # is dropped (least recently used) at the cap, and every node must drop the same states at the
    # same round (daemon/runner.py StateStore)
    CLUSTER_WIDE = ("cluster", "cluster_seed", "codec", "codec_params", "dense_threshold", "chunk_bytes",
                    "max_chunk_bytes", "hop_latency_bytes", "nan_policy", "local_size", "heartbeat_interval", "peer_timeout",
                    "state_limit_bytes")

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(msg)

        if self.local_size < 1:
            bad(f"local_size is {self.local_size}; it must be at least 1 (training processes per node)")
        if self.rank is not None and self.rank < 0:
            bad(f"rank is {self.rank}; ranks start at 0")
        if self.kernel_warmup not in ("all", "used"):
            bad(f"kernel_warmup is {self.kernel_warmup!r}; use 'all' (compile every codec's kernels at start) or "
                "'used' (a codec's at its first call)")
        for name in ("peer_timeout", "heartbeat_interval", "round_timeout", "hello_timeout", "warmup_timeout"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be a positive number of seconds, not {getattr(self, name)}")
        if self.heartbeat_interval * 2 > self.peer_timeout:
            bad(f"heartbeat_interval ({self.heartbeat_interval} s) must be at most half of peer_timeout "
                f"({self.peer_timeout} s), or a live peer could be declared lost")
        if self.chunk_bytes < 4096:
            bad(f"chunk_bytes is {self.chunk_bytes}; use at least 4096")
        if self.max_message_bytes < self.chunk_bytes:
            bad(f"max_message_bytes ({self.max_message_bytes}) is below chunk_bytes ({self.chunk_bytes}): "
                "every dense round's messages would be refused by the peers; raise max_message_bytes or "
                "lower chunk_bytes")
        if self.max_chunk_bytes < 0:
            bad(f"max_chunk_bytes is {self.max_chunk_bytes}; use 0 (chunks of chunk_bytes always) or more")
        if self.max_message_bytes < self.largest_chunk_bytes:
            bad(f"max_message_bytes ({self.max_message_bytes}) is below max_chunk_bytes ({self.max_chunk_bytes}): "
                "a large tensor's dense messages would be refused by the peers; raise max_message_bytes, or "
                f"lower max_chunk_bytes (0: chunks of chunk_bytes, {self.chunk_bytes}, always)")
        if self.nan_policy not in ("propagate", "reject"):
            bad(f"nan_policy is {self.nan_policy!r}; use 'propagate' or 'reject'")
        if self.dense_threshold < 0:
            bad("dense_threshold must be >= 0")
        if self.hop_latency_bytes < 0:
            bad(f"hop_latency_bytes is {self.hop_latency_bytes}; use 0 (always the ring) or more")

    @property
    def largest_chunk_bytes(self) -> int:
        """The largest message of a dense ring: chunks grow from chunk_bytes up to max_chunk_bytes."""
        return max(self.chunk_bytes, self.max_chunk_bytes)

    @property
    def round_wait_timeout(self) -> float:
        """round_timeout + peer_timeout: the longest a node waits on a round another node may still be
        agreeing (the leader waits up to round_timeout for every node's processes, and its verdict
        then takes up to peer_timeout to come round). Bounds a follower's wait for ``go``, a lane
        round's wait for data, a round never started, and how long an aborted round is remembered."""
        return self.round_timeout + self.peer_timeout

    @property
    def pass_go_timeout(self) -> float:
        """2 x peer_timeout: how long a node with no part in a round waits to pass its ``go`` on
        (the start it passed has a ring to go round, then the go comes back)."""
        return 2 * self.peer_timeout

    @property
    def socket_path(self) -> str:
        return self.socket or default_socket_path()

    def fingerprint(self) -> str:
        """A digest of the cluster-wide settings; equal on every node of a healthy cluster."""
        return hashlib.sha256(json.dumps(self.cluster_wide(), sort_keys=True).encode()).hexdigest()[:16]

    def cluster_wide(self) -> dict[str, Any]:
        cw = {k: getattr(self, k) for k in self.CLUSTER_WIDE}
        # what codecs put on the wire: a daemon from before a payload change refuses this one by name
        cw["codec_formats"] = dict(WIRE_FORMATS)
        if self.elastic:
            # Only when on, so a cluster without it keeps its fingerprint; an elastic node and a
            # non-elastic one speak different ring protocols and must refuse each other, by name.
            cw["elastic"] = True
        if not self.dense_lane:
            # likewise only when off: nodes that disagree on it must refuse each other
            cw["dense_lane"] = False
        return cw


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _coerce(name: str, value: Any, source: str) -> Any:
    f = _FIELDS[name]
    typ = str(f.type)
    try:
        if value is None:
            return None
        if "dict" in typ:
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, dict):
                raise TypeError("expected a table / JSON object")
            return value
        if typ.startswith("bool"):
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
                return False
            raise TypeError("expected true or false")
        if typ.startswith("int"):
            if isinstance(value, bool):
                raise TypeError("expected an integer")
            return int(value)
        if typ.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {name} = {value!r} is not valid ({exc})") from None


def load_settings(flags: dict[str, Any] | None = None, config: str | None = None,
                  environ: dict[str, str] | None = None) -> Settings:
    """Merge ``flags`` (None values = not given) over ``BIRDNET_*`` environment over the TOML
    file ``config`` over the defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config = config or environ.get("BIRDNET_CONFIG")
    if config:
        try:
            with open(config, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {config}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config} is not valid TOML: {exc}") from None
        for k, v in data.items():
            if k not in _FIELDS:
                raise ConfigError(f"config file {config}: unknown setting {k!r}; known: "
                                  f"{', '.join(sorted(_FIELDS))}")
            values[k] = _coerce(k, v, f"config file {config}")
        if values.get("peers") and not os.path.isabs(values["peers"]):
            values["peers"] = str(Path(config).parent / values["peers"])
    for k in _FIELDS:
        env = environ.get(f"BIRDNET_{k.upper()}")
        if env is not None and env != "":
            values[k] = _coerce(k, env, f"environment BIRDNET_{k.upper()}")
    for k, v in (flags or {}).items():
        if v is not None:
            if k not in _FIELDS:
                raise ConfigError(f"unknown setting {k!r}")
            values[k] = _coerce(k, v, f"--{k.replace('_', '-')}")
    return Settings(**values)
