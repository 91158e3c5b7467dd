"""MoE calibration: experts the router starves are calibrated on a forced-routing pass (the driver, quant/calibrate.py,
calls `force_starved_experts` after each stage's routed capture).

Every expert's Linears are first recorded on exactly the tokens routed to it (calibrate.capture_stage). An expert
whose routed tokens in a stage are fewer than `min_tokens` is recorded again, instead, on all counted tokens of the
block, each weighted by the router's probability p_e(x) for that expert (softmax over all experts' logits):

    H_e = sum_t p_t x_t x_t^T / sum_t p_t        m_e = sum_t p_t |x_t| / sum_t p_t

so its statistics lean toward the inputs the router would send it (the tokens it is routed are those where p_e is
largest) while having the rank of the whole calibration set. Its down_proj is recorded the same way on the expert's
own intermediate activations of those tokens. Experts at or above the threshold keep their routed statistics.

The threshold defaults to the hidden size, the width of the expert's gate/up input: with fewer routed tokens their
Hessian X^T X is singular (rank <= tokens) and GPTQ fits the few tokens seen at the expense of every other direction.
(GPTQModel's FailSafe rounds to nearest under 0.5% of the calibration tokens; llm-compressor routes every token
through every expert, unweighted, for all experts.) `--moe-min-tokens 0` turns the forced pass off: an expert no
token reaches is then rounded to nearest.
"""

from __future__ import annotations

import re
import statistics
from typing import Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.quant.awq import accumulate_magnitude
from quantkit.quant.gptq import accumulate_hessian, finish_hessian
from quantkit.quant.hooked_pass import ForwardDone, hooked_pass


def resolve_min_tokens(min_tokens: Optional[int], hidden_size: int) -> int:
    """The routed tokens an expert needs to keep its routed statistics (None: the hidden size)."""
    return hidden_size if min_tokens is None else min_tokens


def expert_index(name: str, experts: str) -> Optional[int]:
    """'block_sparse_moe.experts.3.w1' -> 3 when experts == 'block_sparse_moe.experts'; None for other Linears."""
    head, _, rest = name.partition(f"{experts}.")
    return int(rest.split(".")[0]) if experts and not head and rest else None


class ForcedStats:
    """Input statistics of a starved expert's Linear over the forced pass (InputStats' interface). `tokens` and
    `samples` stay the routed counts (what the report shows); the sums are weighted by p_e(x), relative to a
    per-expert reference so that tiny probabilities do not underflow (the normalised statistics do not depend on it)."""

    def __init__(self, k: int, needs: tuple[str, ...], device, tokens: int, samples: int):
        self.h_sum = torch.zeros(k, k, device=device) if "hessian" in needs else None  # [K, K] fp32
        self.abs_sum = torch.zeros(k, device=device) if "magnitude" in needs else None  # [K] fp32
        self.tokens, self.samples = tokens, samples
        self.weight = self.weight_sq = 0.0  # sum of the token weights, and of their squares
        self.forced_tokens = 0

    def add(self, x: torch.Tensor, w: torch.Tensor) -> None:
        """x [T, K] the inputs, w [T] fp32 >= 0 their weights."""
        x = x.float()
        if self.h_sum is not None:
            accumulate_hessian(self.h_sum, x * w.sqrt()[:, None])
        if self.abs_sum is not None:
            accumulate_magnitude(self.abs_sum, x * w[:, None])
        self.weight += float(w.sum())
        self.weight_sq += float((w * w).sum())
        self.forced_tokens += x.shape[0]

    def finite(self) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in (self.h_sum, self.abs_sum) if t is not None)

    def hessian(self) -> torch.Tensor:
        return finish_hessian(self.h_sum, 1) / self.weight

    def magnitude(self) -> torch.Tensor:
        return self.abs_sum / self.weight

    def report(self) -> dict:
        """forced_tokens: tokens through the expert; effective_tokens: (sum w)^2 / sum w^2 (Kish), how many
        equally weighted tokens the weighted statistics are worth."""
        return {"forced": True, "forced_tokens": self.forced_tokens,
                "effective_tokens": round(self.weight ** 2 / self.weight_sq, 1) if self.weight_sq else 0.0}


def stats_report(st) -> dict:
    """The report fields of one Linear's statistics (None: an expert no token reached, nothing recorded)."""
    if st is None:
        return {"samples": 0, "tokens": 0}
    return {"samples": st.samples, "tokens": st.tokens, **(st.report() if isinstance(st, ForcedStats) else {})}


def starved_experts(stage: list[str], stats: dict, experts: str, min_tokens: int) -> dict[int, list[str]]:
    """expert e -> its Linears in `stage`, for every expert whose routed tokens (its Linears' statistics) are
    fewer than min_tokens."""
    out: dict[int, list[str]] = {}
    for name in stage:
        e = expert_index(name, experts)
        if e is not None and (stats[name].tokens if name in stats else 0) < min_tokens:
            out.setdefault(e, []).append(name)
    return out


def force_starved_experts(block: nn.Module, stage: list[str], stats: dict, x: torch.Tensor, mask: torch.Tensor,
                          positions: torch.Tensor, needs: tuple[str, ...], batch_size: int, prefix: str, device,
                          bspec, min_tokens: int) -> dict[str, ForcedStats]:
    """The forced-pass statistics of every starved expert's Linears in `stage` (empty when none is starved): the block
    runs over x [N, L, H] (CPU) in batches up to its router; there each starved expert runs on the batch's counted
    tokens [T, H] with hooks recording its Linears' inputs weighted by p_e. `stats`: the stage's routed statistics."""
    starved = starved_experts(stage, stats, bspec.experts, min_tokens)
    if not starved:
        return {}
    moe = block.get_submodule(bspec.router.rpartition(".")[0])
    forced: dict[str, ForcedStats] = {}
    current: dict = {}  # the batch's mask and range; the expert call running: its token weights [T], id(input) -> stats
    reference: dict[int, float] = {}  # expert -> the log p its weights are relative to (its first batch's max)

    def hook(name):
        def record(module, args):
            inp = args[0]
            shared = current["seen"].get(id(inp))
            if shared is not None:  # gate and up are fed the same tensor: one statistics object
                forced.setdefault(name, shared[1])
                return
            st = forced.get(name)
            if st is None:
                routed = stats.get(name)
                st = forced[name] = ForcedStats(inp.shape[-1], needs, inp.device, routed.tokens if routed else 0,
                                                routed.samples if routed else 0)
            st.add(inp.reshape(-1, inp.shape[-1]), current["w"])
            if not st.finite():
                raise QuantkitError(f"forced-pass inputs of {prefix}{name} contain NaN/inf (samples "
                                    f"{current['range']}): load the model in float32 or check the data")
            current["seen"][id(inp)] = (inp, st)
        return record

    def route(module, args, logits):
        keep = current["mask"].reshape(-1)  # [T_all] the tokens that count
        if not bool(keep.any()):
            raise ForwardDone
        tokens = args[0].reshape(-1, args[0].shape[-1])[keep]  # [T, H]
        logp = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)[keep]  # [T, E]
        for e in starved:
            ref = reference.setdefault(e, float(logp[:, e].max()))
            current.update(w=torch.exp(logp[:, e] - ref), seen={})
            moe.experts[e](tokens)
        raise ForwardDone  # the starved experts have run on the batch: the rest of the block is skipped

    hooked_pass(block, {n: hook(n) for names in starved.values() for n in names}, {bspec.router: route}, x, mask,
                positions, batch_size, device, current)
    return forced


_EXPERT_NAME = re.compile(r"^(model\.layers\.\d+)\..*\.experts\.(\d+)\.")


def moe_summary(report: list[dict], min_tokens: int) -> dict:
    """The calibration report's routing per MoE layer: routed tokens per expert (min/median/max over the layer's
    experts; every Linear of an expert reports the same count) and the experts calibrated on a forced pass.
    Empty for a model without experts. (RTN records nothing: its report counts no token.)"""
    tokens: dict[str, dict[int, int]] = {}
    forced: dict[str, set[int]] = {}
    for entry in report:
        m = _EXPERT_NAME.match(entry["name"])
        if m is None or "tokens" not in entry:
            continue
        layer, e = m.group(1), int(m.group(2))
        tokens.setdefault(layer, {}).setdefault(e, entry["tokens"])
        if entry.get("forced"):
            forced.setdefault(layer, set()).add(e)
    layers = {layer: {"experts": len(counts), "tokens_min": min(counts.values()),
                      "tokens_median": statistics.median(counts.values()), "tokens_max": max(counts.values()),
                      "forced": sorted(forced.get(layer, ()))}
              for layer, counts in tokens.items()}
    return {"min_tokens": min_tokens, "layers": layers} if layers else {}


def summary_line(summary: dict) -> str:
    """One line for the CLI: routed tokens per expert over all MoE layers (min, the median of the layers' medians,
    max), and where the forced pass ran."""
    layers = summary["layers"].values()
    forced = {layer: info["forced"] for layer, info in summary["layers"].items() if info["forced"]}
    line = (f"MoE routing ({len(layers)} layers): tokens per expert min {min(i['tokens_min'] for i in layers)}, "
            f"median {statistics.median(i['tokens_median'] for i in layers):g}, "
            f"max {max(i['tokens_max'] for i in layers)}")
    if not forced:
        return line + f"; no expert below --moe-min-tokens {summary['min_tokens']}"
    where = "; ".join(f"{layer.removeprefix('model.')}: {', '.join(map(str, es))}" for layer, es in forced.items())
    return (line + f"; {sum(map(len, forced.values()))} experts below --moe-min-tokens {summary['min_tokens']} "
            f"calibrated on a forced-routing pass ({where})")
