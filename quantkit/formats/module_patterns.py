"""Regexes that name a set of Linears in a checkpoint's per-module rules (GPTQ `dynamic` keys, compressed-tensors
config-group `targets`), so that every reader finds the same modules:

  GPTQModel / transformers / compressed-tensors / quantkit   re.match(pattern, module name), the names on disk
                                                              ("model.layers.3.self_attn.q_proj")
  vLLM                                                        re.match against the name of the module it builds,
                                                              which fuses q/k/v into `qkv_proj` and gate/up into
                                                              `gate_up_proj` (its packed_modules_mapping; gptq_utils
                                                              .get_dynamic_override, compressed_tensors
                                                              find_matched_target)
so a pattern names a fused module's parts and, when all its parts are in the set, the fused name too:
  {model.layers.0.self_attn.{q,k,v}_proj, model.layers.4.self_attn.{q,k,v}_proj}
      -> ^model\\.layers\\.(?:0|4)\\.self_attn\\.(?:k_proj|q_proj|qkv_proj|v_proj)$
Layers with the same parent path and the same module set share one pattern; a name outside a numbered layer list
gets an exact pattern. Every pattern is anchored at both ends: it matches nothing outside the set (and its fused
aliases).
"""

from __future__ import annotations

import re
from typing import Iterable

# vLLM's fused modules of a decoder layer -> their parts (the same in every dense family quantkit runs)
VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LAYERED = re.compile(r"(\D*\.)(\d+)\.(.+)\.([^.]+)")  # "model.layers." index "." parent "." child


def module_patterns(modules: Iterable[str]) -> list[str]:
    """Anchored regexes matching exactly `modules` (and the vLLM-fused names of fused sets wholly inside them)."""
    children: dict[tuple[str, int, str], set[str]] = {}  # (prefix, layer, parent) -> child names
    exact = []
    for name in sorted(set(modules)):
        m = _LAYERED.fullmatch(name)
        if m is None:
            exact.append(f"^{re.escape(name)}$")
            continue
        children.setdefault((m[1], int(m[2]), m[3]), set()).add(m[4])
    layers: dict[tuple[str, str, tuple[str, ...]], list[int]] = {}  # (prefix, parent, children + aliases) -> layers
    for (prefix, layer, parent), names in children.items():
        aliases = {fused for fused, parts in VLLM_FUSED.items() if set(parts) <= names}
        layers.setdefault((prefix, parent, tuple(sorted(names | aliases))), []).append(layer)
    grouped = [f"^{re.escape(prefix)}(?:{'|'.join(str(i) for i in sorted(idx))})\\.{re.escape(parent)}\\."
               f"(?:{'|'.join(re.escape(c) for c in names)})$" for (prefix, parent, names), idx in sorted(layers.items())]
    return grouped + exact
