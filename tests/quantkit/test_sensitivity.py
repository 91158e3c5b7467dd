"""quant/sensitivity.py against independent references on tiny random-weight models: the proxy from the recorded
inputs themselves (sum over tokens of the squared output error), the measured KL from a full forward of a copy of the
model with only that Linear quantized, KL(P || Q) in float64 from both softmaxes; the candidate schemes of the bundled
model's widths; MoE experts grouped into one knapsack item."""

from __future__ import annotations

import copy

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.data import CalibData
from quantkit.errors import QuantkitError
from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.quant.mixed_precision import items
from quantkit.quant.scheme import dequantize, quantize_rtn
from quantkit.quant.sensitivity import (KLToReference, Sensitivity, candidates, input_hessians, measure_kl,
                                        proxy_table, scheme_key, sensitivity)
from tests.conftest import tiny_hf_config
from tests.quantkit.families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

HF = tiny_hf_config(num_hidden_layers=3)
BASE = QuantScheme(4, 32)


def tiny(hf: dict = HF, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_hf(hf)).eval()
    with torch.no_grad():  # weights large enough that one Linear's rounding moves the logits measurably
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(std=0.2)
    return model


def tokens(n: int, seq: int, seed: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def calib(n: int = 6, seq: int = 32) -> CalibData:
    ids = tokens(n, seq, 1)
    return CalibData(ids, None, torch.full((n,), seq))


def kl64(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def test_candidates_of_the_bundled_widths():
    assert [scheme_key(s) for s in candidates(BASE, 576)] == ["w4g64", "w4g32", "w8ch", "float"]
    assert [scheme_key(s) for s in candidates(BASE, 1536)] == ["w4g128", "w4g64", "w4g32", "w8ch", "float"]
    assert all(s is None or s.sym for s in candidates(BASE, 576))
    chosen = ("float", "w8g64", "w4ch", "w4g32", "w4g128")  # --mix-schemes: any order, coarsest first out
    assert [scheme_key(s) for s in candidates(BASE, 576, chosen)] == ["w4ch", "w4g32", "w8g64", "float"]
    with pytest.raises(QuantkitError, match="--mix-schemes: scheme 'w4' is not a scheme name"):
        candidates(BASE, 576, ("w4",))


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: a soft-capped head
@torch.inference_mode()
def test_kl_to_reference_equals_float64_kl_of_the_softmaxes(family):
    hf = tiny_hf_config(family, **FAMILIES[family][1])
    model = tiny(hf)
    ids = tokens(3, 20, 2)
    h = model.hidden(ids)
    other = h + 0.05 * torch.randn(h.shape, generator=torch.Generator().manual_seed(3))
    got = KLToReference(model, h)(other)
    assert got == pytest.approx(kl64(model.logits(h), model.logits(other)), rel=1e-9)
    assert KLToReference(model, h)(h) == pytest.approx(0.0, abs=1e-12)


@torch.inference_mode()
def test_proxy_is_the_squared_output_error_over_the_recorded_inputs():
    model, data = tiny(), calib()
    recorded: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, name=name: recorded.setdefault(name, []).append(a[0]))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in name]
    model(data.input_ids)
    for h in hooks:
        h.remove()
    hessians, count = input_hessians(model, "llama", data)
    assert count == data.input_ids.numel()
    table = proxy_table(model, "llama", BASE, hessians)
    assert len(table) == 3 * 7
    for s in table:
        x = torch.cat(recorded[s.name]).reshape(-1, s.shape[1]).double()  # [T, K]
        w = model.get_submodule(s.name).weight.double()
        for key, value in s.proxy.items():
            if key == "float":
                assert value == 0.0
                continue
            dw = w - dequantize(quantize_rtn(w.float(), BASE.with_precision(key))).double()
            expected = float(((x @ dw.T) ** 2).sum() / x.shape[0])  # sum_n of the mean squared output error
            assert value == pytest.approx(expected, rel=1e-4), (s.name, key)


@torch.inference_mode()
def test_measured_kl_equals_a_full_forward_with_only_that_linear_quantized():
    model, data = tiny(), calib()
    hessians, _ = input_hessians(model, "llama", data)
    table = proxy_table(model, "llama", BASE, hessians)
    windows = tokens(2, 24, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measure_kl(model, table, BASE, windows)  # the reference scheme of every Linear
    measure_kl(model, table, BASE, windows, schemes="all", blocks=[1])  # every scheme of block 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is left as it was
    ref = model(windows)[:, :-1]
    for s in table:
        assert s.reference in s.kl and (set(s.kl) == set(s.proxy) - {"float"}) == s.name.startswith("model.layers.1.")
        for key, value in s.kl.items():
            variant = copy.deepcopy(model)
            linear = variant.get_submodule(s.name)
            linear.weight.data = dequantize(quantize_rtn(linear.weight.data, BASE.with_precision(key)))
            assert value == pytest.approx(kl64(ref, variant(windows)[:, :-1]), rel=1e-5), (s.name, key)
            assert value > 0


@torch.inference_mode()
def test_loss_scales_the_measured_kl_by_the_proxy_and_round_trips_json():
    model, data = tiny(), calib()
    table = sensitivity(model, "llama", BASE, data, tokens(2, 24, 4), progress=False)
    s = table.linears[0]
    assert s.loss(s.reference) == s.kl[s.reference] and s.loss("float") == 0.0
    assert s.loss("w8ch") == pytest.approx(s.kl[s.reference] * s.proxy["w8ch"] / s.proxy[s.reference])
    restricted = items(model, "llama", table, BASE, "gptq", 32, ("w4g32", "float"))
    assert {it.keys for it in restricted} == {("w4g32", "float")} and len(restricted) == 3 * 4  # q/k/v, o, gate/up, down
    again = Sensitivity.from_json(table.to_json())
    assert again.to_json() == table.to_json() and again.rank_correlation() == table.rank_correlation()
    assert -1.0 <= table.rank_correlation() <= 1.0 and table.tokens == {"hessian": 6 * 32, "kl": 2 * 23}


@torch.inference_mode()
def test_moe_experts_are_measured_on_their_tokens_and_planned_as_one_item():
    hf = tiny_hf_config("mixtral", **FAMILIES["mixtral"][1])
    model = tiny(hf)
    table = sensitivity(model, "mixtral", BASE, calib(), tokens(2, 24, 4), progress=False)
    experts = [s for s in table.linears if ".experts." in s.name]
    assert experts and all(s.kl[s.reference] >= 0 for s in experts)
    plan_items = items(model, "mixtral", table, BASE, "gptq", 32)
    expert_items = [it for it in plan_items if any(".experts." in n for n in it.linears)]
    assert len(expert_items) == hf["num_hidden_layers"]  # one per block: vLLM's FusedMoE holds one scheme
    assert all(len(it.linears) == 3 * hf["num_local_experts"] for it in expert_items)
    assert not any("block_sparse_moe.gate" in n for it in plan_items for n in it.linears)  # the router stays float
