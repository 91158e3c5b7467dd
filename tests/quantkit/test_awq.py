"""AWQ: folding the searched scales keeps the float model's logits; the search beats RTN on an outlier layer."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_hf_config
from quantkit.config import QuantScheme
from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.models.registry import arch_spec
from quantkit.quant.awq import (AWQ, candidate_scales, clip_weight, fake_quantize, scale_hessian, search_clip,
                                search_scales)
from quantkit.quant.calibrate import capture_stage
from quantkit.quant.gptq import GPTQ, hessian, output_error
from quantkit.quant.scheme import dequantize, quantize_rtn


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


def fold_every_block(model, ids: torch.Tensor, scheme: QuantScheme, n_grid: int = 20) -> list[float]:
    """Search and fold AWQ scales block by block (statistics of the float model); returns the ratios chosen."""
    spec = arch_spec(model.config.model_type)
    awq = AWQ(scheme, spec, n_grid)
    names = list(spec.linears)
    x = model.model.embed_tokens(ids)
    positions = torch.arange(ids.shape[1])
    mask = torch.ones(ids.shape, dtype=torch.bool)
    ratios = []
    for block in model.model.layers:
        stats = capture_stage(block, names, x, mask, positions, awq.needs, 4, "", "cpu")
        _, info = awq.search_and_fold(block, names, stats)
        ratios += [v["ratio"] for v in info.values() if v]
        x = block(x, positions)
    return ratios


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha-with-v-to-o"])
@torch.no_grad()
def test_folding_keeps_logits_tiny(kv_heads):
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_hf_config(num_key_value_heads=kv_heads))).eval()
    for layer in model.model.layers:  # non-trivial norms, so folding into them is exercised
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    ids = torch.randint(0, 128, (4, 24))
    ref = model(ids)
    norm_before = model.model.layers[0].input_layernorm.weight.clone()
    ratios = fold_every_block(model, ids, QuantScheme(4, 32, sym=False))
    assert len(ratios) == 2 * (7 if kv_heads == 4 else 6)  # v -> o folded only without GQA
    assert not torch.allclose(model.model.layers[0].input_layernorm.weight, norm_before)  # scales were folded
    assert (model(ids) - ref).abs().max() < 1e-4


@pytest.mark.slow
@torch.no_grad()
def test_folding_keeps_logits_bundled(bundled):
    import copy

    model = copy.deepcopy(bundled.model)
    ids = bundled.tokenizer(["The capital of France is Paris, and the capital of Italy is Rome.",
                             "def add(a, b):\n    return a + b  # adds two numbers together and returns"],
                            return_tensors="pt", padding="max_length", max_length=20, truncation=True)["input_ids"]
    ref = model(ids)
    ratios = fold_every_block(model, ids, QuantScheme(4, 64, sym=False), n_grid=2)  # a coarse grid: folding is tested
    assert len(ratios) == 30 * 6 and any(r > 0 for r in ratios)
    assert (model(ids) - ref).abs().max() < 1e-4


def outlier_layer(seed: int = 0):
    """x [2048, 128] whose channels differ in magnitude by ~e^2 (the case AWQ is for), W [96, 128]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, 128, generator=g) * torch.randn(128, generator=g).mul(1.2).exp()
    return x, torch.randn(96, 128, generator=g) * 0.05


def test_scales_are_normalised():
    x, w = outlier_layer()
    s = candidate_scales(x.abs().mean(0), w.abs().mean(0), 0.5)
    assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-5)


def test_awq_beats_rtn_on_output_error():
    x, w = outlier_layer()
    scheme = QuantScheme(4, 32, sym=False)
    h = hessian(x)
    found = search_scales(w, x.abs().mean(0), h, scheme)
    # measured directly on the activations, independently of the H shortcut the search uses
    rtn_mse = ((x @ w.T - x @ fake_quantize(w, scheme).T) ** 2).mean()
    awq_w = fake_quantize(w * found.scales, scheme) / found.scales
    awq_mse = ((x @ w.T - x @ awq_w.T) ** 2).mean()
    assert float(awq_mse) == pytest.approx(found.loss, rel=1e-3)
    assert float(rtn_mse) == pytest.approx(found.loss_unscaled, rel=1e-3)
    assert awq_mse < 0.8 * rtn_mse and found.ratio > 0


def test_clip_search_never_increases_error():
    x, w = outlier_layer(1)
    scheme = QuantScheme(4, 32, sym=False)
    h = hessian(x)
    max_val = search_clip(w, h, scheme)
    org_max = w.abs().reshape(96, 4, 32).amax(-1)
    assert (max_val <= org_max).all() and (max_val >= 0.5 * org_max).all() and (max_val < org_max).any()
    clipped = dequantize(quantize_rtn(clip_weight(w, max_val), scheme))
    assert output_error(w, clipped, h) <= output_error(w, fake_quantize(w, scheme), h)


def test_gptq_rounding_of_the_scaled_weight_beats_clip_and_round_to_nearest():
    """The CLI default (awq_rounding gptq): the searched scales, then GPTQ on the scaled input's Hessian; measured on
    the activations themselves against the paper's clip search + round to nearest on the same scales. The channels
    are correlated, as a model's activations are (GPTQ's compensation works through H's off-diagonal; on
    independent channels it gains nothing: 0.99-1.18x the error of clip + round to nearest)."""
    x, w = outlier_layer(2)
    x = x + 0.5 * x @ torch.randn(128, 128, generator=torch.Generator().manual_seed(102)) / 128 ** 0.5
    scheme = QuantScheme(4, 32, sym=False)
    h = hessian(x)
    s = search_scales(w, x.abs().mean(0), h, scheme).scales
    h_scaled = scale_hessian(h, s)
    assert torch.allclose(h_scaled, hessian(x / s), rtol=1e-4, atol=1e-6)
    qt, info = GPTQ(scheme, damp=0.1, clip=True).quantize_linear(w * s, h_scaled, "layer")
    clipped = clip_weight(w * s, search_clip(w * s, h_scaled, scheme))
    mse = {name: float(((x @ w.T - x @ (dequantize(q) / s).T) ** 2).mean())
           for name, q in (("gptq", qt), ("rtn", quantize_rtn(clipped, scheme)))}
    assert info["loss"] == pytest.approx(mse["gptq"], rel=1e-3) and not info["fallback"]
    assert mse["gptq"] < 0.5 * mse["rtn"]  # 0.26x


def test_awq_rounding_is_checked_and_builds_its_method():
    from quantkit.config import CalibConfig
    from quantkit.errors import QuantkitError
    from quantkit.quant.calibrate import make_method

    assert isinstance(make_method(CalibConfig.from_flat({"method": "awq"}), "llama").rounding, GPTQ)
    assert make_method(CalibConfig.from_flat({"method": "awq", "awq_rounding": "rtn"}), "llama").rounding is None
    with pytest.raises(QuantkitError, match="awq_rounding 'nearest' is unknown: use one of gptq, rtn"):
        CalibConfig.from_flat({"method": "awq", "awq_rounding": "nearest"})


AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]  # FORMATS.md: column 8c + j sits in nibble REVERSE[j] of word c


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] AWQ-interleaved words -> codes [R, 8C], written out from the spec (independent of formats/)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    cols = [(w >> (4 * AWQ_REVERSE[j])) & 0xF for j in range(8)]  # each [R, C]: column 8c + j
    return torch.stack(cols, dim=-1).reshape(words.shape[0], -1)


def test_awq_checkpoint_unpacks_to_the_calibrated_codes(tmp_path, capsys):
    from safetensors.torch import load_file

    from quantkit.commands.info import info
    from quantkit.config import CalibConfig
    from quantkit.data import CalibData
    from quantkit.formats.checkpoint import save_checkpoint
    from quantkit.quant.calibrate import calibrate

    torch.manual_seed(0)
    hf = tiny_hf_config()
    model = LlamaForCausalLM(ModelConfig.from_hf(hf)).eval()
    calib = CalibData(torch.randint(0, 128, (8, 32)), None, torch.full((8,), 32), {}, "tiny")
    cfg = CalibConfig.from_flat({"method": "awq", "group_size": 32})
    assert cfg.layout == "awq" and not cfg.scheme.sym
    calibrate(model, hf, calib, cfg, progress=False)
    save_checkpoint(tmp_path / "awq", model, hf, None, cfg.layout, {"method": "awq"})
    tensors = load_file(str(tmp_path / "awq" / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        qt = model.get_submodule(name).qtensor()
        assert torch.equal(awq_unpack(tensors[f"{name}.qweight"]), qt.codes.T.long())  # qweight [K, N/8]
        assert torch.equal(awq_unpack(tensors[f"{name}.qzeros"]), qt.zeros.T.long())  # qzeros [G, N/8]
        assert torch.equal(tensors[f"{name}.scales"], qt.scales.T)  # scales [G, N]
    info(tmp_path / "awq")
    assert "layout         awq (quant_method awq)" in capsys.readouterr().out
