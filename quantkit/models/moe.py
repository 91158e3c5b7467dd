"""The sparse MoE block: a router picks top-k experts per token, each expert a separate module run once per forward
on exactly the tokens routed to it.

Tokens are grouped by expert (one argsort of the T * k choices, one bincount), so each active expert is one
index_select -> expert -> weighted index_add: the expert's Linears (nn.Linear or QLinear) see only their tokens,
which is what calibration hooks on them record. The router `gate` is a plain nn.Linear (a BiasedRouter: fp32
logits): it is never quantized (a rounding flip would send tokens to other experts). `select` turns its logits into
each token's experts and weights: softmax top-k (MoE), GLM-4.5's grouped sigmoid (GroupedTopKMoE) or ERNIE 4.5's
bias-corrected softmax (CorrectedSoftmaxMoE).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    """softmax over the router logits (fp32) -> top-k; normalize: the k weights rescaled to sum to 1 (Mixtral
    always, which equals a softmax over the top-k logits; Qwen when norm_topk_prob); fp32_weights: the weights stay
    fp32 when multiplying the expert outputs (Mixtral) instead of the model dtype (Qwen), as in HF. gate: the
    router (default a bias-free nn.Linear); shared_experts: an MLP every token also runs, added after the routed
    experts' sum (GLM-4.5, ERNIE 4.5), or None."""

    def __init__(self, hidden: int, experts: list[nn.Module], top_k: int, normalize: bool, fp32_weights: bool,
                 gate: Optional[nn.Module] = None, shared_experts: Optional[nn.Module] = None):
        super().__init__()
        self.gate = gate if gate is not None else nn.Linear(hidden, len(experts), bias=False)
        self.experts = nn.ModuleList(experts)
        self.shared_experts = shared_experts
        self.top_k, self.normalize, self.fp32_weights = top_k, normalize, fp32_weights

    def select(self, logits: torch.Tensor, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """router logits [..., E] -> (weights [T, k], experts [T, k] int64) over the T flattened tokens; the weights
        in `dtype` (the hidden states'; default the logits') unless fp32_weights."""
        logits = logits.reshape(-1, logits.shape[-1])
        top, chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top if self.fp32_weights else top.to(dtype or logits.dtype)), chosen

    def groups(self, chosen: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """chosen [T, k] -> (expert e, its tokens [n] ascending, their slots [n] in chosen.flatten()) for every
        expert with n > 0 tokens, in expert order (one host sync for the counts)."""
        flat = chosen.reshape(-1)  # slot s: token s // k, its (s % k)-th choice
        order = flat.argsort(stable=True)
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if n:
                slots = order[start:start + n]
                yield e, slots // self.top_k, slots
            start += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [*lead, H] -> [*lead, H]: routed(x) [+ shared_experts(x)]."""
        out = self.routed(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """x [*lead, H] -> [*lead, H]: sum over each token's k experts of weight * expert(x) (a serving runner may
        override it with fused kernels: serve/moe_fusion.py, serve/cpu_moe.py)."""
        weights, chosen = self.select(self.gate(x), x.dtype)
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        out = torch.zeros_like(flat)
        weights = weights.reshape(-1)  # [T * k]
        for e, tokens, slots in self.groups(chosen):
            y = self.experts[e](flat.index_select(0, tokens))  # [n, H]
            out.index_add_(0, tokens, (y * weights[slots, None]).to(out.dtype))
        return out.view(x.shape)


def routed_share(top_k: int, experts: int, tokens: int) -> float:
    """The expected share of a block's experts that `tokens` tokens route to when each picks top_k of them
    uniformly: 1 - (1 - top_k / experts) ** tokens (exactly top_k / experts for one token)."""
    return 1.0 - (1.0 - top_k / experts) ** tokens


class BiasedRouter(nn.Linear):
    """The router of GLM-4.5 and ERNIE 4.5 MoE: logits in fp32 (x and the weight widened, as transformers computes
    them) and the e_score_correction_bias (E values, stored [E], or ERNIE's [1, E]) that shifts the scores experts
    are chosen by (not their weights); the loader keeps both tensors fp32 in any model dtype (Family.fp32_tensors),
    as transformers does."""

    def __init__(self, hidden: int, experts: int, bias_shape: tuple[int, ...]):
        super().__init__(hidden, experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(bias_shape))

    @property
    def score_bias(self) -> torch.Tensor:
        """e_score_correction_bias as fp32 [E]."""
        return self.e_score_correction_bias.float().reshape(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class GroupedTopKMoE(MoE):
    """GLM-4.5's MoE (DeepSeek-V3's routing): scores = sigmoid(logits); the experts fall in `groups` groups, each
    group ranked by the sum of its two best biased scores (score + e_score_correction_bias), the experts of the best
    `topk_groups` groups eligible; the top-k eligible biased scores choose the experts, weighted by their unbiased
    scores (renormalised to sum 1 + 1e-20 with `normalize`) times `scaling`, in fp32."""

    def __init__(self, hidden: int, experts: list[nn.Module], top_k: int, normalize: bool, groups: int,
                 topk_groups: int, scaling: float, shared_experts: nn.Module):
        super().__init__(hidden, experts, top_k, normalize, True, BiasedRouter(hidden, len(experts), (len(experts),)),
                         shared_experts)
        self.n_groups, self.topk_groups, self.scaling = groups, topk_groups, scaling

    def select(self, logits: torch.Tensor, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.reshape(-1, logits.shape[-1]).float().sigmoid()  # [T, E]
        biased = scores + self.gate.score_bias
        t, e = biased.shape
        group_rank = biased.view(t, self.n_groups, e // self.n_groups).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        best_groups = group_rank.topk(self.topk_groups, dim=-1)[1]
        eligible = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, best_groups, True)
        biased = biased.masked_fill(~eligible.repeat_interleave(e // self.n_groups, dim=1), float("-inf"))
        chosen = biased.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class CorrectedSoftmaxMoE(MoE):
    """ERNIE 4.5's MoE: softmax over the fp32 router logits; the top-k of softmax + e_score_correction_bias choose
    the experts, weighted by their softmax values divided by max(their sum, norm_min), in the hidden dtype."""

    def __init__(self, hidden: int, experts: list[nn.Module], top_k: int, norm_min: float,
                 shared_experts: Optional[nn.Module]):
        super().__init__(hidden, experts, top_k, True, False, BiasedRouter(hidden, len(experts), (1, len(experts))),
                         shared_experts)
        self.norm_min = norm_min

    def select(self, logits: torch.Tensor, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)  # [T, E]
        chosen = (probs + self.gate.score_bias).topk(self.top_k, dim=-1)[1]
        weights = probs.gather(1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return weights.to(dtype or logits.dtype), chosen
