"""AWQ GEMM layout (quant_method "awq", version "gemm"), as AutoAWQ writes it and vLLM/transformers read it.

Per Linear `<module>` with codes Q [N, K], zeros Z [N, G], scales S [N, G], 4 bits only:
  <module>.qweight  int32   [K, N / 8]  Q.T packed along N (dim 1) after the interleave ORDER within each 8 columns:
                                        nibble i of word [k, c] holds column 8c + ORDER[i]
  <module>.qzeros   int32   [G, N / 8]  Z.T, same interleave, true zeros (no minus-one)
  <module>.scales   float16 [G, N]      S.T
No g_idx: groups are contiguous runs of g input columns, so act-order with a non-monotonic g_idx cannot be stored.
Unpacking reads column 8c + j from nibble REVERSE[j] (REVERSE is ORDER's inverse permutation).
"""

from __future__ import annotations

import torch

from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.quant.scheme import QTensor, num_groups, pack, unpack

SUFFIXES = ("qweight", "qzeros", "scales")
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def _interleave(x: torch.Tensor, perm: tuple[int, ...]) -> torch.Tensor:
    """x [R, N] -> within each run of 8 columns, position i takes column perm[i]."""
    r, n = x.shape
    return x.reshape(r, n // 8, 8)[:, :, list(perm)].reshape(r, n)


def linear_tensors(qt: QTensor, module: str) -> dict[str, torch.Tensor]:
    """QTensor -> {suffix: tensor} for one Linear."""
    n, k = qt.shape
    if qt.bits != 4:
        raise QuantkitError(f"layer {module}: AWQ GEMM is 4-bit only ({qt.bits}-bit requested): use --format gptq_v2 or compressed-tensors")
    if qt.group_size == -1:
        raise QuantkitError(f"layer {module}: AWQ GEMM needs a group size (vLLM's AWQ loader has no per-channel form): use --group-size 32/64/128, or --format gptq_v2 or compressed-tensors")
    if qt.g_idx is not None:
        raise QuantkitError(f"layer {module}: AWQ GEMM has no g_idx, so act-order groups cannot be stored: use --format gptq_v2 or compressed-tensors, or static groups")
    if n % 8:
        raise QuantkitError(f"layer {module}: AWQ GEMM packs 8 output columns per int32, out_features {n} is not a multiple of 8")
    return {
        "qweight": pack(_interleave(qt.codes.T, ORDER), 4, dim=1),  # [K, N/8]
        "qzeros": pack(_interleave(qt.zeros.T, ORDER), 4, dim=1),  # [G, N/8]
        "scales": qt.scales.T.contiguous(),  # [G, N]
    }


def read_linear(t: dict[str, torch.Tensor], qcfg: dict, module: str) -> QTensor:
    """{suffix: tensor} of one Linear + quantization_config -> QTensor."""
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    group_size = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
    version = str(qcfg.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise QuantkitError(f"config.json quantization_config: AWQ {bits}-bit version {version!r} is not supported: quantkit reads 4-bit GEMM")
    if not qcfg.get("zero_point", True):
        raise QuantkitError("config.json quantization_config.zero_point=false: AWQ GEMM without zero points is not supported")
    for suffix in SUFFIXES:
        if suffix not in t:
            raise QuantkitError(f"layer {module}: tensor {module}.{suffix} is missing")
    k, words = t["qweight"].shape
    n = words * 8
    scales = t["scales"]  # [G, N]
    if tuple(scales.shape) != (num_groups(k, group_size), n):
        raise QuantkitError(f"layer {module}: scales {tuple(scales.shape)} do not match qweight {tuple(t['qweight'].shape)} at group_size {group_size}")
    codes = _interleave(unpack(t["qweight"], 4, dim=1, size=n), REVERSE).T.contiguous()  # [N, K]
    zeros = _interleave(unpack(t["qzeros"], 4, dim=1, size=n), REVERSE).T.contiguous()  # [N, G]
    sym = bool((zeros == 8).all())  # AWQ does not record symmetry; all-midpoint zeros are exactly the symmetric case
    return QTensor(codes, zeros, scales.T.to(torch.float16).contiguous(), None, 4, group_size, sym)


def quantization_config(scheme: QuantScheme, skipped: list[str]) -> dict:
    """config.json quantization_config for an AWQ GEMM checkpoint (keys vLLM's awq/awq_marlin read)."""
    return {
        "quant_method": "awq",
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(skipped) or None,
    }
