"""GPTQ layout (quant_method "gptq"), format v1 (checkpoint_format "gptq") and v2 ("gptq_v2").

Per Linear `<module>` with codes Q [N, K], zeros Z [N, G], scales S [N, G], p = 32 / bits:
  <module>.qweight  int32   [K / p, N]  Q.T packed along K (dim 0), sequential
  <module>.qzeros   int32   [G, N / p]  Z.T packed along N (dim 1), sequential; v1 stores Z - 1 (readers add 1)
  <module>.scales   float16 [G, N]      S.T
  <module>.g_idx    int32   [K]         group of each input column (k // g unless act-order)
v1 cannot hold a zero point of 0 (Z - 1 underflows into the neighbouring field), so it is written for symmetric
schemes only (Z = 2^(b-1): every 4-bit qzeros word is 0x77777777, every 8-bit word 0x7F7F7F7F).
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.formats.fused import on_disk_name
from quantkit.quant.scheme import QTensor, canonical_g_idx, num_groups, pack, unpack

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
CHECKPOINT_FORMATS = {"gptq": "gptq", "gptq_v2": "gptq_v2"}  # quantkit layout -> checkpoint_format


def linear_tensors(qt: QTensor, module: str, v1: bool) -> dict[str, torch.Tensor]:
    """QTensor -> {suffix: tensor} for one Linear (suffixes as in SUFFIXES)."""
    n, k = qt.shape
    p = 32 // qt.bits
    if v1 and (not qt.sym or bool((qt.zeros == 0).any())):
        raise QuantkitError(
            f"layer {module}: GPTQ v1 (--format gptq) stores zero-1 and cannot hold asymmetric zero points "
            f"(a zero of 0 underflows and corrupts its neighbours): use --format gptq_v2, awq or compressed-tensors, "
            f"or --sym"
        )
    if k % p or n % p:
        raise QuantkitError(f"layer {module}: GPTQ packs {p} codes per int32, so in/out features ({k}, {n}) must be multiples of {p}")
    zeros = qt.zeros.to(torch.int64) - (1 if v1 else 0)  # [N, G]; v1 symmetric zeros are >= 1
    return {
        "qweight": pack(qt.codes.T, qt.bits, dim=0),  # [K/p, N]
        "qzeros": pack(zeros.T, qt.bits, dim=1),  # [G, N/p]
        "scales": qt.scales.T.contiguous(),  # [G, N]
        "g_idx": qt.group_index().to(torch.int32),  # [K]
    }


def read_linear(t: dict[str, torch.Tensor], qcfg: dict, module: str) -> QTensor:
    """{suffix: tensor} of one Linear + quantization_config -> QTensor (v1 or v2 by checkpoint_format)."""
    qcfg = module_config(qcfg, module)
    bits, group_size, v1 = _bits(qcfg), int(qcfg.get("group_size", -1)), checkpoint_format(qcfg) == "gptq"
    for suffix in ("qweight", "qzeros", "scales"):
        if suffix not in t:
            raise QuantkitError(f"layer {module}: tensor {module}.{suffix} is missing")
    p = 32 // bits
    scales = t["scales"]  # [G, N]
    groups, n = scales.shape
    k = t["qweight"].shape[0] * p
    if "g_idx" in t and t["g_idx"].numel() != k:
        raise QuantkitError(f"layer {module}: g_idx has {t['g_idx'].numel()} entries, qweight implies {k} input features")
    if groups != num_groups(k, group_size):
        raise QuantkitError(f"layer {module}: scales have {groups} groups, group_size {group_size} over {k} inputs needs {num_groups(k, group_size)}")
    codes = unpack(t["qweight"], bits, dim=0, size=k).T.contiguous()  # [N, K]
    zeros = unpack(t["qzeros"], bits, dim=1, size=n)  # [G, N]
    if v1:
        zeros = ((zeros.to(torch.int64) + 1) & ((1 << bits) - 1)).to(torch.uint8)
    g_idx = canonical_g_idx(t.get("g_idx"), k, group_size)
    return QTensor(codes, zeros.T.contiguous(), scales.T.to(torch.float16).contiguous(), g_idx, bits, group_size,
                   bool(qcfg.get("sym", True)))


def module_config(qcfg: dict, module: str) -> dict:
    """quantization_config with `module`'s `dynamic` override applied (GPTQModel's rule, which vLLM follows: the first
    key whose regex re.match-es the name; "+:" or no prefix overrides bits / group_size / sym / desc_act, "-:" leaves
    the module unquantized)."""
    for key, override in (qcfg.get("dynamic") or {}).items():
        negative = key.startswith("-:")
        if not re.match(key[2:] if key.startswith(("-:", "+:")) else key, module):
            continue
        if negative:
            raise QuantkitError(f"layer {module}: config.json quantization_config.dynamic {key!r} marks it "
                                f"unquantized, but the checkpoint holds {module}.qweight")
        keys = ("bits", "group_size", "sym", "desc_act")
        return {**qcfg, **{k: override[k] for k in keys if k in (override or {})}}
    return qcfg


def checkpoint_format(qcfg: dict) -> str:
    fmt = qcfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantkitError(f"config.json quantization_config.checkpoint_format {fmt!r} is not supported: quantkit reads gptq and gptq_v2")
    return fmt


def _bits(qcfg: dict) -> int:
    bits = int(qcfg.get("bits", 0))
    if bits not in (4, 8):
        raise QuantkitError(f"config.json quantization_config.bits={bits} is not supported: quantkit reads 4 or 8 bit GPTQ")
    return bits


def quantization_config(scheme: QuantScheme, layout: str, model_type: str, skipped: list[str],
                        damp_percent: Optional[float] = None,
                        per_module: Optional[dict[str, QuantScheme]] = None) -> dict:
    """config.json quantization_config for a GPTQ checkpoint (keys vLLM's gptq/gptq_marlin and GPTQModel read).
    per_module (a mix of schemes): every quantized module's scheme; `scheme` is the top-level one and the others
    are `dynamic` overrides (`mixed_dynamic`)."""
    from quantkit import __version__
    from quantkit.models.registry import arch_spec

    cfg = {
        "quant_method": "gptq",
        "checkpoint_format": CHECKPOINT_FORMATS[layout],
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "desc_act": scheme.act_order and not scheme.static_groups,  # static groups keep g_idx = k // g: no reorder
        "sym": scheme.sym,
        "static_groups": scheme.static_groups,
        "true_sequential": True,
        "lm_head": False,
        "pack_dtype": "int32",
        "modules_in_block_to_quantize": modules_in_block(arch_spec(model_type).sequential, model_type),
        "meta": {"quantizer": [f"quantkit:{__version__}"]},
    }
    if damp_percent is not None:
        cfg["damp_percent"] = damp_percent
    if per_module is not None:
        cfg["dynamic"] = mixed_dynamic(scheme, per_module, skipped)
    elif skipped:  # GPTQModel/vLLM per-module override: "-:" = leave this module unquantized
        cfg["dynamic"] = {f"-:^{re.escape(name)}$": {} for name in skipped}
    return cfg


def mixed_dynamic(base: QuantScheme, per_module: dict[str, QuantScheme], skipped: list[str]) -> dict[str, dict]:
    """GPTQModel's `dynamic` for a mix: "-:" keys naming the unquantized Linears, then one "+:" key per scheme other
    than `base` naming its modules (bits and group_size; symmetry and act-order are the checkpoint's). The regexes
    (formats/module_patterns.py) also match vLLM's fused qkv_proj / gate_up_proj names."""
    from quantkit.formats.module_patterns import module_patterns

    dynamic: dict[str, dict] = {f"-:{p}": {} for p in module_patterns(skipped)}
    by_scheme: dict[QuantScheme, list[str]] = {}
    for module, s in per_module.items():
        if s != base:
            by_scheme.setdefault(s, []).append(module)
    for s, modules in sorted(by_scheme.items(), key=lambda item: (item[0].bits, item[0].group_size)):
        dynamic.update({f"+:{p}": {"bits": s.bits, "group_size": s.group_size} for p in module_patterns(modules)})
    return dynamic


def modules_in_block(sequential: tuple[tuple[str, ...], ...], model_type: str) -> list[list[str]]:
    """The registry's stages as GPTQ's modules_in_block_to_quantize. Readers match these as suffixes of the module
    names (optimum/transformers: name.endswith), so an expert template `mlp.experts.{e}.gate_proj` is written as its
    part inside the expert, `gate_proj`, which every expert's name ends with (and no router's: `mlp.gate`). Linears
    stored fused (Phi-3's q/k/v -> qkv_proj, formats/fused.py) are listed under the fused module's name."""
    from quantkit.models.registry import EXPERT

    return [list(dict.fromkeys(on_disk_name(model_type, name.rpartition(f"{EXPERT}.")[2]) for name in stage))
            for stage in sequential]
