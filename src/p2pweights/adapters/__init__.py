"""Glue between trainers and p2pweights sessions."""

from p2pweights.adapters.torch_distributed import torch_agree

__all__ = ["torch_agree"]
