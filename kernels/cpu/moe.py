"""A sparse MoE block's softmax top-k routing and its routed experts as one C call (moe.c), for eager serving and
the decode step plans alike (serve/cpu_moe.py builds the expert calls and swaps the block's class).

ExpertCalls: the router's weight (its logits are computed by moe.c: fp32 sums rounded to bf16, for any number of
experts), and every expert's gate_up (with the silu(gate) * up epilogue) and down linear as step-plan calls
(kernels/cpu/step_plan.py rows, recorded on dummy tensors) that moe.c replays with its own x, row count and y: a
kernel for small row counts with its row limit, and the kernel for more rows where one runs here. Routing as
models/moe.py's MoE.select (softmax in fp32, top-k, normalize, the weights in bf16 unless fp32_weights), ties to the
lower expert; its exp is exp.h's (relative error ~2e-7), so the weights may differ from torch's softmax by an ulp.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Optional

import torch

from quantkit.kernels.cpu.build import load_library
from quantkit.kernels.cpu.step_plan import OP_WORDS, Plan

CALL_WORDS = OP_WORDS + 2  # moe.c's: the call, its kernel's row limit (0: any), the address of the larger kernel
_P, _INT = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {"moe_forward": [_P, _INT, _P, _INT, _INT, _INT, _INT, _INT, _P, _P, _P, _P, _P, _P, _P, _P, _P, _INT]}


def _library():
    return load_library("moe", SIGNATURES)


def available() -> bool:
    return _library() is not None


@dataclass
class ExpertCalls:
    """router bf16 [E, H] contiguous; table int64 [E, 2, CALL_WORDS]: expert e's gate_up ([m, H] -> [m, I]) and down
    ([m, I] -> [m, H]) calls; max_rows: the most tokens a call may route (each expert then gets at most that many;
    None: any)."""
    router: torch.Tensor
    table: torch.Tensor
    hidden: int
    inter: int
    max_rows: Optional[int]
    keep: list[Plan] = field(default_factory=list)  # the recordings: they hold the weights the table points at

    @property
    def experts(self) -> int:
        return self.table.shape[0]

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x [T, H] runs here: bf16, and T within max_rows."""
        return x.dtype is torch.bfloat16 and (self.max_rows is None or x.shape[0] <= self.max_rows)


class Scratch:
    """moe.c's work buffers for up to `rows` tokens: gathered x, act, y, the router logits, the routing and its sorted
    slots."""

    def __init__(self, rows: int, calls: ExpertCalls, top_k: int):
        bf16 = torch.bfloat16
        self.xg = torch.empty(rows, calls.hidden, dtype=bf16)
        self.act = torch.empty(rows, calls.inter, dtype=bf16)
        self.y = torch.empty(rows, calls.hidden, dtype=bf16)
        self.logits = torch.empty(rows, calls.experts, dtype=bf16)
        self.chosen = torch.empty(rows, top_k, dtype=torch.int32)
        self.weights = torch.empty(rows, top_k, dtype=torch.float32)
        self.order = torch.empty(calls.experts + 1 + rows * top_k, dtype=torch.int32)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.xg, self.act, self.y, self.logits, self.chosen, self.weights, self.order


def arguments(x: torch.Tensor, calls: ExpertCalls, top_k: int, normalize: bool, fp32_weights: bool,
              scratch: Scratch, out: torch.Tensor) -> list[int]:
    """moe_forward's arguments but the thread count, after checking what it assumes: x and out [T, H] bf16
    contiguous, 1 <= top_k <= E, T within calls.max_rows and the scratch."""
    t, e = x.shape[0], calls.experts
    for name, tensor, shape in (("x", x, (t, calls.hidden)), ("out", out, (t, calls.hidden))):
        if tensor.dtype is not torch.bfloat16 or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"moe_forward: {name} must be bf16 {list(shape)} contiguous; got {tensor.dtype} "
                             f"{list(tensor.shape)}")
    if not (1 <= top_k <= e and calls.takes(x) and scratch.chosen.shape[0] >= t and scratch.chosen.shape[1] == top_k):
        raise ValueError(f"moe_forward: {t} tokens, top-{top_k} of {e} experts (at most {calls.max_rows} tokens, "
                         f"scratch for {scratch.chosen.shape[0]})")
    return [calls.router.data_ptr(), e, x.data_ptr(), t, calls.hidden, top_k, int(normalize), int(fp32_weights),
            calls.table.data_ptr(), *(b.data_ptr() for b in scratch.tensors()), out.data_ptr()]


def moe_forward(x: torch.Tensor, calls: ExpertCalls, top_k: int, normalize: bool, fp32_weights: bool) -> torch.Tensor:
    """x [T, H] bf16 -> out [T, H]: each token's sum of weight * expert(x) over its top_k experts."""
    out = torch.empty_like(x)
    scratch = Scratch(x.shape[0], calls, top_k)
    _library().moe_forward(*arguments(x, calls, top_k, normalize, fp32_weights, scratch, out),
                           torch.get_num_threads())
    return out


def record(plan: Plan, x: torch.Tensor, calls: ExpertCalls, top_k: int, normalize: bool, fp32_weights: bool,
           scratch: Scratch, out: torch.Tensor) -> None:
    """moe_forward as a plan call over these tensors."""
    args = arguments(x, calls, top_k, normalize, fp32_weights, scratch, out)
    plan.record("moe", _library(), args, x, calls.router, calls.table, *scratch.tensors(), out, function="moe_forward")
