"""`pyddp-bench` (also `python -m pyddp.bench`): all-reduce bandwidth, the
overlap of reduction with backward against baselines and torch DDP, and an
alpha-beta simulator of larger machines fed with this machine's timings
(pyddp.bench.simulator)."""
