"""Llama (Llama 2/3/3.1, SmolLM/SmolLM2, TinyLlama): the shared decoder as it is, every other family a difference
from it. Biases follow config.attention_bias (q/k/v/o) and mlp_bias.

Also the historical import path of the model's names (serve/prepare.py, the kernels' and serving tests, bench/,
evals/): each is defined in the module it is imported from below, where new code imports it.
"""

from __future__ import annotations

from quantkit.models.attention import Attention  # noqa: F401
from quantkit.models.config import ModelConfig  # noqa: F401
from quantkit.models.family import Family, register
from quantkit.models.layers import MLP, RMSNorm, RotaryEmbedding, TorchOps, apply_rope, rope_inv_freq  # noqa: F401
from quantkit.models.model import CausalLM as LlamaForCausalLM  # noqa: F401  (builds any family)

LLAMA = register(Family("Llama", ("llama",)))
