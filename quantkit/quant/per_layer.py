"""Per-layer schemes as one calibration method of the driver (quant/calibrate.py's interface: `needs`,
`true_sequential`, `quantize_stage`).

Each stage's Linears go to the method built for their own scheme (`CalibConfig.scheme_of`, one method object per
distinct scheme); a Linear whose scheme is None is not yielded, so the driver leaves it an nn.Linear computing with
its float weight (and later stages see its float output). The mixes quant/mixed_precision.py plans give every
Linear of one input (q/k/v, gate/up) one scheme, so no Hessian is shared across two schemes' methods.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

from torch import nn

from quantkit.config import CalibConfig, QuantScheme
from quantkit.quant.scheme import QTensor


class PerLayerSchemes:
    def __init__(self, cfg: CalibConfig, build: Callable[[CalibConfig], object]):
        """build: CalibConfig without layer_schemes -> the method for its one scheme (calibrate.make_method)."""
        self.cfg, self.build = cfg, build
        self.methods: dict[QuantScheme, object] = {}
        first = self.method(cfg.scheme)
        self.name, self.needs, self.true_sequential = first.name, first.needs, first.true_sequential

    def method(self, scheme: QuantScheme):
        if scheme not in self.methods:
            self.methods[scheme] = self.build(dataclasses.replace(self.cfg, scheme=scheme, layer_schemes=None))
        return self.methods[scheme]

    def quantize_stage(self, block: nn.Module, names: list[str], stats: dict, prefix: str
                       ) -> Iterator[tuple[str, QTensor, dict]]:
        by_scheme: dict[QuantScheme, list[str]] = {}
        for name in names:
            scheme = self.cfg.scheme_of(prefix + name)
            if scheme is not None:
                by_scheme.setdefault(scheme, []).append(name)
        for scheme, part in by_scheme.items():
            for name, qt, info in self.method(scheme).quantize_stage(block, part, stats, prefix):
                yield name, qt, {**info, "scheme": scheme.precision_name()}
