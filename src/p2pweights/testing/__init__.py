"""Fixtures shipped with the library: synthetic models for tests, demos and benchmarks."""

from p2pweights.testing.synthetic import (
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
