"""A test-only sglang plugin: every postprocess gives every parameter new storage.

sglang's CPU backend, on a CPU with AMX, packs each linear weight into a new tensor
after every load (``_amx_process_weight_after_loading``: a new ``Parameter`` whose
``__dict__`` is the old one's), so the addresses published at start-up point at freed
memory after the first update. This plugin does the same to every parameter, keeping
its bytes and layout, so the real-server suite can check on any CPU that p2pweights
writes where parameters live after each update. Enabled by listing it in
``SGLANG_PLUGINS`` with this folder on ``PYTHONPATH`` (its dist-info holds the entry
point).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.model_loader.loader.DefaultModelLoader.postprocess_weights"


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, move_every_parameter, HookType.AFTER)


def move_every_parameter(_result: Any, model: Any, *_args: Any, **_kwargs: Any) -> None:
    import torch

    fresh: dict[int, torch.nn.Parameter] = {}  # a parameter shared by two modules stays shared
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in fresh:
                moved = torch.nn.Parameter(param.data.clone(), requires_grad=False)
                moved.__dict__ = param.__dict__
                fresh[id(param)] = moved
            module._parameters[name] = fresh[id(param)]
    logger.info("p2pweights_moving_storage: gave %d parameters new storage", len(fresh))
