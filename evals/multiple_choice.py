"""Multiple-choice accuracy by log-likelihood, as lm-eval defines it.

Prompt (lm-eval's arc_easy / piqa / hellaswag tasks): a "question" row reads "Question: {question}\\nAnswer:", a
"context" row reads as its context; each choice is scored as the continuation " {choice}".
acc = [argmax_k loglik_k == answer]; acc_norm = [argmax_k loglik_k / len(choice_k) == answer] with len in characters
of the choice string (lm-eval's `completion_len`; the first maximum wins, as np.argmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from quantkit.data import Row
from quantkit.evals.scoring import encode_pair, score_groups

TARGET_DELIMITER = " "


@dataclass
class ChoiceScores:
    loglik: list[list[float]]  # per row, per choice
    acc: np.ndarray  # float64 [R] 0/1
    acc_norm: np.ndarray  # float64 [R] 0/1


def prompt_of(row: Row) -> str:
    return f"Question: {row.prompt}\nAnswer:" if row.prompt_field == "question" else row.prompt


def choice_groups(rows: Sequence[Row], tokenizer) -> list[tuple[list[int], list[list[int]]]]:
    """Per row: (context ids, [continuation ids per choice]) with lm-eval's pair encoding (tokenized once)."""
    groups = []
    for row in rows:
        pairs = [encode_pair(tokenizer, prompt_of(row), TARGET_DELIMITER + c) for c in row.choices]
        groups.append((pairs[0][0], [cont for _, cont in pairs]))
    return groups


def choice_metrics(rows: Sequence[Row], loglik: Sequence[Sequence[float]]) -> ChoiceScores:
    acc, acc_norm = np.zeros(len(rows)), np.zeros(len(rows))
    for i, (row, ll) in enumerate(zip(rows, loglik)):
        ll = np.asarray(ll, dtype=np.float64)
        lengths = np.array([float(len(c)) for c in row.choices])
        acc[i] = float(np.argmax(ll) == row.answer)
        acc_norm[i] = float(np.argmax(ll / lengths) == row.answer)
    return ChoiceScores([list(map(float, ll)) for ll in loglik], acc, acc_norm)


def score_choices(model, groups, rows: Sequence[Row], advance: Optional[Callable[[int], None]] = None) -> ChoiceScores:
    """One model over pre-tokenized groups (build them once with choice_groups, reuse for every model)."""
    scored = score_groups(model, groups, advance=advance)
    return choice_metrics(rows, [[ll for ll, _ in per_choice] for per_choice in scored])
