"""Small validated dataclasses shared by the CLI, recipes and the library.

CLI flags and recipe YAML are two constructors of the same objects; validation lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import QuantkitError

LAYOUTS = ("gptq", "gptq_v2", "awq", "compressed-tensors")


@dataclass(frozen=True)
class QuantScheme:
    """Weight-only integer quantization of every Linear in the decoder blocks.

    bits: 4 or 8.  group_size: columns (input features) sharing one scale/zero, -1 = one group per row.
    sym: zero fixed at 2^(bits-1) (GPTQ / compressed-tensors convention) vs a searched zero point.
    act_order: GPTQ desc_act (columns processed by descending diag(H); g_idx non-monotonic unless static_groups).
    """

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = False
    static_groups: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise QuantkitError(f"bits={self.bits} is not supported: use 4 or 8")
        if self.group_size != -1 and (self.group_size < 1 or self.group_size % 8 != 0):
            raise QuantkitError(
                f"group_size={self.group_size} is not supported: use -1 (per-channel) or a multiple of 8 such as 32, 64, 128"
            )

    @property
    def pack_factor(self) -> int:
        """Codes per int32 word."""
        return 32 // self.bits

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def groups(self, in_features: int, layer: str = "") -> int:
        """Number of groups G for a Linear with `in_features` columns; errors when g does not divide K."""
        if self.group_size == -1:
            return 1
        if in_features % self.group_size != 0:
            raise QuantkitError(
                f"group_size={self.group_size} does not divide in_features={in_features} of layer {layer or '?'}: "
                f"choose a group size that divides {in_features} (e.g. 32 or 64) or -1 for per-channel"
            )
        return in_features // self.group_size

    def group_of(self, in_features: int) -> int:
        """The effective group length (K itself for per-channel)."""
        return in_features if self.group_size == -1 else self.group_size

    def name(self) -> str:
        g = "ch" if self.group_size == -1 else f"g{self.group_size}"
        return f"w{self.bits}{g}{'' if self.sym else '-asym'}{'-act' if self.act_order else ''}"
