"""compressed-tensors "pack-quantized" layout (quant_method "compressed-tensors"), as llm-compressor writes it.

Per Linear `<module>` with codes Q [N, K], zeros Z [N, G], scales S [N, G], p = 32 / bits:
  <module>.weight_packed      int32   [N, K / p]  Q packed along K (dim 1), sequential (= GPTQ qweight transposed);
                                                  compressed-tensors thinks of signed codes Q - 2^(b-1) packed with
                                                  +2^(b-1), which is the same bits
  <module>.weight_scale       float16 [N, G]      S
  <module>.weight_shape       int64   [2]         [N, K]
  <module>.weight_zero_point  int32   [N / p, G]  Z packed along N (dim 0); asymmetric only (symmetric: Z = 2^(b-1))
  <module>.weight_g_idx       int32   [K]         read only: older llm-compressor act-order ("actorder": "group")
compressed-tensors 0.20 removed "group" act-order (its config validation now rejects it, and transformers/vLLM parse
configs with it), so act-order with a non-monotonic g_idx is refused here; static groups ("actorder": "weight") are
plain contiguous groups and are written. weight_scale is written in float16 whatever the model dtype, so the stored scales are exactly those the codes were
fitted to (readers cast it to the model dtype on load).
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.quant.scheme import QTensor, canonical_g_idx, num_groups, pack, unpack

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
FORMAT_VERSION = "0.12.2"  # the compressed-tensors release whose pack-quantized layout this follows


def linear_tensors(qt: QTensor, module: str) -> dict[str, torch.Tensor]:
    """QTensor -> {suffix: tensor} for one Linear."""
    n, k = qt.shape
    mid = 1 << (qt.bits - 1)
    if qt.g_idx is not None:
        raise QuantkitError(
            f"layer {module}: compressed-tensors 0.20+ rejects act-order groups with a g_idx (actorder='group'): "
            f"use --format gptq or gptq_v2, or act-order with static groups"
        )
    if qt.sym and not bool((qt.zeros == mid).all()):
        raise QuantkitError(f"layer {module}: marked symmetric but its zero points are not all {mid}")
    out = {
        "weight_packed": pack(qt.codes, qt.bits, dim=1),  # [N, K/p]
        "weight_scale": qt.scales.contiguous(),  # [N, G]
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not qt.sym:
        out["weight_zero_point"] = pack(qt.zeros, qt.bits, dim=0)  # [N/p, G]
    return out


def read_linear(t: dict[str, torch.Tensor], qcfg: dict, module: str) -> QTensor:
    """{suffix: tensor} of one Linear + quantization_config -> QTensor (weights args of the group targeting it)."""
    args = weight_args(qcfg, module)
    bits, sym = int(args.get("num_bits", 4)), bool(args.get("symmetric", True))
    if args.get("type", "int") != "int" or bits not in (4, 8):
        raise QuantkitError(f"layer {module}: compressed-tensors weights {args.get('type')} {bits}-bit are not supported: quantkit reads int 4/8-bit")
    strategy = args.get("strategy", "group")
    if strategy not in ("group", "channel"):
        raise QuantkitError(f"layer {module}: compressed-tensors strategy {strategy!r} is not supported: quantkit reads group and channel")
    group_size = -1 if strategy == "channel" else int(args["group_size"])
    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
        if suffix not in t:
            raise QuantkitError(f"layer {module}: tensor {module}.{suffix} is missing")
    n, k = (int(v) for v in t["weight_shape"].tolist())
    scales = t["weight_scale"].reshape(n, -1)  # [N, G] (channel strategy stores [N, 1])
    if scales.shape[1] != num_groups(k, group_size):
        raise QuantkitError(f"layer {module}: weight_scale {tuple(scales.shape)} does not match weight_shape [{n}, {k}] at group_size {group_size}")
    codes = unpack(t["weight_packed"], bits, dim=1, size=k)  # [N, K]
    if "weight_zero_point" in t and not sym:
        zeros = unpack(t["weight_zero_point"], bits, dim=0, size=n)  # [N, G]
    elif sym:
        zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.uint8)
    else:
        raise QuantkitError(f"layer {module}: asymmetric scheme but tensor {module}.weight_zero_point is missing")
    g_idx = canonical_g_idx(t.get("weight_g_idx"), k, group_size)
    return QTensor(codes, zeros, scales.to(torch.float16).contiguous(), g_idx, bits, group_size, sym)


def weight_args(qcfg: dict, module: str) -> dict:
    """The `weights` args of the config group whose targets match `module` ("Linear" matches every Linear)."""
    groups = qcfg.get("config_groups") or {}
    for name, group in groups.items():
        for target in group.get("targets", ["Linear"]):
            if target == "Linear" or target == module or (target.startswith("re:") and re.match(target[3:], module)):
                if not group.get("weights"):
                    raise QuantkitError(f"config.json quantization_config.config_groups.{name}: no weights args")
                if group.get("input_activations"):
                    raise QuantkitError(f"config.json quantization_config.config_groups.{name}: activation quantization is not supported (weight-only)")
                return group["weights"]
    raise QuantkitError(f"layer {module}: no config_groups entry of config.json quantization_config targets it")


def quantization_config(scheme: QuantScheme, skipped: list[str],
                        per_module: Optional[dict[str, QuantScheme]] = None) -> dict:
    """config.json quantization_config for a pack-quantized checkpoint (what llm-compressor writes, vLLM reads).
    per_module (a mix of schemes): every quantized module's scheme, one config group per scheme (`mixed_groups`)."""
    cfg = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _weights_args(scheme),
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", *skipped],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "version": FORMAT_VERSION,
    }
    if per_module is not None:
        cfg["config_groups"] = mixed_groups(per_module)
    return cfg


def mixed_groups(per_module: dict[str, QuantScheme]) -> dict[str, dict]:
    """One config group per scheme (in bits, group size order), its `targets` "re:" patterns naming exactly its
    modules (and vLLM's fused qkv_proj / gate_up_proj when all their parts are in it: formats/module_patterns.py).
    No "Linear" target: some vLLM versions match a module's class name before its fused parts' names, so a
    catch-all group would claim every qkv_proj."""
    from quantkit.formats.module_patterns import module_patterns

    by_scheme: dict[QuantScheme, list[str]] = {}
    for module, s in per_module.items():
        by_scheme.setdefault(s, []).append(module)
    ordered = sorted(by_scheme.items(), key=lambda item: (item[0].bits, item[0].group_size))
    return {f"group_{i}": {"targets": [f"re:{p}" for p in module_patterns(modules)], "weights": _weights_args(s),
                           "input_activations": None, "output_activations": None}
            for i, (s, modules) in enumerate(ordered)}


def _weights_args(scheme: QuantScheme) -> dict:
    return {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.sym,
        "strategy": "channel" if scheme.group_size == -1 else "group",
        "group_size": None if scheme.group_size == -1 else scheme.group_size,
        "actorder": "weight" if scheme.act_order else None,  # only static groups reach here
        "dynamic": False,
        "observer": "minmax",
        "observer_kwargs": {},
        "block_structure": None,
    }
