"""Eval building blocks on tiny random-weight models, each against a direct torch / hand / lm-eval reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from quantkit.data import Row
from quantkit.errors import QuantkitError
from quantkit.evals import bootstrap as bs
from quantkit.evals.gate import check, parse_threshold
from quantkit.evals.kl import compare
from quantkit.evals.multiple_choice import choice_metrics
from quantkit.evals.perplexity import perplexity, text_windows
from quantkit.evals.report import MetricResult, Report, write
from quantkit.evals.scoring import encode_pair, score_groups
from tests.evals.evals_tiny import tiny_model


@pytest.fixture(scope="module")
def base():
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def cand():
    return tiny_model(seed=0, noise=0.02)


@pytest.fixture(scope="module")
def tok():
    from quantkit.models.loader import load_tokenizer

    return load_tokenizer(None)


def random_ids(shape, seed=1):
    return torch.randint(0, 49152, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- perplexity


def test_perplexity_equals_a_direct_torch_computation(base):
    windows = random_ids((5, 24))
    result = perplexity(base, windows, batch_size=2)
    with torch.no_grad():
        nll = torch.cat([F.cross_entropy(base(w[None])[0, :-1], w[1:], reduction="none") for w in windows])
    assert result.ppl == pytest.approx(float(torch.exp(nll.double().mean())), rel=1e-6)
    assert (result.windows, result.seq_len) == (5, 24)
    assert torch.allclose(result.window_nll, nll.double().view(5, 23).mean(1), atol=1e-6)


def test_text_windows_tokenize_once_without_bos(tok, shared_data):
    text = (shared_data / "wikitext-2" / "valid.txt").read_text()[:100_000]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for L, count in ((16, 3), (512, 7), (100, 1)):  # only a prefix is tokenized: same tokens as the whole text
        assert text_windows(tok, text, L, max_windows=count).tolist() == torch.tensor(ids[: L * count]).view(count, L).tolist()
    assert text_windows(tok, text, 512).shape[0] == len(ids) // 512  # the tail shorter than L is dropped
    assert ids[0] != tok.bos_token_id
    with pytest.raises(QuantkitError, match="fewer than one window of 65536"):
        text_windows(tok, text, 65536)


# ---------------------------------------------------------------- KL / agreement / paired NLL


def test_compare_matches_per_unit_reference(base, cand):
    units = []
    for n, seed in ((20, 1), (7, 2), (13, 3)):
        ids = random_ids((n,), seed).tolist()
        mask = [False] + [bool(i % 3) for i in range(1, n)]
        units.append((ids, mask))
    got = compare(base, cand, units, max_batch_tokens=40)  # several padded batches
    for u, (ids, mask) in enumerate(units):
        x = torch.tensor([ids])
        with torch.no_grad():
            lb = F.log_softmax(base(x)[0, :-1], -1)
            lc = F.log_softmax(cand(x)[0, :-1], -1)
        sel = torch.tensor(mask[1:])
        tgt = x[0, 1:]
        kl = F.kl_div(lc, lb, log_target=True, reduction="none").sum(-1)
        assert got.base_nll[u] == pytest.approx(-lb[sel].gather(1, tgt[sel, None]).sum().item(), rel=1e-5)
        assert got.cand_nll[u] == pytest.approx(-lc[sel].gather(1, tgt[sel, None]).sum().item(), rel=1e-5)
        assert got.count[u] == sel.sum().item()
        assert got.kl[u] == pytest.approx(kl[sel].sum().item(), rel=1e-4)
        assert got.agree[u] == (lb.argmax(-1) == lc.argmax(-1))[sel].sum().item()
    assert got.kl.sum() > 0 and got.kl_tokens.size == got.count.sum()
    same = compare(base, base, units)
    assert same.kl.sum() == 0 and (same.agree == same.count).all() and (same.base_nll == same.cand_nll).all()


# ---------------------------------------------------------------- log-likelihood of continuations


def test_prefix_tree_scoring_equals_separate_sequences(base):
    ctxs = [random_ids((n,), s).tolist() for n, s in ((9, 4), (3, 5), (15, 6))]
    conts = [[random_ids((n,), 10 + s).tolist() for s, n in enumerate(lens)] for lens in ((1, 4, 2), (6,), (2, 2, 5, 1))]
    got = score_groups(base, list(zip(ctxs, conts)), max_batch_tokens=32)
    for ctx, cs, results in zip(ctxs, conts, got):
        for cont, (ll, greedy) in zip(cs, results):
            with torch.no_grad():
                logp = F.log_softmax(base(torch.tensor([ctx + cont[:-1]]))[0], -1)[-len(cont):]
            assert ll == pytest.approx(logp.gather(1, torch.tensor(cont)[:, None]).sum().item(), rel=1e-5)
            assert greedy == bool((logp.argmax(-1) == torch.tensor(cont)).all())


def test_encode_pair_is_lm_evals(tok):
    from lm_eval.api.model import TemplateLM

    class Encoder(TemplateLM):  # lm-eval's own _encode_pair over the HF backend's tok_encode
        tokenizer = tok
        eot_token_id = tok.eos_token_id

        def tok_encode(self, string, add_special_tokens=None, **kw):
            return tok.encode(string)

        _loglikelihood_tokens = loglikelihood_rolling = generate_until = None

    ref = Encoder.__new__(Encoder)
    for ctx, cont in (("Question: Why?\nAnswer:", " Because."), ("Trailing space ", "word"), ("a", "bc")):
        assert encode_pair(tok, ctx, cont) == TemplateLM._encode_pair(ref, ctx, cont)


def test_choice_metrics_match_a_hand_computation():
    rows = [Row("choice", "f:1", prompt="q", prompt_field="question", choices=("a", "bbbb", "cc"), answer=1),
            Row("choice", "f:2", prompt="q", prompt_field="question", choices=("xx", "y"), answer=0),
            Row("choice", "f:3", prompt="q", prompt_field="context", choices=("same", "same"), answer=1)]
    loglik = [[-2.0, -4.0, -3.0],  # acc: argmax 0 (wrong); norm: -2, -1, -1.5 -> 1 (right)
              [-1.0, -5.0],  # acc: 0 (right); norm: -0.5, -5 -> 0 (right)
              [-3.0, -3.0]]  # a tie: the first maximum wins (0), as np.argmax in lm-eval
    s = choice_metrics(rows, loglik)
    assert s.acc.tolist() == [0.0, 1.0, 0.0] and s.acc_norm.tolist() == [1.0, 1.0, 0.0]


# ---------------------------------------------------------------- bootstrap


def test_bootstrap_identical_is_zero_width_and_pairing_removes_row_variance():
    rng = np.random.default_rng(0)
    b = rng.integers(0, 2, 200).astype(float)
    diff = bs.bootstrap(lambda x, y: y.mean(-1) - x.mean(-1), b, b.copy())
    assert (diff.value, diff.low, diff.high) == (0.0, 0.0, 0.0)
    shifted = bs.bootstrap(lambda x, y: y.mean(-1) - x.mean(-1), b, b + 1.0)  # paired: every row +1 exactly
    assert shifted.value == pytest.approx(1.0) and shifted.high - shifted.low < 1e-12
    c = rng.integers(0, 2, 200).astype(float)
    iv = bs.bootstrap(lambda x, y: y.mean(-1) - x.mean(-1), b, c, seed=3)
    assert iv.low < iv.value < iv.high and iv == bs.bootstrap(lambda x, y: y.mean(-1) - x.mean(-1), b, c, seed=3)
    se = np.std(c - b, ddof=1) / np.sqrt(200)  # the percentile interval is close to the normal one
    assert (iv.high - iv.low) == pytest.approx(2 * 1.96 * se, rel=0.15)


def test_one_unit_has_no_interval_and_says_so():
    one = bs.bootstrap(lambda x, y: y.mean(-1) - x.mean(-1), np.array([1.0]), np.array([3.143]))
    assert one == bs.Interval(pytest.approx(2.143), None, None)
    assert bs.interval_text(one.value, one.low, one.high) == "+2.143 (one unit: no interval)"
    assert bs.interval_text(1.5, 0.25, 2.0, suffix="%") == "+1.5% [+0.25%, +2%]"


# ---------------------------------------------------------------- gate


def metric(task, name, delta, pct, higher, unit):
    iv = bs.Interval(delta, delta, delta)
    return MetricResult(task, name, 10.0, 10.0 + delta, iv, None if pct is None else bs.Interval(pct, pct, pct),
                        higher, unit, 100)


def test_gate_names_each_breached_metric_and_by_how_much():
    metrics = [metric("arc_easy", "acc", -2.5, -4.0, True, "points"), metric("piqa", "acc", -0.5, -1.0, True, "points"),
               metric("wikitext", "ppl", 0.4, 4.2, False, ""), metric("wikitext", "kl_mean", 0.03, None, False, "nats")]
    limits = [parse_threshold(s) for s in ("acc=-1.0", "ppl=+3%", "kl=0.05", "hellaswag/acc_norm=-1")]
    breaches, unchecked = check(limits, metrics)
    assert [b.message() for b in breaches] == [
        "arc_easy/acc: delta -2.5 points breaches the limit -1 points by 1.5 points",
        "wikitext/ppl: delta +4.2% breaches the limit +3% by 1.2%",
    ]
    assert [t.metric for t in unchecked] == ["hellaswag/acc_norm"]
    assert check([parse_threshold("kl=0.01")], metrics)[0][0].name == "wikitext/kl_mean"
    for bad in ("acc", "acc=", "=3", "ppl=three%"):
        with pytest.raises(QuantkitError, match="expected METRIC=VALUE"):
            parse_threshold(bad)


# ---------------------------------------------------------------- report files


def test_report_files(tmp_path):
    report = Report("cand", "base", [metric("arc_easy", "acc", -2.5, -4.0, True, "points"),
                                     metric("wikitext", "ppl", 0.4, 4.2, False, "")], settings={"limit": 5})
    paths = write(report, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["metrics"][0]["delta"] == {"value": -2.5, "low": -2.5, "high": -2.5}
    assert "| arc_easy | acc | 10 | 7.5 | -2.5 [-2.5, -2.5] | points | 100 |" in paths["md"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["deltas.png", "report.json", "report.md"]


# ---------------------------------------------------------------- where the standard sets come from


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No Hub and an empty cache: the standard sets can only come from a local mirror."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_standard_sets_come_from_the_mirror_in_quantkit_data_dir(offline, monkeypatch, tmp_path, shared_data):
    """A mirror built in a temp folder from tests/fixtures: locate() and the lm-eval task loaders read it."""
    import shutil

    from evals.tasks import utils
    from quantkit.data import read_rows
    from quantkit.evals.standard_sets import SETS, locate

    mirror = tmp_path / "mirror"
    for s in SETS.values():
        (mirror / s.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shared_data / s.path, mirror / s.path)
    monkeypatch.setenv("QUANTKIT_DATA_DIR", str(mirror))
    assert {name: locate(name) for name in SETS} == {name: mirror / s.path for name, s in SETS.items()}
    piqa = utils.piqa()["test"]
    rows = read_rows(mirror / "piqa" / "piqa_validation.jsonl")
    assert len(piqa) == len(rows) and piqa["answer"] == [r.answer for r in rows]
    pages = utils.wikitext()["test"]["page"]  # whole articles, every line of the text once (blank lead dropped)
    assert "".join(pages).strip() == (mirror / "wikitext-2" / "test.txt").read_text().strip() and len(pages) > 1


@pytest.mark.parametrize("data_dir", ["empty mirror", "unset"])
def test_no_mirror_and_no_hub_is_one_error_naming_both(offline, monkeypatch, tmp_path, data_dir):
    import quantkit.evals.standard_sets as std

    if data_dir == "unset":  # a fresh clone: no QUANTKIT_DATA_DIR and no data folder beside the repository
        monkeypatch.delenv("QUANTKIT_DATA_DIR")
        monkeypatch.setattr(std, "shared_data_dir", lambda: tmp_path / "shared" / "data")
    else:
        monkeypatch.setenv("QUANTKIT_DATA_DIR", str(tmp_path))
    with pytest.raises(QuantkitError) as e:
        std.locate("arc_easy")
    message = str(e.value)
    assert "QUANTKIT_DATA_DIR" in message and "allenai/ai2_arc" in message and "Hugging Face Hub" in message
    assert "HF_DATASETS_OFFLINE" in message and "arc-easy/arc_easy_test.jsonl" in message
    assert ("is unset" in message) == (data_dir == "unset")


def test_a_hub_set_is_converted_to_the_mirror_schema_and_cached(monkeypatch, tmp_path):
    """Online without a mirror: datasets.load_dataset (here a stand-in with ARC's Hub schema) is called once, its rows
    converted to the mirror's jsonl and cached; a failing fetch is the same error naming both options."""
    import datasets

    import quantkit.evals.standard_sets as std
    from quantkit.data import read_rows

    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("QUANTKIT_DATA_DIR", str(tmp_path / "none"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []
    hub_rows = [{"id": "Mercury_1", "question": "Which is a gas?", "answerKey": "B",
                 "choices": {"text": ["ice", "steam", "rock"], "label": ["A", "B", "C"]}}]

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(hub_rows)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    path = std.locate("arc_easy")
    assert path == tmp_path / "cache" / "quantkit" / "standard-sets" / "arc-easy" / "arc_easy_test.jsonl"
    (row,) = read_rows(path)
    assert (row.id, row.prompt, row.choices, row.answer) == ("Mercury_1", "Which is a gas?", ("ice", "steam", "rock"), 1)
    assert std.locate("arc_easy") == path and calls == [("allenai/ai2_arc", "ARC-Easy", "test")]  # cached

    def unreachable(*args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(QuantkitError, match=r"piqa: .*fetching baber/piqa, split validation from the Hub failed "
                                            r"\(ConnectionError: no route to host\): either set QUANTKIT_DATA_DIR"):
        std.locate("piqa")
