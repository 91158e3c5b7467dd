"""Where the standard evaluation sets come from: `locate(name)` is the one place, used by `quantkit eval`'s built-in
tasks (evals/runner.py) and by the lm-eval task YAMLs (evals/tasks/utils.py).

    1. a local mirror: $QUANTKIT_DATA_DIR (unset: ../shared/data beside a source checkout, quantkit.data.shared_data_dir)
       with the layout of FILES below (tests/fixtures/data is a tiny one);
    2. a copy fetched earlier from the Hub, cached under $XDG_CACHE_HOME/quantkit/standard-sets (default ~/.cache);
    3. the Hugging Face Hub through `datasets`, unless HF_DATASETS_OFFLINE or HF_HUB_OFFLINE is set: converted to the
       mirror's schema (jsonl rows {"id", "question" | "context", "choices", "answer": int}; plain text for wikitext)
       and written to the cache of 2;
    4. none of these: a QuantkitError naming QUANTKIT_DATA_DIR and the Hub.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from quantkit.data import shared_data_dir
from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class StandardSet:
    kind: str  # "choice" (jsonl rows) | "text" (a .txt read whole)
    path: str  # relative to the mirror folder
    hub: tuple[str, Optional[str], str]  # (dataset, config, split) on the Hugging Face Hub
    convert: Callable  # datasets.Dataset -> list of rows (choice) | str (text), in the mirror's schema


def _arc(ds) -> list[dict]:
    return [{"id": r["id"], "question": r["question"], "choices": list(r["choices"]["text"]),
             "answer": list(r["choices"]["label"]).index(r["answerKey"])} for r in ds]


def _piqa(ds) -> list[dict]:
    return [{"id": f"piqa-validation-{i:04d}", "question": r["goal"], "choices": [r["sol1"], r["sol2"]],
             "answer": int(r["label"])} for i, r in enumerate(ds)]


def _hellaswag_text(text: str) -> str:
    """lm-eval's HellaSwag preprocess (the WikiHow [title]/[step] markers), as the mirror's export applied."""
    text = re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". "))
    return text.replace("  ", " ")


def _hellaswag(ds) -> list[dict]:
    """The mirror's 3,000 evenly spaced validation rows: index floor(k * n / 3000), k = 0..2999."""
    n = len(ds)
    picked = sorted({k * n // 3000 for k in range(min(3000, n))})
    rows = []
    for i in picked:
        r = ds[i]
        ctx = r["ctx_a"] + " " + r["ctx_b"].capitalize()
        rows.append({"id": f"hellaswag-val-{i:05d}", "context": _hellaswag_text(r["activity_label"] + ": " + ctx),
                     "choices": [_hellaswag_text(e) for e in r["endings"]], "answer": int(r["label"])})
    return rows


def _wikitext(ds) -> str:
    return "".join(r["text"] for r in ds)


SETS = {
    "arc_easy": StandardSet("choice", "arc-easy/arc_easy_test.jsonl", ("allenai/ai2_arc", "ARC-Easy", "test"), _arc),
    "piqa": StandardSet("choice", "piqa/piqa_validation.jsonl", ("baber/piqa", None, "validation"), _piqa),
    "hellaswag": StandardSet("choice", "hellaswag/hellaswag_val_3000.jsonl", ("Rowan/hellaswag", None, "validation"),
                             _hellaswag),
    # the tokenized WikiText-2 (not raw), as the mirror's pytorch/examples copy
    "wikitext": StandardSet("text", "wikitext-2/test.txt", ("Salesforce/wikitext", "wikitext-2-v1", "test"), _wikitext),
}


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "quantkit" / "standard-sets"


def hub_offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def locate(name: str) -> Path:
    """The local file of standard set `name` (a key of SETS): the mirror's, the cached Hub copy, or fetched now."""
    if name not in SETS:
        raise QuantkitError(f"unknown standard set {name!r}: use one of {', '.join(SETS)}")
    s = SETS[name]
    mirror = shared_data_dir() / s.path
    if mirror.is_file():
        return mirror
    cached = cache_dir() / s.path
    if cached.is_file():
        return cached
    where = ("$QUANTKIT_DATA_DIR=" + os.environ["QUANTKIT_DATA_DIR"]) if os.environ.get("QUANTKIT_DATA_DIR") \
        else f"the default mirror {shared_data_dir()} (QUANTKIT_DATA_DIR is unset)"
    hub = f"{s.hub[0]}" + (f" ({s.hub[1]})" if s.hub[1] else "") + f", split {s.hub[2]}"
    options = (f"either set QUANTKIT_DATA_DIR to a local mirror holding {s.path}, or go online so that the "
               f"datasets library can fetch {hub} from the Hugging Face Hub")
    if hub_offline():
        raise QuantkitError(f"{name}: {mirror} is missing ({where}) and the Hub is off "
                            f"(HF_DATASETS_OFFLINE / HF_HUB_OFFLINE): {options}")
    try:
        import datasets

        converted = s.convert(datasets.load_dataset(s.hub[0], s.hub[1], split=s.hub[2]))
    except Exception as e:  # no network, an unknown repo, a changed schema: say what to do instead
        raise QuantkitError(f"{name}: {mirror} is missing ({where}) and fetching {hub} from the Hub failed "
                            f"({type(e).__name__}: {e}): {options}") from None
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(cached.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(converted if s.kind == "text" else "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in converted))
    tmp.replace(cached)
    return cached
