"""AWQ (Lin et al., 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression"), as pure tensor
functions. The driver (quant/calibrate.py) collects the statistics; the `AWQ` class at the bottom applies them.

Everything the search needs about a group's input X [T, K] is two statistics gathered in one pass:
  m = mean |x| per channel [K]   and   H = X^T X / T [K, K]  (the Hessian GPTQ uses, quant/gptq.py).
The output error of the group's Linears (weights concatenated along N) with fake-quantized W' is
  err = ||X (W - W')^T||^2 / (T N) = tr(dW H dW^T) / N,
so no search step touches the activations again and every token counts.

Scale search, a in {0, 1/20, ..., 19/20}:
  s = m^a / (w_mean^(1-a) + 1e-4),  s /= sqrt(max(s) min(s)),  err(a) = output_error(W, Q(W s) / s, H)
Folding s (x' = x / s, W' = W s) leaves the float model's outputs unchanged.
Rounding of the scaled weights W s, on the scaled input's Hessian H / (s s^T): by default GPTQ (quant/gptq.py, with
the run's damp, group-aware order and clip search), which compensates each column's rounding error through H's
off-diagonal (correlated channels); with awq_rounding "rtn", the paper's clip search + round to nearest:
Clip search (every Linear but q/k): per row and group, the shrink t in {1, 0.95, ..., 0.55} of the group's absmax
minimising that group's partial-output error dw_g H_gg dw_g^T.
MoE (models/registry.py): the norm before an MoE block feeds the router and every expert, so it can hold only one
scale vector: one group over every expert's gate/up (and the shared expert's), its candidates s from the mean |x| of
all tokens (the router's input), folded into the router's columns too. Its error is each Linear's own on its own
inputs, summed over what the block computes: sum_l tokens_l tr(dW_l H_l dW_l^T) / sum_l tokens_l N_l, with H_l the
Hessian of the tokens routed to that expert (of its forced pass when it was starved, weighted by its routed
tokens, so an expert the router never picks does not move the shared scale). Each expert's up -> down is its own
group on its own inputs, and clipping uses each expert's own H. An expert no statistics reached (the forced pass
turned off) is rounded to nearest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from quantkit.config import QuantScheme
from quantkit.models.registry import ArchSpec
from quantkit.quant.gptq import GPTQ, output_error
from quantkit.quant.scheme import QTensor, dequantize, quantize_rtn

N_GRID = 20
MAX_SHRINK = 0.5
_CHUNK = 8192


@dataclass
class ScaleSearch:
    scales: torch.Tensor  # [K] fp32, > 0
    ratio: float  # the chosen a
    loss: float  # output error with the chosen scales
    loss_unscaled: float  # output error of plain RTN (s = 1), for the report


def accumulate_magnitude(abs_sum: torch.Tensor, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> int:
    """abs_sum [K] fp32 += sum of |x| over the tokens of x [..., K] where mask [...] is True; returns tokens added."""
    x = x.reshape(-1, x.shape[-1]) if mask is None else x[mask]
    for start in range(0, x.shape[0], _CHUNK):
        abs_sum += x[start:start + _CHUNK].float().abs().sum(0)
    return x.shape[0]


def weight_magnitude(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """weight [N, K] -> [K]: mean over rows of |w| relative to its group's absmax."""
    n, k = weight.shape
    wg = weight.float().abs().reshape(n, -1, scheme.group_of(k))  # [N, G, g]
    return (wg / wg.amax(dim=2, keepdim=True).clamp(min=1e-12)).reshape(n, k).mean(0)


def fake_quantize(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """weight [N, K] -> the dequantized RTN weight, fp32 [N, K]."""
    return dequantize(quantize_rtn(weight.float(), scheme))


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float) -> torch.Tensor:
    """s [K] = x_mean^a / (w_mean^(1-a) + 1e-4), normalised so that max(s) * min(s) = 1."""
    s = x_mean.pow(ratio).clamp(min=1e-4) / (w_mean.pow(1 - ratio) + 1e-4)
    return s / (s.max() * s.min()).sqrt()


@dataclass
class RowBlock:
    """Rows [start, stop) of a scaling group's concatenated weight, measured on the Hessian h [K, K] of their own
    input, over `tokens` tokens."""

    start: int
    stop: int
    h: torch.Tensor
    tokens: int


def group_error(weight: torch.Tensor, approx: torch.Tensor, h: torch.Tensor | Sequence[RowBlock]) -> float:
    """The group's mean squared output error: `output_error` with one Hessian h [K, K] for all rows, or with each
    RowBlock's own, weighted by its tokens (the error per computed output element)."""
    if isinstance(h, torch.Tensor):
        return output_error(weight, approx, h)
    total = sum(b.tokens * (b.stop - b.start) * output_error(weight[b.start:b.stop], approx[b.start:b.stop], b.h)
                for b in h)
    return total / sum(b.tokens * (b.stop - b.start) for b in h)


def search_scales(weight: torch.Tensor, x_mean: torch.Tensor, h: torch.Tensor | Sequence[RowBlock],
                  scheme: QuantScheme, n_grid: int = N_GRID) -> ScaleSearch:
    """weight [N, K] (the group's Linears concatenated along N), x_mean [K], h [K, K] or RowBlocks -> the best
    scales."""
    w = weight.float()
    w_mean = weight_magnitude(w, scheme)
    best: Optional[ScaleSearch] = None
    for i in range(n_grid):
        s = candidate_scales(x_mean, w_mean, i / n_grid)
        loss = group_error(w, fake_quantize(w * s, scheme) / s, h)
        if best is None or loss < best.loss:
            best = ScaleSearch(s, i / n_grid, loss, 0.0)
    best.loss_unscaled = group_error(w, fake_quantize(w, scheme), h)
    return best


def own_inputs(linears: Sequence[nn.Linear], stats: Sequence, hessians: dict[int, torch.Tensor]) -> list[RowBlock]:
    """The RowBlocks of a group whose Linears (in concatenation order) each have their own input statistics
    (None: no statistics, left out of the error)."""
    blocks, start = [], 0
    for linear, st in zip(linears, stats):
        stop = start + linear.out_features
        if st is not None and st.tokens:
            blocks.append(RowBlock(start, stop, hessians[id(st)], st.tokens))
        start = stop
    return blocks


def fold_scales(prev: nn.Module, linears: Sequence[nn.Linear], s: torch.Tensor) -> None:
    """Divide prev's output channels by s [K] (RMSNorm scale [K], or Linear rows [K, :] and bias) and multiply
    the linears' input columns by s (the quantized ones and the float ones prev also feeds: an MoE router); the
    composition prev -> linears computes the same function."""
    with torch.no_grad():
        s = s.to(prev.weight.device)
        offset = getattr(prev, "weight_offset", 0.0)  # a Gemma RMSNorm scales by 1 + w: fold into the sum
        if prev.weight.dim() == 1 and offset:
            prev.weight.add_(offset).div_(s.to(prev.weight.dtype)).sub_(offset)
        elif prev.weight.dim() == 1:
            prev.weight.div_(s.to(prev.weight.dtype))
        else:
            prev.weight.div_(s.to(prev.weight.dtype)[:, None])
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
        for linear in linears:
            linear.weight.mul_(s.to(linear.weight.dtype)[None, :])


def scale_hessian(h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """H [K, K] of x -> the H of x / s: H / (s s^T)."""
    return h / (s[:, None] * s[None, :])


def search_clip(weight: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, n_grid: int = N_GRID,
                max_shrink: float = MAX_SHRINK) -> torch.Tensor:
    """weight [N, K], h [K, K] -> max_val [N, G]: the clip bound per row and group with the least error."""
    n, k = weight.shape
    g = scheme.group_of(k)
    w = weight.float().reshape(n, -1, g)  # [N, G, g]
    hb = torch.stack([h[j:j + g, j:j + g] for j in range(0, k, g)])  # [G, g, g] diagonal blocks
    org_max = w.abs().amax(dim=2)  # [N, G]
    best_max, best_err = org_max.clone(), None
    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i / n_grid)
        clipped = torch.maximum(torch.minimum(w, max_val[..., None]), -max_val[..., None])
        dw = (w - fake_quantize(clipped.reshape(n, k), scheme).reshape(n, -1, g)).transpose(0, 1)  # [G, N, g]
        err = (torch.bmm(dw, hb) * dw).sum(-1).T  # [N, G]
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


def clip_weight(weight: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """weight [N, K], max_val [N, G] -> weight clamped to [-max_val, max_val] per group, fp32."""
    n, k = weight.shape
    w = weight.float().reshape(n, max_val.shape[1], -1)
    return torch.maximum(torch.minimum(w, max_val[..., None]), -max_val[..., None]).reshape(n, k)



class AWQ:
    """AWQ as a calibration method of the driver: all of a block's Linears in one stage, statistics of the float
    block; every scaling group is searched on the float weights, then all scales are folded, then each scaled
    weight W s is rounded: by `rounding` (a GPTQ: error-compensating rounding on the scaled input's Hessian
    H / (s s^T), the CLI default) or, with rounding None, by the paper's clip search + round to nearest."""

    name = "awq"
    needs = ("hessian", "magnitude")
    true_sequential = False

    def __init__(self, scheme: QuantScheme, spec: ArchSpec, n_grid: int = N_GRID, rounding: Optional[GPTQ] = None):
        self.scheme, self.spec, self.n_grid, self.rounding = scheme, spec, n_grid, rounding

    def search_and_fold(self, block: nn.Module, names: list[str], stats: dict
                        ) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """Search every scaling group on the float weights, then fold all scales into the block (its float
        outputs do not change). Returns each Linear's input Hessian after scaling (none for an expert no
        calibration token reached) and the search report."""
        linears = {n: block.get_submodule(n) for n in names}
        hessians: dict[int, torch.Tensor] = {}  # id(stats) -> H of that input
        for st in stats.values():
            hessians.setdefault(id(st), st.hessian())
        h_of = {n: hessians[id(stats[n])] for n in names if n in stats}

        found = []  # (group, prev module, ScaleSearch)
        for group in self.spec.in_block(block).awq_groups:
            st = stats.get(group.stats_of)
            if st is None:
                continue  # an expert no token reached: its down_proj has no input to scale for
            prev, first = block.get_submodule(group.prev), linears[group.linears[0]]
            if group.needs_equal_heads and prev.weight.shape[0] != first.in_features:
                continue  # GQA: v_proj's output is narrower than o_proj's input, no per-channel fold exists
            weight = torch.cat([linears[n].weight.detach() for n in group.linears])  # [sum N, K]
            h = hessians[id(st)]
            if group.source:  # the router's input: every expert measured on its own tokens instead
                h = own_inputs([linears[n] for n in group.linears], [stats.get(n) for n in group.linears], hessians)
            found.append((group, prev, search_scales(weight, st.magnitude(), h, self.scheme, self.n_grid)))

        info: dict[str, dict] = {n: {} for n in names}
        for group, prev, search in found:
            fed = [linears[n] for n in group.linears] + [block.get_submodule(n) for n in group.unquantized]
            fold_scales(prev, fed, search.scales)
            scaled: dict[int, torch.Tensor] = {}  # id(H) -> H of x / s (linears fed the same x share one)
            for n in group.linears:
                if n in h_of:
                    h = h_of[n]
                    if id(h) not in scaled:
                        scaled[id(h)] = scale_hessian(h, search.scales)
                    h_of[n] = scaled[id(h)]
                info[n] = {"ratio": search.ratio, "group_loss": search.loss, "group_loss_rtn": search.loss_unscaled}
        return h_of, info

    def quantize_stage(self, block, names, stats, prefix) -> Iterator[tuple[str, QTensor, dict]]:
        h_of, info = self.search_and_fold(block, names, stats)
        for name in names:
            weight = block.get_submodule(name).weight.detach().float()  # scaled: W s
            if name not in h_of:  # an expert no token reached (forced pass off): round to nearest, no clip search
                yield name, quantize_rtn(weight, self.scheme, layer=prefix + name), \
                    {**info[name], "loss": None, "fallback": True, "no_tokens": True}
                continue
            if self.rounding is not None:
                qt, stats_of_rounding = self.rounding.quantize_linear(weight, h_of[name], prefix + name)
                yield name, qt, {**info[name], **stats_of_rounding}
                continue
            clipped = weight
            if name not in self.spec.awq_no_clip:
                clipped = clip_weight(weight, search_clip(weight, h_of[name], self.scheme))
            qt = quantize_rtn(clipped, self.scheme, layer=prefix + name)
            yield name, qt, {**info[name], "loss": output_error(weight, dequantize(qt), h_of[name])}
