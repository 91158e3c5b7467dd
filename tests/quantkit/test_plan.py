"""quantkit plan: the sizing arithmetic against hand-computed figures (Llama-2-13B, GQA models, the bundled model)
and the engine's own capacity functions."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from quantkit.benchmark.datasets import workload_lengths
from quantkit.benchmark.plan import (GPUS, Gpu, cost_per_million, gpu_from_args, make_plan, quant_of_folder,
                                     roofline_step_s, weight_bytes)
from quantkit.errors import QuantkitError
from quantkit.models.llama import ModelConfig
from quantkit.serve.capacity import kv_bytes_per_token, num_kv_blocks

LLAMA2_13B = {  # meta-llama/Llama-2-13b-hf config.json (the fields plan reads)
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
    "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
LLAMA2_13B_PARAMS = 13_015_864_320  # the published parameter count of Llama-2-13b-hf
# decoder Linears: 40 x (4 x 5120^2 + 3 x 5120 x 13824)
LLAMA2_13B_LINEAR = 40 * (4 * 5120 * 5120 + 3 * 5120 * 13824)


def cfg_of(hf: dict) -> ModelConfig:
    return ModelConfig.from_hf(hf)


def test_llama2_13b_weights_and_kv_match_the_brief():
    cfg = cfg_of(LLAMA2_13B)
    fp16, w8, w4 = (weight_bytes(cfg, q) for q in ("fp16", "w8", "w4"))
    assert fp16.params == LLAMA2_13B_PARAMS and fp16.quantized_params == LLAMA2_13B_LINEAR
    # the brief's arithmetic: every parameter at bits/8 -> 26 / 13 / 6.5 GB
    assert (fp16.naive_bytes, w8.naive_bytes, w4.naive_bytes) == (
        LLAMA2_13B_PARAMS * 2, LLAMA2_13B_PARAMS, LLAMA2_13B_PARAMS // 2)
    assert [round(w.naive_bytes / 1e9, 1) for w in (fp16, w8, w4)] == [26.0, 13.0, 6.5]
    assert fp16.stored_bytes == fp16.naive_bytes
    # as stored, group 128: per layer 5120 rows x 40 groups for q,k,v,o; 13824 x 40 for gate, up; 5120 x 108 for
    # down -> 2,478,080 groups per layer; each group one fp16 scale (2 B) + one zero packed at `bits`;
    # embed_tokens, lm_head (untied) and the 81 norms stay fp16
    groups = 40 * (4 * 5120 * 40 + 2 * 13824 * 40 + 5120 * 108)
    rest = LLAMA2_13B_PARAMS - LLAMA2_13B_LINEAR
    assert groups == 99_123_200
    assert w4.stored_bytes == LLAMA2_13B_LINEAR // 2 + groups * 2 + groups // 2 + rest * 2 == 7_247_882_240
    assert w8.stored_bytes == LLAMA2_13B_LINEAR + groups * 2 + groups + rest * 2

    plan = make_plan(cfg, GPUS["a100-80gb"], quant="fp16", max_model_len=4096)
    assert plan["kv_bytes_per_token"] == 40 * 40 * 128 * 2 * 2 == 819_200  # ~0.8 MB
    four_users = 4 * plan["kv_bytes_per_seq_at_max_len"]
    assert four_users == 13_421_772_800 and four_users > 13e9  # ~13.4 GB, past 13 GB


def test_kv_per_token_is_gqa_aware():
    mha = dict(LLAMA2_13B)
    for kv_heads, share in ((40, 1), (20, 2), (8, 5)):
        cfg = cfg_of({**mha, "num_key_value_heads": kv_heads})
        assert make_plan(cfg, GPUS["h100-80gb"])["kv_bytes_per_token"] * share == 819_200
    # the bundled SmolLM2 shape: 30 layers, 3 KV heads of 64 (a third of its 9 query heads)
    smol = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "tie_word_embeddings": True, "max_position_embeddings": 8192}
    assert kv_bytes_per_token(cfg_of(smol), 2) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(cfg_of({**smol, "num_key_value_heads": 9}), 2) == 3 * 23_040
    assert make_plan(cfg_of(smol), GPUS["l4"], kv_cache_dtype="fp8")["kv_bytes_per_token"] == 23_040 // 2


def test_capacity_uses_the_engine_functions(bundled_dir):
    """For the bundled model and a fixed budget, plan's blocks are the engine's num_kv_blocks."""
    from quantkit.files import read_hf_config

    hf = read_hf_config(bundled_dir)
    budget = 3_000_000_000
    plan = make_plan(cfg_of(hf), GPUS["l4"], kv_cache_bytes=budget, max_model_len=2048)
    per_token = kv_bytes_per_token(hf, 2)
    assert per_token == 23_040
    assert plan["kv_blocks"] == num_kv_blocks(budget, 16, per_token) == budget // (16 * 23_040) == 8138
    assert plan["kv_tokens"] == 8138 * 16
    assert plan["max_concurrency_at_max_len"] == 8138 // (2048 // 16)
    # budget from the card: 24 GB x 0.9 - weights - activations
    auto = make_plan(cfg_of(hf), GPUS["l4"], quant="w4", group_size=64)
    assert auto["kv_budget_bytes"] == round(24e9 * 0.9) - auto["weights_bytes"] - auto["activation_bytes"]
    assert auto["kv_blocks"] == num_kv_blocks(auto["kv_budget_bytes"], 16, per_token)


@pytest.mark.slow
def test_plan_capacity_equals_what_the_engine_reports_at_start(bundled, caplog):
    """The same KV budget in `quantkit plan` and in the engine (kv_cache_memory): the same blocks and tokens, and
    the start-up log line carries them."""
    import logging

    from quantkit.serve.config import EngineConfig
    from quantkit.serve.engine import LLMEngine

    budget = 60_000_000
    with caplog.at_level(logging.INFO):
        engine = LLMEngine(bundled.model, bundled.tokenizer, EngineConfig(kv_cache_memory=budget, max_model_len=1024))
    plan = make_plan(cfg_of(bundled.hf_config), GPUS["l4"], kv_cache_bytes=budget, kv_cache_dtype="fp32",
                     max_model_len=1024)  # the fixture's model is fp32, so is its KV cache
    assert plan["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert engine.runner.num_blocks == plan["kv_blocks"] == budget // (16 * 46_080) == 81
    assert f"KV cache: 81 blocks, {81 * 16} tokens" in caplog.text


def test_roofline_and_cost():
    cfg = cfg_of(LLAMA2_13B)
    h100 = GPUS["h100-80gb"]
    fp16 = weight_bytes(cfg, "fp16")
    w, width = fp16.stored_bytes, 40 * 40 * 128
    # the Linears and the lm_head multiply every token; the embedding is a lookup
    matmul = 40 * (4 * 5120 * 5120 + 3 * 5120 * 13824) + 32000 * 5120
    assert fp16.device_matmul_params == matmul
    # batch 1, 1000-token context: memory bound, bytes / bandwidth
    assert roofline_step_s(w, 819_200, matmul, width, h100, 1, 1000) == pytest.approx(
        (w + 1000 * 819_200) / 3350e9, rel=1e-12)
    # an absurd batch on a slow-compute card becomes compute bound: 2 x matmul params + attention flops per token
    slow = Gpu("slow", 80, 3350, 1.0)
    flops = 64 * (2 * matmul + 4 * 40 * 40 * 128 * 1000)
    assert roofline_step_s(w, 819_200, matmul, width, slow, 64, 1000) == pytest.approx(flops / 1e12, rel=1e-12)
    plan = make_plan(cfg, h100, quant="w4", max_model_len=4096, price_per_hour=2.0)
    rows = plan["roofline"]
    assert [r["batch"] for r in rows][:4] == [1, 2, 4, 8]
    assert all(a["aggregate_tps"] < b["aggregate_tps"] for a, b in zip(rows, rows[1:]))
    assert all(a["per_user_tps"] > b["per_user_tps"] for a, b in zip(rows, rows[1:]))
    assert rows[0]["usd_per_million_tokens"] == pytest.approx(2.0 / 3600 / rows[0]["aggregate_tps"] * 1e6)
    assert cost_per_million(2.0, 1000.0) == pytest.approx(0.5555555555555556)


def test_cards_and_folder_quantization():
    assert gpu_from_args("h200", None, None, None) == GPUS["h200"]
    assert gpu_from_args("l4", 48, None, None).memory_gb == 48
    assert gpu_from_args(None, 10, 100, 5) == Gpu("custom", 10, 100, 5)
    assert gpu_from_args(None, None, None, None) == GPUS["h100-80gb"]  # bare `quantkit plan` plans for an H100
    with pytest.raises(QuantkitError, match="--memory-gb"):
        gpu_from_args(None, 10, None, None)
    with pytest.raises(QuantkitError, match="unknown card"):
        gpu_from_args("v100", None, None, None)
    assert quant_of_folder({}) == ("fp16", 128)
    assert quant_of_folder({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64}}) == ("w4", 64)
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "strategy": "channel", "group_size": None}}}}
    assert quant_of_folder({"quantization_config": ct}) == ("w8", -1)


def test_azure_workload_lengths(shared_data):
    path = shared_data / "azure-llm-trace-2023" / "AzureLLMInferenceTrace_conv.csv"
    conv = workload_lengths("azure-conv", data_dir=shared_data)
    # the reference: the trace's columns split by hand (TIMESTAMP,ContextTokens,GeneratedTokens), header skipped
    fields = [line.split(",") for line in path.read_text().splitlines()[1:] if line.strip()]
    assert len(conv) == len(fields) == 200  # the fixture: the trace's first 200 requests
    assert conv == [(int(c), int(g)) for _, c, g in fields]
    assert conv[0] == (374, 44)  # the first request of the full trace (2023-11-16 18:15:46.68)


def test_plan_cli(tmp_path, shared_data):
    from quantkit.cli import _typer_app

    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_13B))
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(_typer_app, [
        "plan", str(tmp_path), "--gpu", "a100-80gb", "--quant", "w4", "--max-model-len", "4096",
        "--workload", "azure-conv", "--price-per-hour", "1.5", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "KV cache per token: 819200 bytes (0.819 MB)" in res.output
    assert "weights w4 (group 128): 7.25 GB as stored (every parameter at bits/8 would be 6.51 GB)" in res.output
    data = json.loads(out.read_text())
    trace = shared_data / "azure-llm-trace-2023" / "AzureLLMInferenceTrace_conv.csv"  # $QUANTKIT_DATA_DIR's trace
    requests = sum(1 for line in trace.read_text().splitlines()[1:] if line.strip())
    assert data["workload"]["requests"] == requests and data["price_per_hour"] == 1.5
    res = CliRunner().invoke(_typer_app, ["plan", str(tmp_path), "--gpu", "l4"])
    assert "does not fit" in res.output  # 26 GB of fp16 weights on a 24 GB card
