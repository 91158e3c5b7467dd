"""quantkit models inside lm-eval: an LM class registered as "quantkit" (the same model class and QLinear as serving)
and a runner for lm-eval tasks that returns per-document metric values, so baseline and candidate pair up.

    lm_eval.simple_evaluate(model="quantkit", model_args="pretrained=./m-awq", tasks=["qk_arc_easy"],
                            task_manager=task_manager())   # after `import quantkit.evals.lm_eval_bridge`
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import lm_eval.models  # noqa: F401 (lm-eval registers its own models lazily only while the registry is empty)
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from quantkit.errors import QuantkitError
from quantkit.evals.generation import greedy_generate
from quantkit.evals.scoring import score_groups

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


@register_model("quantkit")
class QuantkitLM(TemplateLM):
    """lm-eval LM over quantkit.models.loader.Loaded. Tokenization mirrors lm-eval's HF backend (tokenizer.encode
    with its default special tokens; BOS, else EOS, as the prefix of an empty context)."""

    def __init__(self, pretrained: Optional[str] = None, loaded=None, dtype: str = "float32",
                 max_batch_tokens: int = 4096, max_gen_toks: int = 256, **_ignored):
        super().__init__()
        if loaded is None:
            from quantkit.models.loader import load_model

            loaded = load_model(pretrained, dtype=getattr(torch, dtype))
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_batch_tokens = max_batch_tokens
        self._max_gen_toks = max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.model.config.max_position_embeddings

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            bos = self.tokenizer.bos_token
            add_special_tokens = not (bos and string.startswith(bos))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation), context ids, continuation ids); requests sharing a context are scored
        as one prefix tree."""
        groups: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
        for i, (_, ctx, _) in enumerate(requests):
            groups.setdefault(tuple(ctx), []).append(i)
        scored = score_groups(self.model, [(list(ctx), [requests[i][2] for i in members])
                                           for ctx, members in groups.items()], self.max_batch_tokens)
        out: list[Any] = [None] * len(requests)
        for members, results in zip(groups.values(), scored):
            for i, result in zip(members, results):
                out[i] = result
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for r, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((ctx, [cont]))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, ((ll, _),) in zip(owner, score_groups(self.model, windows, self.max_batch_tokens)):
            totals[r] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        by_kwargs: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_kwargs.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out: list[Any] = [None] * len(requests)
        for members in by_kwargs.values():
            kwargs = dict(requests[members[0]].args[1])
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) not in (0, 0.0, None):
                raise QuantkitError("quantkit's lm-eval model generates greedily: the task asks for sampling")
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self._max_gen_toks))
            prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] for i in members]
            for i, text in zip(members, greedy_generate(self.loaded, prompts, max_new, stop=until)):
                out[i] = text
        return out


def task_manager(include_defaults: bool = True):
    """lm-eval's task index plus the offline YAMLs in evals/tasks (alone when include_defaults is False: faster)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults)


def user_task(path: str | Path) -> list[dict]:
    """A user's data file as lm-eval task configs, one per kind of row it holds, with the native prompts:
    multiple choice (acc, acc_norm), prompt + answer (greedy generate_until, exact_match), text (rolling perplexity)."""
    from quantkit.data import read_rows
    from quantkit.evals.tasks.utils import rows_dataset

    path = Path(path)
    stem = "qk_user_" + "".join(ch if ch.isalnum() else "_" for ch in path.stem)
    kinds = {r.kind for r in read_rows(path)}
    mean = {"aggregation": "mean", "higher_is_better": True}
    by_kind = {
        "choice": {"output_type": "multiple_choice", "doc_to_text": "{{query}}", "doc_to_target": "answer",
                   "doc_to_choice": "choices",
                   "metric_list": [{"metric": "acc", **mean}, {"metric": "acc_norm", **mean}]},
        "answer": {"output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
                   "target_delimiter": "",
                   "generation_kwargs": {"until": ["\n"], "max_gen_toks": 32, "do_sample": False},
                   "metric_list": [{"metric": "exact_match", **mean, "ignore_case": False,
                                    "ignore_punctuation": False}]},
        "text": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                 "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                                 {"metric": "bits_per_byte"}]},
    }
    return [{"task": f"{stem}_{kind}", "custom_dataset": functools.partial(_ignore_metadata, rows_dataset, path, kind),
             "test_split": "test", **config} for kind, config in by_kind.items() if kind in kinds]


def _ignore_metadata(loader, path, kind, **_metadata):
    return loader(path, kind)


@dataclass
class TaskSamples:
    """Per document of one task (ordered by doc_id): each metric's lm-eval per-sample value, and how it aggregates."""

    doc_ids: list[int]
    values: dict[str, list[Any]] = field(default_factory=dict)
    aggregation: dict[str, Any] = field(default_factory=dict)  # metric -> lm-eval aggregation function
    higher_is_better: dict[str, bool] = field(default_factory=dict)


def run_tasks(lm: QuantkitLM, tasks: list, limit: Optional[int] = None) -> dict[str, TaskSamples]:
    """Evaluate lm-eval tasks (names, or config dicts from user_task) and return per-document values."""
    from lm_eval.evaluator import evaluate

    ours = {p.stem for p in TASKS_DIR.glob("*.yaml")}
    task_dict = task_manager(any(isinstance(t, str) and t not in ours for t in tasks)).load(list(tasks))
    results = evaluate(lm, task_dict, limit=limit, log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    out = {}
    for name, task in task_dict["tasks"].items():
        samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
        agg = task.aggregation()
        hib = task.higher_is_better()
        metrics = [m for m in agg if samples and m in samples[0]]
        out[name] = TaskSamples(
            doc_ids=[s["doc_id"] for s in samples],
            values={m: [s[m] for s in samples] for m in metrics},
            aggregation={m: agg[m] for m in metrics},
            higher_is_better={m: bool(hib.get(m, True)) for m in metrics},
        )
    return out

