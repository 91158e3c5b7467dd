"""Offline data for the task YAMLs beside this file (lm-eval calls these through `!function utils.NAME`):
every loader reads the standard set where quantkit.evals.standard_sets.locate finds it (a local mirror,
$QUANTKIT_DATA_DIR, or the Hub) and returns a DatasetDict with a "test" split."""

from __future__ import annotations

import re

import datasets
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401 (YAML)

from quantkit.data import read_rows
from quantkit.evals.multiple_choice import prompt_of
from quantkit.evals.standard_sets import locate

ARTICLE_TITLE = re.compile(r"^ = [^=].* = $")


def rows_dataset(path, kind: str = "choice") -> datasets.DatasetDict:
    """One kind of row of a data file as lm-eval documents:
    choice -> {"query": the prompt lm-eval scores, "choices", "answer", "id"}; answer -> {"prompt", "answer", "id"};
    text -> {"text", "id"}."""
    docs = []
    for r in read_rows(path):
        if r.kind != kind:
            continue
        if kind == "choice":
            docs.append({"query": prompt_of(r), "choices": list(r.choices), "answer": r.answer, "id": r.id or r.where})
        elif kind == "answer":
            docs.append({"prompt": r.prompt, "answer": r.answer, "id": r.id or r.where})
        else:
            docs.append({"text": r.text, "id": r.id or r.where})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def arc_easy(**_metadata) -> datasets.DatasetDict:
    return rows_dataset(locate("arc_easy"))


def piqa(**_metadata) -> datasets.DatasetDict:
    return rows_dataset(locate("piqa"))


def hellaswag(**_metadata) -> datasets.DatasetDict:
    return rows_dataset(locate("hellaswag"))


def wikitext(**_metadata) -> datasets.DatasetDict:
    """wikitext-2 test.txt cut into articles at their " = Title = " lines, each {"page": text} (as lm-eval's
    wikitext_document_level), scored by lm-eval's own detokenizer and word/byte perplexity."""
    pages, current = [], []
    for line in locate("wikitext").read_text(encoding="utf-8").splitlines(keepends=True):
        if ARTICLE_TITLE.match(line.rstrip("\n")) and current:
            pages.append("".join(current))
            current = []
        current.append(line)
    pages.append("".join(current))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"page": p} for p in pages if p.strip()])})
