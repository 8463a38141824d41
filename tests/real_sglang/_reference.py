"""The bit-exact reference of the real-server suite, built the way the engine builds it.

Run as its own process with sglang's CPU kernel on the path and ``SGLANG_USE_CPU_ENGINE=1``
(``_server.kernel_env()``), as the engine runs: sglang's own model class and
``load_weights`` fill a real CPU model of each rank from the synthetic tensors of a
seed, sglang's start-up postprocess runs (on a CPU with AMX, its weight packing too),
and sglang's own ``WeightChecker`` hashes it, as the engine's ``/weights_checker`` does.

On a GPU server (``"device": "cuda"``) the reference is built on the GPU, where sglang's
checker hashes with its own GPU kernel instead of sha256.

stdin: ``{"config": {...}, "model_path": str, "device": "cpu" | "cuda",
"cases": [{"key", "server_info", "seed"}]}``;
stdout, one line: ``{key: [checksums of rank 0, rank 1, ...]}``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import torch


def main() -> None:
    from p2pweights.engines.fleet import num_engine_ranks
    from p2pweights.testing import synthetic_weights
    from p2pweights.verify import expected_checksums

    job = json.loads(sys.stdin.read())
    config = job["config"]
    answer = {}
    for case in job["cases"]:
        info, seed = case["server_info"], int(case["seed"])

        def tensors(seed: int = seed) -> Iterator[tuple[str, torch.Tensor]]:
            return synthetic_weights(config, seed)

        answer[case["key"]] = [
            expected_checksums(
                info, rank, tensors, model_path=job["model_path"], device=job.get("device", "cpu")
            )
            for rank in range(num_engine_ranks("reference", info))
        ]
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
