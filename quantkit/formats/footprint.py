"""Bits a checkpoint stores per weight of a Linear W [N, K], by layout: the tensors formats/gptq.py, awq.py and
compressed_tensors.py write (a bias is no weight: not counted), with b bits, G = K / g groups (1 per-channel):

  gptq, gptq_v2       qweight b*N*K + qzeros b*G*N + scales 16*G*N + g_idx 32*K
  awq                 qweight b*N*K + qzeros b*G*N + scales 16*G*N
  compressed-tensors  weight_packed b*N*K + weight_scale 16*N*G + weight_shape 128 (+ weight_zero_point b*N*G asym)
  float               the checkpoint dtype's bits * N*K (a Linear left unquantized)

per weight: W4 g64 GPTQ = 4 + (16 + 4)/64 + 32/N = 4.3125 + 32/N; compressed-tensors symmetric = 4.25 + 128/(N*K);
W8 per-channel GPTQ = 8 + 24/K + 32/N. `stored_bits` counts the same from a written folder's tensors (the test holds
the two equal).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from quantkit.config import QuantScheme
from quantkit.formats.fused import on_disk_name


def linear_bits(layout: str, scheme: Optional[QuantScheme], n: int, k: int, float_bits: int = 16) -> int:
    """Bits stored for one Linear [N, K] at `scheme` (None: unquantized, `float_bits` per weight) in `layout`."""
    if scheme is None:
        return float_bits * n * k
    b, groups = scheme.bits, 1 if scheme.group_size == -1 else k // scheme.group_size
    if layout in ("gptq", "gptq_v2"):
        return b * n * k + (b + 16) * groups * n + 32 * k
    if layout == "awq":
        return b * n * k + (b + 16) * groups * n
    return b * n * k + 16 * n * groups + 128 + (0 if scheme.sym else b * n * groups)


def stored_bits(folder, linears: dict[str, tuple[int, int]], model_type: str) -> tuple[int, int]:
    """(bits the folder's tensors hold for `linears` {full name: (N, K)}, their weights sum N*K): each Linear's
    quantized tensors (every tensor of its module on disk but the bias; a module stored fused counts once) or its
    float `.weight`, in the bytes the safetensors files hold."""
    from quantkit.files import read_safetensors

    tensors = read_safetensors(Path(folder))
    modules = {on_disk_name(model_type, name) for name in linears}
    bits = 0
    for module in modules:
        parts = [t for key, t in tensors.items() if key.rpartition(".")[0] == module and not key.endswith(".bias")]
        bits += 8 * sum(t.numel() * t.element_size() for t in parts)
    return bits, sum(n * k for n, k in linears.values())
