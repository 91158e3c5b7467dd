"""quantkit plan across families and tensor parallelism: parameter counts equal transformers' own for a tiny config
of every family; Llama-3-70B W4 on 2 x H100-80GB (per-card weights, KV per token and concurrency) and Mixtral-8x7B
against hand arithmetic; the split rule of quantkit/models/tensor_parallel.py refuses what cannot be split."""

from __future__ import annotations

import json
import math

import pytest
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from quantkit.benchmark.plan import GPUS, make_plan, model_params, step_weight_bytes, weight_bytes
from quantkit.errors import QuantkitError
from quantkit.models import ModelConfig
from quantkit.models.family import family_of
from quantkit.models.sharding import check_shardable
from quantkit.models.tensor_parallel import check_tensor_parallel, device_shape, split_kind
from quantkit.serve.capacity import kv_bytes_per_token
from tests.quantkit.families import BASE, FAMILIES

LLAMA3_70B = {  # meta-llama/Meta-Llama-3-70B config.json (the fields plan reads)
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6, "tie_word_embeddings": False,
}
EXTRA = {  # beyond tests/quantkit/families.py: a tied head, and biases on every Linear
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
}


@pytest.mark.parametrize("name", list(FAMILIES) + list(EXTRA))
def test_parameter_count_equals_transformers(name):
    """Built from the family's own definition (experts, tied heads, q/k norms, biases, Gemma's extra norms, the
    shared expert and its gate, a router's correction bias), not from a Llama formula: the values a checkpoint
    holds, parameters and persistent buffers (transformers makes GLM-4.5's correction bias a buffer, ERNIE's a
    parameter), a tied head once."""
    model_type, extra = {**FAMILIES, **EXTRA}[name]
    config = AutoConfig.for_model(model_type, **{**BASE, **extra})
    tensors = AutoModelForCausalLM.from_config(config).state_dict()  # tiny: built on the CPU
    expected = sum(t.numel() for t in {t.data_ptr(): t for t in tensors.values()}.values())
    assert weight_bytes(ModelConfig.from_hf(config.to_dict())).params == expected


def test_llama3_70b_w4_on_two_h100s_matches_hand_arithmetic():
    cfg = ModelConfig.from_hf(LLAMA3_70B)
    h, layers, inter, vocab, d = 8192, 80, 28672, 128256, 128
    # whole model: per layer q, o [8192, 8192]; k, v [1024, 8192]; gate, up [28672, 8192]; down [8192, 28672]
    linear = layers * (2 * h * h + 2 * 1024 * h + 3 * inter * h)
    params = linear + 2 * vocab * h + (2 * layers + 1) * h  # + embed_tokens, lm_head (untied), 161 norms
    assert params == 70_553_706_496  # Meta-Llama-3-70B's published count
    # one of 2 cards, W4 group 128: q [4096, 8192], k, v [512, 8192] (4 of 8 KV heads), o [8192, 4096],
    # gate, up [14336, 8192], down [8192, 14336]; codes at 4 bits, per group an fp16 scale + a 4-bit zero
    shapes = [(4096, h), (512, h), (512, h), (h, 4096), (14336, h), (14336, h), (h, 14336)]
    codes = sum(n * k for n, k in shapes)
    groups = sum(n * (k // 128) for n, k in shapes)
    assert (codes, groups) == (linear // layers // 2, 3_342_336)
    per_layer = codes // 2 + groups * 2 + groups // 2
    card = layers * per_layer + 2 * (vocab // 2) * h * 2 + (2 * layers + 1) * h * 2  # + half of embed and head, norms
    assert card == 19_885_211_648
    kv_token = 80 * 2 * 4 * 128 * 2  # layers x (K, V) x 4 KV heads per card x head_dim x bf16
    assert kv_token == 163_840
    budget = round(80e9 * 0.9) - card - 2_000_000_000  # memory fraction 0.9, 2 GB of activations
    blocks = budget // (16 * kv_token)
    concurrency = blocks // (8192 // 16)  # sequences of 8192 tokens, 512 blocks each
    assert (blocks, concurrency) == (19117, 37)

    plan = make_plan(cfg, GPUS["h100-80gb"], quant="w4", group_size=128, kv_cache_dtype="bf16", max_model_len=8192,
                     activation_gb=2.0, tensor_parallel_size=2)
    assert plan["params"] == params and plan["quantized_params"] == linear
    assert plan["weights_bytes"] == card and plan["model_weights_bytes"] == layers * (
        linear // layers // 2 + 2 * groups * 2 + groups) + 2 * vocab * h * 2 + (2 * layers + 1) * h * 2
    assert plan["kv_bytes_per_token"] == kv_token and plan["kv_heads_per_device"] == 4
    assert plan["kv_budget_bytes"] == budget and plan["kv_blocks"] == blocks
    assert plan["max_concurrency_at_max_len"] == concurrency
    # the default activation estimate, by hand: 2048 tokens x (4H + 2 x 4 x 128 + 3 x 28672 / 2) at 2 bytes
    # + fp32 logits of 128 rows over the whole vocabulary
    default = make_plan(cfg, GPUS["h100-80gb"], quant="w4", kv_cache_dtype="bf16", tensor_parallel_size=2)
    assert default["activation_bytes"] == 2048 * (4 * h + 2 * 4 * d + 3 * inter // 2) * 2 + 128 * vocab * 4
    # one card alone: 39.8 GB of W4 weights fit in 80 GB but the KV per token doubles (all 8 heads)
    one = make_plan(cfg, GPUS["h100-80gb"], quant="w4", kv_cache_dtype="bf16", max_model_len=8192, activation_gb=2.0)
    assert one["kv_bytes_per_token"] == 2 * kv_token and one["weights_bytes"] == plan["model_weights_bytes"]
    assert one["max_concurrency_at_max_len"] == (round(72e9) - one["weights_bytes"] - 2_000_000_000) // (
        16 * 2 * kv_token) // 512


def test_plan_cli_70b_w4_on_two_h100s(tmp_path):
    from quantkit.cli import _typer_app

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(_typer_app, [
        "plan", str(tmp_path), "--gpu", "h100-80gb", "--tensor-parallel-size", "2", "--quant", "w4",
        "--kv-cache-dtype", "bf16", "--max-model-len", "8192", "--activation-gb", "2", "--price-per-hour", "2",
        "--json", str(out)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert "card h100-80gb x 2, tensor parallel: 80 GB, 3350 GB/s, 989 TFLOP/s each" in lines
    assert ("weights w4 (group 128): 19.89 GB per card, 39.77 GB in all as stored "
            "(every parameter at bits/8 would be 35.28 GB)") in lines
    assert "KV cache per token per card: 163840 bytes (0.164 MB; 4 of 8 KV heads per card)" in lines
    assert "KV capacity per card: 19117 blocks of 16 = 305872 tokens" in lines
    assert "KV of one sequence at max_model_len 8192: 1.34 GB per card; max concurrency there: 37" in lines
    data = json.loads(out.read_text())
    assert data["weights_bytes"] == 19_885_211_648 and data["max_concurrency_at_max_len"] == 37
    # two cards cost twice one card's $2/hour
    first = data["roofline"][0]
    assert first["usd_per_million_tokens"] == pytest.approx(4.0 / 3600 / first["aggregate_tps"] * 1e6)


def test_kv_heads_replicate_when_fewer_than_cards():
    cfg = ModelConfig.from_hf(LLAMA3_70B)
    # 16 cards, 8 KV heads: each card holds one whole head (each head on 2 cards); q heads 64 / 16 = 4
    assert kv_bytes_per_token(cfg, 2, 16) == 80 * 2 * 1 * 128 * 2
    assert device_shape("model.layers.0.self_attn.k_proj.weight", (1024, 8192), cfg, 16) == (128, 8192)
    assert device_shape("model.layers.0.self_attn.q_proj.weight", (8192, 8192), cfg, 16) == (512, 8192)
    plan = make_plan(cfg, GPUS["h100-80gb"], quant="w4", tensor_parallel_size=16)
    assert plan["kv_heads_per_device"] == 1
    assert plan["kv_bytes_per_token"] == kv_bytes_per_token(LLAMA3_70B, 2, 16)  # the config dict too


def test_split_kinds_of_every_parameter_sort():
    assert [split_kind(f"model.layers.0.{n}") for n in (
        "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.o_proj.weight",
        "self_attn.o_proj.bias", "self_attn.q_norm.weight", "mlp.down_proj.weight", "mlp.gate.weight",
        "mlp.shared_expert.up_proj.weight", "mlp.shared_expert_gate.weight", "block_sparse_moe.experts.3.w1.weight",
        "block_sparse_moe.experts.3.w2.weight", "input_layernorm.weight")] == [
        "column", "column", "kv", "row", "replicated", "replicated", "row", "replicated", "column", "replicated",
        "column", "row", "replicated"]
    assert split_kind("model.embed_tokens.weight") == split_kind("lm_head.weight") == "vocab"
    assert split_kind("model.norm.weight") == "replicated"


def test_mixtral_8x7b_counts_every_expert_and_shards_them():
    cfg = ModelConfig.from_hf(MIXTRAL_8X7B)
    h, inter, layers = 4096, 14336, 32
    attention = 2 * h * h + 2 * 1024 * h
    experts = 8 * 3 * inter * h
    per_layer = attention + experts + 8 * h + 2 * h  # + router [8, 4096], 2 norms
    params = layers * per_layer + 2 * 32000 * h + h
    assert params == 46_702_792_704  # Mixtral-8x7B-v0.1's published count
    w = weight_bytes(cfg, "w4", 128, tensor_parallel_size=2)
    assert w.params == params and w.quantized_params == layers * (attention + experts)  # the router stays float
    # per token one card multiplies its half of the attention, 2 of 8 experts, the router (replicated), the lm_head
    assert w.device_matmul_params == layers * (attention // 2 + experts // 2 * 2 // 8 + 8 * h) + 32000 * h // 2
    # routers and norms replicated: a card holds half of all else plus them whole
    replicated = layers * (8 * h + 2 * h) + h
    assert w.device_bytes == (w.stored_bytes - 2 * replicated) // 2 + 2 * replicated
    # a step reads the experts its tokens route to: W4 g128 experts (codes at 4 bits, an fp16 scale and a 4-bit
    # zero per 128 inputs), halved over the cards; 2 of 8 at one token, 1 - (3/4)^4 of them at four
    fp16 = ModelConfig.from_hf(MIXTRAL_8X7B)
    weights, groups = 3 * inter * h, 3 * inter * h // 128
    per_expert = weights // 2 + groups * 2 + groups * 4 // 8
    assert w.device_expert_bytes == layers * 8 * per_expert // 2
    assert step_weight_bytes(w, fp16, 1) == w.device_bytes - w.device_expert_bytes * 6 // 8
    assert step_weight_bytes(w, fp16, 4) == w.device_bytes - round(w.device_expert_bytes * (3 / 4) ** 4)


def test_refuses_what_cannot_be_split():
    cfg = ModelConfig.from_hf(LLAMA3_70B)
    with pytest.raises(QuantkitError) as e:
        check_tensor_parallel(cfg, 3)
    assert str(e.value) == (
        "--tensor-parallel-size 3 cannot split this model (config.json): num_attention_heads=64 is not divisible by "
        "3; num_key_value_heads=8 neither divides by 3 nor divides it; intermediate_size=28672 is not divisible by 3")
    with pytest.raises(QuantkitError, match="vocab_size=49153 is not divisible by 2"):
        check_tensor_parallel(ModelConfig.from_hf({**LLAMA3_70B, "vocab_size": 49153}), 2)
    # a row-parallel input slice must hold whole quantization groups: down_proj's 1536 / 8 = 192 columns
    small = ModelConfig.from_hf({**LLAMA3_70B, "hidden_size": 1024, "intermediate_size": 1536})
    with pytest.raises(QuantkitError, match="intermediate_size=1536 / 8 = 192 columns per device is not a multiple "
                                            "of group size 128"):
        weight_bytes(small, "w4", 128, tensor_parallel_size=8)
    assert weight_bytes(small, "w4", 64, tensor_parallel_size=8).device_bytes > 0
    assert weight_bytes(small, "fp16", 128, tensor_parallel_size=8).device_bytes > 0  # fp16 has no groups


def test_plan_cli_refuses_before_sizing(tmp_path):
    from quantkit.cli import _typer_app

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    res = CliRunner().invoke(_typer_app, ["plan", str(tmp_path), "--tensor-parallel-size", "3"])
    assert isinstance(res.exception, QuantkitError) and res.output == ""  # the CLI prints it as one error line
    assert str(res.exception).startswith("--tensor-parallel-size 3 cannot split this model (config.json)")


def tiny(name: str) -> ModelConfig:
    model_type, extra = FAMILIES[name]
    return ModelConfig.from_hf(AutoConfig.for_model(model_type, **{**BASE, **extra}).to_dict())


def test_every_family_shards_at_two_cards():
    """Every family's tiny config but those whose q/k norms span all heads (OLMo 2 and 3, below) splits over 2
    cards: the split parameters halve, the rest stay whole."""
    for name in FAMILIES:
        cfg = tiny(name)
        if family_of(cfg.model_type).qk_norm_whole:
            continue
        check_tensor_parallel(cfg, 2)
        for p in model_params(cfg):
            one, two = math.prod(p.shape), math.prod(device_shape(p.name, p.shape, cfg, 2))
            assert two * (1 if split_kind(p.name) == "replicated" else 2) == one, (name, p.name)


@pytest.mark.parametrize("name, family", [("olmo2", "OLMo 2"), ("olmo3", "OLMo 3")])
def test_olmo_refuses_tensor_parallelism(name, family):
    """OLMo 2's and 3's q/k norms span every head, which no card's share of the heads computes: plan and TP serving
    refuse it alike, naming the family and the norms."""
    cfg = tiny(name)
    check_tensor_parallel(cfg, 1)
    refused = rf"--tensor-parallel-size 2: {family} \({name}\) normalises q and k over all heads at once \(q_norm"
    for refuse in (lambda: check_tensor_parallel(cfg, 2), lambda: check_shardable(cfg, 2),
                   lambda: make_plan(cfg, GPUS["h100-80gb"], quant="w4", tensor_parallel_size=2)):
        with pytest.raises(QuantkitError, match=refused):
            refuse()
