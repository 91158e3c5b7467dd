"""quantkit eval, end to end: load baseline and candidate through the same loader (same model class, same QLinear as
serving), run every metric over the same tokens for both, and pair the results for the bootstrap.

    spec -> load both -> for each built-in task / data file / lm-eval task:
              tokenize once -> baseline + candidate (text: one pass over both, KL from the same logits)
              -> MetricResults with paired-bootstrap intervals -> gate -> Report
    with data files, the general held-out text too (GENERAL_TASK): a warning when its perplexity delta and a data
    file's have opposite signs (one improves, the other degrades); the gate checks it only where a threshold names it
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from quantkit.data import read_rows, read_text, tokenize_row
from quantkit.errors import QuantkitError
from quantkit.evals import bootstrap as bs
from quantkit.evals.gate import Threshold, check
from quantkit.evals.report import MetricResult, Report
from quantkit.evals.standard_sets import SETS, locate

# the standard sets: a local mirror ($QUANTKIT_DATA_DIR) or the Hub, found by evals/standard_sets.locate
CHOICE_TASKS = tuple(n for n, s in SETS.items() if s.kind == "choice")
TEXT_TASKS = tuple(n for n, s in SETS.items() if s.kind == "text")
DEFAULT_TASKS = ("wikitext", "arc_easy")
# With --data: the delta on one general held-out text as well (Shakespeare's sonnets 1-37, public domain, shipped
# in quantkit/fixtures), so a candidate fitted to the user's domain shows up as deltas of opposite signs
GENERAL_TASK = "held-out:sonnets"
GENERAL_TEXT = "sonnets.txt"


@dataclass
class EvalSpec:
    candidate: str
    baseline: Optional[str] = None  # None: the base_model recorded in the candidate's quantkit.json
    data: list[Path] = field(default_factory=list)
    tasks: Optional[list[str]] = None  # None: DEFAULT_TASKS when no --data is given
    limit: Optional[int] = 500  # rows per task / data file
    windows: Optional[int] = 40  # text windows per task / data file
    seq_len: int = 512
    max_new_tokens: int = 32
    thresholds: list[Threshold] = field(default_factory=list)
    seed: int = 0
    general: bool = True  # with data files: also measure GENERAL_TASK and compare the signs of the deltas


def resolve_baseline(spec: EvalSpec, cand_meta: Optional[dict]) -> str:
    if spec.baseline:
        return spec.baseline
    base = (cand_meta or {}).get("base_model")
    if not base:
        raise QuantkitError(f"{spec.candidate}: quantkit.json records no base_model: pass --baseline MODEL")
    return base


def general_text_file() -> Path:
    import quantkit

    return Path(quantkit.__file__).resolve().parent / "fixtures" / GENERAL_TEXT


def sign_disagreements(data_metrics: list[MetricResult], general: list[MetricResult]) -> list[str]:
    """One warning per perplexity of the user's data whose delta has the opposite sign of the general text's (one
    improves, the other degrades): the candidate is better on one kind of text only."""
    ref = next(m for m in general if m.metric == "ppl")
    return [f"warning: {m.task} perplexity {_change(m)} but the general held-out text ({ref.task}) {_change(ref)}: "
            f"the candidate's change is specific to one kind of text; do not read {m.task} alone as its quality"
            for m in data_metrics if m.metric == "ppl" and m.delta.value * ref.delta.value < 0]


def _change(m: MetricResult) -> str:
    word = "improves" if m.delta.value < 0 else "degrades"
    return f"{word} ({m.baseline:.4g} -> {m.candidate:.4g}, {m.delta_pct.value:+.2f}%)"


def run(spec: EvalSpec, console=None, baseline_cache: Optional[dict] = None) -> Report:
    """baseline_cache: a dict kept across runs that share a baseline (bench/eval.py): the baseline's multiple-choice
    and generation scores are computed once per (baseline, task, rows). Text metrics always run both models together."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from quantkit.models.loader import load_model

    start = time.time()
    data_rows = {Path(p): read_rows(p) for p in spec.data}  # bad rows fail before any model loads
    cand = load_model(spec.candidate)
    base_source = resolve_baseline(spec, cand.quant_meta)
    base = cand if base_source == spec.candidate else load_model(base_source)
    tasks = list(spec.tasks) if spec.tasks is not None else ([] if spec.data else list(DEFAULT_TASKS))
    report = Report(candidate=cand.source, baseline=base.source, settings=dict(
        seq_len=spec.seq_len, windows=spec.windows, limit=spec.limit, max_new_tokens=spec.max_new_tokens,
        tasks=tasks, data=[str(p) for p in spec.data], bootstrap=bs.N_BOOT, seed=spec.seed,
        general=GENERAL_TASK if spec.data and spec.general else None))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        @contextmanager
        def bar(description: str, total: int):
            tid = progress.add_task(description, total=total)
            yield lambda k: progress.advance(tid, k)

        ev = _Evaluator(spec, base, cand, bar, {} if baseline_cache is None else baseline_cache)
        lm_eval_tasks = []
        for task in tasks:
            if task in TEXT_TASKS:
                report.metrics += ev.text(task, read_text(locate(task)))
            elif task in CHOICE_TASKS:
                report.metrics += ev.choices(task, read_rows(locate(task)))
            else:
                lm_eval_tasks.append(task)
        data_metrics = []
        for path, rows in data_rows.items():
            data_metrics += ev.data_file(path, rows)
        report.metrics += data_metrics
        if data_rows and spec.general:
            general = ev.text(GENERAL_TASK, read_text(general_text_file()))
            report.metrics += general
            report.warnings += sign_disagreements(data_metrics, general)
        if lm_eval_tasks:
            report.metrics += ev.lm_eval(lm_eval_tasks)
    # the general text is gated only by a threshold that names it (held-out:sonnets/ppl=+20%)
    named = {t.metric for t in spec.thresholds}
    gated = [m for m in report.metrics if m.task != GENERAL_TASK or f"{m.task}/{m.metric}" in named]
    breaches, unchecked = check(spec.thresholds, gated)
    report.gate = {"thresholds": [f"{t.metric}={t.text()}" for t in spec.thresholds],
                   "breaches": [{"name": b.name, "delta": b.delta, "message": b.message()} for b in breaches],
                   "unchecked": [f"{t.metric}={t.text()}" for t in unchecked]}
    report.seconds = time.time() - start
    return report


class _Evaluator:
    def __init__(self, spec: EvalSpec, base, cand, bar, cache: dict):
        self.spec, self.base, self.cand, self.bar, self.cache = spec, base, cand, bar, cache
        self.tok = cand.tokenizer

    def _both(self, key: tuple, score) -> tuple:
        """(baseline, candidate) results of score(loaded, who); the baseline's comes from the cache when present, and
        is the candidate's too when both are one loaded model (the same source given twice)."""
        key = (self.base.source, *key)
        if key not in self.cache:
            self.cache[key] = score(self.base, "baseline")
        return self.cache[key], self.cache[key] if self.cand is self.base else score(self.cand, "candidate")

    # ---- text: perplexity, KL, top-1 agreement from one pass over both models
    def text(self, task: str, text: str) -> list[MetricResult]:
        from quantkit.evals.perplexity import text_windows

        windows = text_windows(self.tok, text, self.spec.seq_len, self.spec.windows)
        L = windows.shape[1]
        units = [(w.tolist(), [False] + [True] * (L - 1)) for w in windows]
        return self._compare(task, units, f"L={L}, {len(units)} windows")

    def _compare(self, task: str, units, note: str) -> list[MetricResult]:
        from quantkit.evals.kl import compare

        with self.bar(f"{task}: baseline + candidate logits", len(units)) as advance:
            c = compare(self.base.model, self.cand.model, units, advance=advance)
        seed = self.spec.seed
        ppl_delta = bs.bootstrap(lambda b, k, n: bs.ratio_exp(k, n) - bs.ratio_exp(b, n), c.base_nll, c.cand_nll,
                                 c.count, seed=seed)
        ppl_pct = bs.bootstrap(lambda b, k, n: 100 * (bs.ratio_exp(k, n) / bs.ratio_exp(b, n) - 1), c.base_nll,
                               c.cand_nll, c.count, seed=seed)
        base_ppl = float(bs.ratio_exp(c.base_nll, c.count))
        kl = bs.bootstrap(lambda k, n: k.sum(-1) / n.sum(-1), c.kl, c.count, seed=seed)
        agree = bs.bootstrap(lambda a, n: 100 * a.sum(-1) / n.sum(-1) - 100, c.agree, c.count, seed=seed)
        per_unit = np.empty(len(units), dtype=object)
        offsets = np.concatenate([[0], np.cumsum(c.count).astype(int)])
        for i in range(len(units)):
            per_unit[i] = c.kl_tokens[offsets[i] : offsets[i + 1]]
        p99 = bs.bootstrap(lambda u: np.array([np.percentile(np.concatenate(list(r)), 99) for r in u]), per_unit,
                           seed=seed)
        n = len(units)
        return [
            MetricResult(task, "ppl", base_ppl, base_ppl + ppl_delta.value, ppl_delta, ppl_pct, False, "", n, note),
            MetricResult(task, "kl_mean", 0.0, kl.value, kl, None, False, "nats", n, note),
            MetricResult(task, "kl_p99", 0.0, p99.value, p99, None, False, "nats", n, note),
            MetricResult(task, "top1_agree", 100.0, 100.0 + agree.value, agree,
                         bs.Interval(agree.value, agree.low, agree.high), True, "points", n, note),
        ]

    # ---- multiple choice
    def choices(self, task: str, rows) -> list[MetricResult]:
        from quantkit.evals.multiple_choice import choice_groups, score_choices

        rows = [r for r in rows if r.kind == "choice"][: self.spec.limit]
        groups = choice_groups(rows, self.tok)

        def score(loaded, who):
            with self.bar(f"{task}: {who} choices", len(rows)) as advance:
                return score_choices(loaded.model, groups, rows, advance=advance)

        b, c = self._both(("choices", task, tuple(r.where for r in rows)), score)
        return [self._rate(task, "acc", b.acc, c.acc, f"{len(rows)} rows"),
                self._rate(task, "acc_norm", b.acc_norm, c.acc_norm, f"{len(rows)} rows")]

    def _rate(self, task: str, metric: str, b: np.ndarray, c: np.ndarray, note: str) -> MetricResult:
        """A mean of 0/1 per row, reported in percentage points."""
        delta = bs.bootstrap(lambda x, y: 100 * (y.mean(-1) - x.mean(-1)), b, c, seed=self.spec.seed)
        base = 100 * float(b.mean())
        pct = None if base == 0 else bs.bootstrap(
            lambda x, y: 100 * (y.mean(-1) / np.maximum(x.mean(-1), 1e-12) - 1), b, c, seed=self.spec.seed)
        return MetricResult(task, metric, base, 100 * float(c.mean()), delta, pct, True, "points", len(b), note)

    # ---- generation
    def generation(self, task: str, rows) -> list[MetricResult]:
        from quantkit.evals.generation import answer_prompts, score_generation

        prompts = answer_prompts(rows, self.tok)

        def score(loaded, who):
            with self.bar(f"{task}: {who} generation", len(rows)) as advance:
                return score_generation(loaded, rows, prompts, self.spec.max_new_tokens, advance=advance)

        b, c = self._both(("generation", task, tuple(r.where for r in rows), self.spec.max_new_tokens), score)
        note = f"{len(rows)} rows, greedy, {self.spec.max_new_tokens} new tokens"
        return [self._rate(task, "exact_match", b.exact_match, c.exact_match, note),
                self._rate(task, "contains", b.contains, c.contains, note)]

    # ---- a user data file: every kind of row it holds
    def data_file(self, path: Path, rows) -> list[MetricResult]:
        task = path.stem if path.is_file() else path.name
        by_kind: dict[str, list] = {}
        for r in rows:
            by_kind.setdefault(r.kind, []).append(r)
        out = []
        if "text" in by_kind:
            out += self.text(task, read_text(path))
        scored = [r for k in ("chat", "completion") for r in by_kind.get(k, [])][: self.spec.limit]
        if scored:
            out += self._compare(f"{task}:replies", self._reply_units(scored),
                                 f"{len(scored)} rows, assistant/completion tokens")
        if "choice" in by_kind:
            out += self.choices(task, by_kind["choice"])
        if "answer" in by_kind:
            out += self.generation(task, by_kind["answer"][: self.spec.limit])
        return out

    def _reply_units(self, rows) -> list[tuple[list[int], list[bool]]]:
        units = []
        for r in rows:
            ids, mask = tokenize_row(r, self.tok)
            ids, mask = ids[: self.spec.seq_len], [False] + mask[1 : self.spec.seq_len]
            if any(mask):
                units.append((ids, mask))
        if not units:
            raise QuantkitError(f"{rows[0].where.rsplit(':', 1)[0]}: no assistant/completion tokens to score "
                                f"within the first {self.spec.seq_len} tokens of any row")
        return units

    # ---- any lm-eval task, paired by document
    def lm_eval(self, tasks: list[str]) -> list[MetricResult]:
        from quantkit.evals.lm_eval_bridge import QuantkitLM, run_tasks, user_task

        specs = [spec for t in tasks for spec in (user_task(t) if Path(t).exists() else [t])]
        with self.bar(f"lm-eval {', '.join(tasks)}: baseline", 1) as advance:
            base = run_tasks(QuantkitLM(loaded=self.base), specs, self.spec.limit)
            advance(1)
        with self.bar(f"lm-eval {', '.join(tasks)}: candidate", 1) as advance:
            cand = run_tasks(QuantkitLM(loaded=self.cand), specs, self.spec.limit)
            advance(1)
        out = []
        for name, b in base.items():
            c = cand[name]
            for metric, agg in b.aggregation.items():
                out.append(self._lm_eval_metric(name, metric, agg, b.values[metric], c.values[metric],
                                                b.higher_is_better[metric]))
        return out

    def _lm_eval_metric(self, task, metric, agg, b_values, c_values, higher) -> MetricResult:
        """lm-eval's own aggregation of per-document values; means of 0/1 become percentage points."""
        b_arr, c_arr = np.empty(len(b_values), dtype=object), np.empty(len(c_values), dtype=object)
        b_arr[:], c_arr[:] = b_values, c_values
        binary = getattr(agg, "__name__", "") == "mean" and all(v in (0, 1, 0.0, 1.0, True, False)
                                                                for v in list(b_values) + list(c_values))
        scale = 100.0 if binary else 1.0

        def stat(x, y):
            return np.array([scale * (agg(list(yr)) - agg(list(xr))) for xr, yr in zip(x, y)])

        base, candv = scale * float(agg(list(b_values))), scale * float(agg(list(c_values)))
        delta = bs.bootstrap(stat, b_arr, c_arr, seed=self.spec.seed)
        pct = None if base == 0 else bs.Interval(100 * (candv / base - 1), *(
            None if end is None else 100 * ((base + end) / base - 1) for end in (delta.low, delta.high)))
        return MetricResult(task, metric, base, candv, delta, pct, higher, "points" if binary else "",
                            len(b_values), "lm-eval")
