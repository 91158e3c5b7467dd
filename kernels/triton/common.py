"""Host-side helpers every kernel launcher shares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
import triton.testing


def fp32_dot(dtype: torch.dtype) -> bool:
    """True when tl.dot must see fp32 operands: Triton's CPU interpreter (TRITON_INTERPRET=1) multiplies the raw
    uint16 storage of bfloat16 operands. Kernels then round to bf16 first and upcast, so products and fp32 sums
    are the same as a tensor-core bf16 dot; on a GPU this is always False."""
    return bool(triton.knobs.runtime.interpret) and dtype == torch.bfloat16


def quick_bench(fn, quantiles):
    """Autotuning timer: shorter than Triton's default (25 ms warm-up, 100 ms runs) so a first run tunes fast."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


@triton.jit
def mma(a, b, acc, FP32_DOT: tl.constexpr):
    """acc [BM, BN] fp32 += a [BM, BK] @ b [BK, BN] (a and b in one fp16/bf16 dtype); see fp32_dot."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


def exact_bf16_cast(dtype: torch.dtype) -> bool:
    """True when kernels must round fp32 -> bfloat16 themselves (round_to): Triton's CPU interpreter truncates
    that cast (its _convert_float, even with fp_downcast_rounding="rtne"), a bias of half an ulp per rounding that
    compounds over a chain of rounded GEMMs; a GPU rounds to nearest even, so this is always False there."""
    return bool(triton.knobs.runtime.interpret) and dtype == torch.bfloat16


@triton.jit
def round_to(x, dtype: tl.constexpr, EXACT_BF16: tl.constexpr):
    """fp32 x -> `dtype`, rounded to nearest even (EXACT_BF16: by integer ops on the bits; finite x); see
    exact_bf16_cast."""
    if EXACT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


class SplitWorkspaces:
    """Per-device persistent scratch of a kernel whose split programs reduce in one launch (the program that
    arrives last merges the others' partials): an fp32 workspace and int32 arrival counters.

    Invariant: the counters are all zero between launches (the kernel puts each one back after its merge); the
    workspace needs no clearing (a launch writes every element it reads). Buffers grow, never shrink, and never
    during CUDA-graph capture (reserve the engine's largest launch at load time); a replaced buffer is kept alive,
    since a graph captured earlier may still point at it. Launches on one stream are serialised, so one buffer per
    device is safe; concurrent launches on different streams of one device are not supported."""

    def __init__(self):
        self._buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._retired: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reserve(self, device, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 workspace >= floats elements, int32 counters >= counters) of `device`, grown if needed."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # one key per GPU, as tensors name it
        ws, cnt = self._buffers.get(device, (None, None))
        if ws is None or ws.numel() < floats or cnt.numel() < counters:
            assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
                "a split workspace grown during CUDA-graph capture: reserve it at load time"
            if ws is not None:
                self._retired.append((ws, cnt))
                floats, counters = max(floats, ws.numel()), max(counters, cnt.numel())
            self._buffers[device] = (torch.zeros(floats, dtype=torch.float32, device=device),
                                     torch.zeros(counters, dtype=torch.int32, device=device))
        return self._buffers[device]
