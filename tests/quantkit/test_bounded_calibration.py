"""Calibration in bounded memory (quantkit calibrate --max-host-memory): weights read one block at a time from
sharded bf16 safetensors, activations spilled to the work folder, the checkpoint streamed; its bytes are the
unbounded run's (RTN, GPTQ, AWQ; Llama and Phi-3, whose checkpoints fuse q/k/v and gate/up), also after a SIGKILL
in the middle and a resume. The streaming writer gives safetensors' own bytes. (Memory is measured by
bench/bounded_calibration.py, not asserted here.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from tests.conftest import REPO
from tests.quantkit.families import BASE, hf_model
from quantkit.config import CalibConfig
from quantkit.data import CalibData
from quantkit.errors import QuantkitError
from quantkit.formats.checkpoint import read_quantized, save_checkpoint
from quantkit.formats.safetensors_stream import RowWriter, Stored, write_safetensors
from quantkit.models.loader import load_model
from quantkit.quant.bounded import load_streamed, parse_size, streamed_tensors
from quantkit.quant.calibrate import calibrate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest
LAYERS = 4  # of the CLI's model: killed after its second block


def save_bf16(hf, folder: Path, tokenizer: Path) -> Path:
    """A transformers model as bf16 safetensors in several shards, with the bundled tokenizer."""
    hf.to(torch.bfloat16).save_pretrained(folder, max_shard_size="50KB")
    PreTrainedTokenizerFast.from_pretrained(tokenizer).save_pretrained(folder)
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, bundled_dir):
    root = tmp_path_factory.mktemp("bounded")
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = save_bf16(hf_model(name), root / name, bundled_dir)
        return made[name]
    return get


def calib_data() -> CalibData:
    g = torch.Generator().manual_seed(1)
    return CalibData(torch.randint(0, 128, (12, 32), generator=g), None, torch.full((12,), 32), {}, "random-12x32")


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("family, method, budget", [
    ("llama", "rtn", None), ("llama", "gptq", 1), ("llama", "awq", 1), ("phi3", "gptq", None), ("phi3", "awq", 1),
])
def test_bounded_run_writes_the_unbounded_bytes(folders, tmp_path, family, method, budget):
    """budget 1 byte: the activations spill to the work folder; None: weights streamed, activations in memory."""
    folder, calib = folders(family), calib_data()
    cfg = CalibConfig.from_flat({"method": method, "group_size": 32, "num_samples": 12, "seq_len": 32,
                                 "act_order": method == "gptq" and family == "llama"})
    meta = {"method": method}

    whole = load_model(str(folder))
    calibrate(whole.model, whole.hf_config, calib, cfg, work_dir=tmp_path / "w1", progress=False)
    save_checkpoint(tmp_path / "whole", whole.model, whole.hf_config, None, cfg.layout, meta, max_shard_bytes=20_000)

    lazy, weights = load_streamed(str(folder))
    assert all(p.is_meta for p in lazy.model.parameters())
    logs = []
    calibrate(lazy.model, lazy.hf_config, calib, cfg, work_dir=tmp_path / "w2", progress=False, log=logs.append,
              weights=weights, max_host_memory=budget)
    assert all(t.is_meta for t in lazy.model.state_dict().values())  # every block freed once written
    assert any("spill to" in line for line in logs) == (budget is not None and method != "rtn"), logs
    tensors = streamed_tensors(tmp_path / "w2", lazy.model, weights, lazy.hf_config, cfg)
    save_checkpoint(tmp_path / "bounded", lazy.model, lazy.hf_config, None, cfg.layout, meta, max_shard_bytes=20_000,
                    tensors=tensors)

    assert len(list((tmp_path / "bounded").glob("model-*.safetensors"))) > 2
    same_files(tmp_path / "whole", tmp_path / "bounded")
    # the same fingerprint: a run killed in one mode resumes in the other
    assert (tmp_path / "w1" / "manifest.json").read_text() == (tmp_path / "w2" / "manifest.json").read_text()
    assert len(read_quantized(tmp_path / "bounded").qlinears) == whole.hf_config["num_hidden_layers"] * 7


KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    sys.argv = ["quantkit", "calibrate", *{args!r}]
    from quantkit.quant import activation_store

    persist = activation_store.Activations.persist

    def persist_then_die(self, work, next_block):  # a real SIGKILL once the second block is durable
        persist(self, work, next_block)
        if next_block == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    activation_store.Activations.persist = persist_then_die
    from quantkit.cli import app
    app()
""")


def run_cli(args: list[str]) -> str:
    from typer.testing import CliRunner

    from quantkit.cli import _typer_app

    result = CliRunner().invoke(_typer_app, ["calibrate", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def cli_folder(tmp_path_factory, bundled_dir) -> Path:
    """4 layers with the bundled tokenizer's vocabulary, so the CLI's default calibration text tokenizes into it."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**BASE, "num_hidden_layers": LAYERS,
                                                                          "vocab_size": 49152}))
    return save_bf16(hf.eval(), tmp_path_factory.mktemp("cli") / "llama", bundled_dir)


def test_sigkill_in_a_bounded_cli_run_then_resume_gives_the_unbounded_bytes(cli_folder, tmp_path):
    common = [str(cli_folder), "--method", "gptq", "--group-size", "32", "--num-samples", "8", "--seq-len", "32"]
    out, work = tmp_path / "bounded", tmp_path / "work"
    bounded = [*common, "--out", str(out), "--work-dir", str(work), "--max-host-memory", "1KB"]
    killed = subprocess.run([sys.executable, "-c", KILLED_CHILD.format(repo=str(REPO), args=bounded)],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert killed.returncode == -9, killed.stderr
    assert "spill to" in killed.stderr and not out.exists()
    assert sorted(p.name for p in work.glob("block_*")) == ["block_000.safetensors", "block_001.safetensors"]

    assert f"resuming from {work}: blocks 0-1 are done" in run_cli(bounded)
    assert not work.exists()
    run_cli([*common, "--out", str(tmp_path / "whole"), "--work-dir", str(tmp_path / "work-whole")])
    for name in ("model.safetensors", "config.json"):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_a_bad_size_is_one_clear_error(cli_folder, tmp_path):
    assert [parse_size(s) for s in ("6GB", "1.5g", "512MiB", "2kib", "1000")] == [
        6 * 10**9, 1_500_000_000, 512 * 2**20, 2048, 1000]
    for bad in ("lots", "6 parsecs", "0", "-1GB", "0.1"):
        with pytest.raises(QuantkitError, match=rf"--max-host-memory '{bad}' is not a size: give a number with a "
                                                 r"unit, e\.g\. 6GB, 1\.5GB or 512MiB"):
            parse_size(bad)
    with pytest.raises(QuantkitError, match=r"^--max-host-memory '6 parsecs' is not a size"):
        run_cli([str(cli_folder), "--method", "rtn", "--out", str(tmp_path / "x"), "--max-host-memory", "6 parsecs"])
    assert not (tmp_path / "x").exists()


def test_streamed_file_has_save_files_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(5, 3, generator=g), "layer.bias": torch.randn(7, generator=g).to(torch.bfloat16),
               "scales": torch.randn(4, 2, generator=g).half(), "codes": torch.randint(0, 16, (3, 7), generator=g,
                                                                                       dtype=torch.uint8),
               "g_idx": torch.arange(9, dtype=torch.int32), "steps": torch.arange(3), "flags": torch.rand(6) > 0.5,
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "é": torch.ones(1, dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    pieces = {k: Stored(t.dtype, tuple(t.shape), lambda t=t: t.split(2) if t.dim() else (t,))
              for k, t in tensors.items()}
    write_safetensors(tmp_path / "streamed.safetensors", pieces, {"format": "pt"})
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()

    x = torch.randn(5, 3, 2, generator=g)
    save_file({"x": x}, str(tmp_path / "x_ref.safetensors"), metadata={"next_block": "3"})
    rows = RowWriter(tmp_path / "x.safetensors", "x", torch.float32, (5, 3, 2), {"next_block": "3"})
    for b in x.split(2):
        rows.write(b)
    rows.close()
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "x_ref.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"w: 24 bytes produced, its shape \[5, 3\] needs 60"):
        write_safetensors(tmp_path / "short.safetensors", {"w": Stored(torch.float32, (5, 3), lambda: (x[:2, :, 0],))})
