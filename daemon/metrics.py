"""Prometheus metrics for operators: ``birdnetd --metrics-port PORT`` serves ``/metrics``.

A small HTTP server thread (the standard library's ``ThreadingHTTPServer``, no dependency) renders
the Prometheus text exposition format (version 0.0.4) on each scrape. Every metric is prefixed
``birdnet_``:

=====================================  =========  =========================================================
metric                                 type       meaning
=====================================  =========  =========================================================
``birdnet_info``                       gauge      always 1; labels version, rank, world, cluster, codec
``birdnet_uptime_seconds``             gauge      seconds since the daemon started
``birdnet_rounds_total``               counter    rounds completed on this node (all kinds)
``birdnet_rounds_failed_total``        counter    rounds that failed (mismatch, lost peer, timeout, ...)
``birdnet_lane_rounds_total``          counter    rounds run in the dense lane (without an agreement)
``birdnet_lane_given_up_total``        counter    lane rounds given up here (the leader closed the lane)
``birdnet_bytes_sent_total``           counter    bytes sent to a peer (labels rank, address: the right
                                                  neighbour, the only peer a ring node sends to)
``birdnet_bytes_received_total``       counter    bytes received from a peer (the left neighbour)
``birdnet_compression_ratio``          gauge      dense ring bytes / bytes really sent, last all-reduce
``birdnet_round_seconds``              histogram  data phase of each successful all-reduce / broadcast
``birdnet_compress_seconds_total``     counter    time spent in codec compress/decompress
``birdnet_codec_state_bytes``          gauge      memory held by codec state (error feedback, momentum)
``birdnet_codec_states_evicted_total``  counter    codec states dropped (least recently used) under state_limit_bytes
``birdnet_peer_up``                    gauge      1 if the peer is reachable (or is this node), else 0
``birdnet_clients``                    gauge      training processes connected to this daemon
=====================================  =========  =========================================================

Threading: scrapes run on the server's threads, rounds on the ring worker, round completion on the
daemon's main thread. The server therefore only *reads* plain counters (an int attribute read is
atomic in CPython) and never calls methods that change daemon state; the histogram and the
last-round gauges are kept by :class:`RoundFigures` (written on the main thread under a lock), which
every daemon has, with or without the metrics server (``birdnet status`` shows them too).
"""
from __future__ import annotations

import logging
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from birdnet import __version__
from birdnet.errors import ConfigError
from birdnet.osutil import name_os_thread

log = logging.getLogger("birdnet.metrics")

#: upper bounds (seconds) of the round-time histogram: from a small tensor on loopback (~1 ms) to a
#: large dense tensor over Wi-Fi (seconds)
ROUND_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    """Cumulative buckets as Prometheus wants them; ``observe`` is called under the server's lock."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for b, c in zip([*map(_number, self.bounds), "+Inf"], self.counts):
            acc += c
            out.append((b, acc))
        return out


class RoundFigures:
    """Per-round figures every daemon keeps (``birdnet status`` shows them; the metrics server,
    when enabled, serves them): a histogram of round times, total codec time, the last ratio.
    Written by the daemon's main thread, read by the metrics thread: guarded by a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.round_seconds = Histogram(ROUND_SECONDS_BUCKETS)
        self.compress_seconds = 0.0
        self.last_ratio: float | None = None

    def observe(self, rnd: Any) -> None:
        """Record a finished round. Never raises: figures must not disturb the daemon's loop."""
        try:
            st = rnd.stats
            with self._lock:
                self.compress_seconds += float(st.get("compress_seconds", 0.0) or 0.0)
                if rnd.error is None and "seconds" in st:
                    self.round_seconds.observe(float(st["seconds"]))
                if rnd.error is None and rnd.kind == "allreduce" and "ratio" in st:
                    self.last_ratio = float(st["ratio"])
        except Exception:
            log.exception("could not record the figures of round %s", getattr(rnd, "key", "?"))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"last_ratio": self.last_ratio, "compress_seconds_total": self.compress_seconds,
                    "round_seconds_buckets": [[le, c] for le, c in self.round_seconds.cumulative()],
                    "round_seconds_sum": self.round_seconds.sum, "round_seconds_count": self.round_seconds.count}


#: seconds a scrape connection may take to send its request or read the answer (Handler.timeout)
SCRAPE_TIMEOUT = 5.0
#: scrapes served at once; further connections are closed at once (a scraper opens one or two)
MAX_SCRAPES = 8


def _address_family(host: str) -> int:
    """AF_INET6 for an IPv6 --metrics-host (the standard library's server is AF_INET only)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror:
        return socket.AF_INET  # the bind then fails with the resolver's message


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with a chosen address family and at most MAX_SCRAPES connections at once:
    otherwise every idle connection holds a thread for SCRAPE_TIMEOUT, without bound."""

    def __init__(self, family: int, address: tuple[str, int], handler: Any) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """Serves ``daemon``'s figures at ``http://host:port/metrics``.

    Parameters
    ----------
    daemon : birdnet.daemon.service.Daemon
        The running daemon; read, never modified.
    host, port : str, int
        Where to listen (``port=0`` picks a free port; :attr:`port` then holds it).
    """

    def __init__(self, daemon: Any, host: str, port: int) -> None:
        self.daemon = daemon
        self.host = host
        self.port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifetime ---------------------------------------------------------------------------------
    def start(self) -> None:
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            server_version = f"birdnetd/{__version__}"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, ctype, code = metrics.render().encode(), CONTENT_TYPE, 200
                elif path == "/":
                    body, ctype, code = b"birdnetd: metrics at /metrics\n", "text/plain", 200
                else:
                    body, ctype, code = b"not found; metrics are at /metrics\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            #: a scraper that sends nothing, or reads nothing, holds a thread and a descriptor
            #: until this socket timeout ends its connection
            timeout = SCRAPE_TIMEOUT

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("metrics %s: " + fmt, self.client_address[0], *args)

        try:
            server = _Server(_address_family(self.host), (self.host, self.port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc}; "
                              "choose another --metrics-port (or --metrics-host)") from None
        server.daemon_threads = True
        self._server = server
        self.port = server.server_address[1]
        def serve() -> None:
            name_os_thread("birdnet-metrics")
            server.serve_forever(poll_interval=0.25)

        self._thread = threading.Thread(target=serve, name="birdnet-metrics", daemon=True)
        self._thread.start()
        log.info("metrics at http://%s:%d/metrics", self.host, self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    # -- rendering --------------------------------------------------------------------------------
    def render(self) -> str:
        d = self.daemon
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[dict[str, Any], float]],
                   suffix: str = "") -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{suffix}{_labels(labels)} {_number(value)}")

        w, net = d.worker, d.net
        settings = d.settings
        family("birdnet_info", "gauge", "Build and ring position of this daemon (always 1).",
               [({"version": __version__, "rank": d.rank, "world": d.world, "cluster": settings.cluster,
                  "codec": settings.codec}, 1)])
        family("birdnet_uptime_seconds", "gauge", "Seconds since the daemon started.",
               [({}, time.time() - d.started)])
        family("birdnet_rounds_total", "counter", "Rounds completed on this node (all kinds).",
               [({}, w.rounds_done if w else 0)])
        family("birdnet_rounds_failed_total", "counter", "Rounds that failed on this node.",
               [({}, w.rounds_failed if w else 0)])
        family("birdnet_lane_rounds_total", "counter", "Rounds run in the dense lane (without an agreement).",
               [({}, getattr(w, "lane_rounds", 0))])
        family("birdnet_lane_given_up_total", "counter",
               "Lane rounds given up here because the leader closed the lane (run again once agreed).",
               [({}, getattr(w, "lanes_given_up", 0))])
        # A ring node sends only to its right neighbour and receives only from its left one, so the
        # transport's totals are per peer.
        sent: list[tuple[dict[str, Any], float]] = []
        received: list[tuple[dict[str, Any], float]] = []
        if net is not None:
            sent.append(({"rank": net.right.rank, "address": net.right.address}, net.bytes_sent))
            received.append(({"rank": net.left.rank, "address": net.left.address}, net.bytes_received))
        family("birdnet_peer_messages_lost_total", "counter",
               "Messages from a peer (the left ring neighbour; in elastic mode every node) lost on a TCP "
               "connection that broke and reconnected (each loss fails one round or, in an elastic "
               "agreement, starts it again).",
               [({"rank": p.rank, "address": p.address}, n) for p, n in net.messages_lost_by_peer()]
               if net is not None else [])
        family("birdnet_bytes_sent_total", "counter", "Bytes sent to a peer (the right ring neighbour).", sent)
        family("birdnet_bytes_received_total", "counter",
               "Bytes received from a peer (the left ring neighbour).", received)
        fig = d.figures.snapshot()
        ratio, hist, comp = fig["last_ratio"], fig["round_seconds_buckets"], fig["compress_seconds_total"]
        hsum, hcount = fig["round_seconds_sum"], fig["round_seconds_count"]
        family("birdnet_compression_ratio", "gauge",
               "Dense ring bytes divided by bytes really sent, for the last all-reduce.",
               [({}, ratio)] if ratio is not None else [])
        out.append("# HELP birdnet_round_seconds Data phase of each successful all-reduce or broadcast on this node.")
        out.append("# TYPE birdnet_round_seconds histogram")
        for le, c in hist:
            out.append(f"birdnet_round_seconds_bucket{_labels({'le': le})} {c}")
        out.append(f"birdnet_round_seconds_sum {_number(hsum)}")
        out.append(f"birdnet_round_seconds_count {hcount}")
        family("birdnet_compress_seconds_total", "counter", "Seconds spent in codec compress and decompress.",
               [({}, comp)])
        family("birdnet_codec_state_bytes", "gauge",
               "Memory held by codec state (error feedback, momentum correction, compensation).",
               [({}, _state_bytes(d.states))])
        family("birdnet_codec_states_evicted_total", "counter",
               "Codec states dropped, least recently used first, to stay under state_limit_bytes.",
               [({}, getattr(d.states, "evicted", 0))])
        family("birdnet_peer_up", "gauge", "1 if the peer is reachable (or is this node), else 0.",
               [({"rank": r, "address": a}, up) for r, a, up in _peer_up(d)])
        sessions = list(d.sessions.values())
        family("birdnet_clients", "gauge", "Training processes connected to this daemon.",
               [({}, sum(1 for s in sessions if s.job != "__status__"))])
        return "\n".join(out) + "\n"


def _state_bytes(states: Any) -> int:
    # The ring worker may add a state while we read; copying the values is one C call under the GIL.
    for _ in range(3):
        try:
            return sum(v.nbytes for v in list(states.states.values()))
        except RuntimeError:
            continue
    return 0


def _peer_up(d: Any) -> list[tuple[int, str, int]]:
    """Liveness per peer, read without side effects. Mirrors ``PeerNet.lost()`` (which also logs
    transitions and so belongs to the daemon's own threads): a neighbour is lost after
    ``peer_timeout`` without a sign of life; other peers are as the left neighbour reports them."""
    net = d.net
    if net is None:
        return [(p.rank, p.address, 1) for p in d.peers]
    now = time.monotonic()
    grace = d.settings.peer_timeout
    lost = set(net.live.left_reports)
    if now - max(net.live.left_seen, net.live.started) > grace:
        lost.add(net.left.rank)
    if now - max(net.live.right_seen, net.live.started) > grace:
        lost.add(net.right.rank)
    if net.refused_by_right:
        lost.add(net.right.rank)
    lost.discard(d.rank)
    return [(p.rank, p.address, 0 if p.rank in lost else 1) for p in d.peers]


def _number(v: float) -> str:
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    def esc(s):
        return (str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"'))
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"
