"""OLMo 2 (model_type olmo2): a post-norm block without input norms (x += post_attention_layernorm(attn(x)); x +=
post_feedforward_layernorm(mlp(x))), q_norm / k_norm over the whole q / k projection (Hq * D, Hkv * D wide) before
the head split and RoPE, and RMSNorms whose product with the weight is rounded once from fp32 (Fp32RMSNorm); SwiGLU,
biases as config.attention_bias (q/k/v/o). Tensor parallelism is refused (models/tensor_parallel.py): a norm over
all heads needs every device's heads."""

from __future__ import annotations

from quantkit.models.blocks import PostNormDecoderLayer
from quantkit.models.family import Family, register
from quantkit.models.layers import Fp32RMSNorm

OLMO2 = register(Family("OLMo 2", ("olmo2",), decoder=PostNormDecoderLayer, norm=Fp32RMSNorm, qk_norm=True,
                        qk_norm_whole=True))
