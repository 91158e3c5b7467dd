"""Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration, config.json model_type "gemma3") read as their
text decoder (quantkit/models/multimodal.py), against transformers' own multimodal model on text input_ids: both
tensor layouts, calibration to a text-only gemma3_text checkpoint (whole and in bounded memory), and serving.

The tiny model is families.py's gemma3 text config under a tiny SigLIP tower, without the final soft-cap:
Gemma3ForConditionalGeneration applies none (Gemma3ForCausalLM does; no Gemma 3 release sets one).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig
from transformers import PreTrainedTokenizerFast

from quantkit.files import read_safetensors
from quantkit.formats.checkpoint import base_dtype
from quantkit.models.config import ModelConfig
from quantkit.models.loader import load_model, tensor_names_of
from quantkit.models.multimodal import text_config
from tests.quantkit.families import BASE, FAMILIES
from tests.quantkit.test_vision_language import HUB_NAMES, calibrated_text_only, module_names
from tests.serve.test_families_serving import GREEDY, PROMPTS, dense_greedy, served, tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

TEXT = {k: v for k, v in {**BASE, **FAMILIES["gemma3"][1]}.items() if k != "final_logit_softcapping"}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)  # 4 x 4 patches pooled to mm_tokens_per_image 2 x 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory, bundled_dir) -> tuple[Gemma3ForConditionalGeneration, Path]:
    """(transformers' random-weight multimodal model, its save_pretrained folder with the bundled tokenizer)."""
    torch.manual_seed(0)
    config = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                          initializer_range=TEXT["initializer_range"])  # the wrapper's initialises every weight
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # Gemma's norms hold w of (1 + w): random around 0, so a missing norm cannot hide
        for name, p in hf.model.language_model.named_parameters():
            if "norm" in name:
                p.normal_(std=0.1)
    folder = tmp_path_factory.mktemp("gemma3-mm") / "model"
    hf.save_pretrained(folder)
    PreTrainedTokenizerFast.from_pretrained(bundled_dir).save_pretrained(folder)
    return hf, folder


def ids(length: int) -> torch.Tensor:
    return torch.randint(0, TEXT["vocab_size"], (2, length), generator=torch.Generator().manual_seed(length))


@torch.no_grad()
def assert_logits_match(model, hf) -> None:
    for length in (8, 48):  # inside and past the sliding window
        x = ids(length)
        torch.testing.assert_close(model(x), hf(input_ids=x).logits, atol=1e-4, rtol=0, msg=f"{length} tokens")


def test_loads_as_the_text_decoder_with_transformers_logits(saved):
    hf, folder = saved
    stored = load_file(folder / "model.safetensors")
    assert all(name.startswith(HUB_NAMES) for name in stored)  # what transformers 5 save_pretrained writes
    loaded = load_model(str(folder))
    assert loaded.hf_config["model_type"] == "gemma3_text" and loaded.model.config.tie_word_embeddings
    read = read_safetensors(folder, tensor_names_of(folder))  # the vision tower and projector are never read
    assert set(read) == {n for n in loaded.model.state_dict() if n != "lm_head.weight"}
    assert_logits_match(loaded.model, hf)


def test_transformers_module_names_load_the_same(saved, tmp_path):
    """model.language_model.* / model.vision_tower.* / model.multi_modal_projector.*: the other layout in use."""
    hf, folder = saved
    shutil.copytree(folder, tmp_path / "m")
    module_names(tmp_path / "m")
    assert_logits_match(load_model(str(tmp_path / "m")).model, hf)


GEMMA3_4B = {  # google/gemma-3-4b-it's config.json (transformers 4.50's form), its vision_config cut to the type
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"model_type": "siglip_vision_model"},
}


def test_a_hub_text_config_takes_transformers_defaults_and_the_wrappers_fields():
    """The hub's text_config lists only what differs from Gemma3TextConfig (no head counts, head_dim, vocab_size)."""
    text = text_config(GEMMA3_4B, ())  # no lm_head stored: tied to the embeddings
    ours, theirs = ModelConfig.from_hf(text), Gemma3Config(**GEMMA3_4B).text_config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "query_pre_attn_scalar",
                  "sliding_window"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert list(ours.layer_types) == theirs.layer_types
    full, sliding = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert ours.rope() == (full["rope_theta"], {"factor": full["factor"], "rope_type": full["rope_type"]})
    assert ours.rope(sliding=True) == (sliding["rope_theta"], None)
    assert ours.tie_word_embeddings and base_dtype(text) == torch.bfloat16 and text["eos_token_id"] == [1, 106]
    assert text["architectures"] == ["Gemma3ForCausalLM"] and "vision_config" not in text


def test_rtn_calibration_writes_a_text_only_checkpoint(saved, tmp_path):
    _, folder = saved
    out = calibrated_text_only(folder, tmp_path, "Gemma3ForConditionalGeneration", "Gemma3ForCausalLM")
    text = AutoConfig.from_pretrained(out)
    assert type(text) is Gemma3TextConfig
    for field in ("hidden_size", "num_hidden_layers", "head_dim", "sliding_window"):
        assert getattr(text, field) == TEXT[field], field
    assert text.tie_word_embeddings
    assert text.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2


def test_served_greedy_equals_the_dense_path(saved):
    """quantkit.serve.llm.LLM, fp32 paged attention with chunked prefill, on the folder as loaded."""
    _, folder = saved
    reference = load_model(str(folder)).model
    expected = [dense_greedy("gemma3-multimodal", reference, p) for p in PROMPTS]
    assert tokens(served(folder).generate(PROMPTS, GREEDY)) == expected
