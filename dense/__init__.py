"""Dense Laneformer (DESIGN.md §5): config.py (LaneformerSpec), adapter.py (registry entry, tensor list),
reference.py (the oracle forward), preset.py (laneformer-2b / -tiny, random checkpoints), presets.py (provider for
models/presets.py), lanes.py (lane plans: what N devices own and exchange), simulate.py (N-rank CPU simulation)."""
