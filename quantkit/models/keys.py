"""Checkpoint tensor names -> the model's module names, for checkpoints that store several Linears as one tensor.

Every family exposes the same per-Linear names to quantization and serving (q/k/v_proj, gate/up/down_proj, one set
per expert), so fused checkpoint tensors are split at load:
  Phi-3            <p>.self_attn.qkv_proj.weight [Hq*D + 2*Hkv*D, H] -> q_proj | k_proj | v_proj (rows in that order)
                   <p>.mlp.gate_up_proj.weight   [2I, H]             -> gate_proj | up_proj
  MoE (transformers 5's in-memory layout, `model.state_dict()` of its MoE models; save_pretrained writes the
  per-expert hub names, which need nothing):
                   <p>.mlp.experts.gate_up_proj  [E, 2I, H] -> <moe>.experts.{e}.<gate> | <up>   (rows [:I] | [I:])
                   <p>.mlp.experts.down_proj     [E, H, I]  -> <moe>.experts.{e}.<down>
                   <p>.mlp.gate.weight                      -> <moe>.gate.weight (Mixtral's moe is block_sparse_moe)
"""

from __future__ import annotations

import re

import torch


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


def split_experts(state: dict[str, torch.Tensor], moe: str, gate: str, up: str, down: str) -> dict[str, torch.Tensor]:
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
        elif m["what"] == "experts.down_proj":
            out.update({f"{base}.experts.{e}.{down}.weight": w for e, w in enumerate(t)})
        else:
            half = t.shape[1] // 2
            for e, w in enumerate(t):
                out[f"{base}.experts.{e}.{gate}.weight"], out[f"{base}.experts.{e}.{up}.weight"] = w[:half], w[half:]
    return out
