"""Helpers for tests and benchmarks; library code never imports this package.

The synthetic models themselves live in ``p2pweights.source.synthetic`` (the demo, the
local engine and the planner use them); this package names them for tests, as it always
has, and holds ``bitexact``, the bit-exact reference checks.
"""

from p2pweights.source.synthetic import (
    MODEL_NAMES,
    hf_checkpoint_names_and_shapes,
    model_config,
    save_safetensors,
    synthetic_weights,
    write_model_dir,
)

__all__ = [
    "MODEL_NAMES",
    "hf_checkpoint_names_and_shapes",
    "model_config",
    "save_safetensors",
    "synthetic_weights",
    "write_model_dir",
]
