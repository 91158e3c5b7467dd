"""Mixed precision end to end on a tiny random-weight model with the bundled tokenizer: the bits per weight each
layout stores (counted from the bytes written), the exact knapsack against brute force, the per-module rules every
reader matches (compressed-tensors' own matcher, vLLM's fused names), mixed checkpoints written, read back, resumed,
served (quantkit.LLM greedy = the dense dequantized model) and loaded in transformers; `--target-bpw` within 0.05
of its target and below uniform W4 g64's KL; `--max-delta` stopping at a passing mix whose next more aggressive mix
fails."""

from __future__ import annotations

import copy
import itertools
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from quantkit.config import CalibConfig, QuantScheme
from quantkit.errors import QuantkitError
from quantkit.formats import awq, compressed_tensors, gptq
from quantkit.formats.checkpoint import qlinear_modules, read_quantized, save_checkpoint
from quantkit.formats.footprint import linear_bits, stored_bits
from quantkit.formats.module_patterns import module_patterns
from quantkit.models.loader import load_model
from quantkit.quant.calibrate import calibrate
from quantkit.quant.mixed_precision import Item, Knapsack
from quantkit.quant.scheme import dequantize, quantize_rtn
from tests.conftest import REPO
from tests.evals.evals_tiny import save_tiny, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

W4G32, W4G64, W8 = (QuantScheme(4, 32), QuantScheme(4, 64), QuantScheme(8, -1))
# a mix of every kind: float, W8 per-channel, W4 g64 and (the base) W4 g32; one scheme per fused set (q/k/v, gate/up)
MIX = {**{f"model.layers.0.self_attn.{p}_proj": None for p in "qkv"},
       "model.layers.0.mlp.down_proj": W8, "model.layers.1.mlp.gate_proj": W4G64, "model.layers.1.mlp.up_proj": W4G64,
       "model.layers.1.self_attn.o_proj": W8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(save_tiny(tiny_model(), tmp_path_factory.mktemp("tiny") / "model")))


def mixed_config(layout: str, method: str = "rtn", **kw) -> CalibConfig:
    return CalibConfig(method=method, scheme=W4G32, layout=layout, layer_schemes=MIX, num_samples=8, seq_len=64, **kw)


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    """layout -> (the mixed RTN model in memory, its checkpoint folder), built once."""
    root, made = tmp_path_factory.mktemp("mixed"), {}

    def get(layout: str):
        if layout not in made:
            model = copy.deepcopy(tiny.model)
            calibrate(model, tiny.hf_config, None, mixed_config(layout), progress=False)
            made[layout] = model, save_checkpoint(root / layout, model, tiny.hf_config, tiny.tokenizer, layout,
                                                  {"method": "rtn", "base_model": tiny.source})
        return made[layout]
    return get


# ------------------------------------------------------------------------------------------------ bits per weight


@pytest.mark.parametrize("layout, bits, group_size, sym", [
    (layout, b, g, sym) for layout in ("gptq_v2", "awq", "compressed-tensors") for b, g in ((4, 32), (4, 128), (8, -1))
    for sym in (True, False) if not (layout == "awq" and (b == 8 or g == -1))] + [("gptq", 4, 64, True)])
def test_linear_bits_is_what_the_writer_writes(layout, bits, group_size, sym):
    n, k = 96, 256
    qt = quantize_rtn(torch.randn(n, k), QuantScheme(bits, group_size, sym))
    if layout.startswith("gptq"):
        tensors = gptq.linear_tensors(qt, "m", v1=layout == "gptq")
    else:
        tensors = (awq if layout == "awq" else compressed_tensors).linear_tensors(qt, "m")
    written = 8 * sum(t.numel() * t.element_size() for t in tensors.values())
    assert linear_bits(layout, QuantScheme(bits, group_size, sym), n, k) == written
    assert linear_bits(layout, None, n, k, float_bits=16) == 16 * n * k


def test_the_footprint_formula_of_the_docstring():
    """W4 g64 with fp16 scales and packed 4-bit zeros: 4 + 16/64 + 4/64 = 4.3125 bits, plus g_idx's 32 / N (GPTQ)."""
    assert linear_bits("gptq", W4G64, 576, 576) / (576 * 576) == 4.3125 + 32 / 576
    assert linear_bits("compressed-tensors", W4G64, 576, 576) / (576 * 576) == 4.25 + 128 / (576 * 576)


@pytest.mark.parametrize("layout", ["gptq", "compressed-tensors"])
def test_stored_bits_of_a_mixed_folder_equal_the_sum_of_linear_bits(layout, mixed, tiny):
    model, folder = mixed(layout)
    shapes = {f"model.layers.{i}.{n}": tuple(m.weight.shape) for i, block in enumerate(tiny.model.model.layers)
              for n, m in block.named_modules() if type(m) is nn.Linear}
    planned = sum(linear_bits(layout, MIX.get(name, W4G32), n, k, float_bits=32) for name, (n, k) in shapes.items())
    assert stored_bits(folder, shapes, "llama") == (planned, sum(n * k for n, k in shapes.values()))


# ------------------------------------------------------------------------------------------------- the knapsack


def test_knapsack_is_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    items = []
    for j in range(6):
        bits = np.sort(rng.integers(1000, 9000, 3))  # cheapest first, as candidates are
        loss = np.sort(rng.random(3))[::-1].copy()
        loss[-1] = 0.0
        items.append(Item((f"l{j}",), 1000, ("a", "b", "c"), tuple(int(b) for b in bits), tuple(float(x) for x in loss)))
    sack = Knapsack(items)
    unit = 1e-4 * sack.weights  # bits per budget unit
    combos = list(itertools.product(range(3), repeat=6))
    loss = lambda c: sum(it.loss[o] for it, o in zip(items, c))  # noqa: E731
    for bpw in np.linspace(sack.lowest * 1e-4, 9.0, 25):
        plan = sack.plan(float(bpw))
        assert sack.bpw(plan) <= bpw + 1e-12
        # the DP solves the problem with every cost rounded up to whole units exactly; the unrounded optimum can
        # only be as good or better
        budget = int(np.floor(bpw / 1e-4 + 1e-6))
        rounded = min(loss(c) for c in combos if sum(np.ceil(it.bits[o] / unit) for it, o in zip(items, c)) <= budget)
        exact = min(loss(c) for c in combos if sum(it.bits[o] for it, o in zip(items, c)) <= bpw * sack.weights)
        assert sack.loss(plan) == pytest.approx(rounded, abs=1e-12) and exact <= sack.loss(plan) + 1e-12
    with pytest.raises(QuantkitError, match="is below the smallest mix"):
        sack.plan(sack.lowest * 1e-4 - 0.01)


# ----------------------------------------------------------------------------------- per-module rules, per reader


NAMES = [f"model.layers.{i}.{p}" for i in range(12) for p in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
    "mlp.down_proj")]
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def vllm_names():
    """The module names vLLM's Llama builds: fused qkv_proj and gate_up_proj."""
    return [f"model.layers.{i}.{p}" for i in range(12) for p in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                  "mlp.gate_up_proj", "mlp.down_proj")]


def test_module_patterns_match_exactly_the_set_under_both_namings():
    from compressed_tensors.utils.match import match_name

    chosen = {n for n in NAMES if int(n.split(".")[2]) in (1, 3, 10) and "self_attn" in n and "o_proj" not in n}
    chosen |= {"model.layers.3.mlp.down_proj", "model.layers.11.mlp.down_proj", "model.layers.2.mlp.gate_proj",
               "model.layers.2.mlp.up_proj", "model.layers.5.mlp.up_proj"}  # 5: gate_up only half in
    patterns = module_patterns(chosen)
    assert {n for n in NAMES if any(re.match(p, n) for p in patterns)} == chosen
    fused_in = {f"model.layers.{i}.self_attn.qkv_proj" for i in (1, 3, 10)} | {"model.layers.2.mlp.gate_up_proj"}
    assert {n for n in vllm_names() if any(re.match(p, n) for p in patterns)} == fused_in | (chosen & set(vllm_names()))
    # compressed-tensors' own matcher (transformers loads through it; vLLM's newer versions too, with the fused map)
    assert {n for n in NAMES if any(match_name(n, f"re:{p}") for p in patterns)} == chosen
    assert {n for n in vllm_names() if any(match_name(n, f"re:{p}", FUSED) for p in patterns)} >= fused_in


@pytest.mark.parametrize("layout", ["gptq", "gptq_v2", "compressed-tensors"])
def test_mixed_folders_read_back_each_module_in_its_own_scheme(layout, mixed):
    model, folder = mixed(layout)
    read = read_quantized(folder).qlinears
    written = qlinear_modules(model)
    assert read.keys() == written.keys() and not read.keys() & {n for n, s in MIX.items() if s is None}
    for name, m in written.items():
        assert (m.bits, m.group_size) == ((MIX.get(name) or W4G32).bits, (MIX.get(name) or W4G32).group_size), name
        assert read[name][0].equal(m.qtensor()), name
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    floats = {n for n, s in MIX.items() if s is None}
    if layout.startswith("gptq"):
        assert (qcfg["bits"], qcfg["group_size"]) == (4, 32)  # the most common scheme on top
        negative = [k[2:] for k in qcfg["dynamic"] if k.startswith("-:")]
        assert any(re.match(p, "model.layers.0.self_attn.qkv_proj") for p in negative)  # vLLM's fused name
        assert {n for n in NAMES if any(re.match(p, n) for p in negative)} == floats
    else:
        assert set(qcfg["ignore"]) == {"lm_head"} | floats
        assert all(t.startswith("re:") for g in qcfg["config_groups"].values() for t in g["targets"])


def test_awq_refuses_a_mix_naming_the_layouts_that_hold_one(tiny):
    model = copy.deepcopy(tiny.model)
    calibrate(model, tiny.hf_config, None, mixed_config("compressed-tensors"), progress=False)
    with pytest.raises(QuantkitError, match="a awq checkpoint holds one scheme .*gptq, gptq_v2 or compressed-tensors"):
        save_checkpoint("/nonexistent/never-written", model, tiny.hf_config, None, "awq", {"method": "rtn"})
    with pytest.raises(QuantkitError, match="per-layer schemes take --method gptq or rtn"):
        mixed_config("gptq", method="awq")


def test_a_mix_request_is_checked_before_any_weight_loads():
    from quantkit.quant.mixed_precision import check_request

    cfg = CalibConfig(method="gptq", scheme=W4G32, layout="gptq")
    assert [t.metric for t in check_request(cfg, None, ["kl=0.05", "ppl=+3%"])] == ["kl_mean", "ppl"]
    for args, message in [((cfg, 4.5, ["kl=0.05"]), "give one of --target-bpw and --max-delta"),
                          ((cfg, None, []), "give one of --target-bpw and --max-delta"),
                          ((cfg, 4.5, [], "w4g64,w9x"), "--mix-schemes: scheme 'w9x' is not a scheme name"),
                          ((cfg, 4.5, [], "float"), "name at least one quantized scheme"),
                          ((CalibConfig(method="awq", scheme=W4G32, layout="awq"), 4.5, []), "AWQ searches one scale"),
                          ((CalibConfig(method="rtn", scheme=QuantScheme(4, 32, sym=False), layout="awq"), 4.5, []),
                           "format awq holds one scheme")]:
        with pytest.raises(QuantkitError, match=re.escape(message)):
            check_request(*args)


def test_layer_schemes_round_trip_through_the_flat_recipe_form():
    cfg = mixed_config("gptq")
    flat = cfg.to_flat()
    assert flat["layer_schemes"] == {"float": sorted(n for n, s in MIX.items() if s is None),
                                     "w4g64": ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"],
                                     "w8ch": ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj"]}
    assert CalibConfig.from_flat(flat) == cfg
    with pytest.raises(QuantkitError, match=r"layer_schemes: scheme 'w4x' is not a scheme name"):
        CalibConfig.from_flat({**flat, "layer_schemes": {"w4x": ["a"]}})
    with pytest.raises(QuantkitError, match="a is listed under two schemes"):
        CalibConfig.from_flat({**flat, "layer_schemes": {"w8ch": ["a"], "float": ["a"]}})


# ------------------------------------------------------------------------------------ calibration, resume, serving


@torch.no_grad()
def test_gptq_mix_resumes_to_the_same_codes(tiny, tmp_path):
    from quantkit.data import calibration_batches

    calib = calibration_batches(None, tiny.tokenizer, 8, 64)
    cfg, logs = mixed_config("gptq", method="gptq"), []
    fresh = copy.deepcopy(tiny.model)
    calibrate(fresh, tiny.hf_config, calib, cfg, work_dir=tmp_path / "w", progress=False)
    resumed = copy.deepcopy(tiny.model)
    calibrate(resumed, tiny.hf_config, calib, cfg, work_dir=tmp_path / "w", progress=False, log=logs.append)
    assert logs == [f"resuming from {tmp_path / 'w'}: blocks 0-1 are done"]
    a, b = qlinear_modules(fresh), qlinear_modules(resumed)
    assert a.keys() == b.keys() and all(a[n].qtensor().equal(b[n].qtensor()) for n in a)
    assert all(type(fresh.get_submodule(n)) is nn.Linear for n, s in MIX.items() if s is None)
    ids = torch.randint(0, 49152, (2, 24))
    torch.testing.assert_close(resumed(ids), fresh(ids), atol=0, rtol=0)


def dequantized(model: nn.Module) -> nn.Module:
    """The dense reference: every QLinear an nn.Linear holding its dequantized weight (fp32)."""
    dense = copy.deepcopy(model)
    for name, m in qlinear_modules(dense).items():
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        linear.weight.data = dequantize(m.qtensor())
        parent, _, child = name.rpartition(".")
        setattr(dense.get_submodule(parent), child, linear)
    return dense


@torch.inference_mode()
def greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


PROMPTS = [[1, 504, 3301, 28, 339], [1, 9156, 11, 2817, 314, 253, 3459, 28, 30, 40, 11, 5]]


@pytest.mark.parametrize("layout", ["gptq", "compressed-tensors"])
def test_served_mixed_checkpoint_gives_the_dense_reference_greedy_text(layout, mixed):
    from quantkit.serve.llm import LLM
    from quantkit.serve.sampling_params import SamplingParams

    _, folder = mixed(layout)
    loaded = load_model(str(folder))
    kinds = {(m.bits, m.group_size) for m in qlinear_modules(loaded.model).values()}
    assert kinds == {(4, 32), (4, 64), (8, -1)}  # each module loaded with its own scheme
    reference = dequantized(loaded.model)
    llm = LLM(load_model(str(folder)), dtype="float32", device="cpu", block_size=4, max_model_len=64,
              kv_cache_memory=4 << 20)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [greedy(reference, p, 16) for p in PROMPTS]
    if layout == "gptq":  # and `quantkit serve`'s engine process behind the real HTTP API, the official client
        import openai

        from tests.serve.api_live import live_server, serving_app

        with serving_app(loaded, "mixed", process=True, device="cpu", block_size=4, max_model_len=64,
                         kv_cache_memory=4 << 20) as app, live_server(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            response = client.completions.create(model="mixed", prompt=PROMPTS, max_tokens=16, temperature=0,
                                                 extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in outs]


@torch.no_grad()
def test_mixed_compressed_tensors_loads_in_transformers_with_quantkit_logits(mixed):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    _, folder = mixed("compressed-tensors")
    hf, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not {k: v for k, v in info.items() if v}  # every tensor where transformers expects it
    ours = load_model(str(folder)).model
    ids = torch.tensor([PROMPTS[1]])
    torch.testing.assert_close(hf.eval()(ids).logits, ours(ids), atol=1e-4, rtol=0)
    assert greedy(lambda x: hf(x).logits, PROMPTS[0], 16) == greedy(ours, PROMPTS[0], 16)


# ------------------------------------------------------------------------------------ --target-bpw / --max-delta


def kl_to_float(folder, base: str, windows: int = 4) -> float:
    from quantkit.evals.runner import EvalSpec, general_text_file, run

    report = run(EvalSpec(candidate=str(folder), baseline=base, data=[general_text_file()], tasks=[], windows=windows,
                          seq_len=256, general=False))
    return next(m.candidate for m in report.metrics if m.metric == "kl_mean")


def test_target_bpw_cli_writes_its_budget_and_beats_uniform_w4g64(tiny, tmp_path):
    """The tiny model's widths (64, 128) take W4 g32/g64 (g128 on down_proj); W4 g64 compressed-tensors stores
    4.25 bits per weight (a little more), so a target of 4.5 buys about a quarter bit more than uniform W4 g64."""
    base = str(tiny.path)
    run = lambda *flags: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "quantkit.cli", "calibrate", base, "--method", "rtn", "--format", "compressed-tensors",
         "--seq-len", "64", *flags], capture_output=True, text=True, timeout=600, cwd=REPO)
    done = run("--group-size", "32", "--target-bpw", "4.5", "--out", str(tmp_path / "mix"))
    assert done.returncode == 0, done.stderr
    uniform = run("--group-size", "64", "--out", str(tmp_path / "w4g64"))
    assert uniform.returncode == 0, uniform.stderr
    shapes = {f"model.layers.{i}.{n}": tuple(m.weight.shape) for i, block in enumerate(tiny.model.model.layers)
              for n, m in block.named_modules() if type(m) is nn.Linear}
    bits, weights = stored_bits(tmp_path / "mix", shapes, "llama")
    assert abs(bits / weights - 4.5) <= 0.05
    meta = json.loads((tmp_path / "mix" / "quantkit.json").read_text())["mixed_precision"]
    assert meta["planned_bpw"] == bits / weights and meta["target_bpw"] == 4.5
    assert kl_to_float(tmp_path / "mix", base) < kl_to_float(tmp_path / "w4g64", base)
    from quantkit.card import render_card

    card = render_card(tmp_path / "mix")
    assert "## Mixed precision" in card and "| block | self_attn.q_proj | self_attn.k_proj | self_attn.v_proj |" in card


def test_max_delta_stops_at_a_passing_mix_whose_next_more_aggressive_mix_fails(tiny, tmp_path):
    from quantkit.quant.mixed_precision import choose_mix

    cfg = CalibConfig(method="rtn", scheme=W4G32, layout="compressed-tensors", seq_len=64)
    # the tiny model's ladder measures 6.6e-5 (all W4) down to 3e-7 (all W8): the limit sits 15-20% from its neighbours
    mix = choose_mix(tiny, None, cfg, None, ["kl=3.5e-5"], None, log=lambda _: None, scratch=tmp_path / "scratch",
                     progress=False, step_bpw=0.5, eval_windows=4, eval_seq_len=256)
    search = mix.record["search"]
    chosen, failed = search["rungs"][search["chosen"]], search["rungs"][search["failed"]]
    assert not chosen["breaches"] and failed["breaches"]
    assert failed["planned_bpw"] < chosen["planned_bpw"] and chosen["metrics"]["sonnets/kl_mean"]["delta"] <= 3.5e-5
    assert failed["metrics"]["sonnets/kl_mean"]["delta"] > 3.5e-5
    assert failed["ladder_index"] == chosen["ladder_index"] - 1  # the next more aggressive mix of the ladder
    assert all(r["planned_bpw"] == r["stored_bpw"] for r in search["rungs"])
    assert not (tmp_path / "scratch").exists()
    # the config the command calibrates with gives the checkpoint that was evaluated: the same KL
    model = copy.deepcopy(tiny.model)
    calibrate(model, tiny.hf_config, None, mix.cfg, progress=False)
    out = save_checkpoint(tmp_path / "final", model, tiny.hf_config, tiny.tokenizer, cfg.layout,
                          {"method": "rtn", "base_model": tiny.source, "mixed_precision": mix.record})
    from quantkit.evals.runner import EvalSpec, general_text_file, run

    report = run(EvalSpec(candidate=str(out), baseline=tiny.source, data=[general_text_file()], tasks=[], windows=4,
                          seq_len=256, general=False))
    assert next(m.candidate for m in report.metrics if m.metric == "kl_mean") == \
        chosen["metrics"]["sonnets/kl_mean"]["candidate"]
    from quantkit.card import render_card

    card = render_card(out)  # both mixes in the card, with their measured KL
    for rung, mark in ((chosen, "**(chosen)**"), (failed, "(next more aggressive)")):
        delta = rung["metrics"]["sonnets/kl_mean"]["delta"]
        assert f"{mark} | {rung['planned_bpw']:.4f} | {rung['stored_bpw']:.4f} |" in card
        assert f"sonnets/kl_mean {delta:+.4g} | {'passed' if rung is chosen else 'failed'} |" in card
