"""The Llama-family model against transformers' own implementation (independent reference), and ModelConfig's parsing
of every family's config.json forms and refusals (the families themselves: test_families.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quantkit.errors import QuantkitError
from quantkit.models.llama import LlamaForCausalLM, ModelConfig, rope_inv_freq
from tests.conftest import tiny_hf_config

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

CASES = {
    "llama": tiny_hf_config("llama"),
    "llama-tied-mha": tiny_hf_config("llama", tie_word_embeddings=True, num_key_value_heads=4),
    "llama-bias": tiny_hf_config("llama", attention_bias=True, mlp_bias=True),
    "llama3-rope": tiny_hf_config("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "llama-linear-rope": tiny_hf_config("llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mistral": tiny_hf_config("mistral", head_dim=16),
    "qwen2-bias": tiny_hf_config("qwen2", num_key_value_heads=1, tie_word_embeddings=True),
}


def _pair(hf_dict: dict):
    torch.manual_seed(0)
    hf_cfg = AutoConfig.for_model(**hf_dict)
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases/norms, so a missing term cannot hide behind zeros/ones
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    ours = LlamaForCausalLM(ModelConfig.from_hf(hf.config.to_dict())).eval()
    state = hf.state_dict()
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not [m for m in missing if m != "lm_head.weight"] and not unexpected, (missing, unexpected)
    return hf, ours


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_on_tiny_configs(case):
    hf, ours = _pair(CASES[case])
    ids = torch.randint(0, 128, (2, 200))  # long enough that llama3 low/high frequency bands both matter
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_qwen2_has_qkv_bias_and_no_o_bias():
    _, ours = _pair(CASES["qwen2-bias"])
    attn = ours.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert attn.o_proj.bias is None


def test_old_style_rope_keys_parse_like_new_ones():
    old = tiny_hf_config("llama", rope_theta=500000.0, rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"}})
    new = tiny_hf_config("llama", rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE})
    new.pop("rope_theta")
    a, b = ModelConfig.from_hf(old), ModelConfig.from_hf(new)
    assert a.rope_theta == b.rope_theta == 500000.0
    torch.testing.assert_close(rope_inv_freq(a), rope_inv_freq(b), atol=0, rtol=0)


def test_rope_scaling_added_beside_new_style_rope_parameters_applies_on_their_theta():
    """A config transformers 5 saved (rope_parameters: default, theta 1e5) with Qwen's YaRN setting added as
    rope_scaling in the 4.x spelling: the scaling applies (as in transformers), on the saved theta."""
    hf = tiny_hf_config("qwen3", rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
                        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    hf.pop("rope_theta")
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_theta == 100000.0
    assert cfg.rope_scaling == {"factor": 4.0, "original_max_position_embeddings": 64, "rope_type": "yarn"}


def test_positions_argument_equals_implicit_positions():
    _, ours = _pair(CASES["llama"])
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        full = ours(ids)
        explicit = ours(ids, positions=torch.arange(12))
        # logits_indices picks rows of the flattened [B*L, V] logits
        picked = ours(ids, logits_indices=torch.tensor([3, 11]))
    torch.testing.assert_close(full, explicit, atol=0, rtol=0)
    torch.testing.assert_close(picked, full[0, [3, 11]], atol=1e-6, rtol=0)


def test_head_dim_null_is_hidden_over_heads():
    assert ModelConfig.from_hf(tiny_hf_config("mistral", head_dim=None)).head_dim == 16


def test_windows_follow_each_familys_rules():
    assert ModelConfig.from_hf(tiny_hf_config("mistral", sliding_window=None)).layer_types == ()  # v0.2+: full
    assert ModelConfig.from_hf(tiny_hf_config("mistral", sliding_window=16)).window(1) == 16
    assert ModelConfig.from_hf(tiny_hf_config("qwen2", sliding_window=16)).layer_types == ()  # use_sliding_window off
    qwen = ModelConfig.from_hf(tiny_hf_config("qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1))
    assert [qwen.window(i) for i in range(2)] == [None, 16]
    gemma2 = ModelConfig.from_hf(tiny_hf_config("gemma2", num_hidden_layers=4))  # 4.x config: no layer_types
    assert [gemma2.window(i) for i in range(4)] == [4096, None, 4096, None]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)  # HF's defaults


def test_gemma3_old_and_new_rope_keys_parse_alike():
    old = tiny_hf_config("gemma3_text", num_hidden_layers=6, rope_theta=1e6, rope_local_base_freq=1e4,
                         sliding_window_pattern=6, rope_scaling={"rope_type": "linear", "factor": 8.0})
    new = AutoConfig.for_model(**old).to_dict()
    assert "full_attention" in new["rope_parameters"] and "layer_types" in new
    a, b = ModelConfig.from_hf(old), ModelConfig.from_hf(new)
    assert (a.rope_theta, a.rope_local_theta, a.layer_types) == (b.rope_theta, b.rope_local_theta, b.layer_types)
    assert a.rope_scaling["factor"] == b.rope_scaling["factor"] == 8.0 and a.rope_local_theta == 1e4
    assert [a.window(i) for i in range(6)] == [4096] * 5 + [None]  # 5 local : 1 global


def test_olmo3_old_and_new_rope_keys_parse_alike():
    """OLMo 3's 4.x config (the Hub's: rope_theta and a YaRN rope_scaling, no layer_types) and transformers 5's
    (rope_parameters per layer type): YaRN on the full layers only, the sliding ones on plain RoPE of the same base,
    three sliding layers to one full."""
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "attention_factor": 1.2}
    old = tiny_hf_config("olmo3", num_hidden_layers=8, rope_theta=5e5, rope_scaling=yarn, sliding_window=4096)
    new = AutoConfig.for_model(**old).to_dict()
    assert new["rope_parameters"]["sliding_attention"]["rope_type"] == "default"
    a, b = ModelConfig.from_hf(old), ModelConfig.from_hf(new)
    assert (a.rope_theta, a.rope_local_theta, a.layer_types) == (b.rope_theta, b.rope_local_theta, b.layer_types)
    assert a.rope(sliding=True) == b.rope(sliding=True) == (5e5, None)
    assert a.rope_scaling == b.rope_scaling and a.rope_scaling["factor"] == 8.0
    assert [a.window(i) for i in range(8)] == [4096, 4096, 4096, None] * 2
    plain = ModelConfig.from_hf(tiny_hf_config("olmo3", rope_theta=5e5))
    assert plain.rope_local_theta is None  # one RoPE for every layer: one rotary, one table


def test_seed_oss_and_ministral_defaults_are_transformers():
    """Fields a config.json may omit, read as transformers' classes default them: Seed-OSS's q/k/v bias on and o bias
    off; Ministral's layers all sliding when a window is set, all full without one, and never a bias."""
    raw = tiny_hf_config("seed_oss", head_dim=16)
    attn = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).model.layers[0].self_attn
    ours = ModelConfig.from_hf(raw)
    assert (ours.qkv_bias, ours.o_bias) == (attn.q_proj.bias is not None, attn.o_proj.bias is not None) == (True, False)
    for window in (16, None):
        raw = tiny_hf_config("ministral", head_dim=16, sliding_window=window, attention_bias=True)
        theirs, ours = AutoConfig.for_model(**raw), ModelConfig.from_hf(raw)
        assert [ours.window(i) for i in range(2)] == [
            theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types]
        assert not ours.qkv_bias and not ours.o_bias


@pytest.mark.parametrize("model_type", ["glm", "glm4", "ernie4_5", "helium", "exaone4", "cohere", "cohere2",
                                        "ministral3", "hunyuan_v1_dense"])
def test_fields_config_json_omits_default_as_transformers(model_type):
    """A config.json holding only the sizes: head_dim, RoPE base and rotated dims, norm epsilon, biases, tying, the
    sliding and NoPE layers read as transformers' config class and model fill them in."""
    raw = {"model_type": model_type, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": None}
    if model_type == "hunyuan_v1_dense":
        raw["head_dim"] = 16  # transformers' Hunyuan attention fails on a null head_dim
    theirs, ours = AutoConfig.for_model(**raw), ModelConfig.from_hf(raw)
    layer = AutoModelForCausalLM.from_config(theirs).model.layers[0]
    rope = theirs.rope_parameters
    head_dim = getattr(theirs, "head_dim", 64 // 4)  # EXAONE 4's class has none: hidden / heads
    eps = getattr(theirs, "rms_norm_eps", None) or theirs.layer_norm_eps  # Cohere's LayerNorm
    assert (ours.head_dim, ours.rope_theta, ours.rms_norm_eps, ours.tie_word_embeddings) == (
        head_dim, rope["rope_theta"], eps, theirs.tie_word_embeddings)
    assert ours.logit_scale == getattr(theirs, "logit_scale", 1.0)
    beta = rope.get("llama_4_scaling_beta")  # Ministral 3's query scale
    assert ours.query_scale == (None if beta is None else (beta, rope["original_max_position_embeddings"]))
    assert (ours.rope_scaling or {}).get("factor") == rope.get("factor")
    assert ours.partial_rotary_factor == rope.get("partial_rotary_factor", 1.0)
    assert (ours.qkv_bias, ours.o_bias, ours.mlp_bias) == (layer.self_attn.q_proj.bias is not None,
                                                           layer.self_attn.o_proj.bias is not None,
                                                           layer.mlp.down_proj.bias is not None)
    types = getattr(theirs, "layer_types", None) or ["full_attention"] * 4
    assert [ours.window(i) for i in range(4)] == [theirs.sliding_window if t == "sliding_attention" else None
                                                  for t in types]
    nope = tuple(i for i, t in enumerate(types) if t == "full_attention") if model_type in ("exaone4", "cohere2") else ()
    assert ours.nope_layers == nope


def test_exaone4_sliding_pattern_string_and_no_window():
    """EXAONE 4.0's Hub configs spell the pattern "LLLG" (each letter a layer: L slides, G is full and NoPE); without
    a sliding_window every layer is full and rotates (EXAONE-4.0-1.2B)."""
    cfg = ModelConfig.from_hf(tiny_hf_config("exaone4", num_hidden_layers=8, sliding_window=16,
                                             sliding_window_pattern="LLLG"))
    assert [cfg.window(i) for i in range(8)] == [16, 16, 16, None] * 2 and cfg.nope_layers == (3, 7)
    plain = ModelConfig.from_hf(tiny_hf_config("exaone4", sliding_window=None))
    assert [plain.window(i) for i in range(2)] == [None, None] and plain.nope_layers == ()
    with pytest.raises(QuantkitError, match=r"EXAONE 4.0 \(exaone4\): sliding_window_pattern 'LGX' is neither"):
        ModelConfig.from_hf(tiny_hf_config("exaone4", sliding_window=16, sliding_window_pattern="LGX"))


@pytest.mark.parametrize("extra", [dict(no_rope_layer_interval=3, use_sliding_window=True, sliding_window=16),
                                   dict(no_rope_layers=[1, 0, 0, 1, 1, 1, 0, 1], use_sliding_window=True),
                                   dict(use_sliding_window=False, sliding_window=16)])
def test_smollm3_nope_layers_windows_and_defaults_are_transformers(extra):
    """Which layers skip RoPE and which slide, derived as SmolLM3Config derives them; its defaults for the RoPE
    base and the tied embeddings (Gemma's are tied too)."""
    raw = tiny_hf_config("smollm3", num_hidden_layers=8, **extra)
    del raw["rope_theta"], raw["tie_word_embeddings"]
    theirs, ours = AutoConfig.for_model(**raw), ModelConfig.from_hf(raw)
    assert ours.nope_layers == tuple(i for i, rope in enumerate(theirs.no_rope_layers) if not rope)
    assert [ours.window(i) for i in range(8)] == [
        theirs.sliding_window if t == "sliding_attention" else None for t in theirs.layer_types]
    assert (ours.rope_theta, ours.tie_word_embeddings) == (theirs.rope_parameters["rope_theta"], True) == (2e6, True)
    gemma = tiny_hf_config("gemma")
    del gemma["tie_word_embeddings"]
    assert ModelConfig.from_hf(gemma).tie_word_embeddings and AutoConfig.for_model(**gemma).tie_word_embeddings


@pytest.mark.parametrize("hf, message", [
    (tiny_hf_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 4.0}), r"Llama \(llama\): rope .* 'dynamic'"),
    (tiny_hf_config("phi3", partial_rotary_factor=0.2), r"Phi-3 \(phi3\): partial_rotary_factor 0.2 rotates 3 of"),
    (tiny_hf_config("gemma2", use_bidirectional_attention=True), r"Gemma 2 \(gemma2\): use_bidirectional"),
    (tiny_hf_config("gemma", use_bidirectional_attention=True), r"Gemma \(gemma\): use_bidirectional"),
    (tiny_hf_config("gemma", hidden_act="silu"), r"Gemma \(gemma\): hidden_act 'silu' is not supported"),
    (tiny_hf_config("smollm3", no_rope_layers=[1]), r"SmolLM3 \(smollm3\): no_rope_layers has 1 entries for 2"),
    (tiny_hf_config("granite", logits_scaling=0), r"Granite \(granite\): logits_scaling is 0"),
    (tiny_hf_config("qwen2_moe", num_experts=4, num_experts_per_tok=2), r"Qwen2-MoE \(qwen2_moe\) model has no 'moe_"),
    (tiny_hf_config("cohere", use_qk_norm=True), r"Cohere \(cohere\): use_qk_norm \(per-head q/k LayerNorms"),
    (tiny_hf_config("starcoder2", hidden_act="gelu"), r"StarCoder2 \(starcoder2\): hidden_act 'gelu' is not supported"),
    (tiny_hf_config("nemotron", hidden_act="silu"), r"Nemotron \(nemotron\): hidden_act 'silu' is not supported"),
    (tiny_hf_config("gpt_neox"),
     r"'gpt_neox' is not supported: quantkit runs Arcee \(arcee\), .*Gemma \(gemma\), .*Llama \(llama\)"),
])
def test_configs_quantkit_cannot_run_are_refused_naming_the_family(hf, message):
    with pytest.raises(QuantkitError, match=message):
        ModelConfig.from_hf(hf)


@pytest.mark.slow
def test_bundled_model_matches_transformers_on_real_prompts(bundled, bundled_dir):
    hf = AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    tok = bundled.tokenizer
    prompts = [
        "The tower is 324 metres (1,063 ft) tall, about the same height as an 81-storey building.",
        "Shall I compare thee to a summer's day? Thou art more lovely and more temperate:",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        tok.apply_chat_template([{"role": "user", "content": "Give me three tips for staying healthy."}],
                                tokenize=False, add_generation_prompt=True),
    ]
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            torch.testing.assert_close(bundled.model(ids), hf(ids).logits, atol=1e-3, rtol=0)
