"""A sparse MoE block's routing and its routed experts as one C call (moe.c), for eager serving and the decode step
plans alike (serve/cpu_moe.py builds the expert calls and swaps the block's class).

ExpertCalls: the router's weight (moe.c computes the logits, for any number of experts), the routing (Routing: one
of moe.c's three, as models/moe.py's select() methods compute it, ties to the lower expert; its exp is exp.h's,
relative error ~2e-7, so a weight may differ from torch's by an ulp), and every expert's gate_up (with the
silu(gate) * up epilogue) and down linear as step-plan calls (kernels/cpu/step_plan.py rows, recorded on dummy
tensors) that moe.c replays with its own x, row count and y: a kernel for small row counts with its row limit, and
the kernel for more rows where one runs here. sigmoid_gated_add: Qwen2-MoE's shared expert, gated by the sigmoid of
one more linear, added after the routed experts.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Optional

import torch

from quantkit.kernels.cpu.build import load_library
from quantkit.kernels.cpu.step_plan import OP_WORDS, Plan, float_bits

CALL_WORDS = OP_WORDS + 2  # moe.c's: the call, its kernel's row limit (0: any), the address of the larger kernel
ROUTES = ("softmax", "corrected_softmax", "grouped_sigmoid")  # moe.c's ROUTE_ enum, in order
_P, _INT = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {"moe_forward": [_P, _P, _INT, _INT, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _INT],
              "sigmoid_gated_add": [_P, _P, _P, _P, _INT, _INT, _INT]}


def _library():
    return load_library("moe", SIGNATURES)


def available() -> bool:
    return _library() is not None


@dataclass
class Routing:
    """How moe.c chooses each token's top_k experts and weights (its header): mode, one of ROUTES; bias fp32 [E]
    (corrected_softmax, grouped_sigmoid); groups, topk_groups (grouped_sigmoid); param: the divisor's floor
    (corrected_softmax) or the weights' scaling (grouped_sigmoid)."""
    mode: str
    top_k: int
    normalize: bool
    fp32_weights: bool
    bias: Optional[torch.Tensor] = None
    groups: int = 0
    topk_groups: int = 0
    param: float = 0.0

    def words(self, experts: int, fp32_router: bool) -> torch.Tensor:
        """moe.c's routing words (int64 [10], its R_ enum's order)."""
        grouped = self.mode == "grouped_sigmoid"
        per = experts // self.groups if grouped and self.groups > 0 else experts
        if (self.bias is None) != (self.mode == "softmax") or not 1 <= self.top_k <= experts or (
                self.bias is not None and (self.bias.dtype is not torch.float32 or self.bias.shape != (experts,)
                                           or not self.bias.is_contiguous())) or (grouped and not (
                self.groups > 0 and experts % self.groups == 0 and per >= 2 and 1 <= self.topk_groups <= self.groups
                and self.top_k <= self.topk_groups * per)):
            raise ValueError(f"moe routing {self.mode!r}: top-{self.top_k} of {experts} experts (groups "
                             f"{self.groups}, {self.topk_groups} eligible), bias "
                             f"{None if self.bias is None else (self.bias.dtype, tuple(self.bias.shape))}")
        bias = 0 if self.bias is None else self.bias.data_ptr()
        return torch.tensor([ROUTES.index(self.mode), experts, self.top_k, int(self.normalize),
                             int(self.fp32_weights), int(fp32_router), bias, self.groups, self.topk_groups,
                             float_bits(self.param)], dtype=torch.int64)


@dataclass
class ExpertCalls:
    """router bf16 or fp32 [E, H] contiguous (a bf16 one's logits rounded to bf16, as a bf16 nn.Linear's); table
    int64 [E, 2, CALL_WORDS]: expert e's gate_up ([m, H] -> [m, I]) and down ([m, I] -> [m, H]) calls; max_rows:
    the most tokens a call may route (each expert then gets at most that many; None: any)."""
    router: torch.Tensor
    routing: Routing
    table: torch.Tensor
    hidden: int
    inter: int
    max_rows: Optional[int]
    keep: list[Plan] = field(default_factory=list)  # the recordings: they hold the weights the table points at

    def __post_init__(self):
        if self.router.dtype not in (torch.bfloat16, torch.float32) or not self.router.is_contiguous() \
                or tuple(self.router.shape) != (self.experts, self.hidden):
            raise ValueError(f"moe router: {self.router.dtype} {tuple(self.router.shape)}, not a contiguous bf16 or "
                             f"fp32 [{self.experts}, {self.hidden}]")
        self.words = self.routing.words(self.experts, self.router.dtype is torch.float32)

    @property
    def experts(self) -> int:
        return self.table.shape[0]

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x [T, H] runs here: bf16, and T within max_rows."""
        return x.dtype is torch.bfloat16 and (self.max_rows is None or x.shape[0] <= self.max_rows)


class Scratch:
    """moe.c's work buffers for up to `rows` tokens: gathered x, act, y, the router logits, the routing and its sorted
    slots."""

    def __init__(self, rows: int, calls: ExpertCalls):
        bf16, top_k = torch.bfloat16, calls.routing.top_k
        self.xg = torch.empty(rows, calls.hidden, dtype=bf16)
        self.act = torch.empty(rows, calls.inter, dtype=bf16)
        self.y = torch.empty(rows, calls.hidden, dtype=bf16)
        self.logits = torch.empty(rows, calls.experts, dtype=torch.float32)
        self.values = torch.empty(rows, calls.experts, dtype=torch.float32)
        self.chosen = torch.empty(rows, top_k, dtype=torch.int32)
        self.weights = torch.empty(rows, top_k, dtype=torch.float32)
        self.order = torch.empty(calls.experts + 1 + rows * top_k, dtype=torch.int32)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.xg, self.act, self.y, self.logits, self.values, self.chosen, self.weights, self.order


def arguments(x: torch.Tensor, calls: ExpertCalls, scratch: Scratch, out: torch.Tensor) -> list[int]:
    """moe_forward's arguments but the thread count, after checking what it assumes: x and out [T, H] bf16
    contiguous, T within calls.max_rows and the scratch."""
    t = x.shape[0]
    for name, tensor, shape in (("x", x, (t, calls.hidden)), ("out", out, (t, calls.hidden))):
        if tensor.dtype is not torch.bfloat16 or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"moe_forward: {name} must be bf16 {list(shape)} contiguous; got {tensor.dtype} "
                             f"{list(tensor.shape)}")
    if not (calls.takes(x) and scratch.chosen.shape == (scratch.chosen.shape[0], calls.routing.top_k)
            and scratch.chosen.shape[0] >= t and scratch.logits.shape[1] == calls.experts):
        raise ValueError(f"moe_forward: {t} tokens (at most {calls.max_rows}), scratch for "
                         f"{tuple(scratch.chosen.shape)} choices of {scratch.logits.shape[1]} experts")
    return [calls.router.data_ptr(), x.data_ptr(), t, calls.hidden, calls.words.data_ptr(), calls.table.data_ptr(),
            *(b.data_ptr() for b in scratch.tensors()), out.data_ptr()]


def moe_forward(x: torch.Tensor, calls: ExpertCalls) -> torch.Tensor:
    """x [T, H] bf16 -> out [T, H]: each token's sum of weight * expert(x) over its top_k experts."""
    out, scratch = torch.empty_like(x), Scratch(x.shape[0], calls)  # (scratch held until the call returns)
    _library().moe_forward(*arguments(x, calls, scratch, out), torch.get_num_threads())
    return out


def record(plan: Plan, x: torch.Tensor, calls: ExpertCalls, scratch: Scratch, out: torch.Tensor) -> None:
    """moe_forward as a plan call over these tensors."""
    plan.record("moe", _library(), arguments(x, calls, scratch, out), x, calls.router, calls.words, calls.table,
                *scratch.tensors(), out, function="moe_forward")


def _gated_add_arguments(out: torch.Tensor, shared: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> list[int]:
    """sigmoid_gated_add's arguments but the thread count: out, shared, x bf16 [T, H] contiguous, gate bf16 [H]."""
    t, h = x.shape
    if any(a.dtype is not torch.bfloat16 or not a.is_contiguous() or tuple(a.shape) != shape
           for a, shape in ((out, (t, h)), (shared, (t, h)), (x, (t, h)), (gate, (h,)))):
        raise ValueError(f"sigmoid_gated_add: out {tuple(out.shape)}, shared {tuple(shared.shape)}, x {tuple(x.shape)}"
                         f", gate {tuple(gate.shape)}: bf16 contiguous [T, H] and [H]")
    return [out.data_ptr(), shared.data_ptr(), x.data_ptr(), gate.data_ptr(), t, h]


def sigmoid_gated_add(out: torch.Tensor, shared: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out += sigmoid(x @ gate) * shared, in place (each step rounded to bf16) -> out."""
    _library().sigmoid_gated_add(*_gated_add_arguments(out, shared, x, gate), torch.get_num_threads())
    return out


def record_gated_add(plan: Plan, out: torch.Tensor, shared: torch.Tensor, x: torch.Tensor, gate: torch.Tensor) -> None:
    """sigmoid_gated_add as a plan call over these tensors."""
    plan.record("sigmoid_gated_add", _library(), _gated_add_arguments(out, shared, x, gate), out, shared, x, gate)
