"""Released checkpoints' config.json files (as published on the Hub, a few unused keys left out) of the families the
tiny random models cannot show whole (tests/quantkit/families.py builds configs from transformers' classes, which
spell every field their own way): read by quantkit as transformers' config classes read them, field by field."""

from __future__ import annotations

import math

import pytest
from transformers import AutoConfig

from quantkit.models.config import ModelConfig

LAYERS_32B = ["sliding_attention"] * 3 + ["full_attention"]
HUB = {
    "EXAONE-4.0-1.2B": {  # no window: every layer full and rotating; llama3 RoPE
        "architectures": ["Exaone4ForCausalLM"], "bos_token_id": 1, "eos_token_id": 361, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 4096,
        "layer_types": ["full_attention"] * 30, "max_position_embeddings": 65536, "model_type": "exaone4",
        "num_attention_heads": 32, "num_hidden_layers": 30, "num_key_value_heads": 8, "pad_token_id": 0,
        "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 1000000, "sliding_window": None, "sliding_window_pattern": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "vocab_size": 102400},
    "EXAONE-4.0-32B": {  # 3 sliding : 1 full, the full layers NoPE; the pattern spelt "LLLG"
        "architectures": ["Exaone4ForCausalLM"], "bos_token_id": 1, "eos_token_id": 361, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 27392, "layer_types": LAYERS_32B * 16,
        "max_position_embeddings": 131072, "model_type": "exaone4", "num_attention_heads": 40,
        "num_hidden_layers": 64, "num_key_value_heads": 8, "pad_token_id": 0, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 1000000, "sliding_window": 4096, "sliding_window_pattern": "LLLG", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 102400},
    "GLM-4-9B-0414": {
        "architectures": ["Glm4ForCausalLM"], "attention_bias": True, "eos_token_id": [151329, 151336, 151338],
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 13696,
        "max_position_embeddings": 32768, "model_type": "glm4", "num_attention_heads": 32, "num_hidden_layers": 40,
        "num_key_value_heads": 2, "pad_token_id": 151329, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151552},
    "ERNIE-4.5-0.3B-PT": {
        "architectures": ["Ernie4_5ForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 131072,
        "model_type": "ernie4_5", "num_attention_heads": 16, "num_hidden_layers": 18, "num_key_value_heads": 2,
        "pad_token_id": 0, "rms_norm_eps": 1e-05, "rope_theta": 500000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_bias": False, "vocab_size": 103424},
    "c4ai-command-r7b-12-2024": {  # 3 sliding : 1 full NoPE; keys of Cohere's own code transformers ignores too
        "architectures": ["Cohere2ForCausalLM"], "attention_bias": False, "bos_token_id": 5,
        "cache_implementation": "hybrid", "eos_token_id": 255001, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "layer_norm_eps": 1e-05, "logit_scale": 0.25,
        "max_position_embeddings": 132096, "model_type": "cohere2", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "order_of_interleaved_layers": "local_attn_first",
        "pad_token_id": 0, "position_embedding_type": "rope_gptj", "rope_scaling": None, "rope_theta": 50000,
        "rotary_pct": 1.0, "sliding_window": 4096, "sliding_window_pattern": 4, "torch_dtype": "bfloat16",
        "use_embedding_sharing": True, "use_gated_activation": True, "vocab_size": 256000},
    "aya-expanse-8b": {
        "architectures": ["CohereForCausalLM"], "attention_bias": False, "bos_token_id": 5, "eos_token_id": 255001,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "layer_norm_eps": 1e-05,
        "logit_scale": 0.125, "max_position_embeddings": 8192, "model_type": "cohere", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "pad_token_id": 0, "rope_theta": 10000,
        "torch_dtype": "float16", "use_qk_norm": False, "vocab_size": 256000},
    "Hunyuan-1.8B-Instruct": {  # NTK alpha written as a "dynamic" rope_scaling
        "architectures": ["HunYuanDenseV1ForCausalLM"], "attention_bias": False, "bos_token_id": 1,
        "eos_token_id": 127960, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 6144, "max_position_embeddings": 32768, "mlp_bias": False,
        "model_type": "hunyuan_v1_dense", "num_attention_heads": 16, "num_hidden_layers": 32,
        "num_key_value_heads": 4, "pad_token_id": 127961, "rms_norm_eps": 1e-05,
        "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "type": "dynamic"},
        "rope_theta": 10000.0, "tie_word_embeddings": True, "use_qk_norm": True, "vocab_size": 120818},
    "helium-1-2b": {
        "architectures": ["HeliumForCausalLM"], "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "mlp_bias": False, "model_type": "helium", "num_attention_heads": 16,
        "num_hidden_layers": 28, "num_key_value_heads": 8, "pad_token_id": 3, "rms_norm_eps": 1e-08,
        "rope_theta": 100000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 64000},
    "Ministral-3-3B (text_config)": {  # the decoder of the mistral3 checkpoint: YaRN and the query scale
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 9216,
        "max_position_embeddings": 262144, "model_type": "ministral3", "num_attention_heads": 32,
        "num_hidden_layers": 26, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16384,
                            "rope_theta": 1000000.0, "rope_type": "yarn", "type": "yarn"},
        "sliding_window": None, "tie_word_embeddings": True, "vocab_size": 131072},
}


def their_rope_theta(theirs) -> float:
    """The RoPE base transformers' model rotates by: Hunyuan's NTK alpha stretches it (its compute_ntk_alpha)."""
    rope = theirs.rope_parameters
    if rope.get("alpha"):
        return rope["rope_theta"] * rope["alpha"] ** (theirs.head_dim / (theirs.head_dim - 2))
    return rope["rope_theta"]


@pytest.mark.parametrize("name", HUB)
def test_a_released_config_reads_as_transformers_reads_it(name):
    hub = HUB[name]
    ours, theirs = ModelConfig.from_hf(dict(hub)), AutoConfig.for_model(**hub)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.head_dim == getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)  # Cohere
    assert ours.rms_norm_eps == (getattr(theirs, "rms_norm_eps", None) or theirs.layer_norm_eps)
    assert math.isclose(ours.rope_theta, their_rope_theta(theirs), rel_tol=1e-12)
    rope = theirs.rope_parameters
    assert ours.partial_rotary_factor == rope.get("partial_rotary_factor", 1.0)
    assert (ours.rope_scaling or {}).get("rope_type", "default") == ("default" if rope.get("alpha")
                                                                     else rope["rope_type"])
    assert (ours.rope_scaling or {}).get("factor") == (None if rope.get("alpha") else rope.get("factor"))
    types = getattr(theirs, "layer_types", None) or ["full_attention"] * theirs.num_hidden_layers
    window = getattr(theirs, "sliding_window", None)
    assert [ours.window(i) for i in range(len(types))] == [
        window if t == "sliding_attention" and window else None for t in types]
    nope = {i for i, t in enumerate(types) if t == "full_attention"} if window and hub["model_type"] in (
        "exaone4", "cohere2") else set()  # their full layers skip RoPE where layers slide
    assert set(ours.nope_layers) == nope
    assert ours.logit_scale == getattr(theirs, "logit_scale", 1.0)
    beta = rope.get("llama_4_scaling_beta")
    assert ours.query_scale == (None if beta is None else (beta, rope["original_max_position_embeddings"]))
