"""The Megatron adapter on GPUs over NCCL (run with torchrun; not collected by pytest).

Without CUDA it runs the same on gloo (a dry run).

    torchrun --nproc-per-node 2 tests/integration/megatron_gpu_export.py \\
        --folder <HF folder with config.json and model.safetensors> --tp 2 --pp 1 --out DIR

Each rank builds the bridge's GPT model (megatron-core's local layer spec, bf16, on its
GPU), loads the checkpoint with megatron-bridge, exports it through
``p2pweights.adapters.megatron.MegatronExport`` (each pipeline stage its own), and checks
every exported tensor bit-exact against the checkpoint. It also runs the session's
collectives (``torch_agree``, ``torch_gather``, ``torch_stage_ranks``) over NCCL. The
first rank of each stage writes what it exported to ``DIR/<tag>-stage<s>.safetensors``,
for pushing into a local engine elsewhere (sglang's server cannot run on that machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))

from _megatron_cpu import build_gpt, import_bridge, load_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if on_gpu else "gloo")  # gloo: a dry run on a CPU host
    rank = dist.get_rank()
    auto_bridge = import_bridge()
    from megatron.core import parallel_state

    from p2pweights.adapters.megatron import MegatronExport
    from p2pweights.adapters.torch_distributed import torch_agree, torch_gather, torch_stage_ranks

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp
    )
    bridge = auto_bridge.from_hf_pretrained(args.folder)
    model = build_gpt(bridge, args.tp, args.pp)
    load_checkpoint(bridge, model)
    export = MegatronExport(bridge, model)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    stage_rank = torch_stage_ranks(stage, args.pp)

    expected = load_file(Path(args.folder) / "model.safetensors")
    exported = dict(export.named_tensors(cpu=True))
    devices = sorted({str(p.device) for chunk in model for p in chunk.parameters()})
    wrong = sorted(
        name
        for name, tensor in exported.items()
        if tensor.dtype != expected[name].dtype or not torch.equal(tensor, expected[name])
    )
    everyone = torch_gather()((stage, sorted(exported)))
    union = sorted(name for _, names in {s: n for s, n in everyone}.items() for name in names)
    agreed = torch_agree()(not wrong)
    disagreed = torch_agree()(rank != 1)  # one rank says no: everyone must learn it
    summary = {
        "rank": rank,
        "tp": args.tp,
        "pp": args.pp,
        "stage": stage,
        "stage_rank": stage_rank,
        "param_devices": devices,
        "exported": len(exported),
        "bit_exact_mismatches": wrong,
        "stages_cover_checkpoint": union == sorted(expected),
        "agree_all_true": agreed,
        "agree_one_false": disagreed,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "backend": dist.get_backend(),
        "torch": torch.__version__,
    }
    print(json.dumps(summary), flush=True)
    if stage_rank[0] == 0:
        tag = f"tp{args.tp}pp{args.pp}"
        save_file(exported, str(Path(args.out) / f"{tag}-stage{stage}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
