"""Turning the trainer's tensors into the engine's checkpoint format before the loaders run."""
