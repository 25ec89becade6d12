"""birdnetd: the per-node service (transport, peers, sessions, shared memory, metrics, systemd glue)."""
