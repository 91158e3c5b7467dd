"""Mistral 3, LLaVA, Aya Vision and InternVL (their ForConditionalGeneration classes) checkpoints read as their text
decoder (quantkit/models/multimodal.py), against transformers' own vision-language model on text input_ids:
loading, calibration to a text-only checkpoint (whole and in bounded memory), and serving. Gemma 3, the third
wrapper, is tests/quantkit/test_gemma3_multimodal.py (with this file's module_names and calibrated_text_only).

VARIANTS, families.py's mistral and llama text configs under tiny vision towers:
  mistral3      transformers 5's Mistral3Config: the wrapper ties lm_head to the embeddings, none is stored
  mistral3-hub  Mistral Small 3.1's form: its own lm_head stored, config.json naming no tie_word_embeddings
  llava         a llama decoder with its own lm_head, stored under transformers' module names (model.language_model.*)
  ministral3    Ministral 3's form: a ministral3 decoder (YaRN, queries past 16 positions scaled) in mistral3
  aya_vision    a cohere2 decoder (parallel block, LayerNorm, RoPE pairs, NoPE full layers) under a SigLIP tower
  internvl      a qwen2 decoder (q/k/v biases, a sliding layer), its tensors under transformers' module names
  llava_next    a llama decoder beside a CLIP tower and the image_newline parameter (LLaVA 1.6)
  llava_onevision  a qwen2 decoder beside a SigLIP tower and image_newline
  smolvlm       a llama decoder under model.text_model, beside model.vision_model and model.connector
  qwen2_5_vl    Qwen2.5-VL's M-RoPE qwen2 decoder as transformers 5 saves it (the hub's tensor names: model.*, visual.*)
  qwen2_5_vl-4x the same with the hub's flat 4.x config.json (decoder fields at the top, rope_scaling type mrope)
  qwen3_vl      Qwen3-VL's qwen3 decoder (q/k norms, interleaved M-RoPE sections), under model.language_model.*
  qwen3_vl_moe  Qwen3-VL-MoE's qwen3_moe decoder (router always renormalised), experts fused as transformers 5 saves
  qwen3_vl_moe-hub  the same with the hub files' transposed experts ([E, H, 2I] and [E, I, H])
  glm4v         GLM-4.1V's glm4v_text decoder: GLM-4-0414's block, M-RoPE over half of each head's dims in pairs
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AyaVisionConfig, AyaVisionForConditionalGeneration, InternVLConfig
from transformers import InternVLForConditionalGeneration, LlavaConfig, LlavaForConditionalGeneration, Mistral3Config
from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaOnevisionConfig
from transformers import LlavaOnevisionForConditionalGeneration, SmolVLMConfig, SmolVLMForConditionalGeneration
from transformers import Mistral3ForConditionalGeneration, PreTrainedTokenizerFast, Qwen2_5_VLConfig
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration
from transformers import Glm4vConfig, Glm4vForConditionalGeneration, Qwen3VLMoeConfig
from transformers import Qwen3VLMoeForConditionalGeneration
from typer.testing import CliRunner

from quantkit.cli import _typer_app
from quantkit.config import CalibConfig
from quantkit.errors import QuantkitError
from quantkit.files import read_safetensors
from quantkit.models.config import ModelConfig
from quantkit.models.loader import load_model, tensor_names_of
from quantkit.models.multimodal import TEXT_AS, text_config
from quantkit.quant.calibrate import calibrate
from tests.quantkit.families import BASE, FAMILIES
from tests.serve.test_families_serving import GREEDY, PROMPTS, dense_greedy, served, tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

MISTRAL = {**BASE, **FAMILIES["mistral"][1], "model_type": "mistral"}  # sliding window 16
LLAMA = {**BASE, **FAMILIES["llama"][1], "model_type": "llama"}
COHERE2 = {**BASE, **FAMILIES["cohere2"][1], "model_type": "cohere2"}
MINISTRAL3 = {**BASE, **FAMILIES["ministral3"][1], "model_type": "ministral3"}
QWEN2 = {**BASE, **FAMILIES["qwen2"][1], "model_type": "qwen2"}
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
             patch_size=8)
PIXTRAL, CLIP = {**TOWER, "head_dim": 16}, {**TOWER, "projection_dim": 32}
SIGLIP = {**TOWER, "model_type": "siglip_vision_model"}
GRID = [[32, 32]]  # LLaVA-NeXT's image tiling: one tile of the tiny tower's size
QWEN_TOWER = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # 8 frequencies of a 16-dim head
QWEN25_VL = {**QWEN2, "model_type": "qwen2_5_vl_text", "rope_parameters": MROPE}
QWEN3_VL = {**BASE, "head_dim": 16, "model_type": "qwen3_vl_text",
            "rope_parameters": {**MROPE, "mrope_interleaved": True}}
QWEN3_TOWER = {**QWEN_TOWER, "deepstack_visual_indexes": [0], "num_position_embeddings": 16}
GLM4V = {**BASE, "head_dim": 16, "model_type": "glm4v_text",
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                             "partial_rotary_factor": 0.5}}  # sections of the 4 frequencies of 8 rotated dims
GLM4V_TOWER = {**QWEN_TOWER, "image_size": 16}
QWEN3_VL_MOE = {**QWEN3_VL, "model_type": "qwen3_vl_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
                "moe_intermediate_size": 96}  # 2I, I and H all differ: the experts' orientation shows
INTERN_VIT = {**TOWER, "image_size": [32, 32], "patch_size": [8, 8], "model_type": "internvl_vision"}
HUB_NAMES = ("language_model.model.", "language_model.lm_head.", "vision_tower.", "multi_modal_projector.")
MODULE_NAMES = ("model.language_model.", "lm_head.", "model.vision_tower.", "model.multi_modal_projector.")


def hub_form(folder: Path) -> None:
    """config.json as Mistral Small 3.1's: neither the wrapper nor text_config names tie_word_embeddings."""
    config = json.loads((folder / "config.json").read_text())
    del config["tie_word_embeddings"], config["text_config"]["tie_word_embeddings"]
    (folder / "config.json").write_text(json.dumps(config))


def module_names(folder: Path) -> None:
    """The tensors under transformers' module names (MODULE_NAMES) rather than the hub's (HUB_NAMES)."""
    stored = load_file(folder / "model.safetensors")
    renamed = {}
    for name, t in stored.items():
        hub = next(p for p in HUB_NAMES if name.startswith(p))
        renamed[MODULE_NAMES[HUB_NAMES.index(hub)] + name[len(hub):]] = t
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})


def transposed_experts(folder: Path) -> None:
    """The fused experts as Qwen3-VL-MoE's hub files store them: gate_up_proj [E, H, 2I], down_proj [E, I, H]."""
    stored = load_file(folder / "model.safetensors")
    save_file({n: t.transpose(1, 2).contiguous() if ".mlp.experts." in n else t for n, t in stored.items()},
              folder / "model.safetensors", metadata={"format": "pt"})


def flat_form(folder: Path) -> None:
    """config.json as Qwen2.5-VL's hub files (transformers 4.x): the decoder's fields at the top level, M-RoPE as
    rope_theta and rope_scaling {"type": "mrope", "mrope_section"}."""
    config = json.loads((folder / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update({k: v for k, v in text.items() if v is not None and k not in ("model_type", "architectures")})
    config.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]},
                  torch_dtype="float32")  # 4.x names the dtype at the top
    (folder / "config.json").write_text(json.dumps(config))


def vl(model_cls, config_cls, text: dict, tower: dict, **extra):
    """-> a builder of transformers' vision-language `model_cls` over the `text` and `tower` configs."""
    return lambda: model_cls(config_cls(text_config=text, vision_config=tower, **extra))


QWEN25_VL_MODEL = vl(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, QWEN25_VL, QWEN_TOWER)
QWEN3_VL_MOE_MODEL = vl(Qwen3VLMoeForConditionalGeneration, Qwen3VLMoeConfig, QWEN3_VL_MOE, QWEN3_TOWER)
VARIANTS = {  # name -> (transformers' model, an edit of its save_pretrained folder, the text model's class)
    "mistral3": (vl(Mistral3ForConditionalGeneration, Mistral3Config, MISTRAL, PIXTRAL), None, "MistralForCausalLM"),
    "mistral3-hub": (vl(Mistral3ForConditionalGeneration, Mistral3Config, MISTRAL, PIXTRAL, tie_word_embeddings=False),
                     hub_form, "MistralForCausalLM"),
    "llava": (vl(LlavaForConditionalGeneration, LlavaConfig, LLAMA, CLIP), module_names, "LlamaForCausalLM"),
    "ministral3": (vl(Mistral3ForConditionalGeneration, Mistral3Config, MINISTRAL3, PIXTRAL), None,
                   "Ministral3ForCausalLM"),
    "aya_vision": (vl(AyaVisionForConditionalGeneration, AyaVisionConfig, COHERE2, SIGLIP), None, "Cohere2ForCausalLM"),
    "internvl": (vl(InternVLForConditionalGeneration, InternVLConfig, QWEN2, INTERN_VIT), module_names,
                 "Qwen2ForCausalLM"),
    "llava_next": (vl(LlavaNextForConditionalGeneration, LlavaNextConfig, LLAMA, CLIP, image_grid_pinpoints=GRID),
                   None, "LlamaForCausalLM"),
    "llava_onevision": (vl(LlavaOnevisionForConditionalGeneration, LlavaOnevisionConfig, QWEN2, SIGLIP,
                           image_grid_pinpoints=GRID), None, "Qwen2ForCausalLM"),
    "smolvlm": (vl(SmolVLMForConditionalGeneration, SmolVLMConfig, LLAMA, TOWER), None, "LlamaForCausalLM"),
    "qwen2_5_vl": (QWEN25_VL_MODEL, None, "Qwen2ForCausalLM"),
    "qwen2_5_vl-4x": (QWEN25_VL_MODEL, flat_form, "Qwen2ForCausalLM"),
    "qwen3_vl": (vl(Qwen3VLForConditionalGeneration, Qwen3VLConfig, QWEN3_VL, QWEN3_TOWER), None, "Qwen3ForCausalLM"),
    "qwen3_vl_moe": (QWEN3_VL_MOE_MODEL, None, "Qwen3MoeForCausalLM"),
    "qwen3_vl_moe-hub": (QWEN3_VL_MOE_MODEL, transposed_experts, "Qwen3MoeForCausalLM"),
    "glm4v": (vl(Glm4vForConditionalGeneration, Glm4vConfig, GLM4V, GLM4V_TOWER), None, "Glm4ForCausalLM"),
}


def text_type(hf) -> str:
    """The model_type quantkit reads the decoder of transformers' vision-language model `hf` as."""
    own = hf.config.text_config.model_type
    return TEXT_AS[own][0] if own in TEXT_AS else own


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory, bundled_dir):
    """(variant name, transformers' random-weight model, its folder with the bundled tokenizer)."""
    build, edit, _ = VARIANTS[request.param]
    torch.manual_seed(0)
    hf = build().eval()
    with torch.no_grad():  # random norms around 1: a missing norm cannot hide
        for name, p in decoder(hf).named_parameters():
            if "norm" in name:
                p.normal_(mean=1.0, std=0.1)
    folder = tmp_path_factory.mktemp(request.param) / "model"
    hf.save_pretrained(folder)
    if edit is not None:
        edit(folder)
    PreTrainedTokenizerFast.from_pretrained(bundled_dir).save_pretrained(folder)
    return request.param, hf, folder


def decoder(hf):
    """The text decoder module of transformers' vision-language model `hf` (SmolVLM calls it text_model)."""
    return getattr(hf.model, "language_model", None) or hf.model.text_model


def tied(hf) -> bool:
    return hf.lm_head.weight is decoder(hf).embed_tokens.weight


def ids(length: int) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(length))


@torch.no_grad()
def test_loads_as_the_text_decoder_with_transformers_logits(saved):
    name, hf, folder = saved
    loaded = load_model(str(folder))
    assert loaded.hf_config["model_type"] == text_type(hf)
    assert loaded.hf_config["architectures"] == [VARIANTS[name][2]]
    assert loaded.model.config.tie_word_embeddings == tied(hf)
    read = read_safetensors(folder, tensor_names_of(folder))  # the vision tower and projector are never read
    read = loaded.model.family.model_tensors(read, loaded.model.config)  # fused experts split
    assert set(read) == {n for n in loaded.model.state_dict() if not (tied(hf) and n == "lm_head.weight")}
    for length in (8, 48):  # inside and past the sliding window
        x = ids(length)
        torch.testing.assert_close(loaded.model(x), hf(input_ids=x).logits, atol=1e-4, rtol=0, msg=f"{length}")


MISTRAL_SMALL_31 = {  # mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json, its vision_config cut to the type
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "vision_feature_layer": -1,
    "text_config": {"attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
                    "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 131072,
                    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40,
                    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
                    "sliding_window": None, "use_cache": True, "vocab_size": 131072},
    "vision_config": {"model_type": "pixtral"},
}
LLAVA_15 = {  # llava-hf/llava-1.5-7b-hf's config.json: text_config names little but the model_type and sizes
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.36.0.dev0", "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default", "vocab_size": 32064,
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "vision_config": {"model_type": "clip_vision_model"},
}


NO_TEXT_CONFIG = {"model_type": "mistral3"}  # transformers' default text_config: Mistral Small 3.1's


@pytest.mark.parametrize("hub, wrapper, architecture", [(MISTRAL_SMALL_31, Mistral3Config, "MistralForCausalLM"),
                                                        (NO_TEXT_CONFIG, Mistral3Config, "MistralForCausalLM"),
                                                        (LLAVA_15, LlavaConfig, "LlamaForCausalLM")],
                         ids=["mistral-small-3.1", "no-text_config", "llava-1.5"])
def test_a_hub_text_config_takes_transformers_defaults_and_the_wrappers_fields(hub, wrapper, architecture):
    """Both store their own lm_head (language_model.lm_head.weight): untied whatever the configs' defaults."""
    text = text_config(hub, ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight"])
    ours, theirs = ModelConfig.from_hf(text), wrapper(**hub).text_config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.sliding_window == getattr(theirs, "sliding_window", None)
    assert ours.rope() == (theirs.rope_parameters["rope_theta"], None)
    assert not ours.tie_word_embeddings and text["architectures"] == [architecture]
    assert (text["bos_token_id"], text["eos_token_id"]) == (theirs.bos_token_id, theirs.eos_token_id)
    assert text.get("torch_dtype") == hub.get("torch_dtype") and "vision_config" not in text


QWEN25_VL_3B = {  # Qwen/Qwen2.5-VL-3B-Instruct's config.json (flat, 4.x), its vision_config cut to a few fields
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 2048, "image_token_id": 151655,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000, "max_window_layers": 70,
    "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 2048, "fullatt_block_indexes": [7, 15]},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}


def test_qwen25_vl_hub_config_reads_as_its_qwen2_decoder_on_plain_rope():
    """The flat 4.x config.json: the decoder's fields as transformers' config class reads them, M-RoPE as the plain
    RoPE it is on text, tied (no lm_head stored), the checkpoint's dtype and token ids."""
    text = text_config(QWEN25_VL_3B, ["model.embed_tokens.weight", "visual.merger.mlp.0.weight"])
    ours, theirs = ModelConfig.from_hf(text), Qwen2_5_VLConfig(**QWEN25_VL_3B).text_config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.head_dim, ours.sliding_window, ours.qkv_bias, ours.o_bias) == (128, None, True, False)
    assert ours.rope() == (1e6, None) and ours.tie_word_embeddings and text["architectures"] == ["Qwen2ForCausalLM"]
    assert (text["torch_dtype"], text["eos_token_id"]) == ("bfloat16", 151645) and "vision_config" not in text


def test_a_text_decoder_transformers_does_not_know_is_refused():
    with pytest.raises(QuantkitError, match=r"config.json text_config.model_type 'vicuna'"):
        text_config({**LLAVA_15, "text_config": {"model_type": "vicuna"}}, ())


def run_calibrate(*args: str) -> str:
    result = CliRunner().invoke(_typer_app, ["calibrate", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@torch.no_grad()
def calibrated_text_only(folder: Path, out_root: Path, wrapper: str, text: str) -> Path:
    """`quantkit calibrate` RTN W4 g32 of the vision-language `folder` (transformers class `wrapper`), whole and in
    bounded memory: the same bytes, a line naming what was left out, a `text` checkpoint without a vision tensor or
    sub-config, on which quantkit's logits equal the float model's RTN-quantized in memory. -> its folder."""
    out, bounded = out_root / "w4", out_root / "w4-bounded"
    common = [str(folder), "--method", "rtn", "--bits", "4", "--group-size", "32"]
    printed = run_calibrate(*common, "--out", str(out))
    assert (f"{folder} is a vision-language checkpoint ({wrapper}): its vision tower and projector were left out, "
            f"{out} is text-only ({text})") in " ".join(printed.split())
    run_calibrate(*common, "--out", str(bounded), "--max-host-memory", "1KB")  # one block at a time
    for file in ("model.safetensors", "config.json"):
        assert (out / file).read_bytes() == (bounded / file).read_bytes(), file
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [text] and not {"text_config", "vision_config"} & config.keys()
    assert all(n.startswith(("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head."))
               for n in load_file(out / "model.safetensors"))  # the text model's names, and only its tensors

    loaded = load_model(str(folder))  # quantized in memory as the CLI did (RTN: the same codes)
    calibrate(loaded.model, loaded.hf_config, None, CalibConfig.from_flat({"method": "rtn", "group_size": 32}),
              progress=False)
    x = ids(20)
    torch.testing.assert_close(load_model(str(out)).model(x), loaded.model(x), atol=1e-4, rtol=0)
    return out


def test_rtn_calibration_writes_a_text_only_checkpoint(saved, tmp_path):
    name, hf, folder = saved
    out = calibrated_text_only(folder, tmp_path, type(hf).__name__, VARIANTS[name][2])
    assert ("lm_head.weight" in load_file(out / "model.safetensors")) != tied(hf)
    text = AutoConfig.from_pretrained(out)
    assert text.model_type == text_type(hf) and text.tie_word_embeddings == tied(hf)
    for field in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size", "num_experts"):
        assert getattr(text, field, None) == getattr(hf.config.text_config, field, None), field


def test_served_greedy_equals_the_dense_path(saved):
    """quantkit.serve.llm.LLM, fp32 paged attention with chunked prefill, on the folder as loaded."""
    name, _, folder = saved
    reference = load_model(str(folder)).model
    expected = [dense_greedy(f"{name}-vision-language", reference, p) for p in PROMPTS]
    assert tokens(served(folder).generate(PROMPTS, GREEDY)) == expected
