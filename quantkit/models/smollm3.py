"""SmolLM3: Llama whose NoPE layers skip RoPE (config.no_rope_layers, per layer 1 = RoPE, 0 = none; absent: every
no_rope_layer_interval-th layer, default 4, is NoPE), RoPE base 2e6 and tied embeddings by default. With
use_sliding_window and a sliding_window, the NoPE layers slide; config.layer_types, where given, says which layers
slide over sliding_window (as transformers' masks do)."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.config import FULL, SLIDING, windowed
from quantkit.models.family import Family, register


def parse(hf: dict, where: str) -> dict:
    n = hf["num_hidden_layers"]
    uses_rope = hf.get("no_rope_layers")
    if uses_rope is None:
        interval = hf.get("no_rope_layer_interval", 4)
        uses_rope = [int((i + 1) % interval != 0) for i in range(n)]
    if len(uses_rope) < n:
        raise QuantkitError(f"{where}: no_rope_layers has {len(uses_rope)} entries for {n} layers")
    window = hf.get("sliding_window")
    slides = bool(hf.get("use_sliding_window")) and window is not None
    types = hf.get("layer_types") or [SLIDING if slides and not uses_rope[i] else FULL for i in range(n)]
    return {"nope_layers": tuple(i for i in range(n) if not uses_rope[i]), **windowed(types, window)}


SMOLLM3 = register(Family("SmolLM3", ("smollm3",), parse=parse, tied=True, rope_theta=2e6))
