"""Recipes: flat YAML files, one per (model, method, scheme), that build the same CalibConfig as the flags.

    method: gptq            # calibration keys: quantkit.config.CALIB_KEYS (flag names with _ for -)
    bits: 4
    group_size: 64
    max_delta: {ppl: "+25%", kl: 0.1}   # the accuracy gate `quantkit eval --recipe` checks (evals/gate.py)

An unknown key, a nested value (other than max_delta) or a value of the wrong type is an error naming the file,
line and key. Flags given on the command line override the recipe's keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from quantkit.config import CALIB_KEYS, CalibConfig
from quantkit.errors import QuantkitError

GATE_KEY = "max_delta"  # metric -> limit, parsed by quantkit.evals.gate
DOC_KEYS = ("description",)


@dataclass
class Recipe:
    path: Path
    calib: dict[str, Any]  # CALIB_KEYS subset, as written
    max_delta: dict[str, Any]  # the accuracy gate as written (metric -> limit)
    where: dict[str, str] = field(default_factory=dict)  # key -> "file:line"
    description: str = ""


def load_recipe(path: str | Path) -> Recipe:
    import yaml

    from quantkit.evals.gate import thresholds_from_mapping

    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"recipe {path} does not exist")
    text = path.read_text()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise QuantkitError(f"{path}{line}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict):
        raise QuantkitError(f"{path}: a recipe is a flat mapping of keys to values (see recipes/*.yaml)")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value}
    recipe = Recipe(path, {}, {})
    for key, value in data.items():
        at = f"{path}:{lines.get(key, '?')}"
        recipe.where[key] = at
        if key == GATE_KEY:
            thresholds_from_mapping(value, at)  # validates every METRIC: LIMIT
            recipe.max_delta = dict(value)
        elif isinstance(value, (dict, list)):
            raise QuantkitError(f"{at}: key {key!r}: recipes are flat, give a single value")
        elif key in CALIB_KEYS:
            recipe.calib[key] = value
        elif key in DOC_KEYS:
            recipe.description = str(value)
        else:
            known = ", ".join([*CALIB_KEYS, GATE_KEY, *DOC_KEYS])
            raise QuantkitError(f"{at}: unknown key {key!r} (known: {known})")
    CalibConfig.from_flat(recipe.calib, recipe.where, origin=str(path))  # validate now, not at first use
    return recipe


def calib_config(recipe: Optional[Recipe], flags: dict[str, Any]) -> CalibConfig:
    """The recipe's keys overridden by every flag that was given (flags: CALIB_KEYS -> value or None)."""
    given = {k: v for k, v in flags.items() if v is not None}
    flat = {**(recipe.calib if recipe else {}), **given}
    where = {**(recipe.where if recipe else {}), **{k: f"--{k.replace('_', '-')}" for k in given}}
    return CalibConfig.from_flat(flat, where, origin=str(recipe.path) if recipe else "")
