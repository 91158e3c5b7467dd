"""Round-to-nearest as a calibration method: min/max qparams per group (quant/scheme.py), no data needed."""

from __future__ import annotations

from typing import Iterator

from torch import nn

from quantkit.config import QuantScheme
from quantkit.quant.scheme import QTensor, quantize_rtn


class RTN:
    name = "rtn"
    needs: tuple[str, ...] = ()  # no input statistics: the driver runs no forward pass
    true_sequential = False

    def __init__(self, scheme: QuantScheme):
        self.scheme = scheme

    def quantize_stage(self, block: nn.Module, names: list[str], stats: dict, prefix: str
                       ) -> Iterator[tuple[str, QTensor, dict]]:
        for name in names:
            weight = block.get_submodule(name).weight.detach().float()
            yield name, quantize_rtn(weight, self.scheme, layer=prefix + name), {}
