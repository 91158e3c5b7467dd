"""The loader: HF folders (single and sharded), the hub cache (offline), and clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from quantkit.errors import QuantkitError
from quantkit.models.loader import load_model, resolve
from tests.conftest import tiny_hf_config


def _save_tiny(folder, bundled_dir, max_shard_size="2GB"):
    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_hf_config("llama", vocab_size=49152)))
    hf.save_pretrained(folder, max_shard_size=max_shard_size)
    PreTrainedTokenizerFast.from_pretrained(bundled_dir).save_pretrained(folder)
    return hf.eval()


@pytest.mark.parametrize("shard", ["2GB", "2MB"])
def test_hf_folder_loads_single_and_sharded(tmp_path, bundled_dir, shard):
    hf = _save_tiny(tmp_path, bundled_dir, shard)
    if shard == "2MB":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(str(tmp_path))
    ids = torch.randint(0, 49152, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), hf(ids).logits, atol=1e-4, rtol=0)
    assert loaded.quant_meta is None and loaded.path == tmp_path


def test_hub_id_missing_from_cache_is_a_clear_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(QuantkitError, match=r"not in the local Hugging Face cache.*huggingface-cli download someone/model"):
        resolve("someone/model")


def test_folder_without_config_and_missing_paths_are_named(tmp_path):
    with pytest.raises(QuantkitError, match=f"{tmp_path}: no config.json"):
        resolve(str(tmp_path))
    with pytest.raises(QuantkitError, match="no such model folder"):
        resolve(str(tmp_path / "nope" / "deeper"))


def test_missing_weight_is_named(tmp_path, bundled_dir):
    _save_tiny(tmp_path, bundled_dir)
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(QuantkitError, match="model.layers.1.mlp.down_proj.weight"):
        load_model(str(tmp_path))
