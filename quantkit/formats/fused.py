"""Quantized Linears a family's checkpoints store as one module: written fused, read back per Linear.

quantkit quantizes one Linear per projection (q/k/v_proj, gate/up_proj), but Phi-3's checkpoints, and the Phi-3
modules of transformers and vLLM that load them, have one `self_attn.qkv_proj` (rows q | k | v) and one
`mlp.gate_up_proj` (rows gate | up); GLM's have that gate_up_proj. A quantized folder must use the loading runtime's
module names, so the parts' QTensors are concatenated along N (codes, zeros and scales are all row-major in N; the
parts share their input, so their g_idx is one) and written under the fused name. Reading splits them again by the
family's own `split` (the one place the row sizes live, quantkit/models/keys.py), so a fused folder written by
GPTQModel reads the same way.
"""

from __future__ import annotations

from typing import Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.quant.scheme import QTensor

Entry = tuple[QTensor, Optional[torch.Tensor]]  # (QTensor, bias or None) of one quantized Linear

# model_type -> (fused name, its parts in row order), names relative to the Linears' common parent module
_GATE_UP = ("gate_up_proj", ("gate_proj", "up_proj"))
FUSED_ON_DISK: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "phi3": (("qkv_proj", ("q_proj", "k_proj", "v_proj")), _GATE_UP),
    "glm": (_GATE_UP,),
    "glm4": (_GATE_UP,),
}


def on_disk_name(model_type: str, name: str) -> str:
    """A Linear's name in the checkpoint: its fused module's name when the family fuses it, else its own."""
    parent, dot, child = name.rpartition(".")
    for fused, parts in FUSED_ON_DISK.get(model_type, ()):
        if child in parts:
            return f"{parent}{dot}{fused}"
    return name


def fuse(model_type: str, entries: dict[str, Entry]) -> dict[str, Entry]:
    """{Linear name: entry} -> {checkpoint module name: entry}, each fused group's parts concatenated along N."""
    groups: dict[str, list[str]] = {}
    for name in entries:
        groups.setdefault(on_disk_name(model_type, name), []).append(name)
    out = {}
    for target, names in groups.items():
        if names == [target]:
            out[target] = entries[target]
            continue
        parent = target.rpartition(".")[0]
        parts = dict(FUSED_ON_DISK[model_type])[target.rpartition(".")[2]]
        ordered = [f"{parent}.{p}" if parent else p for p in parts]
        if sorted(ordered) != sorted(names):
            raise QuantkitError(f"layer {target}: the checkpoint stores {', '.join(parts)} as one module, but only "
                                f"{', '.join(sorted(names))} are quantized: quantize all of them or none")
        out[target] = _concat(target, [entries[n] for n in ordered])
    return out


def split(hf_config: dict, entries: dict[str, Entry]) -> dict[str, Entry]:
    """{checkpoint module name: entry} -> {Linear name: entry}: every fused module cut into its parts' rows, the
    rows of each in the model's order (the family's model_tensors, applied to row indices)."""
    return _mapped_rows(hf_config, entries, to_checkpoint=False)


def as_stored(hf_config: dict, entries: dict[str, Entry]) -> dict[str, Entry]:
    """{Linear name: entry} -> the same Linears under the checkpoint's names, rows in its order (the family's
    checkpoint_tensors applied to row indices): `split`'s inverse but for the fusing, which `fuse` does."""
    return _mapped_rows(hf_config, entries, to_checkpoint=True)


def _mapped_rows(hf_config: dict, entries: dict[str, Entry], to_checkpoint: bool) -> dict[str, Entry]:
    from quantkit.models.config import ModelConfig
    from quantkit.models.family import FAMILIES

    family = FAMILIES.get(hf_config.get("model_type"))
    if family is None or family.stored_as_built:
        return entries  # the loader refuses an unknown model_type with the list of those it runs
    cfg = ModelConfig.from_hf(hf_config)
    mapping = family.checkpoint_tensors if to_checkpoint else family.model_tensors
    out = {}
    for name, (qt, bias) in entries.items():
        rows = torch.arange(qt.shape[0])
        for key, index in mapping({f"{name}.weight": rows}, cfg).items():  # its weight -> the rows of each part
            out[key.removesuffix(".weight")] = (qt, bias) if index is rows else take_rows(qt, bias, index)
    return out


def take_rows(qt: QTensor, bias: Optional[torch.Tensor], index: torch.Tensor) -> Entry:
    """The entry of output rows `index` of (qt, bias); g_idx, which indexes input columns, is shared."""
    part = QTensor(qt.codes[index].contiguous(), qt.zeros[index].contiguous(), qt.scales[index].contiguous(),
                   qt.g_idx, qt.bits, qt.group_size, qt.sym)
    return part, None if bias is None else bias[index].contiguous()


def _concat(target: str, entries: list[Entry]) -> Entry:
    first = entries[0][0]
    for qt, _ in entries[1:]:
        if (qt.bits, qt.group_size, qt.sym, qt.shape[1]) != (first.bits, first.group_size, first.sym, first.shape[1]):
            raise QuantkitError(f"layer {target}: its parts differ in scheme or in_features and cannot be fused")
        if not _same_g_idx(qt.g_idx, first.g_idx):
            raise QuantkitError(f"layer {target}: its parts have different act-order g_idx, so one fused module "
                                f"cannot hold them: quantize them from one Hessian (same input) or without act-order")
    biases = [b for _, b in entries]
    if any(b is None for b in biases) != all(b is None for b in biases):
        raise QuantkitError(f"layer {target}: some of its parts have a bias and some do not")
    qt = QTensor(torch.cat([e[0].codes for e in entries]), torch.cat([e[0].zeros for e in entries]),
                 torch.cat([e[0].scales for e in entries]), first.g_idx, first.bits, first.group_size, first.sym)
    return qt, None if biases[0] is None else torch.cat(biases)


def _same_g_idx(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)
