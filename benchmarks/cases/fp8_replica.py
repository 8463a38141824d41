"""The fp8 replica on a GPU host: does it reproduce what sglang's own fp8 code does on CUDA?

tests/integration/test_replica_families.py::test_fp8_block_engines_bit_exact checks the
block-fp8 (DeepSeek-V3 / Kimi-K2 style) replica on a CPU host. On a CUDA host sglang
takes other branches (``_is_cuda``: the fp8 linear kernel dispatch, the MoE runner,
the rope kernel, the reload-layout step materializing modules on the GPU) and the
sender quantizes on the GPU. This script runs the same comparisons with everything
that can live on the GPU there:

* (a) layouts: the replica's parameter layouts (shape, stride, dtype, bytes) equal the
  reference's parameters after ``begin_update(..., device)`` (the reload layout);
* (b) staged bytes: every loader group staged through ``ModelReplica.load_into`` from
  fp8 checkpoint tensors that live on the device (the sender's ``quantize`` ran there)
  equals the reference's parameter bytes; staged once into device buffers and once
  into CPU buffers (both staging locations a session supports);
* (c) engine path: a real rank model on the device holding other weights, updated as
  p2pweights updates an engine (begin_update, staged bytes over its parameters,
  end_update(run_post_load=True)), equals the reference on every parameter,
  persistent buffer and derived tensor (``state_mismatches``);
* (d) ``convert.fp8_block.quantize`` on the device is bit-equal to the CPU (whole
  engine checkpoint, plus partial-block and ue8m0 cases).

The reference is ``load_real_rank_model(..., device=<device>)``: sglang's own
``load_weights`` and start-up postprocess into a real model of the rank on the device.
It also records which sglang branches ran (``_is_cuda``, the fp8 linear kernel chosen,
the MoE runner backend, DeepGEMM / FlashInfer availability) and, when the stub
``sgl_kernel`` package is on the path, which names were imported from it and whether
any stub function was called (a call fails the run).

    .venv/bin/python benchmarks/fp8.py replica --device cpu --out /tmp/fp8_replica.json  # here
    PYTHONPATH=/tmp/site:benchmarks/gpu_stub:src python3 benchmarks/fp8.py replica \\
        --device cuda --out $OUT/gpu_fp8_replica.json                        # on the H200

Exits non-zero on any mismatch or error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

MODEL = "deepseek-v3-fp8-tiny"
BLOCKS = ([128, 128], [64, 64])
LAYOUTS = (
    ("tp1", {"tp_size": 1}, (0,)),
    ("tp2-ep2", {"tp_size": 2, "ep_size": 2}, (0, 1)),
    ("tp4-ep4", {"tp_size": 4, "ep_size": 4}, (0, 3)),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _on(pairs: list[tuple[str, torch.Tensor]], device: torch.device) -> list[tuple[str, Any]]:
    return [(name, tensor.to(device)) for name, tensor in pairs]


def stage_on(replica: Any, loader_map: Any, hf: list, device: torch.device) -> dict:
    """``bitexact.stage_all`` with the staging buffers on ``device``."""
    from p2pweights.testing.bitexact import stage_all

    return stage_all(replica, loader_map, hf, device)


def engine_path_on(folder: Path, spec: Any, previous: list, staged: dict, info: dict, device):
    """``bitexact.engine_path_model`` with the rank model on ``device``."""
    from p2pweights.testing.bitexact import engine_path_model

    return engine_path_model(folder, spec, iter(previous), staged, info, device=device)


def _layout_tuple(p: torch.Tensor) -> tuple:
    return (tuple(p.shape), p.stride(), p.dtype, p.nbytes)


def _fn_name(fn: Any) -> str:
    if fn is None:
        return "None"
    inner = getattr(fn, "func", fn)
    name = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"
    if inner is not fn:
        name += f" (partial {getattr(fn, 'keywords', {})})"
    return name


def sglang_branches(reference: Any) -> dict[str, Any]:
    """Which sglang code paths the reference model took on this host."""
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.moe import get_moe_a2a_backend, get_moe_runner_backend
    from sglang.srt.layers.quantization import fp8, fp8_utils
    from sglang.srt.utils import is_cuda

    from p2pweights.replica.sglang.reload_layout import _storage_device

    out: dict[str, Any] = {
        "is_cuda()": is_cuda(),
        "fp8._is_cuda": fp8._is_cuda,
        "fp8_utils._is_cuda": fp8_utils._is_cuda,
        "deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM": deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM,
        "fp8_gemm_runner_backend": str(fp8_utils.get_fp8_gemm_runner_backend()),
        "moe_runner_backend": str(get_moe_runner_backend()),
        "moe_a2a_backend": str(get_moe_a2a_backend()),
        "reload_layout storage device": str(_storage_device()),
    }
    linear_methods, moe_methods, rope = {}, {}, {}
    for name, module in reference.named_modules():
        qm = getattr(module, "quant_method", None)
        kind = type(qm).__name__ if qm is not None else None
        if kind == "Fp8LinearMethod":
            key = (
                _fn_name(qm.w8a8_block_fp8_linear),
                bool(qm.use_marlin),
                bool(qm.cutlass_fp8_supported),
                bool(getattr(qm, "block_fp8_as_mxfp8", False)),
            )
            linear_methods.setdefault(key, []).append(name)
        elif kind and "MoE" in kind:
            runner = getattr(qm, "runner", None)
            backend = getattr(runner, "runner_backend", None)
            moe_methods.setdefault((kind, str(backend)), []).append(name)
        if "Rotary" in type(module).__name__ or "Rope" in type(module).__name__:
            rope.setdefault(
                (type(module).__name__, str(getattr(module, "use_fallback_kernel", "?"))), []
            ).append(name)
    out[
        "Fp8LinearMethod (w8a8_block_fp8_linear, use_marlin, cutlass_fp8_supported, "
        "block_fp8_as_mxfp8) -> #modules"
    ] = {" | ".join(map(str, k)): len(v) for k, v in linear_methods.items()}
    out["MoE quant method (class, runner backend) -> #modules"] = {
        " | ".join(k): len(v) for k, v in moe_methods.items()
    }
    out["rope (class, use_fallback_kernel) -> #modules"] = {
        " | ".join(k): len(v) for k, v in rope.items()
    }
    out["optional packages importable"] = {
        name: importlib.util.find_spec(name) is not None
        for name in ("flashinfer", "deep_gemm", "vllm", "aiter")
    }
    return out


CALLS: dict[str, int] = {}
"""sglang fp8 helpers seen running (name -> calls), so the reader knows which branch ran."""

_COUNTED = (
    ("sglang.srt.models.deepseek_common.deepseek_weight_loader", "block_quant_dequant"),
    ("sglang.srt.models.deepseek_common.deepseek_weight_loader", "block_quant_to_tensor_quant"),
    ("sglang.srt.models.deepseek_common.deepseek_weight_loader", "channel_quant_to_tensor_quant"),
    ("sglang.srt.models.deepseek_common.deepseek_weight_loader", "input_to_float8"),
    ("sglang.srt.layers.quantization.fp8_utils", "scaled_fp8_quant"),
    ("sglang.srt.layers.quantization.fp8_utils", "input_to_float8"),
    ("sglang.srt.layers.quantization.fp8_utils", "requant_block_scale_ue8m0_for_deepgemm"),
    ("sglang.srt.layers.quantization.fp8", "requant_block_scale_ue8m0_for_deepgemm"),
    ("sglang.kernels.ops.quantization.fp8_kernel", "sgl_per_tensor_quant_fp8"),
)


def count_sglang_calls() -> None:
    """Wrap a few sglang fp8 helpers (where their callers look them up) with a call counter.

    Only helpers compared by call, never by identity, are wrapped; a missing one is skipped.
    """
    import functools
    import importlib

    for module_name, attr in _COUNTED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        fn = getattr(module, attr, None)
        if fn is None or getattr(fn, "_counted", False):
            continue
        key = f"{module_name.rsplit('.', 1)[-1]}.{attr}"

        def wrapper(*args: Any, _fn: Any = fn, _key: str = key, **kwargs: Any) -> Any:
            CALLS[_key] = CALLS.get(_key, 0) + 1
            return _fn(*args, **kwargs)

        functools.update_wrapper(wrapper, fn)
        wrapper._counted = True  # type: ignore[attr-defined]
        setattr(module, attr, wrapper)


def stub_report() -> dict[str, Any]:
    """What sglang took from the stub sgl_kernel (if that is what is on the path)."""
    module = sys.modules.get("sgl_kernel")
    if module is None:
        found = importlib.util.find_spec("sgl_kernel") is not None
        return {"sgl_kernel": "not imported" + (" (installed)" if found else " (absent)")}
    if not getattr(module, "STUB", False):
        return {"sgl_kernel": f"real package at {getattr(module, '__file__', '?')}"}
    return {
        "sgl_kernel": f"STUB at {module.__file__}",
        "stub submodules imported": sorted(m for m in sys.modules if m.startswith("sgl_kernel.")),
        "stub names imported": sorted(module.ACCESSED),
        "stub functions called": list(module.CALLS),
    }


def check_rank(
    folder: Path, info: dict, rank: int, hf: list, previous: list, device: torch.device
) -> dict[str, Any]:
    from p2pweights.replica.ranks import RankSpec
    from p2pweights.replica.sglang.model_replica import ModelReplica
    from p2pweights.replica.sglang.reference import begin_update, load_real_rank_model
    from p2pweights.source.inputs import describe_inputs
    from p2pweights.testing.bitexact import as_bytes, stage_all, state_mismatches

    result: dict[str, Any] = {"checks": {}, "details": {}, "seconds": {}}
    checks, details, seconds = result["checks"], result["details"], result["seconds"]
    spec = RankSpec.from_server_info(info, rank)
    CALLS.clear()

    t = time.perf_counter()
    replica = ModelReplica(folder, spec, server_args_fields=info)
    seconds["replica"] = time.perf_counter() - t
    details["materialized_modules"] = list(replica.materialized_modules)
    details["optional_params"] = sorted(replica.optional_params)
    loader_map = replica.loader_map(describe_inputs(hf))

    t = time.perf_counter()
    reference = load_real_rank_model(folder, spec, iter(hf), server_args_fields=info, device=device)
    _sync(device)
    seconds["reference"] = time.perf_counter() - t
    ref_devices = sorted({str(p.device) for p in reference.parameters()})
    details["reference parameter devices"] = ref_devices
    result["branches"] = sglang_branches(reference)

    # (b) staged bytes, on the device and into CPU buffers
    t = time.perf_counter()
    staged = stage_on(replica, loader_map, hf, device)
    _sync(device)
    seconds["stage"] = time.perf_counter() - t
    staged_cpu = stage_all(replica, loader_map, hf) if device.type != "cpu" else staged
    details["staged params"] = len(staged)
    replica_meta = all(p.device.type == "meta" for p in replica.model.parameters())

    # (c) engine path (compared with the reference in its start-up state)
    t = time.perf_counter()
    updated = engine_path_on(folder, spec, previous, staged, info, device)
    _sync(device)
    seconds["engine_path"] = time.perf_counter() - t
    mismatches = state_mismatches(updated, reference)
    checks["c engine path == reference (params, buffers, derived)"] = mismatches == []
    if mismatches:
        details["c mismatches"] = mismatches
    from p2pweights.testing.bitexact import model_state

    details["c tensors compared"] = len(model_state(reference))
    del updated

    # the reference brought to the reload layout, as begin_weight_update does
    startup = {n: (_layout_tuple(p), as_bytes(p).clone()) for n, p in reference.named_parameters()}
    begin_update(reference, spec, device)
    real = dict(reference.named_parameters())
    restore_changed = sorted(
        n
        for n, p in real.items()
        if n not in startup
        or startup[n][0] != _layout_tuple(p)
        or not torch.equal(startup[n][1], as_bytes(p))
    )
    details["begin_update changed (layout or bytes)"] = restore_changed

    # (a) layouts
    layout_bad = sorted(set(replica.layouts) ^ set(real))
    for name, layout in replica.layouts.items():
        if name in real and (
            layout.shape,
            layout.stride,
            layout.dtype,
            layout.num_bytes,
        ) != _layout_tuple(real[name]):
            layout_bad.append(name)
    checks["a layouts == reference after begin_update"] = layout_bad == []
    if layout_bad:
        details["a mismatches"] = layout_bad[:50]
    details["a params"] = len(real)

    # (b) continued: which params are fed, and their bytes
    unfed_ok = set(loader_map.unfed_params) <= replica.optional_params
    num_layers = replica.model_config.hf_config.num_hidden_layers
    unused_bad = [
        n
        for n in loader_map.unused
        if not (".experts." in n or n.startswith(f"model.layers.{num_layers}."))
    ]
    set_ok = set(staged) == set(real) - replica.optional_params
    wrong = sorted(n for n in staged if n in real and not torch.equal(staged[n], as_bytes(real[n])))
    wrong_cpu = sorted(
        n
        for n in staged_cpu
        if n in real and not torch.equal(staged_cpu[n], as_bytes(real[n]).cpu())
    )
    checks["b staged bytes (device buffers) == reference"] = (
        unfed_ok and not unused_bad and set_ok and not wrong
    )
    checks["b staged bytes (CPU buffers) == reference"] = set(staged_cpu) == set(staged) and (
        not wrong_cpu
    )
    checks["replica params still on meta after staging"] = replica_meta and all(
        p.device.type == "meta" for p in replica.model.parameters()
    )
    if wrong or wrong_cpu or not (unfed_ok and set_ok) or unused_bad:
        details["b problems"] = {
            "wrong (device staging)": wrong,
            "wrong (cpu staging)": wrong_cpu,
            "unfed not optional": sorted(set(loader_map.unfed_params) - replica.optional_params),
            "staged vs expected set": sorted(set(staged) ^ (set(real) - replica.optional_params)),
            "unexpected unused hf names": unused_bad,
        }
    staged_bytes = sum(t.numel() for t in staged.values())
    details["b staged bytes"] = staged_bytes
    result["sglang fp8 helper calls (replica, reference, engine path)"] = dict(CALLS)
    del reference, staged, staged_cpu
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["ok"] = all(checks.values())
    return result


def _quantize_reciprocal_scalar(weight: torch.Tensor, fmt: Any) -> tuple:
    """``quantize`` with ``amax * float32(1 / 448)`` in place of ``amax / 448``.

    On CUDA, PyTorch divides a tensor by a Python scalar as a multiplication by the
    scalar's reciprocal (``div_true_kernel_cuda``: "may lose one bit of precision"); on
    the CPU it divides. Run on the CPU, this emulates what ``quantize`` does on CUDA.
    """
    from p2pweights.source import fp8_block as f

    blocks, (rows, cols) = f._blocks(weight.float(), fmt)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=f._MIN_AMAX)
    inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(f.FP8_MAX, dtype=torch.float32)
    scale = amax * inverse
    if fmt.ue8m0:
        scale = f._ceil_power_of_two(scale)
    quantized = (blocks * (1.0 / scale)).clamp(-f.FP8_MAX, f.FP8_MAX).to(f.FP8)
    padded_shape = (*weight.shape[:-2], blocks.shape[-4] * blocks.shape[-3], -1)
    q = quantized.reshape(padded_shape)[..., :rows, :cols].contiguous()
    return q, scale.squeeze(-1).squeeze(-2).contiguous()


def _differences(cpu_pair: tuple, dev_pair: tuple, emulated: tuple) -> dict[str, Any]:
    """How a device result differs from the CPU one, and whether the emulation explains it."""
    from p2pweights.testing.bitexact import as_bytes

    (q_c, s_c), (q_d, s_d) = cpu_pair, (dev_pair[0].cpu(), dev_pair[1].cpu())
    ulps = (s_c.view(torch.int32).long() - s_d.view(torch.int32).long()).abs()
    return {
        "scale elements differing": f"{int((ulps != 0).sum())}/{s_c.numel()}",
        "scale max ulp difference": int(ulps.max()) if ulps.numel() else 0,
        "fp8 elements differing": f"{int((q_c.view(torch.uint8) != q_d.view(torch.uint8)).sum())}"
        f"/{q_c.numel()}",
        "device == CPU emulation of a * (1/448)": torch.equal(as_bytes(q_d), as_bytes(emulated[0]))
        and torch.equal(as_bytes(s_d), as_bytes(emulated[1])),
    }


def quantize_cases(
    device: torch.device, folder: Path, hf_cpu: list, hf_dev: list, bf16_cpu: list
) -> tuple[dict[str, bool], dict[str, Any]]:
    """(d) the sender's quantization on the device vs on the CPU, bit for bit."""
    from p2pweights.source.fp8_block import BlockFp8Format, quantize
    from p2pweights.testing.bitexact import as_bytes

    out: dict[str, bool] = {}
    details: dict[str, Any] = {}
    cpu, dev = dict(hf_cpu), dict(hf_dev)
    differ = sorted(
        n
        for n in cpu
        if cpu[n].dtype != dev[n].dtype
        or cpu[n].shape != dev[n].shape
        or not torch.equal(as_bytes(cpu[n]), as_bytes(dev[n]).cpu())
    )
    key = f"engine_checkpoint ({len(cpu)} tensors, {folder.name})"
    out[key] = not differ and set(cpu) == set(dev)
    if differ:
        details[key] = {"tensors differing": f"{len(differ)}/{len(cpu)}", "first": differ[:10]}
    g = torch.Generator().manual_seed(1234)
    samples = {
        "partial blocks 300x200 N(0,1)": torch.randn(300, 200, generator=g),
        "experts 3x257x129 heavy tails": torch.randn(3, 257, 129, generator=g) ** 3,
        "tiny values 256x256 *1e-6": torch.randn(256, 256, generator=g) * 1e-6,
        "zeros block + large 128x384": torch.cat(
            [torch.zeros(128, 128), torch.randn(128, 256, generator=g) * 1e3], dim=1
        ),
    }
    weights = {n: t for n, t in bf16_cpu if t.dim() >= 2 and "norm" not in n}
    for block in BLOCKS:
        for ue8m0 in (False, True):
            fmt = BlockFp8Format(tuple(block), ue8m0=ue8m0)
            suffix = f" block{block[0]}x{block[1]}" + (" ue8m0" if ue8m0 else "")
            for label, w in samples.items():
                for dtype in (torch.bfloat16, torch.float32):
                    x = w.to(dtype)
                    cpu_pair, dev_pair = quantize(x, fmt), quantize(x.to(device), fmt)
                    key = f"{label} {str(dtype)[6:]}{suffix}"
                    out[key] = torch.equal(
                        as_bytes(cpu_pair[0]), as_bytes(dev_pair[0]).cpu()
                    ) and torch.equal(as_bytes(cpu_pair[1]), as_bytes(dev_pair[1]).cpu())
                    if not out[key]:
                        details[key] = _differences(
                            cpu_pair, dev_pair, _quantize_reciprocal_scalar(x, fmt)
                        )
            # every matrix of the synthetic model, summed up
            totals = {"tensors differing": 0, "explained by the emulation": 0}
            for w in weights.values():
                cpu_pair, dev_pair = quantize(w, fmt), quantize(w.to(device), fmt)
                same = torch.equal(as_bytes(cpu_pair[0]), as_bytes(dev_pair[0]).cpu()) and (
                    torch.equal(as_bytes(cpu_pair[1]), as_bytes(dev_pair[1]).cpu())
                )
                if not same:
                    totals["tensors differing"] += 1
                    emulated = _quantize_reciprocal_scalar(w, fmt)
                    totals["explained by the emulation"] += int(
                        torch.equal(as_bytes(dev_pair[0]).cpu(), as_bytes(emulated[0]))
                        and torch.equal(as_bytes(dev_pair[1]).cpu(), as_bytes(emulated[1]))
                    )
            key = f"synthetic model's {len(weights)} bf16 matrices{suffix}"
            out[key] = totals["tensors differing"] == 0
            if not out[key]:
                details[key] = totals
    return out, details


def environment(device: torch.device) -> dict[str, Any]:
    import sglang
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sglang": sglang.__version__,
        "sglang file": sglang.__file__,
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["torch.version.cuda"] = torch.version.cuda
    return env


def to_markdown(results: dict[str, Any]) -> str:
    lines = ["# fp8 replica vs sglang's fp8 code", ""]
    lines += ["## Environment", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in results["environment"].items()]
    lines += [
        "",
        "## Cases",
        "",
        "| block | layout | rank | check | result |",
        "|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        if "error" in case:
            lines.append(f"| {case['block']} | {case['layout']} | {case['rank']} | ERROR | FAIL |")
            continue
        for check, ok in case["checks"].items():
            lines.append(
                f"| {case['block']} | {case['layout']} | {case['rank']} | {check} | "
                f"{'PASS' if ok else 'FAIL'} |"
            )
    lines += [
        "",
        "## quantize() on the device vs the CPU",
        "",
        "| case | result (and how the device differs) |",
        "|---|---|",
    ]
    for check, ok in results["quantize"].items():
        detail = results.get("quantize details", {}).get(check, "")
        lines.append(f"| {check} | {'PASS' if ok else 'FAIL'} {detail} |")
    lines += [
        "",
        "## sglang branches (first case of each block)",
        "",
        "```",
        json.dumps(results.get("branches", {}), indent=2, default=str),
        "```",
    ]
    lines += ["", "## Stub sgl_kernel", "", "```", json.dumps(results["stub"], indent=2), "```", ""]
    lines += [f"Overall: {'PASS' if results['ok'] else 'FAIL'}", ""]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", default="128,64", help="block sizes, e.g. 128,64")
    parser.add_argument("--layouts", default=",".join(name for name, _, _ in LAYOUTS))


def run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """The results (a markdown copy beside ``--out``) and 1 on any mismatch or error."""
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"fp8 replica --device {args.device}: this host has no CUDA device")

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
    from p2pweights.replica.engine_checkpoint import engine_checkpoint
    from p2pweights.testing import model_config, synthetic_weights, write_model_dir

    count_sglang_calls()
    started = time.perf_counter()
    results: dict[str, Any] = {"environment": environment(device), "cases": [], "quantize": {}}
    print(json.dumps(results["environment"], indent=2))
    blocks = [b for b in BLOCKS if str(b[0]) in args.blocks.split(",")]
    layouts = [entry for entry in LAYOUTS if entry[0] in args.layouts.split(",")]
    bf16_new = _on(list(synthetic_weights(MODEL, seed=7)), device)
    bf16_old = _on(list(synthetic_weights(MODEL, seed=8)), device)
    header = f"{'block':>8} {'layout':>8} {'rank':>4}  {'check':<55} result"
    with tempfile.TemporaryDirectory() as tmp:
        for block in blocks:
            config = model_config(MODEL)
            config["quantization_config"]["weight_block_size"] = block
            folder = write_model_dir(config, Path(tmp) / f"fp8-{block[0]}")
            t = time.perf_counter()
            hf = engine_checkpoint(folder, bf16_new)  # quantized on `device`
            previous = engine_checkpoint(folder, bf16_old)
            _sync(device)
            quant_s = time.perf_counter() - t
            print(
                f"\nblock {block}: engine checkpoint ({len(hf)} tensors) on "
                f"{sorted({str(t.device) for _, t in hf})} in {quant_s:.2f} s"
            )
            if block == blocks[0]:
                try:
                    bf16_cpu = _on(bf16_new, torch.device("cpu"))
                    hf_cpu = engine_checkpoint(folder, bf16_cpu)
                    results["quantize"], results["quantize details"] = quantize_cases(
                        device, folder, hf_cpu, hf, bf16_cpu
                    )
                except Exception:
                    results["quantize"] = {"error": False}
                    results["quantize details"] = {"error": traceback.format_exc()}
            print(header)
            for name, info, ranks in layouts:
                for rank in ranks:
                    case = {
                        "block": f"{block[0]}x{block[1]}",
                        "layout": name,
                        "rank": rank,
                        "info": info,
                    }
                    try:
                        case.update(check_rank(folder, info, rank, hf, previous, device))
                    except Exception:
                        case["error"] = traceback.format_exc()
                        case["ok"] = False
                    if "branches" in case:
                        first = results.setdefault("branches", {}).setdefault(
                            case["block"], case["branches"]
                        )
                        if case["branches"] != first:
                            case["branches differ from the block's first case"] = True
                        else:
                            del case["branches"]
                    results["cases"].append(case)
                    if "error" in case:
                        print(f"{case['block']:>8} {name:>8} {rank:>4}  {'ERROR':<55} FAIL")
                        print(case["error"])
                        continue
                    for check, ok in case["checks"].items():
                        print(
                            f"{case['block']:>8} {name:>8} {rank:>4}  {check:<55} "
                            f"{'PASS' if ok else 'FAIL'}"
                        )
                    mat = case["details"]["materialized_modules"]
                    changed = case["details"]["begin_update changed (layout or bytes)"]
                    print(
                        f"{'':>24}materialized {len(mat)} modules: "
                        f"{', '.join(mat[:2])}{' ...' if len(mat) > 2 else ''}; "
                        f"begin_update changed {len(changed)}"
                        f"; seconds {', '.join(f'{k} {v:.1f}' for k, v in case['seconds'].items())}"
                    )
                    print(
                        f"{'':>24}sglang fp8 helpers: "
                        f"{case['sglang fp8 helper calls (replica, reference, engine path)']}"
                    )
                    for key in ("a mismatches", "b problems", "c mismatches"):
                        if key in case["details"]:
                            print(f"{'':>24}{key}: {case['details'][key]}")

    print("\nquantize() on the device vs the CPU")
    for check, ok in results["quantize"].items():
        print(f"  {check:<60} {'PASS' if ok else 'FAIL'}")
        if check in results.get("quantize details", {}):
            print(f"      {results['quantize details'][check]}")
    results["stub"] = stub_report()
    print("\nsglang branches (first case of each block):")
    print(json.dumps(results.get("branches", {}), indent=2, default=str))
    print("\nstub:")
    print(json.dumps(results["stub"], indent=2))
    stub_called = bool(results["stub"].get("stub functions called"))
    quant_ok = bool(results["quantize"]) and all(results["quantize"].values())
    results["ok"] = (
        bool(results["cases"])
        and all(c.get("ok") for c in results["cases"])
        and quant_ok
        and not stub_called
    )
    results["seconds"] = time.perf_counter() - started
    passed = sum(bool(c.get("ok")) for c in results["cases"])
    print(
        f"\n{'PASS' if results['ok'] else 'FAIL'}: {passed}"
        f"/{len(results['cases'])} rank cases, quantize {'PASS' if quant_ok else 'FAIL'}, "
        f"stub calls {results['stub'].get('stub functions called', 'n/a')}, "
        f"{results['seconds']:.1f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(to_markdown(results))
    return results, 0 if results["ok"] else 1
