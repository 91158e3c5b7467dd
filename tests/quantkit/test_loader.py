"""The loader: HF folders (single and sharded), the hub cache (offline), and clear errors: an architecture quantkit does
not run is one error line from every command before any weight loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from quantkit.errors import QuantkitError
from quantkit.models.loader import load_model, resolve
from tests.conftest import REPO, tiny_hf_config


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


def quantkit_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantkit.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    return lines[-1]


REFUSED = {  # config.json of architectures quantkit does not run (only the config: nothing else is read)
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128),
    "opt": dict(model_type="opt", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                vocab_size=128),
    "unknown": tiny_hf_config("my_new_arch"),
}


@pytest.mark.parametrize("arch", REFUSED)
def test_unsupported_architectures_are_one_error_line_before_any_weight_loads(tmp_path, arch):
    (tmp_path / "config.json").write_text(json.dumps(REFUSED[arch]))
    expected = (f"error: {tmp_path}: config.json model_type {REFUSED[arch]['model_type']!r} is not supported: "
                f"quantkit runs Arcee (arcee), Cohere (cohere), Cohere 2 (cohere2), ERNIE 4.5 (ernie4_5), ")
    assert one_error_line(quantkit_cli("calibrate", str(tmp_path), "--method", "rtn",
                                       "--out", str(tmp_path / "out"))).startswith(expected)
    assert one_error_line(quantkit_cli("serve", str(tmp_path))).startswith(expected)
    with pytest.raises(QuantkitError, match="is not supported: quantkit runs"):
        load_model(str(tmp_path))
    import quantkit

    with pytest.raises(QuantkitError, match="is not supported: quantkit runs"):
        quantkit.LLM(str(tmp_path))


def test_a_known_family_with_an_unsupported_feature_names_the_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("gemma3_text", use_bidirectional_attention=True)))
    with pytest.raises(QuantkitError, match=r"Gemma 3 \(gemma3_text\): use_bidirectional_attention"):
        resolve(str(tmp_path))


def test_head_dim_null_calibrates(tmp_path, bundled_dir):
    """Transformers writes "head_dim": null for Mixtral-style configs: head_dim is hidden / heads then."""
    torch.manual_seed(0)
    folder = tmp_path / "model"
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_hf_config("mistral", sliding_window=None)))
    hf.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert "head_dim" in config
    (folder / "config.json").write_text(json.dumps({**config, "head_dim": None}))
    PreTrainedTokenizerFast.from_pretrained(bundled_dir).save_pretrained(folder)
    done = quantkit_cli("calibrate", str(folder), "--method", "rtn", "--group-size", "32", "--out", str(tmp_path / "q"))
    assert done.returncode == 0, done.stderr
    assert load_model(str(tmp_path / "q")).model.config.head_dim == 16
