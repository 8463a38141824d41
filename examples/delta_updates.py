"""Delta updates: after a full first update, each engine rank gets only what changed.

    python examples/delta_updates.py

Small AdamW steps change a few percent of a model's bf16 values; with
``SyncConfig(delta=DeltaConfig(...))`` each update after the first sends those elements
(index and value) and the engine applies them, checked by its write digests.
``mode="always"`` sends a delta whatever it costs; the default, ``"auto"``, sends one
only where earlier updates predict it faster than writing everything (on one CPU host,
with no network link to save, it goes back to full updates).
"""

import tempfile

import torch
import transformers

from p2pweights import DeltaConfig, MooncakeConfig, SyncConfig, WeightSyncSession
from p2pweights.adapters import hf_named_tensors
from p2pweights.local_engine import LocalEngine
from p2pweights.testing import write_model_dir
from p2pweights.verify import EngineClient, verify_engine

folder = write_model_dir("qwen3-tiny", tempfile.mkdtemp())
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(
    transformers.AutoConfig.from_pretrained(folder), dtype=torch.float32
)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

config = SyncConfig(
    transport=MooncakeConfig(protocol="tcp"),
    delta=DeltaConfig(mode="always"),
)
with LocalEngine(folder, tp=2) as engine, WeightSyncSession(config) as session:
    session.connect([engine.url])
    for step in range(3):
        tokens = torch.randint(0, model.config.vocab_size, (2, 16))
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # fp32 master weights, sent as the engine's bf16
        report = session.update(hf_named_tensors(model, dtype=torch.bfloat16))
        delta = report.delta
        assert delta is not None
        print(
            f"update {step + 1}: sent {delta.sent_bytes} of {delta.full_bytes} bytes; "
            f"{delta.num_delta_params} parameter(s) as deltas, {delta.num_full_params} in full, "
            f"{delta.num_unchanged_params} unchanged"
        )
    client = EngineClient(engine.url)
    final = list(hf_named_tensors(model, dtype=torch.bfloat16))
    mismatches = verify_engine(client, lambda: final)
    client.close()
    assert mismatches == {0: [], 1: []}, mismatches
print("bit-exact at every engine rank")
