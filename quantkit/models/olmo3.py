"""OLMo 3 (model_type olmo3): OLMo 2's block with three sliding layers to one full (config.layer_types, else layer
i slides unless (i + 1) % 4 == 0, over config.sliding_window, default 4096); RoPE base 5e5, its scaling (YaRN in the
long-context checkpoints) on the full layers only, the sliding layers' RoPE unscaled."""

from __future__ import annotations

from quantkit.models.config import every_nth_full, per_layer_type_rope, windowed
from quantkit.models.family import Family, register
from quantkit.models.olmo2 import OLMO2


def parse(hf: dict, where: str) -> dict:
    return {**windowed(every_nth_full(hf, 4), hf.get("sliding_window", 4096)),
            **per_layer_type_rope(hf, where, default_theta=5e5, local_default=None)}


OLMO3 = register(Family("OLMo 3", ("olmo3",), parse=parse, decoder=OLMO2.decoder, norm=OLMO2.norm, qk_norm=True,
                        qk_norm_whole=True))
