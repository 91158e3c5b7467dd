"""`quantkit export`: the same codes in another layout, byte-identical round trips, identical logits, refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.export import export
from quantkit.formats.checkpoint import save_checkpoint
from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.models.loader import load_model
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import QTensor, fit_qparams, quantize, quantize_rtn
from tests.conftest import tiny_hf_config

GROUP = 32
TOKENS = torch.tensor([[5, 17, 99, 3, 64, 127, 8, 0, 42, 42, 11, 90], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def tiny_tokenizer():
    """A real (word-level) fast tokenizer over the tiny model's 128 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")


def act_order_qtensor(w: torch.Tensor, scheme: QuantScheme, gen: torch.Generator) -> QTensor:
    """Groups formed over a random column order, as GPTQ act-order does: g_idx [K] is non-monotonic."""
    k = w.shape[1]
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // scheme.group_size).to(torch.int32)
    scales, zeros = fit_qparams(w, scheme, g_idx)
    return QTensor(quantize(w, scales, zeros, scheme.bits, scheme.group_size, g_idx), zeros, scales, g_idx,
                   scheme.bits, scheme.group_size, scheme.sym)


def write_checkpoint(out: Path, scheme: QuantScheme, layout: str, seed: int = 0) -> Path:
    """A random tiny Llama, every decoder Linear quantized (act-order when the scheme says so), saved in `layout`."""
    gen = torch.Generator().manual_seed(seed)
    hf_config = tiny_hf_config(torch_dtype="float16", bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(ModelConfig.from_hf(hf_config))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    for name, m in list(model.model.layers.named_modules()):
        if isinstance(m, nn.Linear):
            w = m.weight.detach()
            qt = act_order_qtensor(w, scheme, gen) if scheme.act_order else quantize_rtn(w, scheme)
            parent, _, child = name.rpartition(".")
            setattr(model.model.layers.get_submodule(parent), child, QLinear.from_qtensor(qt))
    meta = {"method": "rtn", "base_model": "tiny-random-llama",
            "scheme": {"bits": scheme.bits, "group_size": scheme.group_size, "sym": scheme.sym,
                       "act_order": scheme.act_order, "static_groups": False}}
    path = save_checkpoint(out, model.half(), hf_config, tiny_tokenizer(), layout, meta)
    (path / "eval").mkdir()
    (path / "eval" / "report.json").write_text('{"tasks": {}}')  # eval/ travels with the codes it measured
    return path


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def logits(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return load_model(str(folder), dtype=torch.float32).model(TOKENS)


@pytest.mark.parametrize(
    "scheme, chain",
    [
        (QuantScheme(4, GROUP, sym=False), ["gptq_v2", "awq", "compressed-tensors", "gptq_v2"]),
        (QuantScheme(8, GROUP, sym=True, act_order=True), ["gptq", "gptq_v2", "gptq"]),  # only GPTQ holds a g_idx
        (QuantScheme(8, -1, sym=True), ["compressed-tensors", "gptq", "gptq_v2", "compressed-tensors"]),
    ],
    ids=["w4-asym", "w8-sym-act-order", "w8-sym-per-channel"],
)
def test_round_trip_gives_the_same_bytes_and_every_hop_the_same_logits(tmp_path, scheme, chain):
    start = write_checkpoint(tmp_path / chain[0], scheme, chain[0])
    reference = logits(start)
    folder = start
    for i, fmt in enumerate(chain[1:], start=1):
        folder = export(folder, fmt, tmp_path / f"{i}-{fmt}")
        assert (folder / "config.json").read_text().count(f'"quant_method": "{fmt.split("_")[0]}"') == 1
        assert torch.equal(logits(folder), reference), f"{fmt}: logits differ from {chain[0]}"
    assert folder_bytes(folder) == folder_bytes(start)
    assert sorted(folder_bytes(start)) == [
        "config.json", "eval/report.json", "generation_config.json", "model.safetensors", "quantkit.json",
        "tokenizer.json", "tokenizer_config.json",
    ]


@pytest.mark.parametrize(
    "scheme, src, fmt, why",
    [
        (QuantScheme(4, GROUP, sym=False), "gptq_v2", "gptq", r"GPTQ v1 \(--format gptq\) stores zero-1 and cannot hold asymmetric zero points"),
        (QuantScheme(8, GROUP, sym=True), "compressed-tensors", "awq", r"AWQ GEMM is 4-bit only \(8-bit requested\)"),
        (QuantScheme(4, GROUP, sym=True, act_order=True), "gptq", "awq", r"AWQ GEMM has no g_idx, so act-order groups cannot be stored"),
        (QuantScheme(4, GROUP, sym=True, act_order=True), "gptq_v2", "compressed-tensors", r"compressed-tensors 0\.20\+ rejects act-order groups with a g_idx"),
        (QuantScheme(4, -1, sym=True), "gptq", "awq", r"AWQ GEMM needs a group size"),
    ],
    ids=["asym-to-gptq-v1", "8bit-to-awq", "act-order-to-awq", "act-order-to-compressed-tensors", "per-channel-to-awq"],
)
def test_refuses_what_a_layout_cannot_hold(tmp_path, scheme, src, fmt, why):
    folder = write_checkpoint(tmp_path / "src", scheme, src)
    with pytest.raises(QuantkitError, match=rf"^layer model\.layers\.0\.\S+: {why}.*--format "):
        export(folder, fmt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_arguments_and_the_cli(tmp_path):
    from quantkit.cli import _typer_app

    folder = write_checkpoint(tmp_path / "src", QuantScheme(4, GROUP, sym=True), "gptq")
    with pytest.raises(QuantkitError, match=r"^--format 'exl2' is not a layout: use one of gptq, gptq_v2, awq, compressed-tensors$"):
        export(folder, "exl2", tmp_path / "out")
    with pytest.raises(QuantkitError, match=r"is the source folder: export into a new folder$"):
        export(folder, "awq", folder)

    result = CliRunner().invoke(_typer_app, ["export", str(folder), "--format", "awq", "--out", str(tmp_path / "awq")])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [  # the second line: quantkit/formats/compatibility.py's note
        f"wrote {tmp_path / 'awq'} (awq)",
        "awq w4 g32 sym: loads in: vLLM (CUDA), vLLM (CPU), transformers, TGI, SGLang (quantkit info DIR says why)"]
    assert torch.equal(logits(tmp_path / "awq"), logits(folder))
