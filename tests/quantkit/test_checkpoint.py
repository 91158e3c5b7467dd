"""formats/checkpoint.py + `quantkit info`: a tiny random Llama with QLinear layers saved in every layout reads back to
identical QTensors and loads (via the real loader) into a model with the same logits; the folder holds what FORMATS.md
lists; tampering, truncation and missing files are caught by name; writes are atomic."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from typer.testing import CliRunner

from quantkit.cli import _typer_app
from quantkit.commands.info import _human
from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import qlinear_modules, read_quantized, save_checkpoint
from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.models.loader import load_model, load_tokenizer
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import dequantize, quantize_rtn
from tests.conftest import tiny_hf_config

LAYOUT_SCHEMES = {
    "gptq": QuantScheme(bits=4, group_size=32, sym=True),
    "gptq_v2": QuantScheme(bits=8, group_size=64, sym=False),
    "awq": QuantScheme(bits=4, group_size=64, sym=False),
    "compressed-tensors": QuantScheme(bits=4, group_size=-1, sym=False),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def quantized_model(hf_config: dict, scheme: QuantScheme, skip: tuple[str, ...] = (), seed: int = 0) -> LlamaForCausalLM:
    """A random tiny model whose block Linears (except `skip`) are RTN QLinears; float params rounded to the
    base dtype (fp16) so a saved-and-loaded copy must match it exactly."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_hf(hf_config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    for name, m in list(model.named_modules()):
        if type(m) is nn.Linear and name != "lm_head" and name not in skip:
            parent, _, child = name.rpartition(".")
            qt = quantize_rtn(m.weight.detach(), scheme, layer=name)
            setattr(model.get_submodule(parent), child, QLinear.from_qtensor(qt, m.bias))
    return model


@pytest.mark.parametrize("layout", list(LAYOUT_SCHEMES))
def test_save_read_and_load_round_trip(layout, tmp_path, tokenizer):
    hf_config = tiny_hf_config(tie_word_embeddings=True, torch_dtype="float16", bos_token_id=1, eos_token_id=2)
    model = quantized_model(hf_config, LAYOUT_SCHEMES[layout])
    out = save_checkpoint(tmp_path / "ck", model, hf_config, tokenizer, layout, {"method": "rtn", "calibration": {"rows": 0}})

    q = read_quantized(out)
    assert q.layout == layout and q.meta["method"] == "rtn"
    qlinears = qlinear_modules(model)
    assert set(q.qlinears) == set(qlinears)
    for name, m in qlinears.items():
        assert m.qtensor().equal(q.qlinears[name][0])
    state = model.state_dict()
    assert "lm_head.weight" not in q.float_tensors  # tied: written once, as the embedding
    for key, t in q.float_tensors.items():
        assert t.dtype == torch.float16 and torch.equal(t.float(), state[key])

    loaded = load_model(str(out))
    ids = torch.randint(0, hf_config["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), model(ids), rtol=0, atol=1e-5)
    assert loaded.quant_meta["layout"] == layout


def test_folder_holds_config_tokenizer_generation_config_and_checksums(tmp_path, tokenizer):
    hf_config = tiny_hf_config(torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, attention_bias=True)
    model = quantized_model(hf_config, QuantScheme(bits=4, group_size=32, sym=True), skip=("model.layers.1.mlp.down_proj",))
    out = save_checkpoint(tmp_path / "ck", model, hf_config, tokenizer, "compressed-tensors", {"method": "rtn"})
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "quantkit.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left behind
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [out, *out.iterdir()]}
    assert modes == {name: (0o777 if name == "ck" else 0o666) & ~umask for name in modes}  # readable by others

    config = json.loads((out / "config.json").read_text())
    qcfg = config["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors"
    assert qcfg["ignore"] == ["lm_head", "model.layers.1.mlp.down_proj"]
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}

    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["layout"] == "compressed-tensors" and meta["method"] == "rtn" and meta["quantkit_version"]
    assert meta["scheme"] == {"bits": 4, "group_size": 32, "sym": True, "act_order": False, "static_groups": False, "name": "w4g32"}
    assert set(meta["files"]) == files - {"quantkit.json"}
    import hashlib

    assert meta["files"]["model.safetensors"] == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16  # base dtype from config.json
        assert f.get_tensor("model.layers.0.self_attn.q_proj.bias").dtype == torch.bfloat16
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16  # untied: written
    assert "model.layers.1.mlp.down_proj.weight" in keys  # the unquantized Linear stays a float weight
    assert "model.layers.0.self_attn.q_proj.weight_packed" in keys and "model.layers.0.self_attn.q_proj.weight" not in keys


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    hf_config = tiny_hf_config(tie_word_embeddings=True)
    model = quantized_model(hf_config, QuantScheme(bits=4, group_size=32, sym=True))
    out = save_checkpoint(tmp_path_factory.mktemp("ck") / "ck", model, hf_config, tokenizer, "gptq", {"method": "rtn"})
    return out, model


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_a_modified_safetensors_byte_is_caught_naming_the_file(saved, tmp_path):
    folder = copy_folder(saved[0], tmp_path / "bad")
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(QuantkitError, match=r"model\.safetensors: sha256 does not match quantkit\.json"):
        read_quantized(folder)
    with pytest.raises(QuantkitError, match=r"model\.safetensors: sha256 does not match"):
        load_model(str(folder))


def test_truncated_and_missing_files_are_named(saved, tmp_path):
    folder = copy_folder(saved[0], tmp_path / "trunc")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(QuantkitError, match=r"model\.safetensors: sha256 does not match"):
        read_quantized(folder)
    (folder / "tokenizer.json").unlink()
    path.unlink()
    with pytest.raises(QuantkitError, match=r"model\.safetensors: missing"):
        read_quantized(folder)
    # without quantkit.json (another tool's folder) a truncated file is still named when it fails to parse
    folder = copy_folder(saved[0], tmp_path / "foreign")
    (folder / "quantkit.json").unlink()
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(QuantkitError, match=r"model\.safetensors: cannot read safetensors file"):
        read_quantized(folder)


def test_sharded_checkpoint_reads_back(saved, tmp_path, tokenizer):
    _, model = saved
    hf_config = tiny_hf_config(tie_word_embeddings=True)
    out = save_checkpoint(tmp_path / "sharded", model, hf_config, tokenizer, "gptq_v2", {}, max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    q = read_quantized(out)
    for name, m in qlinear_modules(model).items():
        assert m.qtensor().equal(q.qlinears[name][0])
    meta = json.loads((out / "quantkit.json").read_text())
    assert set(shards) | {"model.safetensors.index.json"} <= set(meta["files"])


def test_save_replaces_an_existing_checkpoint_and_refuses_other_folders(saved, tmp_path, tokenizer):
    _, model = saved
    hf_config = tiny_hf_config(tie_word_embeddings=True)
    out = tmp_path / "ck"
    save_checkpoint(out, model, hf_config, tokenizer, "gptq", {"run": 1})
    save_checkpoint(out, model, hf_config, tokenizer, "awq", {"run": 2})
    assert read_quantized(out).layout == "awq" and json.loads((out / "quantkit.json").read_text())["run"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]

    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    with pytest.raises(QuantkitError, match="exists and is not a model folder"):
        save_checkpoint(precious, model, hf_config, tokenizer, "gptq", {})
    assert (precious / "todo.txt").read_text() == "keep me"


def test_a_failed_save_leaves_the_existing_checkpoint_and_no_temp_folder(saved, tmp_path, tokenizer):
    hf_config = tiny_hf_config()
    out = tmp_path / "ck"
    save_checkpoint(out, quantized_model(hf_config, QuantScheme(bits=4, group_size=32, sym=True)), hf_config, tokenizer, "gptq", {"run": 1})
    asym = quantized_model(hf_config, QuantScheme(bits=4, group_size=32, sym=False))
    with pytest.raises(QuantkitError, match=r"GPTQ v1 .* use --format gptq_v2, awq or compressed-tensors"):
        save_checkpoint(out, asym, hf_config, tokenizer, "gptq", {"run": 2})
    assert json.loads((out / "quantkit.json").read_text())["run"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_reads_an_autoawq_style_folder_packed_independently(tmp_path):
    """An AWQ folder as AutoAWQ lays it out (quant_config.json, no quantization_config, no quantkit.json), packed
    here with plain Python ints from FORMATS.md: the codes come back."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    n, k, g = 16, 64, 32
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (n, k // g), generator=gen)
    scales = (torch.rand(k // g, n, generator=gen) * 0.01).half()

    def awq_pack(mat):  # mat [R, N] -> int32 [R, N / 8]
        words = [[sum(int(mat[r, 8 * c + order[i]]) << (4 * i) for i in range(8)) for c in range(mat.shape[1] // 8)]
                 for r in range(mat.shape[0])]
        return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)

    hf_config = tiny_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    (tmp_path / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": g, "w_bit": 4, "version": "GEMM"}))
    name = "model.layers.0.mlp.up_proj"
    save_file({f"{name}.qweight": awq_pack(codes.T), f"{name}.qzeros": awq_pack(zeros.T), f"{name}.scales": scales,
               "model.norm.weight": torch.ones(64, dtype=torch.float16)}, str(tmp_path / "model.safetensors"))
    q = read_quantized(tmp_path)
    qt, bias = q.qlinears[name]
    assert q.layout == "awq" and q.meta is None and bias is None
    assert torch.equal(qt.codes, codes.to(torch.uint8)) and torch.equal(qt.zeros, zeros.to(torch.uint8))
    assert torch.equal(dequantize(qt), scales.float().T.repeat_interleave(g, 1) * (codes - zeros.repeat_interleave(g, 1)).float())
    assert set(q.float_tensors) == {"model.norm.weight"}

    result = CliRunner().invoke(_typer_app, ["info", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "awq" in result.output and "mlp.up_proj" in result.output and "16 x 64" in result.output


def test_info_prints_scheme_layout_layers_and_bytes_saved(saved):
    folder, model = saved
    result = CliRunner().invoke(_typer_app, ["info", str(folder)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "gptq (quant_method gptq)" in out and "w4g32" in out
    assert "self_attn.q_proj" in out and "0-1" in out and "64 x 64" in out
    # bytes saved = 2 bytes per weight of every stored tensor - the safetensors bytes actually written
    params = sum(p.numel() for name, p in model.state_dict().items()
                 if not name.startswith(tuple(qlinear_modules(model))) and name != "lm_head.weight")
    params += sum(m.in_features * m.out_features for m in qlinear_modules(model).values())
    saved_bytes = 2 * params - os.path.getsize(folder / "model.safetensors")
    assert (_human(1536), _human(3 * 1024**2 + 1)) == ("1.5 KB", "3.0 MB")
    assert f"{_human(saved_bytes)} saved" in out
    assert "method         rtn" in out


def test_info_names_a_tampered_file(saved, tmp_path):
    folder = copy_folder(saved[0], tmp_path / "bad")
    (folder / "config.json").write_text((folder / "config.json").read_text() + " ")
    result = CliRunner().invoke(_typer_app, ["info", str(folder)])
    assert result.exit_code != 0 and "config.json: sha256 does not match" in str(result.exception)


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="compressed-tensors is not installed")
@pytest.mark.parametrize("scheme", [QuantScheme(bits=4, group_size=32, sym=False), QuantScheme(bits=8, group_size=-1, sym=True)],
                         ids=["w4g32-asym", "w8ch-sym"])
def test_transformers_with_compressed_tensors_decompresses_to_our_weights(scheme, tmp_path, tokenizer):
    """The real compressed-tensors library (via transformers) reads our folder: its dense fp16 weights equal
    dequantize(qt) rounded to fp16, bit for bit. Runs where compressed-tensors is installed (not a quantkit dependency)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    hf_config = tiny_hf_config(torch_dtype="float16")
    model = quantized_model(hf_config, scheme)
    out = save_checkpoint(tmp_path / "ck", model, hf_config, tokenizer, "compressed-tensors", {"method": "rtn"})
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    state = hf.state_dict()
    for name, m in qlinear_modules(model).items():
        assert torch.equal(state[f"{name}.weight"].half(), dequantize(m.qtensor(), torch.float16)), name
