"""The calibration driver on tiny random models: quantized outputs, resume after SIGKILL with the same bytes,
clear errors for bad inputs; recipes and flags building the same config; the calibrate CLI on the bundled model."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, tiny_hf_config
from quantkit.config import CalibConfig
from quantkit.data import CalibData
from quantkit.errors import QuantkitError
from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from quantkit.quant.calibrate import calibrate
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import dequantize, quantize_rtn
from quantkit.recipes import calib_config, load_recipe

HF = tiny_hf_config(num_hidden_layers=4)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(ModelConfig.from_hf(HF)).eval()


def tiny_calib(n: int = 12, seq: int = 32, mask: bool = False) -> CalibData:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, HF["vocab_size"], (n, seq), generator=g)
    m = torch.rand(n, seq, generator=g) > 0.3 if mask else None
    return CalibData(ids, m, torch.full((n,), seq), {}, f"tiny-{n}-{seq}-{mask}")


def config(method: str, **kw) -> CalibConfig:
    return CalibConfig.from_flat({"method": method, "group_size": 32, "num_samples": 12, "seq_len": 32, **kw})


def quantized_states(model) -> dict[str, torch.Tensor]:
    return {name: dequantize(m.qtensor()) for name, m in model.named_modules() if isinstance(m, QLinear)}


@torch.no_grad()
def test_gptq_driver_beats_rtn_and_reports_every_layer():
    base, calib = tiny_model(), tiny_calib(mask=True)
    ids = calib.input_ids
    ref = base(ids)
    errors = {}
    for method in ("rtn", "gptq", "awq"):
        model = copy.deepcopy(base)
        report = calibrate(model, HF, calib, config(method), progress=False)
        assert len(report) == 4 * 7 and len(quantized_states(model)) == 4 * 7
        errors[method] = float((model(ids) - ref).pow(2).mean())
        if method != "rtn":
            assert {e["tokens"] for e in report} == {int(calib.mask.sum())}  # only masked tokens count
            assert all(e["loss"] >= 0 and not e.get("fallback") for e in report)
    assert errors["gptq"] < errors["rtn"] and errors["awq"] < errors["rtn"]


@torch.no_grad()
def test_rtn_driver_equals_scheme_rtn():
    base = tiny_model()
    model = copy.deepcopy(base)
    calibrate(model, HF, None, config("rtn", group_size=-1), progress=False)
    cfg = config("rtn", group_size=-1)
    for name, w in quantized_states(model).items():
        expected = dequantize(quantize_rtn(base.get_submodule(name).weight, cfg.scheme))
        assert torch.equal(w, expected), name


@torch.no_grad()
def test_same_seed_same_weights():
    calib = tiny_calib()
    a, b = tiny_model(), tiny_model()
    calibrate(a, HF, calib, config("gptq", act_order=True), progress=False)
    calibrate(b, HF, calib, config("gptq", act_order=True), progress=False)
    for (name, wa), wb in zip(quantized_states(a).items(), quantized_states(b).values()):
        assert torch.equal(wa, wb), name


def test_nan_input_names_the_layer():
    model, calib = tiny_model(), tiny_calib()
    with torch.no_grad():
        model.model.embed_tokens.weight[int(calib.input_ids[3, 5])] = float("nan")
    with pytest.raises(QuantkitError, match=r"model\.layers\.0\.self_attn\.q_proj contain NaN/inf \(samples 0-7\)"):
        calibrate(model, HF, calib, config("gptq"), progress=False)


def test_too_few_tokens_names_the_counts():
    with pytest.raises(QuantkitError, match=r"gives 48 tokens \(3 samples x 16\), fewer than the hidden size 64"):
        calibrate(tiny_model(), HF, tiny_calib(3, 16), config("gptq"), progress=False)


def test_changed_fingerprint_starts_fresh(tmp_path):
    calib, logs = tiny_calib(), []
    calibrate(tiny_model(), HF, calib, config("gptq"), work_dir=tmp_path / "w", progress=False, log=logs.append)
    calibrate(tiny_model(), HF, calib, config("gptq"), work_dir=tmp_path / "w", progress=False, log=logs.append)
    assert logs == [f"resuming from {tmp_path / 'w'}: blocks 0-3 are done"]
    calibrate(tiny_model(), HF, calib, config("gptq", damp=0.05), work_dir=tmp_path / "w", progress=False,
              log=logs.append)
    assert logs[-1] == f"{tmp_path / 'w'} holds a run with a different config: starting fresh"


def calibrate_and_save(work: Path, out: Path, method: str, log=print) -> None:
    """What the killed child and the in-process runs both do."""
    from quantkit.formats.checkpoint import save_checkpoint

    model = tiny_model()
    cfg = config(method, act_order=True) if method == "gptq" else config(method)
    report = calibrate(model, HF, tiny_calib(), cfg, work_dir=work, progress=False, log=log)
    save_checkpoint(out, model, HF, None, cfg.layout, {"method": method, "layers": report})


KILLED_CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {repo!r})
    from tests.quantkit.test_calibrate import calibrate_and_save
    from quantkit.quant import resume

    save_inputs = resume.WorkFolder.save_inputs

    def save_then_die(self, next_block, x):  # a real SIGKILL right after the second block is durable
        save_inputs(self, next_block, x)
        if next_block == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    resume.WorkFolder.save_inputs = save_then_die
    calibrate_and_save({work!r}, {out!r}, {method!r})
""")


@pytest.mark.parametrize("method", ["gptq", "awq"])  # AWQ also rescales the norms the work folder must restore
def test_sigkill_after_second_block_then_resume_gives_same_bytes(tmp_path, method):
    work, resumed = tmp_path / "work", tmp_path / "resumed"
    script = KILLED_CHILD.format(repo=str(REPO), work=str(work), out=str(resumed), method=method)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert killed.returncode == -9, killed.stderr
    assert not resumed.exists()
    assert sorted(p.name for p in work.glob("block_*")) == ["block_000.safetensors", "block_001.safetensors"]

    logs = []
    calibrate_and_save(work, resumed, method, log=logs.append)
    assert logs == [f"resuming from {work}: blocks 0-1 are done"]
    calibrate_and_save(None, tmp_path / "clean", method)  # one uninterrupted run, no work folder
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "clean" / name).read_bytes() == (resumed / name).read_bytes(), name


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize("name,text,message", [
    ("bad.yaml", "method: gptq\nbits: 4\ngroup_sise: 64\n", r"bad\.yaml:3: unknown key 'group_sise'"),
    ("typed.yaml", "method: gptq\nbits: four\n", r"typed\.yaml:2: bits must be int, got 'four'"),
    ("nested.yaml", "method: gptq\nscheme:\n  bits: 4\n", r"nested\.yaml:2: key 'scheme': recipes are flat"),
    ("combo.yaml", "method: gptq\nsym: false\nformat: gptq\n", r"combo\.yaml: format gptq \(v1\) stores zero - 1"),
    ("gate.yaml", "method: gptq\nmax_delta: {ppl: lots}\n", r"gate\.yaml:2"),
])
def test_recipe_errors_name_file_line_and_key(tmp_path, name, text, message):
    with pytest.raises(QuantkitError, match=message):
        load_recipe(write(tmp_path / name, text))


def test_flags_override_recipe_and_build_the_same_config(tmp_path):
    path = write(tmp_path / "r.yaml", """\
        method: gptq
        bits: 4
        group_size: 64
        act_order: true
        damp: 0.02
        max_delta: {ppl: "+20%"}
        """)
    recipe = load_recipe(path)
    assert recipe.max_delta == {"ppl": "+20%"}
    from_recipe = calib_config(recipe, {"bits": None, "seed": None})
    assert from_recipe == CalibConfig.from_flat({"method": "gptq", "bits": 4, "group_size": 64, "act_order": True,
                                                 "damp": 0.02})
    overridden = calib_config(recipe, {"bits": 8, "act_order": False})
    assert (overridden.scheme.bits, overridden.scheme.act_order, overridden.damp) == (8, False, 0.02)
    assert CalibConfig.from_flat(overridden.to_flat()) == overridden


@pytest.mark.parametrize("name,method,bits,sym,layout", [
    ("smollm2-135m-gptq-w4g64", "gptq", 4, True, "gptq"), ("smollm2-135m-gptq-w8g64", "gptq", 8, True, "gptq"),
    ("smollm2-135m-awq-w4g64", "awq", 4, False, "awq"), ("smollm2-135m-rtn-w4g64", "rtn", 4, True, "gptq"),
])
def test_shipped_recipes(name, method, bits, sym, layout):
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    cfg = calib_config(recipe, {})
    assert (cfg.method, cfg.scheme.bits, cfg.scheme.group_size, cfg.scheme.sym, cfg.layout) == (method, bits, 64, sym, layout)
    assert recipe.max_delta


@pytest.mark.slow
def test_cli_rtn_on_bundled_model(tmp_path, bundled):
    from quantkit.formats.checkpoint import read_quantized

    out = tmp_path / "rtn"
    env = {**os.environ, "QUANTKIT_DEBUG": "1"}
    done = subprocess.run([sys.executable, "-m", "quantkit.cli", "calibrate", "--method", "rtn", "--bits", "4",
                           "--group-size", "64", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out} (rtn w4g64, gptq, 210 layers" in done.stderr
    folder = read_quantized(out)
    assert folder.layout == "gptq" and folder.meta["method"] == "rtn" and len(folder.meta["layers"]) == 210
    scheme = CalibConfig.from_flat({"method": "rtn", "group_size": 64}).scheme
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"):
        qt, _ = folder.qlinears[name]
        assert torch.equal(qt.codes, quantize_rtn(bundled.model.get_submodule(name).weight, scheme).codes)
    assert not (tmp_path / ".rtn.work").exists()


@torch.no_grad()
def test_replaying_finished_submodules_changes_nothing(monkeypatch):
    import contextlib

    from quantkit.quant import calibrate as driver

    base, calib = tiny_model(), tiny_calib()
    replays = []
    replay_call = driver._Replayed.forward
    monkeypatch.setattr(driver._Replayed, "forward", lambda self, *a: replays.append(1) or replay_call(self, *a))
    fast = copy.deepcopy(base)
    calibrate(fast, HF, calib, config("gptq"), progress=False)
    # self_attn is replayed in the [down] stage and in the final forward: 2 per batch (2 batches) per block
    assert len(replays) == 4 * 2 * 2

    monkeypatch.setattr(driver.Replay, "forward", lambda self, done, batches, record=True: contextlib.nullcontext())
    slow = copy.deepcopy(base)
    calibrate(slow, HF, calib, config("gptq"), progress=False)
    for (name, a), b in zip(quantized_states(fast).items(), quantized_states(slow).values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--group-size", "128"], "error: group_size=128 does not divide in_features=576 of layer "
                              "model.layers.N.self_attn.q_proj"),
    (["--method", "awq", "--bits", "8", "--format", "awq"], "error: format awq (AWQ GEMM) is 4-bit only"),
])
def test_cli_rejects_a_bad_scheme_before_loading(tmp_path, bundled_dir, flags, message):
    done = subprocess.run([sys.executable, "-m", "quantkit.cli", "calibrate", *flags, "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr
    assert not (tmp_path / "x").exists()
