"""Checkpoint tensor names -> the model's module names, for checkpoints that store several Linears as one tensor.

Every family exposes the same per-Linear names to quantization and serving (q/k/v_proj, gate/up/down_proj, one set
per expert), so fused checkpoint tensors are split at load:
  Phi-3            <p>.self_attn.qkv_proj.weight [Hq*D + 2*Hkv*D, H] -> q_proj | k_proj | v_proj (rows in that order)
                   <p>.mlp.gate_up_proj.weight   [2I, H]             -> gate_proj | up_proj
  MoE (transformers 5's in-memory layout, `model.state_dict()` of its MoE models; save_pretrained writes the
  per-expert hub names, which need nothing; Qwen3-VL-MoE's hub files hold both transposed, [E, H, 2I] and
  [E, I, H], told apart by which dim is hidden_size):
                   <p>.mlp.experts.gate_up_proj  [E, 2I, H] -> <moe>.experts.{e}.<gate> | <up>   (rows [:I] | [I:])
                   <p>.mlp.experts.down_proj     [E, H, I]  -> <moe>.experts.{e}.<down>
                   <p>.mlp.gate.weight                      -> <moe>.gate.weight (Mixtral's moe is block_sparse_moe)

Families whose RoPE turns interleaved pairs (Cohere, GLM, ERNIE 4.5, Helium) have their q_proj / k_proj rows
reordered at load into rotate-half's order (`half_rope_rows`) and back at write (`pair_rope_rows`), so one RoPE
serves every path.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from quantkit.errors import QuantkitError


def split_rows(state: dict[str, torch.Tensor], fused: str, parts: dict[str, int]) -> dict[str, torch.Tensor]:
    """Every `<prefix>.<fused>.weight` [sum(parts), K] -> `<prefix>.<part>.weight` rows in `parts`' order."""
    out = {}
    for key, t in state.items():
        prefix, _, rest = key.rpartition(f".{fused}.")
        if not prefix or rest != "weight":
            out[key] = t
            continue
        for name, piece in zip(parts, torch.split(t, list(parts.values()))):
            out[f"{prefix}.{name}.weight"] = piece
    return out


_FUSED_EXPERTS = re.compile(
    r"^(?P<layer>.*\.layers\.\d+)\.mlp\.(?P<what>experts\.gate_up_proj|experts\.down_proj|gate\.weight)$")


def split_experts(state: dict[str, torch.Tensor], cfg, moe: str, gate: str, up: str, down: str
                  ) -> dict[str, torch.Tensor]:
    """transformers 5's fused 3-d experts (module docstring) -> per-expert `<layer>.<moe>.experts.{e}.<name>`."""
    out = {}
    for key, t in state.items():
        m = _FUSED_EXPERTS.match(key)
        if m is None:
            out[key] = t
            continue
        base = f"{m['layer']}.{moe}"
        if m["what"] == "gate.weight":
            out[f"{base}.gate.weight"] = t
            continue
        t = _experts_out_by_in(t, cfg.hidden_size, hidden_in=m["what"] == "experts.gate_up_proj")
        if m["what"] == "experts.down_proj":
            out.update({f"{base}.experts.{e}.{down}.weight": w for e, w in enumerate(t)})
        else:
            half = t.shape[1] // 2
            for e, w in enumerate(t):
                out[f"{base}.experts.{e}.{gate}.weight"], out[f"{base}.experts.{e}.{up}.weight"] = w[:half], w[half:]
    return out


def _experts_out_by_in(t: torch.Tensor, hidden: int, hidden_in: bool) -> torch.Tensor:
    """A 3-d experts tensor as [E, out, in] (hidden_size the in dim of gate_up_proj, the out dim of down_proj),
    transposed where stored the other way round. Square [E, n, n] is taken as stored [E, out, in] (transformers 5's
    layout; Qwen3-VL-MoE's transposed hub files are never square: 2I and I differ from hidden_size)."""
    out_dim, in_dim = t.shape[1:]
    stored_out_by_in = in_dim == hidden if hidden_in else out_dim == hidden
    return t if stored_out_by_in else t.transpose(1, 2)


_ROTATED = re.compile(r"\.self_attn\.(?P<proj>[qk])_proj\.(weight|bias)$")


def rope_row_order(key: str, cfg) -> Optional[torch.Tensor]:
    """For a q_proj / k_proj weight or bias (else None): the row order [heads * D] taking each head's interleaved
    RoPE pairs (x0, x1), (x2, x3), ... of its first R = cfg.rotary_dim dims to rotate-half's layout
    (x0, x2, ..., x_{R-2}, x1, x3, ..., x_{R-1}), the other D - R dims in place. q and k reordered alike keep every
    q.k, hence attention, unchanged; v and o are untouched."""
    m = _ROTATED.search(key)
    if m is None:
        return None
    d, r = cfg.head_dim, cfg.rotary_dim
    heads = cfg.num_attention_heads if m["proj"] == "q" else cfg.num_key_value_heads
    head = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)])
    return (head + d * torch.arange(heads)[:, None]).reshape(-1)


def half_rope_rows(state: dict[str, torch.Tensor], cfg, inverse: bool = False) -> dict[str, torch.Tensor]:
    """Checkpoint q_proj / k_proj rows (interleaved RoPE pairs) -> rotate-half order (`rope_row_order`); inverse:
    back to the checkpoint's order."""
    out = {}
    for key, t in state.items():
        order = rope_row_order(key, cfg)
        if order is not None:
            if t.shape[0] != order.numel():
                raise QuantkitError(f"tensor {key!r} has {t.shape[0]} rows where the config's heads x head_dim is "
                                    f"{order.numel()}")
            order = torch.argsort(order) if inverse else order
        out[key] = t if order is None else t[order]
    return out


def pair_rope_rows(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The model's q_proj / k_proj rows (rotate-half order) -> the checkpoint's interleaved pairs."""
    return half_rope_rows(state, cfg, inverse=True)
