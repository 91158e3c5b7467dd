"""Every family against transformers' own implementation (the independent reference).

Per family a tiny random-weight checkpoint built by transformers from its config, norms and biases perturbed, saved
with save_pretrained and loaded through quantkit's loader (so the checkpoint-name mapping is tested too): fp32 logits
below and above the sliding window, greedy continuations equal to `generate`, MoE routing and token grouping, the
per-layer attention facts, and RTN / GPTQ / AWQ end to end.
"""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quantkit.config import CalibConfig, QuantScheme
from quantkit.data import CalibData
from quantkit.formats.checkpoint import save_checkpoint
from quantkit.models import unsupported_by_paged_attention
from quantkit.models.layers import MLP
from quantkit.models.loader import load_model, load_state
from quantkit.models.model import CausalLM
from quantkit.models.registry import arch_spec
from quantkit.quant.awq import AWQ
from quantkit.quant.calibrate import calibrate, capture_stage, observed
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import dequantize
from tests.quantkit.families import FAMILIES, MOE_FAMILIES, WINDOW, saved_families

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, bundled_dir):
    """name -> (transformers model, quantkit Loaded) through save_pretrained + load_model, built once."""
    saved = saved_families(tmp_path_factory.mktemp("families"), bundled_dir)

    @functools.cache
    def get(name: str):
        hf, folder = saved(name)
        return hf, load_model(str(folder))
    return get


@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_logits_match_transformers_below_and_above_the_window(name, pairs):
    hf, loaded = pairs(name)
    for length in (8, 48):
        ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
        got, expected = loaded.model(ids), hf(ids).logits
        assert got.dtype == torch.float32 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=f"{name} at {length} tokens")


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "phi3-longrope"])  # HF switches its cache mid-way
@torch.no_grad()
def test_greedy_continuation_equals_generate(name, pairs):
    hf, loaded = pairs(name)
    g = torch.Generator().manual_seed(7)
    for length in (3, 6, 11, 20):
        ids = torch.randint(0, 128, (1, length), generator=g)
        expected = hf.generate(ids, do_sample=False, max_new_tokens=32)
        for _ in range(32):  # the dense path: the whole sequence again each step
            ids = torch.cat([ids, loaded.model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(ids, expected), name


@pytest.mark.parametrize("name", ["glm4_moe", "ernie4_5_moe"])
@torch.no_grad()
def test_corrected_routers_route_in_fp32_in_a_bf16_model(name, tmp_path_factory, bundled_dir):
    """GLM-4.5's and ERNIE 4.5's router weight and score correction bias stay fp32 in a bf16 model (transformers
    keeps them so): the same bf16 hidden states choose the same experts with the same weights as transformers' bf16
    model."""
    from transformers import AutoModelForCausalLM

    _, folder = saved_families(tmp_path_factory.mktemp(f"{name}-bf16"), bundled_dir)(name)
    hf_router = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).model.layers[1].mlp.gate
    moe = load_model(str(folder), dtype=torch.bfloat16).model.model.layers[1].mlp
    assert moe.experts[0].gate_proj.weight.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == hf_router.weight.dtype == torch.float32
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    weights, chosen = moe.select(moe.gate(x), x.dtype)  # as MoE.forward calls it
    _, hf_weights, hf_chosen = hf_router(x)
    assert torch.equal(chosen, hf_chosen)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)


@torch.no_grad()
def test_glm4_moe_router_is_written_fp32_whole_or_block_by_block(pairs):
    """The writer keeps GLM-4.5's router weight and correction bias fp32 in an fp16 checkpoint, whether it writes the
    whole model or one block at a time (bounded calibration: names relative to the block, then prefixed)."""
    from quantkit.formats.checkpoint import checkpoint_tensors

    _, loaded = pairs("glm4_moe")
    model = copy.deepcopy(loaded.model)
    calibrate(model, loaded.hf_config, None, CalibConfig.from_flat({"method": "rtn", "group_size": 32}),
              progress=False)
    whole = checkpoint_tensors(model, loaded.hf_config, "compressed-tensors", torch.float16)
    block = checkpoint_tensors(model.model.layers[1], loaded.hf_config, "compressed-tensors", torch.float16,
                               "model.layers.1.")
    for tensors in (whole, block):
        router = "model.layers.1.mlp.gate."
        assert tensors[router + "weight"].dtype == tensors[router + "e_score_correction_bias"].dtype == torch.float32
        assert tensors["model.layers.1.input_layernorm.weight"].dtype == torch.float16


def test_glm4_moe_multi_token_prediction_layers_are_not_read():
    """GLM-4.5 releases store num_nextn_predict_layers layers after the decoder's (model.layers.46 of 46)."""
    from quantkit.models.config import ModelConfig
    from quantkit.models.glm4_moe import split

    cfg = ModelConfig.from_hf(dict(FAMILIES["glm4_moe"][1], model_type="glm4_moe", vocab_size=128, hidden_size=64,
                                   intermediate_size=128, num_attention_heads=4, num_key_value_heads=2))
    w = torch.zeros(2)
    kept = split({"model.layers.2.input_layernorm.weight": w, "model.layers.3.eh_proj.weight": w,
                  "model.layers.3.input_layernorm.weight": w, "model.norm.weight": w}, cfg)
    assert set(kept) == {"model.layers.2.input_layernorm.weight", "model.norm.weight"}


@pytest.mark.parametrize("name", MOE_FAMILIES)
@torch.no_grad()
def test_moe_routes_and_groups_tokens_like_transformers(name, pairs):
    hf, loaded = pairs(name)
    ours, moe_name = loaded.model, loaded.model.family.ffn_name
    theirs, mine, rows = [], [], []  # per sparse layer: HF (weights, experts); ours; each expert's input rows
    handles = []
    for i in loaded.model.config.sparse_layers:
        hf_router = hf.model.layers[i].mlp.gate
        handles.append(hf_router.register_forward_hook(lambda m, a, out: theirs.append((out[1], out[2]))))
        moe = getattr(ours.model.layers[i], moe_name)
        handles.append(moe.register_forward_pre_hook(lambda m, a: mine.append((m, a[0].reshape(-1, a[0].shape[-1])))))
        for e, expert in enumerate(moe.experts):
            handles.append(expert.register_forward_pre_hook(lambda m, a, e=e: rows.append((e, a[0]))))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    try:
        hf(ids), ours(ids)
    finally:
        for handle in handles:
            handle.remove()
    assert len(theirs) == len(mine) == len(ours.config.sparse_layers)
    calls = iter(rows)
    for (hf_weights, hf_experts), (moe, x) in zip(theirs, mine):
        weights, chosen = moe.select(moe.gate(x))
        torch.testing.assert_close(chosen, hf_experts, atol=0, rtol=0)
        torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=0)
        for e in sorted(set(chosen.flatten().tolist())):  # one call per active expert, on exactly its tokens
            called, inputs = next(calls)
            tokens = (chosen == e).any(dim=1).nonzero().flatten()
            assert called == e and torch.equal(inputs, x[tokens])
    assert next(calls, None) is None


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@torch.no_grad()
def test_fused_3d_experts_split_into_per_expert_linears(name, pairs):
    """transformers 5's in-memory state_dict stores experts as [E, 2I, H] / [E, H, I] tensors (models/keys.py)."""
    hf, loaded = pairs(name)
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    with torch.device("meta"):
        model = CausalLM(loaded.model.config)
    load_state(model, hf.state_dict(), "memory", torch.float32)
    ids = torch.randint(0, 128, (1, 20))
    torch.testing.assert_close(model.eval()(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_attention_facts_are_data_and_the_paged_path_refuses_what_it_cannot_run(pairs):
    specs = {name: pairs(name)[1].model.attention_specs
             for name in ("llama", "gemma", "gemma2", "gemma3", "qwen2", "smollm3")}
    assert {(s.scale, s.sliding_window, s.logit_softcap) for s in specs["llama"] + specs["gemma"]} == {
        (0.25, None, None)}
    assert [(s.sliding_window, s.logit_softcap) for s in specs["gemma2"]] == [(WINDOW, 1.0), (None, 1.0)]
    assert [s.sliding_window for s in specs["gemma3"]] == [WINDOW, WINDOW, None] * 2  # 2 local : 1 global here
    assert all(s.scale == pytest.approx(24 ** -0.5) for s in specs["gemma3"])
    assert [s.sliding_window for s in specs["qwen2"]] == [None, WINDOW]
    assert [s.sliding_window for s in specs["smollm3"]] == [None, None, None, WINDOW]  # the NoPE layer slides
    assert [layer.rotary is None for layer in pairs("smollm3")[1].model.model.layers] == [False, False, False, True]
    gemma3 = pairs("gemma3")[1].model
    assert gemma3.model.layers[0].rotary is not gemma3.model.layers[2].rotary  # local vs global RoPE base
    for name in ("llama", "qwen3_moe", "mistral", "gemma", "gemma2", "gemma3", "smollm3"):  # both paged backends
        assert unsupported_by_paged_attention(pairs(name)[1].model) is None, name
    longrope = copy.deepcopy(pairs("phi3-longrope")[1].model)  # its RoPE switches until settled for a length
    reason = unsupported_by_paged_attention(longrope)
    assert reason is not None and "longrope" in reason and longrope.family.name in reason, reason
    for rotary in longrope.rotaries():
        rotary.settle(256)
    assert unsupported_by_paged_attention(longrope) is None


def test_geglu_is_not_fused_as_swiglu(pairs):
    """serve/prepare.py fuses gate/up with a SiLU epilogue only into modules whose type is exactly MLP."""
    model = pairs("gemma2")[1].model
    assert not any(type(m) is MLP for m in model.modules())
    assert sum(type(m) is MLP for m in pairs("qwen2_moe")[1].model.modules()) == 4 + 1 + 1  # experts, shared, dense


def kl(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Mean over tokens of KL(softmax(reference) || softmax(candidate)), logits [..., V]."""
    p = F.log_softmax(reference, -1)
    return float((p.exp() * (p - F.log_softmax(candidate, -1))).sum(-1).mean())


@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_rtn_gptq_awq_run_on_every_family(name, pairs):
    _, loaded = pairs(name)
    g = torch.Generator().manual_seed(11)
    calib = CalibData(torch.randint(0, 128, (12, 32), generator=g), None, torch.full((12,), 32), {}, f"tiny-{name}")
    held_out = torch.randint(0, 128, (4, 40), generator=g)
    reference = loaded.model(held_out)
    spec = arch_spec(loaded.model.config.model_type)
    divergence = {}
    for method in ("rtn", "gptq", "awq"):
        model = copy.deepcopy(loaded.model)
        cfg = CalibConfig.from_flat({"method": method, "group_size": 32, "num_samples": 12, "seq_len": 32})
        report = calibrate(model, loaded.hf_config, calib if method != "rtn" else None, cfg, progress=False)
        quantized = {n for n, m in model.named_modules() if isinstance(m, QLinear)}
        expected = {f"model.layers.{i}.{n}" for i, block in enumerate(model.model.layers)
                    for n in spec.in_block(block).linears}
        assert quantized == expected == {e["name"] for e in report}, method
        assert all(torch.isfinite(dequantize(m.qtensor())).all() for m in model.modules() if isinstance(m, QLinear))
        assert not any(isinstance(m, QLinear) for n, m in model.named_modules() if n.endswith(("gate", "_gate")))
        divergence[method] = kl(reference, model(held_out))
    assert divergence["gptq"] <= divergence["rtn"] and divergence["awq"] <= divergence["rtn"], divergence


@pytest.mark.parametrize("name", ["gemma", "gemma2", "mixtral", "qwen2_moe", "granite", "olmo2"])
@torch.no_grad()
def test_awq_folding_keeps_logits(name, pairs):
    """Gemma's norms scale by (1 + w) (Gemma 1: the pre-norm block's two, Gemma 2: the sandwich's input and
    pre-feedforward ones); an MoE block's router (and shared-expert gate) is scaled with its experts; Granite's
    multipliers act outside every folded pair; OLMo 2's block folds v -> o and up -> down alone."""
    model = copy.deepcopy(pairs(name)[1].model)
    spec = arch_spec(model.config.model_type)
    awq = AWQ(QuantScheme(4, 32, sym=False), spec, n_grid=4)
    ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(5))
    reference, x, positions = model(ids), model.embed(ids), torch.arange(24)
    for block in model.model.layers:
        bspec = spec.in_block(block)
        names = list(bspec.linears)
        stats = capture_stage(block, observed(names, bspec), x, torch.ones(ids.shape, dtype=torch.bool), positions,
                              awq.needs, 4, "", "cpu", bspec.router)
        awq.search_and_fold(block, names, stats)
        x = block(x, positions)
    torch.testing.assert_close(model(ids), reference, atol=1e-4, rtol=0)


@torch.no_grad()
def test_olmo2_block_has_no_input_norms_and_its_norms_round_as_transformers(pairs):
    """No norm feeds q/k/v or gate/up (AWQ scales v -> o and up -> down alone); q_norm spans the whole projection
    (Hq * D); every norm rounds its fp32 product with the weight once, as transformers' Olmo2RMSNorm (Llama's
    RMSNorm rounds before the product): bit for bit in bf16."""
    hf, loaded = pairs("olmo2")
    ours, theirs = loaded.model.model.layers[0], hf.model.layers[0]
    assert not hasattr(ours, "input_layernorm") and ours.self_attn.q_norm.weight.shape == (4 * 16,)
    assert [(g.prev, g.linears) for g in arch_spec("olmo2").in_block(ours).awq_groups] == [
        ("self_attn.v_proj", ("self_attn.o_proj",)), ("mlp.up_proj", ("mlp.down_proj",))]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    for name in ("self_attn.q_norm", "self_attn.k_norm", "post_feedforward_layernorm"):
        norm, reference = (copy.deepcopy(m.get_submodule(name)).bfloat16() for m in (ours, theirs))
        assert torch.equal(norm(x), reference(x)), name


@pytest.mark.parametrize("name, layout", [("mixtral", "gptq"), ("qwen2_moe", "awq"),
                                          ("qwen3_moe", "compressed-tensors"), ("phi3", "gptq_v2"), ("gemma3", "gptq")])
@torch.no_grad()
def test_quantized_checkpoints_round_trip_with_routers_left_float(name, layout, pairs, tmp_path):
    _, loaded = pairs(name)
    model = copy.deepcopy(loaded.model)
    cfg = CalibConfig.from_flat({"method": "rtn", "group_size": 32, "sym": layout == "gptq", "format": layout})
    calibrate(model, loaded.hf_config, None, cfg, progress=False)
    out = save_checkpoint(tmp_path / "q", model, loaded.hf_config, loaded.tokenizer, layout, {"method": "rtn"})
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    floats = {n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"}
    assert bool(floats) == (name in MOE_FAMILIES) and all(n.endswith(("gate", "shared_expert_gate")) for n in floats)
    listed = json.dumps(qcfg.get("dynamic") or qcfg.get("modules_to_not_convert") or qcfg.get("ignore"))
    listed = listed.replace("\\\\", "")  # GPTQ's dynamic keys are escaped regexes
    assert all(n in listed for n in floats), listed
    if layout.startswith("gptq"):
        assert not any("{e}" in n for stage in qcfg["modules_in_block_to_quantize"] for n in stage)
    ids = torch.randint(0, 128, (2, 20))
    torch.testing.assert_close(load_model(str(out)).model(ids), model(ids), atol=1e-4, rtol=0)
