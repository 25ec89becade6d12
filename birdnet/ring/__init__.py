"""Ring algorithms (no sockets): dense reduce-scatter + all-gather, all-gather of payloads, and
Marsit's merged pattern. Each talks to a :class:`~birdnet.ring.transport.Transport`."""
