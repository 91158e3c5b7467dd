"""MoE calibration against transformers' routing (quant/moe_calibration.py, quant/calibrate.py, quant/awq.py): tokens
per expert equal to transformers' router's top-k, an expert no token reaches calibrated on the forced-routing pass
(finite, not RTN, a smaller error than RTN on its forced inputs), GPTQ and AWQ closer to the float model than RTN,
AWQ's shared norm scale searched on every expert's own tokens, RTN for an unreached expert when the forced pass is off,
the CLI's report and its group-size refusal, and serving's one call per active expert per step.

Per MoE family a tiny random-weight transformers model (tests/quantkit/families.py) with one expert starved: every
token embedding carries a constant channel CHANNEL, which each RMSNorm turns into a large positive input; every router
ignores it (its column zeroed) except layer 0's row of expert STARVED, which weighs it by -PUSH, so that expert is
never among layer 0's top-k. Saved with save_pretrained and loaded through quantkit's loader. Statistics in float32
so that routing is reproducible by transformers' own router.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, PreTrainedTokenizerFast

from quantkit.commands.calibrate import check_group_size, linear_widths
from quantkit.config import CalibConfig, QuantScheme
from quantkit.data import CalibData
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_quantized
from quantkit.models.loader import load_model
from quantkit.models.registry import arch_spec
from quantkit.quant.awq import AWQ, N_GRID, candidate_scales, fake_quantize, weight_magnitude
from quantkit.quant.calibrate import calibrate, capture_stage, observed
from quantkit.quant.moe_calibration import moe_summary
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import dequantize, quantize_rtn
from quantkit.serve.llm import LLM
from quantkit.serve.sampling_params import SamplingParams
from tests.conftest import REPO
from tests.quantkit.families import BASE, FAMILIES, MOE_FAMILIES, hf_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

# the families whose layer 0 is a softmax-routed MoE block of 4 experts, which the starving below steers: not GLM-4.5's
# and ERNIE 4.5's corrected routing behind a dense layer 0, nor Hunyuan's, whose layer-0 router input the embedding
# channel does not steer (expert 3 keeps 6 tokens); test_families.py checks their routing against transformers
SOFTMAX_ROUTED = [name for name in MOE_FAMILIES if name not in ("glm4_moe", "ernie4_5_moe", "hunyuan_moe")]
STARVED, CHANNEL, PUSH = 3, 0, 2.0
HIDDEN = BASE["hidden_size"]  # the default --moe-min-tokens
_g = torch.Generator().manual_seed(11)
CALIB = CalibData(torch.randint(0, 128, (12, 32), generator=_g), None, torch.full((12,), 32), {}, "tiny-moe")
HELD_OUT = torch.randint(0, 128, (4, 40), generator=_g)
TOKENS = CALIB.input_ids.numel()  # 384, no mask: every token counts


def config(method: str, **extra) -> CalibConfig:
    return CalibConfig.from_flat({"method": method, "group_size": 32, "num_samples": 12, "seq_len": 32,
                                  "compute_dtype": "float32", **extra})


def router_weight(router) -> torch.Tensor:
    """A transformers router's weight [E, H] (Hunyuan's router holds it in its Linear `wg`)."""
    return getattr(router, "wg", router).weight


@pytest.fixture(scope="module")
def starved(tmp_path_factory, bundled_dir):
    """name -> (transformers model, quantkit Loaded, checkpoint folder), built once."""
    root = tmp_path_factory.mktemp("moe-calibration")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(bundled_dir)

    @functools.cache
    def get(name: str):
        hf = hf_model(name)
        with torch.no_grad():
            hf.model.embed_tokens.weight[:, CHANNEL] = 0.5
            for layer in hf.model.layers:
                if hasattr(layer.mlp, "experts"):
                    router_weight(layer.mlp.gate)[:, CHANNEL] = 0.0
            router_weight(hf.model.layers[0].mlp.gate)[STARVED, CHANNEL] = -PUSH
        folder = root / name
        hf.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return hf, load_model(str(folder)), folder
    return get


@pytest.fixture(scope="module")
def calibrated(starved):
    """(name, method, moe_min_tokens) -> (quantized model, report), calibrated once."""
    @functools.cache
    def get(name: str, method: str, min_tokens=None):
        loaded = starved(name)[1]
        model = copy.deepcopy(loaded.model)
        report = calibrate(model, loaded.hf_config, CALIB if method != "rtn" else None,
                           config(method, moe_min_tokens=min_tokens), device="cpu", progress=False)
        return model, report
    return get


def ffn(model, layer: int = 0):
    return model.model.layers[layer].get_submodule(model.family.ffn_name)


def layer0_inputs(model) -> torch.Tensor:
    """The MoE block input of layer 0 [T, H] when `model` runs the calibration tokens."""
    seen = []
    handle = ffn(model).register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, HIDDEN)))
    with torch.no_grad():
        model(CALIB.input_ids)
    handle.remove()
    return seen[0]


def transformers_routing(hf, model, method: str) -> tuple[list[int], torch.Tensor]:
    """(tokens per expert, router probabilities [T, E]) of layer 0 on the calibration tokens, from transformers'
    router on the inputs calibration saw there: AWQ records the float block (transformers' own forward), GPTQ's
    experts the quantized attention's output (`model`'s layer-0 MoE inputs)."""
    router = hf.model.layers[0].mlp.gate
    with torch.no_grad():
        if method == "awq":
            seen = []
            handle = router.register_forward_hook(lambda m, args, out: seen.append(out))
            hf(CALIB.input_ids)
            handle.remove()
            logits, _, indices = seen[0]
        else:
            logits, _, indices = router(layer0_inputs(model))
    counts = torch.bincount(indices.flatten(), minlength=router.num_experts).tolist()
    return counts, torch.softmax(logits.float(), dim=-1)


def entries(report: list[dict], layer: int, expert: int) -> list[dict]:
    return [e for e in report if f"layers.{layer}." in e["name"] and f".experts.{expert}." in e["name"]]


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("name", SOFTMAX_ROUTED)
def test_tokens_per_expert_are_transformers_routing(name, method, starved, calibrated):
    hf, loaded, _ = starved(name)
    model, report = calibrated(name, method)
    counts, _ = transformers_routing(hf, model, method)
    assert counts[STARVED] == 0 and sum(counts) == TOKENS * loaded.model.config.num_experts_per_tok, counts
    for e, n in enumerate(counts):
        assert [entry["tokens"] for entry in entries(report, 0, e)] == [n] * 3, (e, entries(report, 0, e))
    summary = moe_summary(report, HIDDEN)
    assert summary["layers"]["model.layers.0"] == {
        "experts": 4, "tokens_min": min(counts), "tokens_median": sorted(counts)[1] / 2 + sorted(counts)[2] / 2,
        "tokens_max": max(counts), "forced": [e for e, n in enumerate(counts) if n < HIDDEN]}
    sparse = loaded.model.config.sparse_layers
    assert set(summary["layers"]) == {f"model.layers.{i}" for i in sparse}
    for i in sparse:  # every token reaches k experts in every sparse layer
        routed = sum(entries(report, i, e)[0]["tokens"] for e in range(4))
        assert routed == TOKENS * loaded.model.config.num_experts_per_tok, i


def forced_errors(model, reference, rtn: torch.nn.Module) -> tuple[float, float]:
    """sum_t p_t ||expert(x_t) - float_expert(x_t)||^2 / sum_t p_t over the quantized model's layer-0 MoE inputs x,
    p its router's probability of STARVED (the error on the forced pass), for its own STARVED expert and for `rtn`
    (the float expert rounded to nearest). AWQ folded scales s out of the norm into the experts: x * s is what the
    float and RTN experts would see."""
    x = layer0_inputs(model)
    norm = "post_attention_layernorm"
    s = reference.model.layers[0].get_submodule(norm).weight / model.model.layers[0].get_submodule(norm).weight
    with torch.no_grad():
        p = torch.softmax(ffn(model).gate(x).float(), dim=-1)[:, STARVED]
        target = ffn(reference).experts[STARVED](x * s)
        outputs = ffn(model).experts[STARVED](x), rtn(x * s)
    return tuple(float((p * ((y - target) ** 2).sum(-1)).sum() / p.sum()) for y in outputs)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("name", SOFTMAX_ROUTED)
def test_a_starved_expert_is_calibrated_on_its_forced_pass(name, method, starved, calibrated):
    hf, loaded, _ = starved(name)
    model, report = calibrated(name, method)
    p = transformers_routing(hf, model, method)[1][:, STARVED]  # the forced pass's token weights
    for entry in entries(report, 0, STARVED):
        assert entry["tokens"] == 0 and entry["forced"] and entry["forced_tokens"] == TOKENS, entry
        assert entry["effective_tokens"] == pytest.approx(float(p.sum() ** 2 / (p * p).sum()), abs=0.1), entry
        assert not entry.get("fallback") and entry["loss"] > 0, entry
    quantized, float_expert = ffn(model).experts[STARVED], ffn(loaded.model).experts[STARVED]
    rtn = copy.deepcopy(float_expert)
    scheme = config(method).scheme
    for (part, q), (_, f), r in zip(quantized.named_children(), float_expert.named_children(), rtn.children()):
        assert isinstance(q, QLinear) and torch.isfinite(dequantize(q.qtensor())).all(), part
        plain = quantize_rtn(f.weight, scheme)
        assert not torch.equal(q.qtensor().codes, plain.codes), part  # calibrated, not rounded to nearest
        with torch.no_grad():
            r.weight.copy_(dequantize(plain))
    calibrated_error, rtn_error = forced_errors(model, loaded.model, rtn)
    assert calibrated_error < rtn_error, (calibrated_error, rtn_error)


def kl(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Mean over tokens of KL(softmax(reference) || softmax(candidate)), logits [..., V]."""
    p = F.log_softmax(reference, -1)
    return float((p.exp() * (p - F.log_softmax(candidate, -1))).sum(-1).mean())


@pytest.mark.parametrize("name", SOFTMAX_ROUTED)
@torch.no_grad()
def test_gptq_and_awq_are_closer_to_the_float_model_than_rtn(name, starved, calibrated):
    reference = starved(name)[1].model(HELD_OUT)
    divergence = {m: kl(reference, calibrated(name, m)[0](HELD_OUT)) for m in ("rtn", "gptq", "awq")}
    assert divergence["gptq"] < divergence["rtn"] and divergence["awq"] < divergence["rtn"], divergence


@pytest.mark.parametrize("method", ["gptq", "awq"])
@torch.no_grad()
def test_without_the_forced_pass_an_unreached_expert_is_rounded_to_nearest(method, starved, calibrated):
    loaded = starved("mixtral")[1]
    model, report = calibrated("mixtral", method, 0)
    for entry in entries(report, 0, STARVED):
        assert entry["tokens"] == 0 and entry["fallback"] and entry["no_tokens"] and "forced" not in entry, entry
    assert not any(e.get("fallback") or e.get("forced") for e in report if e not in entries(report, 0, STARVED))
    assert moe_summary(report, 0)["layers"]["model.layers.0"]["forced"] == []
    unrouted = ffn(model).experts[STARVED].w2  # AWQ too: its up -> down group has no input, so no scale
    plain = quantize_rtn(ffn(loaded.model).experts[STARVED].w2.weight, config(method).scheme)
    assert torch.equal(unrouted.qtensor().codes, plain.codes)
    assert torch.isfinite(model(CALIB.input_ids[:2])).all()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@torch.no_grad()
def test_awq_searches_the_shared_norm_scale_on_each_experts_own_tokens(name, starved):
    """One scale s for post_attention_layernorm -> every expert's gate/up (and the shared expert's): the search must
    minimise sum_l ||X_l (W_l - Q(W_l s) / s)^T||^2 / sum_l T_l N_l over each Linear l's own routed inputs X_l [T_l, K]
    (recorded here by hooks, no Hessian), not every expert on every token."""
    loaded = starved(name)[1]
    block, spec = copy.deepcopy(loaded.model.model.layers[0]), arch_spec(loaded.model.config.model_type)
    bspec, awq = spec.in_block(block), AWQ(config("awq").scheme, spec)
    group = next(g for g in bspec.awq_groups if g.source)  # the norm's group, its statistics the router's input
    x, positions, inputs = loaded.model.embed(CALIB.input_ids), torch.arange(32), {}
    handles = [block.get_submodule(n).register_forward_pre_hook(
        lambda m, args, n=n: inputs.setdefault(n, []).append(args[0].reshape(-1, HIDDEN)))
        for n in (group.source, *group.linears)]
    block(x, positions)
    for handle in handles:
        handle.remove()
    rows = {n: torch.cat(inputs.get(n, [torch.zeros(0, HIDDEN)])) for n in (group.source, *group.linears)}
    weights = {n: block.get_submodule(n).weight.clone() for n in group.linears}
    stats = capture_stage(block, observed(list(bspec.linears), bspec), x, torch.ones(12, 32, dtype=torch.bool),
                          positions, awq.needs, 12, "", "cpu", bspec.router)
    _, info = awq.search_and_fold(block, list(bspec.linears), stats)

    scheme, w_all = awq.scheme, torch.cat(list(weights.values()))
    errors = []
    for i in range(N_GRID):
        s = candidate_scales(rows[group.source].abs().mean(0), weight_magnitude(w_all, scheme), i / N_GRID)
        total = sum(float(((rows[n] @ (w - fake_quantize(w * s, scheme) / s).T) ** 2).sum())
                    for n, w in weights.items())
        errors.append(total / sum(rows[n].shape[0] * w.shape[0] for n, w in weights.items()))
    best = min(range(N_GRID), key=errors.__getitem__)
    assert rows[f"{bspec.experts}.{STARVED}.{group.linears[0].rpartition('.')[2]}"].shape[0] == 0
    for n in group.linears:
        assert info[n]["ratio"] == best / N_GRID and info[n]["group_loss"] == pytest.approx(errors[best], rel=1e-4)


def arithmetic_file(path, tokenizer) -> str:
    """Rows of sums whose every token id is below the tiny models' vocabulary of 128 (digits and signs)."""
    rnd = random.Random(0)
    rows = ["".join(f"{a}+{b}={a + b};" for a, b in ((rnd.randrange(999), rnd.randrange(999)) for _ in range(12)))
            for _ in range(24)]
    assert max(max(tokenizer(row)["input_ids"]) for row in rows) < 128
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit.cli", "calibrate", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


def test_the_cli_reports_tokens_per_expert_and_the_forced_experts(starved, tmp_path):
    _, loaded, folder = starved("mixtral")
    out = tmp_path / "q"
    done = run_cli(str(folder), "--method", "gptq", "--group-size", "32", "--data",
                   arithmetic_file(tmp_path / "sums.txt", loaded.tokenizer), "--data-mode", "rows",
                   "--num-samples", "12", "--seq-len", "32", "--compute-dtype", "float32", "--device", "cpu",
                   "--out", str(out))
    assert done.returncode == 0, done.stderr
    meta = read_quantized(out).meta
    layer0 = meta["moe"]["layers"]["model.layers.0"]
    assert meta["moe"]["min_tokens"] == HIDDEN and STARVED in layer0["forced"] and layer0["tokens_min"] == 0, layer0
    counts = {e: entries(meta["layers"], 0, e)[0]["tokens"] for e in range(4)}
    assert layer0["forced"] == [e for e, n in counts.items() if n < HIDDEN], (layer0, counts)
    assert layer0["tokens_max"] == max(counts.values()), (layer0, counts)
    line = next(line for line in done.stderr.splitlines() if line.startswith("MoE routing (2 layers): tokens per "))
    assert f"below --moe-min-tokens {HIDDEN} calibrated on a forced-routing pass (layers.0: " in line, line
    assert json.loads((out / "quantkit.json").read_text())["moe"] == meta["moe"]


def test_a_group_size_that_does_not_divide_an_experts_width_is_refused_before_loading(starved, tmp_path):
    done = run_cli(str(starved("qwen2_moe")[2]), "--method", "rtn", "--group-size", "64", "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: group_size=64 does not divide in_features=32 of layer model.layers.N.mlp.experts.E.down_proj "
        "(config.json moe_intermediate_size): choose a group size that divides 32 (e.g. 32 or 16) or -1 for "
        "per-channel"]
    assert not (tmp_path / "x").exists()

    model_type, extra = FAMILIES["qwen2_moe"]
    hf_config = AutoConfig.for_model(model_type, **{**BASE, **extra, "shared_expert_intermediate_size": 40}).to_dict()
    widths = linear_widths(hf_config)
    assert widths["model.layers.N.mlp.shared_expert.down_proj"] == 40
    with pytest.raises(QuantkitError, match=r"in_features=40 of layer model\.layers\.N\.mlp\.shared_expert\.down_proj "
                                            r"\(config\.json shared_expert_intermediate_size\)"):
        check_group_size(QuantScheme(4, 16), widths, hf_config)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_serving_runs_each_active_expert_once_per_step_on_its_tokens(name, starved):
    """The paged CPU path: per MoE block and step, one call per routed-to expert on all of its tokens."""
    llm = LLM(load_model(str(starved(name)[2])), dtype="float32", device="cpu", block_size=4,
              max_num_batched_tokens=64, max_model_len=128, kv_cache_memory=4 << 20)
    moe = ffn(llm.loaded.model)
    steps, calls = [], []
    handles = [moe.gate.register_forward_hook(lambda m, args, logits: steps.append(moe.select(logits)[1]))]
    handles += [expert.register_forward_pre_hook(lambda m, args, e=e: calls.append((len(steps), e, args[0].shape[0])))
                for e, expert in enumerate(moe.experts)]
    g = torch.Generator().manual_seed(16)
    prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (16,), generator=g)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for handle in handles:
        handle.remove()
    assert max(chosen.shape[0] for chosen in steps) > 1  # steps batch several requests' tokens
    for i, chosen in enumerate(steps, start=1):
        counts = torch.bincount(chosen.flatten(), minlength=len(moe.experts)).tolist()
        assert [(e, n) for step, e, n in calls if step == i] == [(e, n) for e, n in enumerate(counts) if n], i
