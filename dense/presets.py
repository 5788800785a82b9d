"""Provider hook for models/presets.py: its PROVIDERS list names this module, which registers the Laneformer
presets of dense/preset.py there on first lookup (so `kie synth laneformer-2b` and friends find them). models/
never imports dense/ directly; dense/preset.py stays usable without models/presets.py."""
from kie_moe.models.presets import Published, register_preset

from .preset import PRESETS

register_preset("laneformer-2b", PRESETS["laneformer-2b"], PRESETS["laneformer-tiny"],
                Published(2.3e9, 2.3e9, True, "Kog Laneformer 2B model card: 2.3B parameters (about 4.6 GB in FP16)"))
