"""quantkit/benchmark/step.py (`quantkit bench step`) on a tiny random model: the table's columns and rows, and
every step's kernel time inside its wall time (no timing thresholds)."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from quantkit.benchmark.step import COLUMNS, KernelTimer, busy_seconds, format_table, profile_steps, stream_bytes
from quantkit.cli import _typer_app
from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.serve.config import EngineConfig
from quantkit.serve.engine import LLMEngine
from tests.conftest import tiny_hf_config


def tiny_engine() -> LLMEngine:
    from quantkit.models.loader import load_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config(vocab_size=128))).eval()
    cfg = EngineConfig(kv_cache_memory=1 << 22, max_model_len=128, block_size=4, max_num_seqs=4)
    return LLMEngine(model, load_tokenizer(None), cfg, eos_token_ids=[2])


def test_step_table_for_batch_1_and_2():
    engine = tiny_engine()
    rows = profile_steps(engine, [1, 2], prompt_len=8, steps=3, bandwidth=1e10)
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["kernel_s"] <= r["wall_s"]
        assert r["kernel_calls"] > 0 and r["kv_bytes"] > 0 and r["weight_bytes"] > 0
    assert not engine.has_unfinished()  # the profiler's requests are gone
    lines = format_table(rows).splitlines()
    assert lines[0] == "| " + " | ".join(COLUMNS) + " |"
    cells = [line.strip("| ").split(" | ") for line in lines[2:4]]
    assert [c[0] for c in cells] == ["1", "2"] and all(len(c) == len(COLUMNS) for c in cells)
    for c in cells:
        wall, kernels, host = (float(v) for v in c[1:4])
        assert wall >= kernels and abs(wall - kernels - host) < 0.02
    assert lines[4].startswith("copy bandwidth")
    assert lines[5].startswith("batch 1 kernels per step: ") and lines[6].startswith("batch 2 kernels per step: ")
    assert abs(sum(sec for sec, _ in rows[0]["kernels"].values()) - rows[0]["kernel_s"]) < 1e-9


def test_weights_count_what_a_step_streams():
    """fp32 tiny model: every Linear weight and norm, not the embedding table (untied)."""
    model = tiny_engine().runner.model
    expected = sum(p.numel() * 4 for name, p in model.named_parameters() if "embed_tokens" not in name)
    assert stream_bytes(model) == expected


def test_a_triton_weight_counts_its_packed_tensors():
    """On CUDA a QLinear streams its Triton PackedWeight (a dataclass): its qweight, scales and zeros, once."""
    from quantkit.config import QuantScheme
    from quantkit.kernels.triton.repack import repack_ref
    from quantkit.quant.qlinear import QLinear
    from quantkit.quant.scheme import quantize_rtn

    qt = quantize_rtn(torch.randn(64, 256), QuantScheme(bits=4, group_size=128, sym=True))
    layer = QLinear.from_qtensor(qt)
    pw = repack_ref(qt)
    layer._prepared["triton"] = pw  # what QLinear.prepared("triton") holds on a GPU
    assert stream_bytes(torch.nn.Sequential(layer)) == sum(t.nbytes for t in (pw.qweight, pw.scales, pw.zeros))
    assert pw.qweight.nbytes == 256 * 64 // 2 and pw.scales.nbytes == 2 * 64 * 2


def test_busy_time_is_the_union_of_the_kernels_intervals():
    """DeviceKernelTimer's busy time (microsecond spans -> seconds): overlaps and nested spans count once."""
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(20.0, 30.0), (0.0, 10.0), (5.0, 15.0), (22.0, 25.0)]) == 25e-6
    assert busy_seconds([(0.0, 4.0), (4.0, 6.0)]) == 6e-6


def test_timer_restores_what_it_wrapped():
    linear = torch.nn.functional.linear
    engine = tiny_engine()
    with KernelTimer(engine.runner).active():
        assert torch.nn.functional.linear is not linear
    assert torch.nn.functional.linear is linear


def test_cli_refuses_bad_batch_sizes():
    result = CliRunner().invoke(_typer_app, ["bench", "step", "--batch", "0,x"])
    assert result.exit_code != 0 and "--batch" in str(result.exception or result.output)


def test_a_moe_block_counts_the_experts_a_step_routes_to(family_folder):
    """Qwen3-MoE, 4 experts, top-2: one token reads 2 of each block's 4 experts; 3 tokens, uniformly routed, an
    expected 1 - (1/2)^3 of them."""
    from quantkit.models.loader import load_model
    from quantkit.models.moe import MoE

    model = load_model(str(family_folder("qwen3_moe")), dtype=torch.float32).model
    head = model.lm_head.weight.data_ptr()
    every = {p.data_ptr(): p.nbytes for name, p in model.named_parameters()
             if "embed_tokens" not in name or p.data_ptr() == head}
    experts = [sum(p.nbytes for p in block.experts.parameters()) for block in model.modules() if isinstance(block, MoE)]
    assert experts and all(block.top_k == 2 and len(block.experts) == 4
                           for block in model.modules() if isinstance(block, MoE))
    assert stream_bytes(model) == sum(every.values()) - sum(experts) // 2
    assert stream_bytes(model, 3) == sum(every.values()) - sum(e // 8 for e in experts)
