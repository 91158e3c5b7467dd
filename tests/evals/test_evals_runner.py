"""quantkit eval end to end on tiny model folders: a model against itself, a quantized candidate against its recorded
base, lm-eval through the bridge against the native numbers, generation against an argmax loop, and the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from quantkit.evals.runner import EvalSpec, run
from tests.evals.evals_tiny import save_tiny, tiny_model

DATA_ROWS = [
    {"text": "A first paragraph of plain text about rivers and the sea. " * 6},
    {"question": "Which is a fruit?", "choices": ["apple", "chair", "cloud"], "answer": 0},
    {"context": "The sun rises in the", "choices": ["east", "west"], "answer": 0},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, friend!"}]},
    {"prompt": "2 + 2 =", "completion": " 4"},
    {"prompt": "The capital of France is", "answer": "Paris"},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("evals")
    base = save_tiny(tiny_model(seed=0), root / "base")
    same = root / "same"
    shutil.copytree(base, same)
    cand = save_tiny(tiny_model(seed=0, noise=0.05), root / "cand")
    data = root / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in DATA_ROWS))
    return {"root": root, "base": base, "same": same, "cand": cand, "data": data}


def test_a_model_against_itself_has_zero_deltas_with_zero_width_intervals(folders):
    spec = EvalSpec(candidate=str(folders["same"]), baseline=str(folders["base"]), data=[folders["data"]],
                    tasks=["wikitext", "arc_easy"], limit=4, windows=2, seq_len=64, max_new_tokens=4)
    report = run(spec)
    names = {(m.task, m.metric) for m in report.metrics}
    assert {("wikitext", "ppl"), ("wikitext", "kl_mean"), ("wikitext", "kl_p99"), ("wikitext", "top1_agree"),
            ("arc_easy", "acc"), ("arc_easy", "acc_norm"), ("mine", "ppl"), ("mine:replies", "kl_mean"),
            ("mine", "acc"), ("mine", "exact_match"), ("mine", "contains")} <= names
    for m in report.metrics:
        width = (0.0, 0.0) if m.n >= 2 else (None, None)  # one unit (mine's single window): no interval
        assert (m.delta.value, m.delta.low, m.delta.high) == (0.0, *width), (m.task, m.metric, m.n)
        assert m.baseline == m.candidate
    by = {(m.task, m.metric): m for m in report.metrics}
    assert by["wikitext", "kl_mean"].candidate == 0.0 and by["wikitext", "top1_agree"].candidate == 100.0
    assert by["wikitext", "ppl"].n == 2 and by["wikitext", "ppl"].note == "L=64, 2 windows"
    assert by["arc_easy", "acc"].n == 4


def test_quantized_candidate_is_compared_with_the_base_model_it_records(folders, shared_data):
    """RTN W4 g32 through `quantkit calibrate`; the baseline comes from quantkit.json; perplexity numbers equal a
    direct computation on each model as the loader builds it (QLinear for the candidate)."""
    from quantkit.data import read_text
    from quantkit.evals.perplexity import perplexity, text_windows
    from quantkit.models.loader import load_model

    out = folders["root"] / "rtn"
    res = invoke("calibrate", folders["base"], "--method", "rtn", "--bits", "4", "--group-size", "32", "--out", out)
    assert res.exit_code == 0, res.output
    report = run(EvalSpec(candidate=str(out), tasks=["wikitext"], windows=3, seq_len=64))
    assert report.baseline == str(folders["base"])
    by = {m.metric: m for m in report.metrics}
    base, cand = load_model(str(folders["base"])), load_model(str(out))
    assert type(cand.model.model.layers[0].mlp.up_proj).__name__ == "QLinear"
    windows = text_windows(base.tokenizer, read_text(shared_data / "wikitext-2" / "test.txt"), 64, 3)
    assert by["ppl"].baseline == pytest.approx(perplexity(base.model, windows).ppl, rel=1e-5)
    assert by["ppl"].candidate == pytest.approx(perplexity(cand.model, windows).ppl, rel=1e-5)
    assert by["kl_mean"].candidate > 0 and by["top1_agree"].candidate < 100
    assert by["ppl"].delta.low <= by["ppl"].delta.value <= by["ppl"].delta.high


def test_lm_eval_bridge_equals_the_native_evaluation(folders, shared_data):
    from lm_eval.api.instance import Instance

    from quantkit.data import read_rows
    from quantkit.evals.lm_eval_bridge import QuantkitLM, run_tasks, user_task
    from quantkit.evals.multiple_choice import choice_groups, score_choices
    from quantkit.models.loader import load_model

    loaded = load_model(str(folders["base"]))
    lm = QuantkitLM(loaded=loaded)
    got = run_tasks(lm, ["qk_piqa", *user_task(folders["data"])], limit=6)
    rows = read_rows(shared_data / "piqa" / "piqa_validation.jsonl")[:6]
    native = score_choices(loaded.model, choice_groups(rows, loaded.tokenizer), rows)
    assert got["qk_piqa"].doc_ids == list(range(6))
    assert got["qk_piqa"].values["acc"] == native.acc.tolist()
    assert got["qk_piqa"].values["acc_norm"] == native.acc_norm.tolist()
    mine = [r for r in read_rows(folders["data"]) if r.kind == "choice"]  # the user's file: same prompts and numbers
    native_mine = score_choices(loaded.model, choice_groups(mine, loaded.tokenizer), mine)
    assert got["qk_user_mine_choice"].values["acc_norm"] == native_mine.acc_norm.tolist() and len(mine) == 2
    assert got["qk_user_mine_answer"].values["exact_match"] in ([0.0], [1.0])  # greedy, scored by lm-eval
    assert len(got["qk_user_mine_text"].values["word_perplexity"]) == 1

    text = "Rolling windows cover every token of a document exactly once. " * 4
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = [loaded.tokenizer.bos_token_id] + loaded.tokenizer.encode(text)
    with torch.no_grad():
        logp = torch.log_softmax(loaded.model(torch.tensor([ids[:-1]]))[0], -1)
    assert rolling == pytest.approx(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item(), rel=1e-5)


def test_greedy_generation_equals_an_argmax_loop(folders):
    from quantkit.evals.generation import greedy_generate
    from quantkit.models.loader import load_model

    loaded = load_model(str(folders["cand"]))
    tok = loaded.tokenizer
    prompts = [tok.encode(p) for p in ("Once upon a time", "The capital of France is", "1, 2, 3,")]
    got = greedy_generate(loaded, prompts, max_new_tokens=6)
    for prompt, text in zip(prompts, got):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                nxt = int(loaded.model(torch.tensor([ids]))[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                ids.append(nxt)
        assert text == tok.decode(ids[len(prompt):], skip_special_tokens=True)


def invoke(*args):
    """The typer app in this process (the real commands; QuantkitError surfaces as result.exception)."""
    from typer.testing import CliRunner

    from quantkit.cli import _typer_app

    return CliRunner().invoke(_typer_app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_cli_gate_breach_exits_1_naming_the_metric(folders, tmp_path):
    text = tmp_path / "notes.jsonl"
    text.write_text(json.dumps({"text": "Some plain text for the gate to look at, long enough for windows. " * 8}) + "\n")
    out = tmp_path / "report"
    res = invoke("eval", folders["cand"], "--baseline", folders["base"], "--data", text, "--seq-len", "32",
                 "--max-delta", "kl=0.000001", "--max-delta", "ppl=+1000%", "--out", out)
    assert res.exit_code == 1, res.output
    breached = [line for line in res.stderr.splitlines() if line.startswith("gate breached:")]
    assert len(breached) == 1 and breached[0].startswith("gate breached: notes/kl_mean: delta +")
    assert "breaches the limit +1e-06 nats by" in breached[0]
    report = json.loads((out / "report.json").read_text())
    assert [b["name"] for b in report["gate"]["breaches"]] == ["notes/kl_mean"]
    kl = next(m for m in report["metrics"] if m["metric"] == "kl_mean")
    assert report["gate"]["breaches"][0]["delta"] == pytest.approx(kl["delta"]["value"])
    assert np.isclose(kl["candidate"], kl["delta"]["value"])


def test_cli_gate_on_a_metric_nothing_measured_exits_2(folders, tmp_path):
    text = tmp_path / "notes.jsonl"
    text.write_text(json.dumps({"text": "Plain text has a perplexity but no accuracy to gate on. " * 8}) + "\n")
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, "-m", "quantkit.cli", "eval", str(folders["cand"]), "--baseline",
                          str(folders["base"]), "--data", str(text), "--seq-len", "32", "--max-delta", "acc=-1.0",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --max-delta acc=-1: no task measured that metric (measured: ")
    assert "notes/kl_mean, " in last and "notes/ppl" in last and (out / "report.json").is_file()
    assert "held-out:sonnets/ppl" in last  # with --data the general held-out text is measured too


def test_cli_bad_rows_name_file_and_line(folders, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 1}) + "\n"
                   + json.dumps({"question": "q", "choices": ["a", "b"], "answer": 7}) + "\n")
    res = subprocess.run([sys.executable, "-m", "quantkit.cli", "eval", str(folders["cand"]), "--data", str(bad)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2  # the data is read before any model loads; one line, no traceback
    assert res.stderr.strip() == f'error: {bad}:2: field "answer": 7 is out of range for 2 choices (0..1)'
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"context": "c", "choices": [], "answer": 0}) + "\n")
    res = invoke("eval", folders["cand"], "--data", empty)
    assert res.exit_code == 1 and str(res.exception).startswith(f'{empty}:1: field "choices": empty list')


def test_recipe_thresholds_apply(tmp_path):
    from quantkit.commands.eval import recipe_thresholds

    recipe = tmp_path / "r.yaml"
    recipe.write_text('method: rtn\nbits: 4\ngroup_size: 64\nmax_delta: {acc: -1.0, ppl: "+3%", kl: 0.05}\n')
    got = [(t.metric, t.limit, t.relative) for t in recipe_thresholds(recipe)]
    assert got == [("acc", -1.0, False), ("ppl", 3.0, True), ("kl_mean", 0.05, False)]


def steered(folder, boost_tokens=()):
    """A tiny model whose logits are 0 everywhere (uniform: perplexity = vocabulary size on any text), or, with
    boost_tokens, about +40 for those tokens only: better than uniform on a text made of them, far worse on any
    text mostly made of others. (Embedding column 0 = 50 makes the final norm's channel 0 about +8 at every
    position; the final norm keeps only that channel and lm_head reads only it.)"""
    model = tiny_model(seed=0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 50.0
        model.model.norm.weight.zero_()
        model.lm_head.weight.zero_()
        if boost_tokens:
            model.model.norm.weight[0] = 1.0
            model.lm_head.weight[list(boost_tokens), 0] = 5.0
    return save_tiny(model, folder)


def test_with_data_the_general_text_is_measured_and_opposite_deltas_warn(tmp_path):
    from quantkit.evals.runner import GENERAL_TASK, general_text_file
    from quantkit.models.loader import load_tokenizer

    text = "A first paragraph of plain text about rivers and the sea. " * 12
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"text": text}) + "\n")
    tokens = set(load_tokenizer(None)(text, add_special_tokens=False)["input_ids"])
    base, cand = steered(tmp_path / "uniform"), steered(tmp_path / "fitted", tokens)
    spec = dict(data=[mine], windows=4, seq_len=32)

    report = run(EvalSpec(candidate=str(cand), baseline=str(base), **spec))
    ppl = {m.task: m for m in report.metrics if m.metric == "ppl"}
    assert set(ppl) == {"mine", GENERAL_TASK}
    assert ppl["mine"].baseline == pytest.approx(49152, rel=1e-4)  # uniform over the vocabulary
    assert ppl[GENERAL_TASK].baseline == pytest.approx(49152, rel=1e-4)
    assert ppl["mine"].delta.value < 0 < ppl[GENERAL_TASK].delta.value
    assert ppl[GENERAL_TASK].n == 4 and general_text_file().is_file()
    assert len(report.warnings) == 1
    assert report.warnings[0].startswith("warning: mine perplexity improves (4.915e+04 -> ")
    assert f"but the general held-out text ({GENERAL_TASK}) degrades (4.915e+04 -> " in report.warnings[0]
    assert report.settings["general"] == GENERAL_TASK

    # the CLI prints the warning; a --max-delta that does not name the general text does not gate it
    out = tmp_path / "report"
    res = invoke("eval", cand, "--baseline", base, "--data", mine, "--windows", "4", "--seq-len", "32",
                 "--max-delta", "ppl=+0%", "--out", out)
    assert res.exit_code == 0, res.output
    assert report.warnings[0].split(" -> ")[0] in res.stderr
    saved = json.loads((out / "report.json").read_text())
    assert saved["warnings"] == report.warnings and saved["gate"]["breaches"] == []
    assert "**warning: mine perplexity improves" in (out / "report.md").read_text()
    res = invoke("eval", cand, "--baseline", base, "--data", mine, "--windows", "4", "--seq-len", "32",
                 "--max-delta", f"{GENERAL_TASK}/ppl=+0%", "--out", out)
    assert res.exit_code == 1 and f"gate breached: {GENERAL_TASK}/ppl" in res.stderr

    # same sign (here both 0: the model against itself) -> no warning; --no-general / no --data -> not measured
    same = run(EvalSpec(candidate=str(base), baseline=str(base), **spec))
    assert GENERAL_TASK in {m.task for m in same.metrics} and same.warnings == []
    off = run(EvalSpec(candidate=str(cand), baseline=str(base), general=False, **spec))
    assert {m.task for m in off.metrics} == {"mine"} and off.warnings == []
    tasks_only = run(EvalSpec(candidate=str(cand), baseline=str(base), tasks=["wikitext"], windows=2, seq_len=32))
    assert {m.task for m in tasks_only.metrics} == {"wikitext"} and tasks_only.warnings == []
