"""The ranks of a local engine: sglang models with real storage, published for writers.

Each rank holds the model sglang's own model class builds for that rank, filled
through sglang's own ``load_weights`` and start-up postprocess, its weights
registered with a transport publisher, and sglang's own ``WeightChecker``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from p2pweights.replica import sglang_env
from p2pweights.transfer.transports import Publisher, create_publisher


@contextlib.contextmanager
def _chunks_stay_on_host() -> Iterator[None]:
    """sglang's weight comparator moves each chunk to CUDA before comparing (``.cuda()``).

    A local engine on a host without a GPU holds its weights in host memory; there the
    chunks are compared where they are. Nothing else changes: same chunks, same
    bitwise test. Used only around the checker calls of a CPU-only local engine.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


class EngineRank:
    """One TP rank of a local engine."""

    def __init__(
        self,
        server_info: dict[str, Any],
        spec: sglang_env.RankSpec,
        weights: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        transport: str,
    ):
        from sglang.srt.utils.weight_checker import WeightChecker

        self.spec = spec
        self.model = sglang_env.load_real_rank_model(
            server_info["model_path"],
            spec,
            weights(),
            dtype=server_info["dtype"],
            server_args_fields=server_info,
        )
        with sglang_env.rank_scope(spec):
            self.checker = WeightChecker(get_model=lambda: self.model)
        self.params = {name: p.data for name, p in self.model.named_parameters()}
        self.publisher: Publisher = create_publisher(transport, engine_rank=spec.tp_rank)
        self.publisher.register(self.params)

    @property
    def rank(self) -> int:
        return self.spec.tp_rank

    def publication(self) -> Any:
        return self.publisher.publication(self.params)

    @torch.no_grad()
    def begin_update(self) -> None:
        sglang_env.begin_update(self.model, self.spec)

    @torch.no_grad()
    def end_update(self) -> None:
        # Bytes arrived by writes, not load_weights: run post_load_weights as sglang does then.
        sglang_env.end_update(self.model, self.spec, run_post_load=True)

    def check(self, action: str, **options: Any) -> dict[str, Any] | None:
        with sglang_env.rank_scope(self.spec), torch.no_grad(), _chunks_stay_on_host():
            result: dict[str, Any] | None = self.checker.handle(action, role="target", **options)
            return result

    def close(self) -> None:
        self.publisher.close()
