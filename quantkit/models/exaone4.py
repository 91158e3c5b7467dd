"""EXAONE 4.0 (model_type exaone4; LG AI EXAONE-4.0-1.2B / 32B): OLMo 2's post-norm block (no input norms) with
Qwen3's q/k RMSNorm over each head's dims before RoPE. With config.sliding_window (default 4096) set, the layers
slide as config.layer_types says, else as sliding_window_pattern does (an int p: layer i slides unless (i + 1) % p
== 0; a string such as "LLLG": layer i slides where its letter is L), and the full layers take no RoPE (NoPE);
without a window every layer is full and rotates."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.blocks import PostNormDecoderLayer
from quantkit.models.config import FULL, SLIDING, every_nth_full, windowed
from quantkit.models.family import Family, register


def parse(hf: dict, where: str) -> dict:
    n, window = hf["num_hidden_layers"], hf.get("sliding_window", 4096)
    eps = {"rms_norm_eps": hf.get("rms_norm_eps", 1e-5)}
    if window is None:
        return eps
    types = _layer_types(hf, where)
    return {**eps, "nope_layers": tuple(i for i in range(n) if types[i] == FULL), **windowed(types, window)}


def _layer_types(hf: dict, where: str) -> list[str]:
    pattern = hf.get("sliding_window_pattern", 4)
    if hf.get("layer_types") or isinstance(pattern, int) and pattern > 0:
        return every_nth_full(hf, pattern)
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        return [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(hf["num_hidden_layers"])]
    raise QuantkitError(f"{where}: sliding_window_pattern {pattern!r} is neither a positive int nor a string of L "
                        f"(local) and G (global)")


EXAONE4 = register(Family("EXAONE 4.0", ("exaone4",), parse=parse, decoder=PostNormDecoderLayer, qk_norm=True))
