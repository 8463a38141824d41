"""Write the tiny Qwen3 the CPU real-server suite uses (tests/real_sglang) into a folder."""

from __future__ import annotations

import sys
from pathlib import Path

from p2pweights.testing import model_config, save_safetensors, synthetic_weights, write_model_dir

CONFIG = {
    **model_config("qwen3-tiny"),
    "num_attention_heads": 4,
    "head_dim": 64,
    "vocab_size": 1024,
}
"""The CPU real-server suite's tiny Qwen3 (tests/real_sglang/test_real_server.py)."""

if __name__ == "__main__":
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    write_model_dir(CONFIG, folder)
    save_safetensors(folder, synthetic_weights(CONFIG, seed=0))
    print(f"tiny model in {folder}")
