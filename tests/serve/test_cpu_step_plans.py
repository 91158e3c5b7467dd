"""Decode steps replayed as recorded C kernel calls (serve/cpu_step_plans.py, kernels/cpu/step_plan.py): the plan's
logits and KV writes equal the eager forward's bit for bit in bf16, for bf16, W4, W8 and mixed-width weights, with
biases, q/k norms and sliding windows, in batch-invariant serving and without it; which models and batch sizes
get a plan; the engine's greedy tokens and logprobs with plans on and off; the replay reading torch's thread count
and the inputs written into its buffers, and the recorder refusing what a kernel does not take."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from quantkit.benchmark.step import rtn_quantize_linears
from quantkit.config import QuantScheme
from quantkit.kernels.cpu import gemm as cpu_gemm
from quantkit.kernels.cpu import gemv, step_plan
from quantkit.kernels.cpu.capability import onednn_bf16
from quantkit.models.loader import load_model
from quantkit.quant.qlinear import QLinear, packed_kernel
from quantkit.quant.scheme import quantize_rtn
from quantkit.serve.config import EngineConfig
from quantkit.serve.cpu_linear import can_pack
from quantkit.serve.engine import LLMEngine
from quantkit.serve.model_runner import ModelRunner
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.validation import validate_request

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not (step_plan.available() and can_pack(torch.bfloat16, torch.device("cpu"))),
                                 reason="no C kernels or no oneDNN bf16 here: plans never run")]

BLOCK, MAX_MODEL_LEN = 4, 128
W4, W8 = QuantScheme(bits=4, group_size=32, sym=False), QuantScheme(bits=8, group_size=32, sym=True)
needs_gemv = pytest.mark.skipif(not gemv.available(), reason="no AVX2 + FMA + F16C: W4/W8 decode has no C GEMV here")


def quantized(model, weights: str):
    """The model with its decoder linears as RTN QLinears: w4, w8, or mixed (q_proj and gate_proj 8-bit, the rest
    4-bit: no q/k/v or gate/up fusion, so every linear and the SiLU run alone)."""
    if weights in ("w4", "w8"):
        rtn_quantize_linears(model, W4 if weights == "w4" else W8)
    elif weights == "mixed":
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    scheme = W8 if name in ("q_proj", "gate_proj") else W4
                    bias = None if child.bias is None else child.bias.detach()
                    setattr(parent, name, QLinear.from_qtensor(quantize_rtn(child.weight.detach().float(), scheme),
                                                               bias))
    return model


def runner_for(folder, weights="bf16", batch_invariant=True, plans=True):
    loaded = load_model(str(folder), dtype=torch.bfloat16)
    cfg = EngineConfig(block_size=BLOCK, kv_cache_memory=4 << 20, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                       batch_invariant=batch_invariant, cpu_step_plans=plans)
    return ModelRunner(quantized(loaded.model, weights), cfg, "cpu", torch.bfloat16, MAX_MODEL_LEN)


def prefilled(runner, n, seed=0):
    """n random prompts (3-30 tokens) prefilled into distinct blocks -> decode feeds (next token, its position, a
    block table with room for it)."""
    rng = random.Random(seed)
    feeds, next_block = [], 0
    runner.kv_pool.zero_()  # no stray NaN bit patterns of the uninitialised pool in the comparisons
    for _ in range(n):
        prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(3, 31))]
        blocks = list(range(next_block, next_block + len(prompt) // BLOCK + 2))  # room for 4 more tokens
        next_block += len(blocks)
        runner.last_logits([(prompt, 0, blocks)], sample=False)
        feeds.append(([rng.randrange(3, 128)], len(prompt), blocks))
    return feeds


@torch.inference_mode()
def plan_and_eager(runner, feeds):
    """(plan logits, eager logits, plan KV, eager KV) of one decode step of feeds, from the same KV state."""
    before = runner.kv_pool.clone()
    eager = runner.last_logits(feeds)
    eager_kv = runner.kv_pool.clone()
    runner.kv_pool.copy_(before)
    input_ids, positions, meta, _ = runner.flatten(feeds)
    got = runner.plans.logits(SimpleNamespace(input_ids=input_ids, positions=positions, meta=meta), len(feeds))
    return got.clone(), eager, runner.kv_pool.clone(), eager_kv  # (got lives in a buffer the next replay reuses)


# llama: plain; qwen2: q/k/v biases, layer 1 sliding; qwen3: q/k RMSNorm; phi3: fused gate_up split at load;
# qwen3-yarn, phi3-longrope (settled on its long factors by the serving length): cos/sin scaled by a factor;
# phi4-mini: RoPE on 12 of each head's 16 dims; smollm3: layer 3 without RoPE (no rope call), sliding; granite:
# embeddings, o and down scaled by its multipliers, logits divided after the replay; ernie4_5: every Linear biased,
# q/k rows reordered from RoPE pairs at load; glm: the same on half of each head's dims; gemma: embeddings scaled,
# (1 + w) norms rounded once from fp32, GeGLU; gemma2: sandwich blocks, soft-capped attention and logits, sliding;
# gemma3: per-head (1 + w) q/k norms, a RoPE base per layer type; glm4: GLM-4-0414's sandwich; olmo2: post-norm
# blocks, q/k norms over the whole projection; exaone4: post-norm, per-head q/k norms, NoPE full layers; cohere:
# parallel blocks, LayerNorm, logits scaled; hunyuan: q/k norms after RoPE; ministral3: queries scaled by position
# (from 16 on: the steps reach position 33); starcoder2: LayerNorm with biases, gelu MLP without gate, all biased;
# nemotron: LayerNorm1P, relu^2 MLP, half-head RoPE; mixtral (sliding), qwen3_moe (q/k norms), olmoe, hunyuan_moe
# (a shared MLP added), qwen2_moe (a sigmoid-gated shared expert; layer 1 dense), glm4_moe (grouped sigmoid) and
# ernie4_5_moe (corrected softmax): MoE blocks as one
# moe_forward call, experts on the rowwise GEMM (bf16) or the GEMV / GEMM (W4, W8)
CASES = [("llama", "bf16"), ("qwen2", "bf16"), ("qwen3", "bf16"), ("phi3", "bf16"), ("qwen3-yarn", "bf16"),
         ("phi3-longrope", "bf16"), ("phi4-mini", "bf16"), ("smollm3", "bf16"), ("granite", "bf16"),
         ("ernie4_5", "bf16"), ("glm", "bf16"), ("gemma", "bf16"), ("gemma2", "bf16"), ("gemma3", "bf16"),
         ("glm4", "bf16"), ("olmo2", "bf16"), ("exaone4", "bf16"), ("cohere", "bf16"), ("hunyuan", "bf16"),
         ("ministral3", "bf16"), ("starcoder2", "bf16"), ("nemotron", "bf16"), ("mixtral", "bf16"),
         ("qwen3_moe", "bf16"), ("olmoe", "bf16"), ("hunyuan_moe", "bf16"), ("glm4_moe", "bf16"), ("qwen2_moe", "bf16"),
         ("ernie4_5_moe", "bf16"), pytest.param("glm4_moe", "w4", marks=needs_gemv),
         pytest.param("qwen3_moe", "w4", marks=needs_gemv), pytest.param("hunyuan_moe", "w4", marks=needs_gemv),
         pytest.param("mixtral", "w8", marks=needs_gemv),
         pytest.param("gemma3", "w4", marks=needs_gemv), pytest.param("cohere", "w8", marks=needs_gemv),
         pytest.param("granite", "w4", marks=needs_gemv),
         pytest.param("llama", "w4", marks=needs_gemv), pytest.param("qwen2", "w4", marks=needs_gemv),
         pytest.param("qwen3", "w8", marks=needs_gemv), pytest.param("llama", "mixed", marks=needs_gemv),
         pytest.param("qwen2", "mixed", marks=needs_gemv)]


@pytest.mark.parametrize("name, weights", CASES)
@pytest.mark.parametrize("n", [1, 3, 4, 7])  # 7: W4/W8 on the AMX GEMM, or the rowwise GEMM without AMX
def test_plan_logits_and_kv_equal_the_eager_forward_bit_for_bit(family_folder, name, weights, n):
    if weights != "bf16" and packed_kernel(n) is None:
        pytest.skip(f"{n} rows of W4/W8 have no C kernel here: those steps run eagerly")
    runner = runner_for(family_folder(name), weights)
    feeds = prefilled(runner, n)
    assert runner.plans.plan(n) is not None
    for step in range(3):  # the buffers refilled each step; positions and block tables move on
        got, eager, kv, eager_kv = plan_and_eager(runner, feeds)
        assert got.dtype == torch.float32 and got.shape == (n, 128)
        assert torch.equal(got, eager), step
        assert torch.equal(kv, eager_kv), step
        runner.kv_pool.copy_(eager_kv)
        feeds = [([int(row.argmax())], pos + 1, blocks) for row, (_, pos, blocks) in zip(eager, feeds)]


@needs_gemv
def test_the_decode_kernel_path_without_batch_invariance(family_folder):
    """batch_invariant off: the decode attention kernel (paged_decode) instead of the row kernel; bf16 linears then
    run on AMX's tile GEMM where it runs, else on oneDNN where it has bf16 kernels (no C entry point: a model of
    bf16 decoder linears then gets no plan, and the bf16 lm_head of a W4 one runs after the replay), else (AVX2)
    on the rowwise GEMM."""
    runner = runner_for(family_folder("llama"), "w4", batch_invariant=False)
    assert runner.attn.rows_kernel is None and runner.attn.decode_kernel is not None
    feeds = prefilled(runner, 2)
    got, eager, kv, eager_kv = plan_and_eager(runner, feeds)
    assert torch.equal(got, eager) and torch.equal(kv, eager_kv)
    on_onednn = runner.model.lm_head.kernel == "onednn"
    assert on_onednn == (onednn_bf16() and not cpu_gemm.available())
    assert runner.plans.eager_head == ({2} if on_onednn else set())
    bf16_plan = runner_for(family_folder("llama"), "bf16", batch_invariant=False).plans.plan(1)
    assert (bf16_plan is None) == on_onednn


@needs_gemv
def test_w4_batches_above_the_gemv_rows_get_a_plan_on_the_gemm_that_takes_them(family_folder):
    runner = runner_for(family_folder("llama"), "w4")
    assert runner.plans.plan(gemv.MAX_ROWS) is not None
    assert packed_kernel(gemv.MAX_ROWS + 1) in ("amx", "rowwise")
    assert runner.plans.plan(gemv.MAX_ROWS + 1) is not None
    assert runner_for(family_folder("llama"), "bf16").plans.plan(8) is not None  # AMX's or the rowwise GEMM: any rows


def test_models_plans_do_not_cover_say_why(family_folder, caplog):
    """Gemma 2's soft-capped attention without batch invariance: the decode kernel (paged_decode) has no soft-cap."""
    with caplog.at_level("INFO", logger="quantkit.serve"):
        runner = runner_for(family_folder("gemma2"), batch_invariant=False)
    reason = "attention the decode kernel does not compute"
    assert runner.plans is None
    assert any("decode step plans off" in r.message and reason in r.message for r in caplog.records)


def test_fp32_and_the_off_switch_run_eagerly(family_folder):
    loaded = load_model(str(family_folder("llama")), dtype=torch.float32)
    cfg = EngineConfig(block_size=BLOCK, kv_cache_memory=4 << 20, max_model_len=MAX_MODEL_LEN)
    assert ModelRunner(loaded.model, cfg, "cpu", torch.float32, MAX_MODEL_LEN).plans is None
    assert runner_for(family_folder("llama"), plans=False).plans is None


def engine_run(folder, weights, plans):
    """Six greedy requests with logprobs, of different lengths (the batch shrinks from 6 to 1 as they finish)."""
    loaded = load_model(str(folder), dtype=torch.bfloat16)
    quantized(loaded.model, weights)
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(
        block_size=BLOCK, kv_cache_memory=4 << 20, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
        cpu_step_plans=plans), eos_token_ids=[])
    rng = random.Random(1)
    for i in range(6):
        prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(4, 20))]
        params = SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=3)
        engine.add_request(f"r{i}", validate_request(prompt, params, 128, MAX_MODEL_LEN, 8))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
    recorded = sorted(engine.runner.plans.plans) if plans else []
    return done, recorded


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])  # qwen3_moe: its MoE blocks one C call, eager or planned
@pytest.mark.parametrize("weights", ["bf16", pytest.param("w4", marks=needs_gemv)])
def test_engine_tokens_and_logprobs_are_the_same_with_plans_on_and_off(family_folder, name, weights):
    on, recorded = engine_run(family_folder(name), weights, plans=True)
    off, _ = engine_run(family_folder(name), weights, plans=False)
    assert on == off and len(on) == 6
    assert {1, 2, 3, 4} <= set(recorded)  # the plain decode steps of the shrinking batch ran plans


def test_a_replay_reads_its_input_buffers_and_the_thread_count(family_folder):
    runner = runner_for(family_folder("llama"))
    feeds = prefilled(runner, 2)
    got_one, eager, _, _ = plan_and_eager(runner, feeds)
    torch.set_num_threads(2)  # the one_thread fixture restores it
    got_two, _, _, _ = plan_and_eager(runner, feeds)
    assert torch.equal(got_one, eager) and torch.equal(got_two, eager)
    other = [([tok + 1], pos, blocks) for (tok,), pos, blocks in feeds]
    got_other, eager_other, _, _ = plan_and_eager(runner, other)
    assert torch.equal(got_other, eager_other) and not torch.equal(got_other, got_one)


def test_the_recorder_refuses_what_a_kernel_does_not_take():
    plan = step_plan.Plan()
    bf = torch.bfloat16
    with pytest.raises(ValueError, match="add_rms_norm"):
        plan.add_rms_norm(torch.zeros(2, 64, dtype=bf), None, None, torch.ones(32, dtype=bf),
                          torch.zeros(2, 64, dtype=bf), 1e-6)
    with pytest.raises(ValueError, match="copy_rows"):
        plan.copy_rows(torch.zeros(4, 8, dtype=bf), torch.zeros(3, dtype=torch.int32), torch.zeros(3, 8, dtype=bf))
    with pytest.raises(ValueError, match="add_rows"):
        plan.add_rows(torch.zeros(2, 8, dtype=bf), torch.zeros(3, 8, dtype=bf))
    with pytest.raises(ValueError, match="scale_rows"):
        plan.scale_rows(torch.zeros(2, 8), 0.5)
    with pytest.raises(ValueError, match="scale_rows_at"):  # int32 positions
        plan.scale_rows_at(torch.zeros(2, 8, dtype=bf), torch.zeros(2, dtype=torch.int32), torch.ones(4, dtype=bf))
    with pytest.raises(ValueError, match="add_fp32_norm"):  # an fp32 weight for bf16 rows
        plan.add_fp32_norm(torch.zeros(2, 64, dtype=bf), None, None, torch.ones(64), torch.zeros(2, 64, dtype=bf),
                           1e-6, 1.0, False)
    with pytest.raises(ValueError, match="activation 'gelu'"):  # not a kind of fused.ACTIVATIONS
        plan.activation(torch.zeros(2, 8, dtype=bf), torch.zeros(2, 8, dtype=bf), "gelu")
    with pytest.raises(ValueError, match="gelu_tanh_mul"):
        plan.gelu_tanh_mul(torch.zeros(2, 8, dtype=bf), torch.zeros(2, 4, dtype=bf), torch.zeros(2, 8, dtype=bf))
    with pytest.raises(ValueError, match="rope"):
        plan.rope(torch.zeros(2, 4, 16, dtype=bf), torch.zeros(2, 2, 16, dtype=bf), torch.zeros(3, dtype=torch.int64),
                  torch.zeros(8, 16))
    packed = (torch.zeros(2, 32, 16, dtype=torch.uint8), torch.zeros(2, 2, 2, 16, dtype=torch.float16), 32)
    with pytest.raises(ValueError, match="qgemv"):
        plan.qgemv(torch.zeros(5, 64, dtype=bf), packed, 4, torch.zeros(5, 32, dtype=bf))  # above MAX_ROWS
    with pytest.raises(ValueError, match="rowwise_qgemm"):
        plan.rowwise_qgemm(torch.zeros(5, 64, dtype=bf), packed, 4, torch.zeros(5, 16, dtype=bf))  # y of act's width
    with pytest.raises(ValueError, match="qgemm"):  # no AMX here, or a y of act's width
        plan.qgemm(torch.zeros(5, 64, dtype=bf), packed, 4, torch.zeros(5, 16, dtype=bf))
    with pytest.raises(ValueError, match="gemm_bf16"):  # no AMX here, or a y of the wrong width
        plan.gemm_bf16(torch.zeros(5, 64, dtype=bf), torch.zeros(2, 32, 16, dtype=torch.int32),
                       torch.zeros(5, 16, dtype=bf))
    assert len(plan) == 0
