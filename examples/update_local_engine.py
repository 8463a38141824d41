"""Push a model's weights into a local engine over Mooncake TCP, on a CPU host.

    python examples/update_local_engine.py

A tiny Qwen3 (transformers, random weights) trains a few steps; after each, its weights
go into a TP 2 local engine (sglang's own model code and loaders in a process of its own,
standing in for a sglang server), every write checked by the engine's digests. At the
end, every engine rank is compared with what sglang's own ``load_weights`` makes of the
same tensors. The lines between the ``[readme]`` markers are the README's example.
"""

import tempfile

import torch
import transformers

# [readme]
from p2pweights import MooncakeConfig, SyncConfig, WeightSyncSession
from p2pweights.adapters import hf_named_tensors
from p2pweights.local_engine import LocalEngine

# [/readme]
from p2pweights.testing import write_model_dir
from p2pweights.verify import EngineClient, verify_engine

folder = write_model_dir("qwen3-tiny", tempfile.mkdtemp())  # config.json of a 3 MB Qwen3
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(
    transformers.AutoConfig.from_pretrained(folder), dtype=torch.bfloat16
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_one_step(model: torch.nn.Module) -> None:
    """Stand-in for an RL step: one optimizer step on random tokens."""
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


# [readme]
config = SyncConfig(transport=MooncakeConfig(protocol="tcp"))  # "rdma" where there are RDMA NICs
with LocalEngine(folder, tp=2) as engine, WeightSyncSession(config) as session:
    session.connect([engine.url])  # or your sglang servers' URLs
    for _ in range(3):
        train_one_step(model)
        report = session.update(hf_named_tensors(model))  # (checkpoint name, tensor) pairs
        print(report.summary())
    # [/readme]
    assert report.engines[engine.url].verified_by == ("write_digests",)
    client = EngineClient(engine.url)
    mismatches = verify_engine(client, lambda: list(hf_named_tensors(model)))
    client.close()
    print("tensors that differ from sglang's own load, by engine rank:", mismatches)
    assert mismatches == {0: [], 1: []}
print("bit-exact at every engine rank")
