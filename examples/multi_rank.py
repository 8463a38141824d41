"""Several trainer ranks (torch.distributed, gloo on the CPU) update one local engine.

    python examples/multi_rank.py

Two processes each hold the same whole model (with FSDP2, ``hf_named_tensors`` hands
each rank its own shards instead, and each writes the bytes its rows make).
``from_torch_distributed`` makes each a sender: the engine's ranks are split between
them, rank 0 drives the engine's update session, and after each update all ranks agree
whether every one succeeded.
Under torchrun, the body of ``trainer`` is the whole script.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
from p2pweights.adapters import hf_named_tensors
from p2pweights.local_engine import LocalEngine, free_port
from p2pweights.testing import write_model_dir

NUM_RANKS = 2


def trainer(rank: int, folder: str, engine_url: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=NUM_RANKS)
    torch.manual_seed(0)  # the same weights on every rank
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(folder), dtype=torch.bfloat16
    )
    config = SyncConfig(transport=MooncakeConfig(protocol="tcp"))
    with WeightSyncSession.from_torch_distributed(config) as session:
        session.connect([engine_url])  # every rank connects and updates
        for _ in range(2):
            with torch.no_grad():  # stand-in for a training step, the same on every rank
                for param in model.parameters():
                    param.mul_(0.99)
            report = session.update(hf_named_tensors(model))
            written = report.engines[engine_url]
            print(
                f"trainer rank {rank}: version {report.version}, wrote "
                f"{written.num_ranks_written} engine rank(s), {written.bytes_written} bytes, "
                f"verified by {written.verified_by}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    folder = write_model_dir("qwen3-tiny", tempfile.mkdtemp())
    with LocalEngine(folder, tp=2) as engine:
        mp.spawn(trainer, args=(str(folder), engine.url, free_port()), nprocs=NUM_RANKS)
    print("every trainer rank updated the engine")
