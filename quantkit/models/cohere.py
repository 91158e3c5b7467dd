"""Cohere (model_type cohere: Command R, Aya 23, Aya Expanse) and Cohere 2 (model_type cohere2: Command R7B, Command
A): the parallel block (attention and MLP on one input_layernorm, ParallelDecoderLayer), LayerNorm without bias
(mean subtracted; epsilon config.layer_norm_eps), RoPE turning interleaved pairs (q/k rows reordered at load,
models/keys.py), logits times config.logit_scale (default 0.0625), tied embeddings, RoPE base 5e5 where Cohere's
config.json is silent (transformers 5; 4.x said 1e4: the Hub's configs all state it). Cohere 2's layers slide as
config.layer_types says, else layer i unless (i + 1) % sliding_window_pattern (default 4) == 0; only the sliding
layers rotate (the full ones are NoPE), and head_dim is always hidden / heads. Per-head q/k LayerNorms
(config.use_qk_norm, Command R+) are refused."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.blocks import ParallelDecoderLayer
from quantkit.models.config import SLIDING, every_nth_full, windowed
from quantkit.models.family import Family, register
from quantkit.models.layers import Fp32LayerNorm


def parse(hf: dict, where: str) -> dict:
    if hf.get("use_qk_norm"):
        raise QuantkitError(f"{where}: use_qk_norm (per-head q/k LayerNorms, Command R+) is not supported")
    return {"rms_norm_eps": hf.get("layer_norm_eps", 1e-5), "logit_scale": float(hf.get("logit_scale", 0.0625))}


def parse_cohere2(hf: dict, where: str) -> dict:
    n, window = hf["num_hidden_layers"], hf.get("sliding_window", 4096)
    types = every_nth_full(hf, hf.get("sliding_window_pattern", 4))
    rotates = [t == SLIDING and window is not None for t in types]  # transformers: RoPE where the layer has a window
    return {**parse(hf, where), "head_dim": hf["hidden_size"] // hf["num_attention_heads"],
            "nope_layers": tuple(i for i in range(n) if not rotates[i]), **windowed(types, window)}


_COHERE = dict(decoder=ParallelDecoderLayer, norm=Fp32LayerNorm, rope_pairs=True, tied=True)
COHERE = register(Family("Cohere", ("cohere",), parse=parse, rope_theta=5e5, **_COHERE))  # transformers 5's base
COHERE2 = register(Family("Cohere 2", ("cohere2",), parse=parse_cohere2, **_COHERE))
