"""The folders quantkit writes load in transformers, for every family, and give quantkit's logits.

Per family a tiny random-weight model built by transformers from its config (tests/quantkit/families.py), loaded by
quantkit, RTN-quantized, written as compressed-tensors pack-quantized; transformers 5 + compressed-tensors load it with
plain `AutoModelForCausalLM.from_pretrained(folder)` (no missing, unexpected or mismatched tensor: the module names
are the ones its model files expect, Phi-3's fused qkv_proj / gate_up_proj included, MoE experts per expert as the
hub stores them) and its fp32 logits equal quantkit's fp32 logits of the same folder.

Tolerances (fp32 compute on both sides): 1e-4 absolute on logits of magnitude ~3 where transformers keeps the packed
weights and dequantizes them in fp32 at each forward (dense families, default path). 1e-2 where it dequantizes at
load: it then materialises each weight in the dtype of the stored weight_scale (float16, formats/compressed_tensors.py),
i.e. quantkit's dequantized weight rounded to fp16 (asserted bit for bit for the MoE experts), and the logits drift by
~3e-3, inside bf16 tolerance. That is the MoE experts (fused into 3-d tensors at load) and the asymmetric folders.
Asymmetric folders (zero points) load only with CompressedTensorsConfig(dequantize=True): transformers' default
compressed path builds weight_zero_point unpacked ([N, G]) while compressed-tensors writes and reads it packed
([N / 8, G]), and refuses the size (llm-compressor #1618; vLLM reads the packed form). Asymmetric MoE experts do not
load in transformers 5.24 at all: its expert decompression (integrations/compressed_tensors.py) passes no zero point.
GPTQ and AWQ folders load in transformers only through gptqmodel + optimum (its GPTQ/AWQ quantizers import them, CPU
included); they are not quantkit test dependencies (gptqmodel 7.7 pins torch>=2.14.1, a CUDA build on PyPI), so that
test runs where they are installed (checked with gptqmodel 7.7 + optimum 2.3, whose CPU kernels dequantize in fp16:
1e-2). Its MoE families are left out: transformers 5 holds experts as 3-d parameters that optimum's GPTQ conversion
(nn.Linear only) never replaces, so per-expert qweight/qzeros/scales stay unexpected whatever their names
(gptqmodel's own GPTQModel.load un-fuses them first). Everywhere GPTQ/AWQ are also checked by name and by quantkit's
own read-back here, and against vLLM by bench/runtime_compat.py.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

from quantkit.config import CalibConfig, QuantScheme
from quantkit.formats.checkpoint import qlinear_modules, read_quantized, save_checkpoint
from quantkit.models.loader import load_model
from quantkit.quant.calibrate import calibrate
from quantkit.quant.scheme import dequantize, quantize_rtn
from tests.quantkit.families import FAMILIES, MOE_FAMILIES, saved_families

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

FP32_ATOL, FP16_WEIGHTS_ATOL = 1e-4, 1e-2
SCHEMES = {"w4g32": dict(bits=4, group_size=32), "w4g64": dict(bits=4, group_size=64),
           "w8ch": dict(bits=8, group_size=-1)}
# every family at w4g32 and w8ch; w4g64 (two groups per row here) on a few (Qwen MoE experts have 32 inputs)
CASES = [(name, scheme) for name in FAMILIES for scheme in SCHEMES
         if scheme != "w4g64" or name in ("llama", "phi3", "gemma2", "mixtral")]
DENSE = [name for name in FAMILIES if name not in MOE_FAMILIES]
GPTQMODEL = all(importlib.util.find_spec(m) is not None for m in ("gptqmodel", "optimum"))
IDS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))  # past the window (16) and Phi-3's 32


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, bundled_dir):
    """(family, scheme, sym, layout) -> (float quantkit model, quantized quantkit model, folder), built once."""
    root = tmp_path_factory.mktemp("runtime")
    saved = saved_families(root, bundled_dir)

    @functools.cache
    def get(name: str, scheme: str, sym: bool, layout: str):
        loaded = load_model(str(saved(name)[1]))
        model = copy.deepcopy(loaded.model)
        cfg = CalibConfig.from_flat({"method": "rtn", **SCHEMES[scheme], "sym": sym, "format": layout})
        calibrate(model, loaded.hf_config, None, cfg, progress=False)
        out = save_checkpoint(root / f"{name}-{scheme}-{sym}-{layout}", model, loaded.hf_config, loaded.tokenizer,
                              layout, {"method": "rtn"})
        return loaded.model, model, out
    return get


def transformers_load(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True, **kwargs)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, problems  # every tensor landed where transformers' model expects it
    return model.eval()


def assert_experts_are_ours(hf, model) -> None:
    """transformers' fused 3-d experts [E, 2I, H] / [E, H, I] equal quantkit's per-expert dequantized weights in
    fp16, bit for bit, and the router stays the float weight."""
    state, moe = hf.state_dict(), model.family.ffn_name
    for i in model.config.sparse_layers:
        block = model.model.layers[i].get_submodule(moe)
        experts = f"model.layers.{i}.mlp.experts"
        gate_up, down = state[f"{experts}.gate_up_proj"], state[f"{experts}.down_proj"]
        for e, expert in enumerate(block.experts):
            parts = (expert.gate_proj, expert.up_proj, expert.down_proj)
            ours = [dequantize(m.qtensor(), torch.float16) for m in parts]
            assert torch.equal(gate_up[e], torch.cat(ours[:2])) and torch.equal(down[e], ours[2]), (i, e)
        router = model.family.checkpoint_name(f"model.layers.{i}.mlp.gate.weight")  # Hunyuan's: mlp.gate.wg
        assert torch.equal(state[router], block.gate.weight), i


@pytest.mark.parametrize("name, scheme", CASES)
@torch.no_grad()
def test_compressed_tensors_loads_in_transformers_with_quantkit_logits(name, scheme, quantized):
    float_model, model, folder = quantized(name, scheme, True, "compressed-tensors")
    hf = transformers_load(folder)
    ours, theirs = load_model(str(folder)).model(IDS), hf(IDS).logits
    torch.testing.assert_close(theirs, ours, atol=FP16_WEIGHTS_ATOL if name in MOE_FAMILIES else FP32_ATOL, rtol=0)
    # the runtimes agree far more closely than quantization moved the logits: these are the quantized weights
    assert (ours - float_model(IDS)).abs().max() > 10 * (theirs - ours).abs().max()
    if name in MOE_FAMILIES:
        assert_experts_are_ours(hf, model)
        ignore = json.loads((folder / "config.json").read_text())["quantization_config"]["ignore"]
        routers = {model.family.checkpoint_module(n) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n != "lm_head"}  # as the checkpoint names them
        assert routers and routers <= set(ignore), ignore  # routers (and Qwen2-MoE's shared_expert_gate) float


@torch.no_grad()
def test_a_mixed_starcoder2_folder_names_its_modules_as_its_checkpoint_does(tmp_path, bundled_dir):
    """The compressed-tensors config groups of a mix of schemes name StarCoder2's MLP as its checkpoints do (c_fc,
    c_proj, not quantkit's up_proj / down_proj), so transformers finds every module's scheme."""
    loaded = load_model(str(saved_families(tmp_path, bundled_dir)("starcoder2")[1]))
    model = copy.deepcopy(loaded.model)
    mix = {"model.layers.0.mlp.up_proj": QuantScheme(8, -1), "model.layers.1.mlp.down_proj": None}
    cfg = CalibConfig(method="rtn", scheme=QuantScheme(4, 32), layout="compressed-tensors", layer_schemes=mix)
    calibrate(model, loaded.hf_config, None, cfg, progress=False)
    folder = save_checkpoint(tmp_path / "mixed", model, loaded.hf_config, loaded.tokenizer, "compressed-tensors",
                             {"method": "rtn"})
    quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert "model.layers.1.mlp.c_proj" in quantization["ignore"]
    targets = [t for group in quantization["config_groups"].values() for t in group["targets"]]
    assert any("c_fc" in t for t in targets) and "up_proj" not in json.dumps(quantization), targets
    theirs, ours = transformers_load(folder)(IDS).logits, load_model(str(folder)).model(IDS)
    torch.testing.assert_close(theirs, ours, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("name", DENSE)
@torch.no_grad()
def test_asymmetric_compressed_tensors_loads_dequantized_with_quantkit_logits(name, quantized):
    from transformers import CompressedTensorsConfig

    _, _, folder = quantized(name, "w4g32", False, "compressed-tensors")
    hf = transformers_load(folder, quantization_config=CompressedTensorsConfig(dequantize=True))
    torch.testing.assert_close(hf(IDS).logits, load_model(str(folder)).model(IDS), atol=FP16_WEIGHTS_ATOL, rtol=0)


def tensor_modules(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {key.rpartition(".")[0] for key in f.keys()}


@pytest.mark.parametrize("layout, sym", [("gptq", True), ("gptq_v2", False), ("awq", False),
                                         ("compressed-tensors", False)])
@torch.no_grad()
def test_phi3_folders_store_fused_qkv_and_gate_up_and_read_back_exactly(layout, sym, quantized):
    """transformers' and vLLM's Phi-3 have self_attn.qkv_proj and mlp.gate_up_proj: the folder holds those (rows
    q | k | v, gate | up) and quantkit splits them back into the very QTensors it wrote."""
    _, model, folder = quantized("phi3", "w4g32", sym, layout)
    modules = tensor_modules(folder)
    for i in range(model.config.num_hidden_layers):
        assert {f"model.layers.{i}.self_attn.qkv_proj", f"model.layers.{i}.mlp.gate_up_proj"} <= modules
        assert not {f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")} & modules
        assert not {f"model.layers.{i}.mlp.{p}" for p in ("gate_proj", "up_proj")} & modules
    read = read_quantized(folder).qlinears
    written = qlinear_modules(model)
    assert read.keys() == written.keys()
    assert all(read[n][0].equal(m.qtensor()) for n, m in written.items())
    if layout.startswith("gptq"):
        qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
        assert qcfg["modules_in_block_to_quantize"] == [["self_attn.qkv_proj"], ["self_attn.o_proj"],
                                                         ["mlp.gate_up_proj"], ["mlp.down_proj"]]
    torch.testing.assert_close(load_model(str(folder)).model(IDS), model(IDS), atol=1e-4, rtol=0)


@pytest.mark.skipif(not GPTQMODEL, reason="transformers reads GPTQ/AWQ only through gptqmodel + optimum")
@pytest.mark.parametrize("layout, sym", [("gptq", True), ("gptq_v2", False), ("awq", False)])
@pytest.mark.parametrize("name", ["llama", "phi3", "gemma2"])
@torch.no_grad()
def test_gptq_and_awq_load_in_transformers_through_gptqmodel(name, layout, sym, quantized):
    _, _, folder = quantized(name, "w4g32", sym, layout)
    hf = transformers_load(folder)
    torch.testing.assert_close(hf(IDS).logits, load_model(str(folder)).model(IDS), atol=FP16_WEIGHTS_ATOL, rtol=0)


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_every_default_layout_holds_its_scheme_and_asymmetric_4_bit_is_one_vllm_cpu_loads(method):
    """For every (bits, group, sym, act-order, static groups) a method accepts, the default layout's writer takes the
    scheme's QTensor (act-order: a non-monotonic g_idx); asymmetric 4-bit without a g_idx is AWQ GEMM (grouped) or
    compressed-tensors (per-channel), the asymmetric layouts vLLM's CPU build loads (bench/runtime_compat.py; it
    refuses gptq_v2)."""
    from quantkit.config import QuantScheme
    from quantkit.formats.checkpoint import _LAYOUTS
    from tests.quantkit.test_export import act_order_qtensor

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    for bits in (4, 8):
        for group_size in (32, -1):
            for sym in (True, False):
                orders = ((False, False), (True, False), (True, True)) if method == "gptq" else ((False, False),)
                for act, static in orders:
                    flat = {"method": method, "bits": bits, "group_size": group_size, "sym": sym, "act_order": act,
                            "static_groups": static}
                    layout = CalibConfig.from_flat(flat).layout
                    scheme = QuantScheme(bits, group_size, sym, act, static)
                    g_idx_on_disk = act and not static and group_size != -1
                    qt = act_order_qtensor(w, scheme, torch.Generator().manual_seed(1)) if g_idx_on_disk else \
                        quantize_rtn(w, scheme)
                    assert _LAYOUTS[layout].write(qt, "m"), flat  # raises if the layout cannot hold it
                    if not sym and bits == 4 and not g_idx_on_disk and not (act and not static):
                        assert layout == ("awq" if group_size != -1 else "compressed-tensors"), flat
                    elif sym and method != "awq":
                        assert layout == "gptq", flat


@torch.no_grad()
def test_phi3_gptq_act_order_fuses_because_q_k_v_share_one_g_idx(quantized, tmp_path):
    """GPTQ act-order orders each Linear's columns by its Hessian; q/k/v (and gate/up) see the same input, so their
    g_idx agree and one fused qkv_proj holds them."""
    from quantkit.data import CalibData

    float_model, _, folder = quantized("phi3", "w4g32", True, "gptq")
    model = copy.deepcopy(float_model)
    hf_config = json.loads((folder / "config.json").read_text())
    hf_config.pop("quantization_config")
    tokens = torch.randint(0, 128, (12, 32), generator=torch.Generator().manual_seed(11))
    cfg = CalibConfig.from_flat({"method": "gptq", "group_size": 32, "act_order": True, "num_samples": 12,
                                 "seq_len": 32})
    calibrate(model, hf_config, CalibData(tokens, None, torch.full((12,), 32), {}, "tiny"), cfg, progress=False)
    written = qlinear_modules(model)
    assert written["model.layers.0.self_attn.q_proj"].g_idx is not None  # act-order groups really are on disk
    out = save_checkpoint(tmp_path / "act", model, hf_config, None, "gptq", {"method": "gptq"})
    read = read_quantized(out).qlinears
    assert all(read[n][0].equal(m.qtensor()) for n, m in written.items())
