"""Check, on this machine, that a relay payload installs whole on the lent GPU machine.

    python scripts/gpu_sglang/check_requirements.py WHEELS_DIR [MACHINE_LIST]

Every wheel in WHEELS_DIR declares its requirements (``Requires-Dist`` in its METADATA).
The payload is installed there with ``--no-deps``, so each requirement that applies to
the GPU machine (CPython 3.12 on x86-64 Linux, no extras asked for) must be met by a
wheel in the payload or by a package the machine already has: MACHINE_LIST (default
``gpu-machine-packages.txt`` beside this file, ``name==version`` a line, as
``pip list --format=freeze`` printed it there). A requirement met by neither is printed
and the exit status is 1, so the next missing piece shows here, not on the machine.
Requirements that nothing on the import path needs can be waived in ``WAIVED`` below,
each with the reason.
"""

from __future__ import annotations

import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

MACHINE = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}
"""The GPU machine's marker environment (Python 3.12.3, x86-64 Linux), no extras."""

_OPTIONAL_IN_SGLANG = (
    "imported by sglang only inside functions or behind an availability check, on paths the "
    "relay's servers do not take (no DeepGEMM / DeepEP / FlashMLA / TileLang kernels, no "
    "remote model hubs, no file watching)"
)
WAIVED: dict[str, dict[str, str]] = {
    "sglang": {
        **dict.fromkeys(
            (
                "build",
                "deepseek-recipe",
                "easydict",
                "humming-kernels",
                "kernels",
                "numba",
                "nvidia-mathdx",
                "nvshmem4py-cu13",
                "sgl-deep-ep",
                "sgl-deep-gemm",
                "sgl-flash-mla",
                "tilelang",
                "tml-renderers",
                "watchfiles",
                "xxhash",
            ),
            _OPTIONAL_IN_SGLANG,
        ),
        **dict.fromkeys(
            (
                "anthropic",
                "cuda-python",
                "datasets",
                "flash-attn-4",
                "flashinfer-python",
                "llguidance",
                "mistral-common",
                "modelscope",
                "ninja",
                "nvidia-ml-py",
                "openai-harmony",
                "outlines",
                "py-spy",
                "quack-kernels",
                "smg-grpc-servicer",
                "timm",
                "torch-memory-saver",
                "torchcodec",
            ),
            "an optional backend or front end (FlashInfer, FA4, grammar engines, multimodal, "
            "tool parsers, gRPC, profiling): the relay's servers run Triton attention, "
            "PyTorch sampling and no grammar backend",
        ),
        "compressed-tensors": "0.20.1 carried, as in the CPU venv where the same sglang runs",
        "blobfile": "3.3.0 carried, as in the CPU venv where the same sglang runs",
        "sentencepiece": "the machine's 0.2.2; the servers take token ids, no tokenizer",
    },
    "torch": {
        "triton": "the machine's triton 3.6 runs sglang's Triton kernels; nothing here compiles "
        "with torch.compile / inductor, which is what binds torch to triton 3.8",
        "nvidia-nccl-cu13": "the machine's 2.28.9 with nccl_shim.c preloaded (pack.sh), unless "
        "CARRY_NCCL=1 carries 2.30.7",
        "cuda-toolkit": "the machine's CUDA 13 libraries (measured: every symbol torch 2.14.1 "
        "binds is there but NCCL's, which is carried)",
        "nvidia-cudnn-cu13": "the machine's 9.19.0.56 (torch pins 9.24.0.43): the same cuDNN 9 "
        "ABI; measured on the H100, torch 2.14.1 loads and sglang serves on it",
        "nvidia-cusparselt-cu13": "the machine's 0.8.0 (torch pins 0.8.1), measured as for cuDNN",
    },
    "nixl": {"nixl-cu12": "nixl-cu13 is carried for the CUDA 13 machine"},
    "nvidia-cutlass-dsl": {"nvidia-cutlass-dsl-libs-cu12": "libs-cu13 is carried"},
    "ipython": {"jedi": "completion only, never imported on sglang's import path"},
    "blobfile": {"lxml": "imported only to list cloud buckets, which nothing here does"},
}
"""Per carrying distribution: requirement name -> why it is knowingly not carried."""


def wheel_metadata(wheel: Path) -> tuple[str, Version, list[str]]:
    """A wheel's distribution name, version and Requires-Dist lines."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode("utf-8", "replace"))
    return (
        canonicalize_name(meta["Name"]),
        Version(meta["Version"]),
        meta.get_all("Requires-Dist") or [],
    )


def machine_packages(path: Path) -> dict[str, Version | None]:
    have: dict[str, Version | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        try:
            have[canonicalize_name(name)] = Version(version) if version else None
        except InvalidVersion:
            have[canonicalize_name(name)] = None
    return have


def unmet(wheels: Path, machine: dict[str, Version | None]) -> list[str]:
    carried = {
        name: (version, reqs)
        for name, version, reqs in map(wheel_metadata, sorted(wheels.glob("*.whl")))
    }
    problems = []
    for dist, (_, requirements) in sorted(carried.items()):
        for line in requirements:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                problems.append(f"{dist}: cannot read requirement {line!r}")
                continue
            if req.marker is not None and not req.marker.evaluate(MACHINE):
                continue
            name = canonicalize_name(req.name)
            if name in WAIVED.get(dist, {}):
                continue
            if name in carried:
                version: Version | None = carried[name][0]
                where = "the payload"
            elif name in machine:
                version = machine[name]
                where = "the GPU machine"
            else:
                problems.append(f"{dist} requires {req}: neither carried nor on the GPU machine")
                continue
            if (
                version is not None
                and req.specifier
                and not req.specifier.contains(version, prereleases=True)
            ):
                problems.append(f"{dist} requires {req}: {where} has {name} {version}")
    return problems


def main(argv: list[str]) -> int:
    wheels = Path(argv[0])
    listing = (
        Path(argv[1]) if len(argv) > 1 else Path(__file__).with_name("gpu-machine-packages.txt")
    )
    problems = unmet(wheels, machine_packages(listing))
    for problem in problems:
        print(f"check: {problem}")
    count = len(list(wheels.glob("*.whl")))
    print(
        f"check: {count} wheels, {len(problems)} unmet requirements (machine list: {listing.name})"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
