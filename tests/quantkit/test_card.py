"""The model card: Hub metadata, the eval table of a report written by `quantkit eval`, loaders per layout, and the
committed sample card of a real bundled-model run (docs/sample-card)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from quantkit.card import MARKER, render_card
from quantkit.config import QuantScheme
from quantkit.evals.bootstrap import Interval
from quantkit.evals.report import MetricResult, Report, write
from quantkit.formats.checkpoint import quantization_config

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "docs" / "sample-card" / "rtn-w4g64"
SAMPLE_REPO = "OWNER/SmolLM2-135M-Instruct-rtn-w4g64"  # the --repo docs/sample-card/README.md's `quantkit card` names


def checkpoint_meta(folder: Path, scheme: QuantScheme, layout: str, method: str = "gptq") -> Path:
    """config.json + quantkit.json as `quantkit calibrate` writes them (no weights: the card reads neither)."""
    folder.mkdir(parents=True)
    config = {"model_type": "llama", "torch_dtype": "float16",
              "quantization_config": quantization_config(scheme, layout, "llama", [])}
    meta = {
        "method": method, "scheme_name": scheme.name(), "base_model": "bundled:SmolLM2-135M-Instruct",
        "recipe": {"model": None, "method": method, "bits": scheme.bits, "group_size": scheme.group_size,
                   "sym": scheme.sym, "format": layout, "data": "wikitext-2/valid.txt", "num_samples": 128,
                   "seq_len": 512, "seed": 0},
        "layers": [{"name": "model.layers.0.mlp.down_proj", "loss": 0.5, "fallback": False},
                   {"name": "model.layers.1.self_attn.q_proj", "loss": 0.25, "fallback": True}],
        "time_s": 61.5, "damp_percent": 0.01,
        "data": {"path": "wikitext-2/valid.txt", "fingerprint": "f" * 64, "rows": 1001, "tokens": 65536, "samples": 128},
        "layout": layout, "scheme": {"bits": scheme.bits, "group_size": scheme.group_size, "sym": scheme.sym,
                                     "act_order": scheme.act_order, "static_groups": False, "name": scheme.name()},
        "quantkit_version": "0.1.0",
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "quantkit.json").write_text(json.dumps(meta))
    return folder


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card[4:].split("\n---\n", 1)[0])


def table(card: str, header: str) -> list[str]:
    """The markdown table rows after `header` (its separator line left out)."""
    lines = card.splitlines()
    rows = []
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_card_shows_the_eval_report_quantkit_eval_wrote(tmp_path):
    folder = checkpoint_meta(tmp_path / "ckpt", QuantScheme(4, 64), "gptq")
    report = Report(
        candidate=str(folder), baseline="bundled:SmolLM2-135M-Instruct",
        metrics=[
            MetricResult("wikitext", "ppl", 25.61, 27.01, Interval(1.4, 1.1, 1.7), Interval(5.4666, 4.3, 6.6), False,
                         "", 40, "L=512, 40 windows"),
            MetricResult("wikitext", "kl_mean", 0.0, 0.0712, Interval(0.0712, 0.069, 0.0734), None, False, "nats", 40,
                         "L=512, 40 windows"),
            MetricResult("arc_easy", "acc", 58.2, 56.4, Interval(-1.8, -3.6, 0.0), Interval(-3.09, -6.2, 0.0), True,
                         "points", 500),
        ],
        settings={"seq_len": 512, "windows": 40, "limit": 500, "max_new_tokens": 32, "tasks": ["wikitext", "arc_easy"],
                  "data": [], "bootstrap": 1000, "seed": 0},
        gate={"thresholds": ["acc=-1", "ppl=+3%"],
              "breaches": [{"name": "arc_easy/acc", "delta": -1.8, "message": "arc_easy/acc: delta -1.8 points breaches the limit -1 points by 0.8 points"},
                           {"name": "wikitext/ppl", "delta": 5.47, "message": "wikitext/ppl: delta +5.467% breaches the limit +3% by 2.467%"}],
              "unchecked": []},
    )
    write(report, folder / "eval")
    card = render_card(folder, "alice/SmolLM2-135M-Instruct-gptq-w4g64")

    assert front_matter(card) == {
        "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "base_model_relation": "quantized",
        "library_name": "transformers", "license": "apache-2.0", "pipeline_tag": "text-generation",
        "tags": ["quantized", "quantkit", "gptq", "int4", "4-bit"],
    }
    assert table(card, "| task | metric | baseline | quantized | delta [95% CI] | unit | n | notes |") == [
        "| wikitext | ppl ↓ | 25.61 | 27.01 | +1.4 [+1.1, +1.7] (+5.467% [+4.3%, +6.6%]) | - | 40 | L=512, 40 windows |",
        "| wikitext | kl_mean ↓ | 0 | 0.0712 | +0.0712 [+0.069, +0.0734] | nats | 40 | L=512, 40 windows |",
        "| arc_easy | acc ↑ | 58.2 | 56.4 | -1.8 [-3.6, +0] | points | 500 |  |",
    ]
    assert ("Accuracy gate (acc=-1, ppl=+3%): **failed**: arc_easy/acc: delta -1.8 points breaches the limit -1 points "
            "by 0.8 points; wikitext/ppl: delta +5.467% breaches the limit +3% by 2.467%.") in card
    assert "![accuracy deltas with 95% intervals](eval/deltas.png)" in card
    assert (folder / "eval" / "deltas.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| data fingerprint (sha256 of tokens + mask) | `" + "f" * 64 + "` |" in card
    assert "| rows / tokens used | 1001 / 65536 |" in card
    assert ("mean 0.375 over 2 layers; highest `model.layers.0.mlp.down_proj` 0.5, `model.layers.1.self_attn.q_proj` "
            "0.25. RTN fallbacks: model.layers.1.self_attn.q_proj.") in card
    assert ("quantkit eval OUT --tasks wikitext,arc_easy --limit 500 --windows 40 --seq-len 512 --max-new-tokens 32 "
            "--max-delta acc=-1 --max-delta ppl=+3%") in card
    assert "vllm serve alice/SmolLM2-135M-Instruct-gptq-w4g64" in card
    assert "hf download alice/SmolLM2-135M-Instruct-gptq-w4g64\nquantkit serve alice/SmolLM2-135M-Instruct-gptq-w4g64 --port 8000" in card


@pytest.mark.parametrize(
    "scheme, layout, tag, vllm_note",
    [
        (QuantScheme(4, 128, sym=False), "gptq_v2", "int4",
         "| vLLM | yes, recent | needs a vLLM that honours `checkpoint_format: gptq_v2` (older ones misread the zeros); "
         "asymmetric GPTQ has no Marlin path: the slower fp16 GPTQ kernel runs |"),
        (QuantScheme(4, 128, sym=False), "awq", "int4",
         "| vLLM | yes | AWQ-Marlin kernel on Ampere and newer, the AWQ GEMM kernel otherwise; 4-bit only |"),
        (QuantScheme(8, -1, sym=True), "compressed-tensors", "int8",
         "| vLLM | yes | native (`compressed-tensors` W8A16: Marlin/Machete kernels) |"),
    ],
)
def test_metadata_and_loaders_follow_the_scheme_and_layout(tmp_path, scheme, layout, tag, vllm_note):
    folder = checkpoint_meta(tmp_path / "ckpt", scheme, layout, method="awq" if layout == "awq" else "gptq")
    card = render_card(folder)
    meta = front_matter(card)
    assert tag in meta["tags"] and f"{scheme.bits}-bit" in meta["tags"]
    assert vllm_note in card.splitlines()
    assert "## Accuracy\n\nNot evaluated yet." in card


@pytest.mark.parametrize("rounding, text", [("gptq", "AWQ scales, GPTQ rounding (dampening 0.1 of mean diag H)"),
                                             ("rtn", "AWQ scales, clip search + round to nearest")])
def test_method_row_says_how_awq_rounded(tmp_path, rounding, text):
    folder = checkpoint_meta(tmp_path / "ckpt", QuantScheme(4, 64, sym=False), "awq", method="awq")
    meta = json.loads((folder / "quantkit.json").read_text())
    meta["recipe"].update(awq_rounding=rounding, damp=0.1)
    (folder / "quantkit.json").write_text(json.dumps(meta))
    assert f"| method | {text} |" in render_card(folder).splitlines()


def test_card_command_writes_readme(tmp_path):
    from quantkit.cli import _typer_app

    folder = checkpoint_meta(tmp_path / "ckpt", QuantScheme(4, 64), "gptq")
    result = CliRunner().invoke(_typer_app, ["card", str(folder)])
    assert result.exit_code == 0, result.output
    text = (folder / "README.md").read_text()
    assert text == render_card(folder) and MARKER in text


def test_sample_card_of_a_real_run_renders_its_eval_report():
    """docs/sample-card: a bundled-model RTN W4 g64 run and its `quantkit eval` report (commands in its README)."""
    card = render_card(SAMPLE, SAMPLE_REPO)
    assert card == (SAMPLE / "README.md").read_text(), "docs/sample-card is stale: regenerate it with `quantkit card`"
    report = json.loads((SAMPLE / "eval" / "report.json").read_text())
    rows = table(card, "| task | metric | baseline | quantized | delta [95% CI] | unit | n | notes |")
    assert len(rows) == len(report["metrics"]) >= 4
    for row, m in zip(rows, report["metrics"]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == m["task"] and cells[1].split()[0] == m["metric"]
        assert float(cells[2]) == pytest.approx(m["baseline"], rel=1e-3, abs=1e-4)
        assert float(cells[3]) == pytest.approx(m["candidate"], rel=1e-3, abs=1e-4)
        value, low, high = (float(x) for x in cells[4].split(" (")[0].replace("[", "").replace("]", "").replace(",", "").split())
        assert (value, low, high) == pytest.approx((m["delta"]["value"], m["delta"]["low"], m["delta"]["high"]), rel=1e-3, abs=1e-4)
        assert int(cells[6]) == m["n"]
    meta = json.loads((SAMPLE / "quantkit.json").read_text())
    assert f"| method | {meta['method'].upper()} |" in card and f"| group size | {meta['scheme']['group_size']} |" in card
    assert f"| calibration time | {meta['time_s']} s (quantkit {meta['quantkit_version']}) |" in card
    assert "![accuracy deltas with 95% intervals](eval/deltas.png)" in card and (SAMPLE / "eval" / "deltas.png").is_file()


def test_gguf_string_reads_the_header_gguf_writes(tmp_path):
    """The license lookup against a file written by the gguf library, with arrays and scalars before the key."""
    import gguf
    import numpy as np

    from quantkit.card import gguf_string

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello", "wörld"])
    w.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0, 3.0])
    w.add_bool("general.flag", True)
    w.add_string("general.license", "mit")
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_string(path, "general.license") == "mit"
    assert gguf_string(path, "general.architecture") == "llama"
    assert gguf_string(path, "general.missing") is None
    assert gguf_string(path, "llama.block_count") is None  # not a string


@pytest.mark.parametrize("layout", ["gptq_v2", "awq", "compressed-tensors"])
def test_card_of_another_tools_folder_reads_the_scheme_from_config(tmp_path, layout):
    """No quantkit.json (a GPTQModel / AutoAWQ / llm-compressor folder): the scheme comes from quantization_config."""
    folder = checkpoint_meta(tmp_path / "ckpt", QuantScheme(4, 64, sym=False), layout)
    (folder / "quantkit.json").unlink()
    card = render_card(folder)
    assert "4-bit weight-only" in card and "(asymmetric, group size 64)" in card
    assert "W4g64-asym" in card.splitlines()[card.splitlines().index(MARKER) + 2]  # the title
    assert "## Reproduce" not in card  # no recipe recorded, so no command is claimed
