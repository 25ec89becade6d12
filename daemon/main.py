"""``birdnetd``: the per-node daemon's command line."""
from __future__ import annotations

import argparse
import logging
import sys

import zmq

from birdnet import __version__
from birdnet.config import Settings, load_settings, socket_help
from birdnet.errors import BirdnetError, ConfigError
from birdnet.osutil import keep_freed_buffers


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(
        prog="birdnetd",
        description="birdnet daemon: averages gradients of local training processes with the other nodes "
                    "over a compressed ZeroMQ ring. Settings: flags, then BIRDNET_* environment variables "
                    "(e.g. BIRDNET_PEER_TIMEOUT), then the TOML file of --config, then defaults.",
    )
    a = p.add_argument
    a("--peers", metavar="HOSTS_FILE", help="hosts file: one host:port per line in ring order "
      "(# comments allowed). Without it: a one-node ring for local processes only.")
    a("--rank", type=int, help="this node's line in the hosts file, from 0 (default: the line whose "
      "address is on this machine with a free port; needed when several daemons share a machine)")
    a("--socket", metavar="PATH", help=f"Unix socket for training processes ({socket_help()})".replace("%", "%%"))
    a("--config", metavar="FILE", help="TOML file with settings (keys as the long options, with underscores)")
    a("--local-size", type=int, help=f"training processes per job on this node (default {d.local_size})")
    a("--cluster", help=f"cluster name; peers with another name are refused (default {d.cluster!r})")
    a("--cluster-seed", type=int, help="seed shared by the cluster for shared random selections (default 0)")
    a("--codec", help=f"cluster default codec (default {d.codec!r}); see `birdnet codecs`")
    a("--codec-params", metavar="JSON", help='cluster default codec parameters, e.g. \'{"density": 0.01}\'')
    a("--dense-threshold", type=int, help=f"tensors with fewer elements go dense, float32 (fp16 when a call names it; default {d.dense_threshold})")
    a("--chunk-bytes", type=int, help=f"pipelining unit of the ring, its smallest chunk (default {d.chunk_bytes})")
    a("--max-chunk-bytes", type=int, help="a large tensor's chunks grow up to this so that a ring segment travels in "
      f"about 4 (default {d.max_chunk_bytes}; 0: --chunk-bytes always; cluster-wide)")
    a("--hop-latency-bytes", type=int, help="what a link carries in the time one ring hop costs beyond its "
      "bytes; all-reduces small by it go gathered, in N-1 hops instead of 2(N-1); 0: always the ring "
      f"(default {d.hop_latency_bytes}; cluster-wide)")
    a("--peer-timeout", type=float, help=f"seconds without a sign of life before a peer counts as lost "
      f"(default {d.peer_timeout})")
    a("--heartbeat-interval", type=float, help=f"seconds between heartbeats (default {d.heartbeat_interval})")
    a("--round-timeout", type=float, help=f"seconds a round may wait for all processes to arrive "
      f"(default {d.round_timeout})")
    a("--hello-timeout", type=float, help=f"seconds a client connection may say nothing before it is dropped "
      f"(default {d.hello_timeout}; birdnet.client says hello at once)")
    a("--state-limit-bytes", type=int, help="cap on codec state (error feedback) memory (default 4 GiB)")
    a("--max-message-bytes", type=int, help="largest message accepted from a peer (default 1 GiB)")
    a("--nan-policy", choices=["propagate", "reject"], help="NaN/Inf in a contribution: propagate (default) "
      "or reject the round with an error naming the tensor")
    a("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    a("--metrics-host", help="address for --metrics-port (default 127.0.0.1)")
    a("--curve-secret-key", metavar="FILE", help="this node's CURVE secret key file (birdnet keygen); "
      "enables authenticated, encrypted peer links")
    a("--curve-allowed-keys", metavar="FILE", help="file of peer public keys allowed to connect, one per line")
    a("--peer-allowed-networks", metavar="NETS", help="addresses and networks that may connect to the peer "
      "port, comma-separated (e.g. 10.0.0.0/24,fd00::/64), or 'hosts' for the hosts file's addresses; "
      "others are refused in the handshake, before any message (default: any address)")
    a("--shm-group", help="group allowed to use the client socket and shared memory (default: owner only)")
    a("--elastic", action="store_true", default=None, help="go on without a lost node: after peer_timeout "
      "the ring re-forms among the live nodes (a majority of the hosts file must be live) and takes a "
      "returning node back; `mean` divides by the processes that contributed (cluster-wide: all or none)")
    a("--no-dense-lane", dest="dense_lane", action="store_false", default=None,
      help="every round waits for the leader's start/go agreement, also a job's dense all-reduces "
      "(by default the next one after an agreed round starts at once; cluster-wide: all or none)")
    a("--kernel-warmup", choices=["all", "used"], help="compile every codec's Numba kernels at start, in a "
      "subprocess (all, the default), or a codec's at its first call (used); calls wait for their kernels")
    a("--warmup-timeout", type=float, help=f"seconds a call may wait for its codec's kernels to compile "
      f"(default {d.warmup_timeout})")
    a("--log-level", help="DEBUG, INFO (default), WARNING, ERROR")
    a("--version", action="version", version=f"birdnetd {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        settings = load_settings(flags, config=args.config)
    except ConfigError as exc:
        print(f"birdnetd: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, settings.log_level.upper(), logging.INFO),
                        format="%(asctime)s birdnetd %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from birdnet.daemon.service import Daemon
    # process-wide, so here at the process's entry and not in Daemon (which tests run in-process)
    logging.getLogger("birdnet.daemon").info("%s", keep_freed_buffers(settings.largest_chunk_bytes))
    try:
        daemon = Daemon(settings)
        return daemon.serve_forever()
    except ConfigError as exc:
        print(f"birdnetd: {exc}", file=sys.stderr)
        return 2
    except BirdnetError as exc:
        print(f"birdnetd: {exc}", file=sys.stderr)
        return 1
    except (OSError, zmq.ZMQError) as exc:  # a socket or directory the checks above did not foresee
        print(f"birdnetd: cannot start: {exc} ({type(exc).__name__}); check --socket, --peers and "
              "--metrics-port", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
