"""A pass of one decoder block over the calibration activations that runs only for its hooks, which record Linear
input statistics: calibrate.capture_stage (each stage's routed capture) and moe_calibration.force_starved_experts
(the forced-routing pass of the starved experts)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class ForwardDone(Exception):
    """Raised by a hook once it has recorded what the pass needs from the batch: the rest of the block is skipped."""


def hooked_pass(block: nn.Module, pre_hooks: dict[str, Callable], hooks: dict[str, Callable], x: torch.Tensor,
                mask: torch.Tensor, positions: torch.Tensor, batch_size: int, device, batch: dict,
                fresh: Callable[[], dict] = dict) -> None:
    """Run `block` over x [N, L, H] (CPU) in batches of batch_size on `device`, with forward pre-hooks `pre_hooks`
    and forward hooks `hooks` ({submodule name: hook}) installed on its submodules. Before each batch's forward,
    `batch` (the hooks' shared state) holds that batch's mask [B, L] (on device), its sample range "b0-b1" (for error
    messages) and the entries of fresh(). Afterwards the hooks are removed and `batch` is cleared, so it keeps no
    input of the last batch alive."""
    handles = []
    try:
        handles += [block.get_submodule(name).register_forward_pre_hook(fn) for name, fn in pre_hooks.items()]
        handles += [block.get_submodule(name).register_forward_hook(fn) for name, fn in hooks.items()]
        for b0 in range(0, x.shape[0], batch_size):
            b1 = min(b0 + batch_size, x.shape[0])
            batch.update(mask=mask[b0:b1].to(device), range=f"{b0}-{b1 - 1}", **fresh())
            try:
                block(x[b0:b1].to(device), positions)
            except ForwardDone:
                pass
    finally:
        for handle in handles:
            handle.remove()
        batch.clear()
