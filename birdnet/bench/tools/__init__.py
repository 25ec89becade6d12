"""Measuring tools behind docs/benchmarks.md and docs/research/findings.md, each run as
``python -m birdnet.bench.tools.NAME --help``: what a benchmark table needs beyond ``birdnet bench``
(CPU per round by thread, bare rings for comparison, link monitors, table printers) and the
convergence simulators used to choose the codecs' defaults. Not imported by birdnet itself."""
