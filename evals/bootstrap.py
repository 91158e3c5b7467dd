"""95% paired bootstrap: resample evaluation units (rows, windows) with replacement, the same indices for baseline
and candidate, and take the 2.5 / 97.5 percentiles of the statistic. Identical inputs give a zero-width interval; one
unit (a single window or row) gives none: resampling it can only return itself, which would read as certainty."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

N_BOOT = 1000


@dataclass(frozen=True)
class Interval:
    value: float  # the statistic on all units
    low: float | None  # None: fewer than 2 units, no interval can be estimated
    high: float | None


def interval_text(value: float, low: float | None, high: float | None, digits: str = ".4g", suffix: str = "") -> str:
    """'+1.23 [+0.5, +2]' (signed), or '+1.23 (one unit: no interval)'; the one rendering of an interval."""
    text = f"{value:+{digits}}{suffix}"
    if low is None or high is None:
        return text + " (one unit: no interval)"
    return text + f" [{low:+{digits}}{suffix}, {high:+{digits}}{suffix}]"


def bootstrap(stat: Callable[..., np.ndarray], *arrays: np.ndarray, n_boot: int = N_BOOT, seed: int = 0,
              confidence: float = 0.95) -> Interval:
    """stat(*arrays indexed [R, U]) -> [R]; every array has the units on axis 0 and is resampled with the same rows."""
    units = arrays[0].shape[0]
    point = float(stat(*(a[None, :] for a in arrays))[0])
    if units < 2:
        return Interval(point, None, None)
    idx = np.random.default_rng(seed).integers(0, units, size=(n_boot, units))  # [R, U]
    reps = stat(*(a[idx] for a in arrays))
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(reps, [tail, 100 - tail])
    return Interval(point, float(low), float(high))


def mean(x: np.ndarray) -> np.ndarray:
    return x.mean(axis=-1)


def ratio_exp(nll: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Perplexity of resampled units: exp(sum NLL / sum tokens)."""
    return np.exp(nll.sum(axis=-1) / count.sum(axis=-1))
