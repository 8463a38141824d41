"""Glue between trainers and p2pweights sessions.

* ``hf_named_tensors(model)``: a transformers model (plain or FSDP2) as the checkpoint's
  (name, tensor) pairs ``WeightSyncSession.update`` takes: under FSDP2 each rank's own
  shards by default, written by their holders with no gather; ``owned=False``: full
  tensors, gathered first.
* ``owned_tensors(pairs, owned=names)``: what one trainer rank holds, with the tensors
  it owns alone (its experts under expert parallelism): owner sends, no gather.
* ``torch_agree`` / ``torch_gather``: the collectives a multi-rank session needs, over a
  ``torch.distributed`` group (``WeightSyncSession.from_torch_distributed`` uses them).
* ``p2pweights.adapters.megatron``: megatron-core models through megatron-bridge's HF
  export, each pipeline stage a sender group.

Nothing here imports transformers or megatron until it is used.
"""

from p2pweights.adapters.hf import hf_named_tensors
from p2pweights.adapters.owned import owned_tensors
from p2pweights.adapters.torch_distributed import torch_agree, torch_gather

__all__ = ["hf_named_tensors", "owned_tensors", "torch_agree", "torch_gather"]
