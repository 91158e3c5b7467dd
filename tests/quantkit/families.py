"""Tiny random-weight models of every family, built by transformers from its config (shared by the model tests,
tests/quantkit/test_families.py, and the serving tests, tests/serve/test_families_serving.py)."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

WINDOW = 16  # sequences of 8 stay inside it, of 48 go past it
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256, pad_token_id=None,
            bos_token_id=None, eos_token_id=None)  # no EOS: generate runs all its tokens
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)]}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}  # Qwen3's long-context setting
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "llama": ("llama", {}),
    "smollm3": ("smollm3", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW)),  # 3 NoPE, slides
    "gemma": ("gemma", dict(head_dim=16)),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "ministral": ("ministral", dict(num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "ministral3": ("ministral3", dict(head_dim=16, rope_parameters=dict(  # queries at 16 on scaled by 1 + 0.5 ln 2
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5))),
    "seed_oss": ("seed_oss", dict(head_dim=16, attention_bias=True, attention_out_bias=True)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),  # layer 1 slides
    "qwen3": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3-yarn": ("qwen3", dict(head_dim=16, rope_scaling=YARN)),  # cos/sin scaled by its attention factor
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                              attn_logit_softcapping=1.0, final_logit_softcapping=5.0)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, sliding_window_pattern=3, head_dim=16, query_pre_attn_scalar=24,
                                   sliding_window=WINDOW, rope_local_base_freq=100.0, rope_theta=10000.0,
                                   final_logit_softcapping=5.0)),
    "granite": ("granite", dict(embedding_multiplier=4.0, attention_multiplier=0.2, residual_multiplier=0.3,
                                logits_scaling=3.0, tie_word_embeddings=True)),  # each far from 1: none can hide
    "olmo2": ("olmo2", dict(num_key_value_heads=4)),  # MHA, as OLMo 2 7B / 13B: AWQ's v -> o group applies
    "olmo3": ("olmo3", dict(num_hidden_layers=4, num_key_value_heads=4, sliding_window=WINDOW,
                            rope_scaling=YARN)),  # layers 0-2 slide on plain RoPE, layer 3 is full with YaRN
    "exaone4": ("exaone4", dict(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW,
                                sliding_window_pattern=4)),  # layers 0-2 slide on RoPE, layer 3 is full and NoPE
    "hunyuan": ("hunyuan_v1_dense", dict(head_dim=16, attention_bias=True, rope_parameters=dict(
        rope_type="dynamic", alpha=1000.0, factor=1.0, rope_theta=10000.0))),  # q/k norms after RoPE, NTK alpha
    "helium": ("helium", dict(head_dim=16, attention_bias=True, mlp_bias=True)),  # interleaved RoPE pairs
    "ernie4_5": ("ernie4_5", dict(head_dim=16, use_bias=True)),  # interleaved RoPE pairs, every Linear biased
    "glm": ("glm", dict(head_dim=16)),  # interleaved pairs on half of each head (8 of 16 dims), gate_up_proj fused
    "glm4": ("glm4", dict(head_dim=16, tie_word_embeddings=True)),  # the same, and GLM-4-0414's sublayer norms
    "cohere": ("cohere", dict(logit_scale=0.3)),  # the parallel block, LayerNorm, interleaved RoPE pairs
    "cohere2": ("cohere2", dict(num_hidden_layers=4, sliding_window=WINDOW, logit_scale=0.3)),  # 0-2 slide, 3 NoPE
    "starcoder2": ("starcoder2", dict(sliding_window=WINDOW)),  # LayerNorm with bias, c_fc / c_proj, all biased
    "nemotron": ("nemotron", dict(head_dim=16, attention_bias=True, mlp_bias=True)),  # LayerNorm1P, relu^2, half RoPE
    "arcee": ("arcee", dict(head_dim=16)),  # relu^2 MLP without gate
    "phi3": ("phi3", dict(sliding_window=WINDOW)),
    "phi4-mini": ("phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True)),  # RoPE on 12 of 16 dims
    "phi3-longrope": ("phi3", dict(max_position_embeddings=128, original_max_position_embeddings=32,
                                   rope_scaling=LONGROPE)),  # 48 tokens switch to the long factors
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, shared_expert_intermediate_size=64, mlp_only_layers=[1], **MOE)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, norm_topk_prob=True, **MOE)),
    "glm4_moe": ("glm4_moe", dict(num_hidden_layers=3, head_dim=16, attention_bias=True, use_qk_norm=True,
                                  n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=2,
                                  routed_scaling_factor=2.5, first_k_dense_replace=1, **MOE)),  # layer 0 dense
    "ernie4_5_moe": ("ernie4_5_moe", dict(num_hidden_layers=3, head_dim=16, moe_num_experts=4, moe_k=2,
                                          moe_intermediate_size=32, moe_num_shared_experts=1,
                                          moe_layer_start_index=1)),  # layer 0 dense, RoPE pairs
    "hunyuan_moe": ("hunyuan_v1_moe", dict(head_dim=16, num_experts=4, moe_topk=2, intermediate_size=32)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32)),  # whole-projection q/k norms
}
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "ernie4_5_moe", "hunyuan_moe"]


def hf_model(name: str) -> nn.Module:
    model_type, extra = FAMILIES[name]
    return random_hf_model(model_type, **extra)


def random_hf_model(model_type: str, **extra) -> nn.Module:
    """transformers' model of BASE updated by `extra`, random weights (seed 0), fp32, eval mode."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**BASE, **extra}), dtype=torch.float32)
    with torch.no_grad():  # random biases and norms, so a missing term cannot hide behind zeros/ones
        for pname, p in hf.named_parameters():
            if "norm" in pname:  # Gemma stores w of (1 + w): centred on 0 there
                p.normal_(mean=0.0 if model_type.startswith("gemma") else 1.0, std=0.1)
            elif pname.endswith("bias"):
                p.normal_(std=0.1)
        for bname, b in hf.named_buffers():  # GLM-4.5's router score correction (ERNIE's is a parameter, above)
            if bname.endswith("e_score_correction_bias"):
                b.normal_(std=0.1)
    return hf.eval()


def saved_families(root: Path, bundled_dir: Path) -> Callable[[str], tuple[nn.Module, Path]]:
    """name -> (transformers model, its checkpoint folder root/name: save_pretrained plus the bundled tokenizer),
    built once per name."""
    tokenizer = root / "tokenizer"
    PreTrainedTokenizerFast.from_pretrained(bundled_dir).save_pretrained(tokenizer)

    @functools.cache
    def get(name: str) -> tuple[nn.Module, Path]:
        hf, folder = hf_model(name), root / name
        hf.save_pretrained(folder)
        for f in tokenizer.iterdir():
            shutil.copy(f, folder)
        return hf, folder
    return get
