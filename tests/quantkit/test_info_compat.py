"""Which runtimes load a checkpoint (quantkit/formats/compatibility.py): `quantkit info` on small RTN checkpoints of
every layout prints the expected verdict per runtime; `quantkit calibrate` and `export` name the runtimes that read
what they wrote; the transformers rows that can run here are re-measured against the real library."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from typer.testing import CliRunner

from quantkit.cli import _typer_app
from quantkit.config import LAYOUTS, CalibConfig, QuantScheme
from quantkit.errors import QuantkitError
from quantkit.formats.compatibility import RULES, RUNTIMES, VERDICTS, Checkpoint, compatibility, runtime_note
from tests.evals.evals_tiny import save_tiny, tiny_model
from tests.quantkit.families import saved_families
from tests.quantkit.test_export import write_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# (layout, scheme) -> verdict per runtime in RUNTIMES order: vLLM (CUDA), vLLM (CPU), transformers, TGI, SGLang
EXPECTED = {
    ("gptq", QuantScheme(4, 32, sym=True)): ("yes", "yes", "yes", "yes", "yes"),
    ("gptq", QuantScheme(4, 32, sym=True, act_order=True)): ("yes", "no", "yes", "yes", "yes"),
    ("gptq_v2", QuantScheme(4, 32, sym=False)): ("yes", "no", "yes", "no", "unknown"),
    ("gptq_v2", QuantScheme(8, -1, sym=True)): ("yes", "no", "yes", "unknown", "unknown"),
    ("awq", QuantScheme(4, 64, sym=False)): ("yes", "yes", "yes", "yes", "yes"),
    ("compressed-tensors", QuantScheme(4, 32, sym=True)): ("yes", "yes", "yes", "yes", "yes"),
    ("compressed-tensors", QuantScheme(4, 32, sym=False)): ("yes", "yes", "no", "yes", "unknown"),
    ("compressed-tensors", QuantScheme(8, -1, sym=False)): ("yes", "no", "no", "yes", "unknown"),
}
RUNTIME_LINE = re.compile(r"^  (?P<runtime>.+?) +(?P<verdict>yes|no|unknown) +(?P<reason>.+)$")


def runtime_rows(output: str) -> dict[str, tuple[str, str]]:
    """`quantkit info` output -> {runtime: (verdict, reason [source])} from its runtimes section."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("runtimes "))
    rows = {}
    for line in lines[start + 1:start + 1 + len(RUNTIMES)]:
        m = RUNTIME_LINE.match(line)
        assert m, line
        rows[m["runtime"]] = (m["verdict"], m["reason"])
    return rows


@pytest.mark.parametrize("layout, scheme", list(EXPECTED), ids=lambda v: v if isinstance(v, str) else v.name())
def test_info_prints_each_runtime_verdict(layout, scheme, tmp_path):
    folder = write_checkpoint(tmp_path / "ck", scheme, layout)
    res = CliRunner().invoke(_typer_app, ["info", str(folder)])
    assert res.exit_code == 0, res.output
    rows = runtime_rows(res.output)
    assert list(rows) == list(RUNTIMES)
    assert tuple(verdict for verdict, _ in rows.values()) == EXPECTED[layout, scheme]
    header = next(line for line in res.output.splitlines() if line.startswith("runtimes "))
    act = " act-order" if scheme.act_order else ""
    group = "per-channel" if scheme.group_size == -1 else f"g{scheme.group_size}"
    assert header == (f"runtimes       {layout} w{scheme.bits} {group} {'sym' if scheme.sym else 'asym'}{act} "
                      f"(rules: quantkit/formats/compatibility.py)")
    if layout == "gptq_v2" and not scheme.sym:  # the measured refusal is quoted, with where it comes from
        assert rows["vLLM (CPU)"][1] == ("refuses asymmetric GPTQ ('Unsupported quantization config: bits=4, "
                                         "sym=False' for w4) [measured]")
        assert rows["vLLM (CUDA)"][1].endswith("[vllm#26092]")


def test_calibrate_and_export_name_the_runtimes(tmp_path):
    """Asymmetric grouped W4 RTN writes AWQ by default (it loads everywhere); exported as gptq_v2 the note names
    the runtimes that do not read it."""
    src = save_tiny(tiny_model(), tmp_path / "float")
    out = tmp_path / "w4-asym"
    res = CliRunner().invoke(_typer_app, ["calibrate", str(src), "--method", "rtn", "--asym", "--group-size", "32",
                                          "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert ("awq w4 g32 asym: loads in: vLLM (CUDA), vLLM (CPU), transformers, TGI, SGLang "
            "(quantkit info DIR says why)") in res.output.splitlines()
    res = CliRunner().invoke(_typer_app, ["export", str(out), "--format", "gptq_v2", "--out", str(tmp_path / "v2")])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1] == ("gptq_v2 w4 g32 asym: loads in: vLLM (CUDA), transformers; not in: "
                                           "vLLM (CPU), TGI; unknown for: SGLang (quantkit info DIR says why)")


def test_moe_rows_follow_the_experts(tmp_path, bundled_dir):
    """An asymmetric compressed-tensors Mixtral (calibrated through the CLI): vLLM refuses asymmetric MoE there."""
    _, folder = saved_families(tmp_path / "families", bundled_dir)("mixtral")
    out = tmp_path / "mixtral-ct"
    res = CliRunner().invoke(_typer_app, ["calibrate", str(folder), "--method", "rtn", "--asym", "--group-size", "32",
                                          "--format", "compressed-tensors", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert ("compressed-tensors w4 g32 asym MoE: loads in: TGI; not in: vLLM (CUDA), transformers; unknown for: "
            "vLLM (CPU), SGLang (quantkit info DIR says why)") in res.output.splitlines()
    rows = runtime_rows(CliRunner().invoke(_typer_app, ["info", str(out)]).output)
    assert rows["vLLM (CUDA)"] == ("no", "'Only symmetric quantization is supported for MoE' (compressed-tensors "
                                         "WNA16 MoE) [vllm#39980]")


def test_every_writable_checkpoint_meets_a_rule_in_every_runtime():
    """Every (layout, scheme) quantkit can write is covered by a row of each runtime; the rows are well formed."""
    fields = set(Checkpoint.__dataclass_fields__)
    for rule in RULES:
        assert rule.runtime in RUNTIMES and rule.verdict in VERDICTS and set(rule.layouts) <= set(LAYOUTS), rule
        assert set(rule.when) <= fields and rule.reason, rule
    for layout, bits, group, sym, act, static, moe in itertools.product(
            LAYOUTS, (4, 8), (-1, 32, 128), (True, False), (False, True), (False, True), (False, True)):
        scheme = QuantScheme(bits, group, sym, act, static and act)
        try:
            CalibConfig(method="gptq", scheme=scheme, layout=layout)
            if layout == "awq" and group == -1:
                continue  # the AWQ writer refuses per-channel
        except QuantkitError:
            continue  # not a checkpoint quantkit writes
        for v in compatibility(Checkpoint.of(layout, scheme, moe)):
            assert v.reason != "no rule for this layout and scheme", (layout, scheme, moe, v.runtime)


def test_static_groups_are_not_act_order_on_disk():
    static = Checkpoint.of("gptq", QuantScheme(4, 128, True, act_order=True, static_groups=True), moe=False)
    assert static == Checkpoint.of("gptq", QuantScheme(4, 128, True), moe=False)
    assert runtime_note(static) == ("gptq w4 g128 sym: loads in: vLLM (CUDA), vLLM (CPU), transformers, TGI, SGLang "
                                    "(quantkit info DIR says why)")


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_the_transformers_compressed_tensors_rows_hold(sym, tmp_path):
    """Re-measured against the installed transformers + compressed-tensors: a symmetric folder loads (and gives our
    logits), an asymmetric one fails at load. When this fails, the library changed: update the table's row."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from quantkit.models.loader import load_model

    folder = write_checkpoint(tmp_path / "ck", QuantScheme(4, 32, sym=sym), "compressed-tensors")
    verdict = compatibility(Checkpoint.of("compressed-tensors", QuantScheme(4, 32, sym=sym), moe=False))[2]
    assert verdict.runtime == "transformers" and verdict.verdict == ("yes" if sym else "no")
    ids = torch.tensor([[5, 17, 99, 3, 64, 127]])
    if sym:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, load_model(str(folder)).model(ids), atol=2e-3, rtol=0)
    else:
        with pytest.raises(RuntimeError, match="mismatch"):
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def test_a_mixed_checkpoint_is_read_only_where_every_scheme_is(tmp_path):
    """--target-bpw between W4 g32 and W8 per-channel gives a mix of both: vLLM-CPU has no 8-bit kernel, so the note
    of the whole folder says it does not read it, though `info` says it reads the W4 layers."""
    src = save_tiny(tiny_model(), tmp_path / "float")
    res = CliRunner().invoke(_typer_app, ["calibrate", str(src), "--method", "rtn", "--group-size", "32",
                                          "--target-bpw", "6", "--mix-schemes", "w4g32,w8ch", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert ("gptq w4 g32 sym + w8 per-channel sym: loads in: vLLM (CUDA), transformers, TGI, SGLang; not in: "
            "vLLM (CPU) (quantkit info DIR says why)") in res.output.splitlines()
    rows = runtime_rows(CliRunner().invoke(_typer_app, ["info", str(tmp_path / "o")]).output)
    assert rows["vLLM (CPU)"][0] == "yes"  # info's first scheme section: the W4 layers
