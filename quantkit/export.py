"""Rewrite a quantized checkpoint in another layout from the same integer codes (no recalibration).

Every layout holds the same QTensor (codes, zeros, fp16 scales, g_idx), so an export is read -> QLinear -> write:
the codes, scales and zeros survive bit for bit and the exported model gives the same logits in quantkit. A layout
that cannot hold the scheme is refused by its writer before anything is written, saying why (GPTQ v1 cannot hold
asymmetric zeros; AWQ GEMM is 4-bit only, grouped, and has no g_idx for act-order).
Tokenizer files are copied byte for byte; eval/ (the `quantkit eval` report of these same codes) is copied too.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path

from quantkit.config import LAYOUTS
from quantkit.atomic import temp_dir_beside
from quantkit.errors import QuantkitError

# Files a tokenizer's save_pretrained writes (the allow-list copied verbatim into the export).
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "chat_template.*", "*.model", "*.tiktoken")
EVAL_DIR = "eval"


def export(src_dir: str | Path, fmt: str, out_dir: str | Path) -> Path:
    """Write the checkpoint at `src_dir` as layout `fmt` (gptq | gptq_v2 | awq | compressed-tensors) at `out_dir`."""
    from quantkit.formats.checkpoint import base_dtype, save_checkpoint
    from quantkit.models.loader import load_model

    src, out = Path(src_dir).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    if fmt not in LAYOUTS:
        raise QuantkitError(f"--format {fmt!r} is not a layout: use one of {', '.join(LAYOUTS)}")
    if out == src:
        raise QuantkitError(f"--out {out} is the source folder: export into a new folder")
    if not (src / "config.json").is_file():
        raise QuantkitError(f"{src}: no config.json: pass a quantized checkpoint folder")
    hf_config = json.loads((src / "config.json").read_text())
    if not hf_config.get("quantization_config"):
        raise QuantkitError(f"{src / 'config.json'}: no quantization_config: export rewrites quantized checkpoints "
                            "(make one with `quantkit calibrate`)")
    loaded = load_model(str(src), dtype=base_dtype(hf_config))  # read_quantized verifies quantkit.json's sha256s
    meta = loaded.quant_meta or _imported_meta(src, hf_config)
    generation = src / "generation_config.json"
    save_checkpoint(
        out,
        loaded.model,
        hf_config,
        _VerbatimFiles(src),
        fmt,
        meta,
        generation_config=json.loads(generation.read_text()) if generation.is_file() else None,
    )
    if (src / EVAL_DIR).is_dir():
        _copy_dir_atomic(src / EVAL_DIR, out / EVAL_DIR)
    return out


class _VerbatimFiles:
    """Stands where save_checkpoint takes a tokenizer: save_pretrained copies the source's tokenizer files as bytes."""

    def __init__(self, src: Path):
        self.files = sorted(p for p in src.iterdir() if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in TOKENIZER_FILES))

    def save_pretrained(self, out: str) -> None:
        for p in self.files:
            shutil.copyfile(p, Path(out) / p.name)


def _imported_meta(src: Path, hf_config: dict) -> dict:
    """quantkit.json facts for another tool's folder: what it was, from where."""
    method = hf_config["quantization_config"].get("quant_method")
    return {"method": method if method in ("gptq", "awq") else "unknown", "imported_from": str(src),
            "base_model": hf_config.get("_name_or_path")}


def _copy_dir_atomic(src: Path, dst: Path) -> None:
    tmp = temp_dir_beside(dst)
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        tmp.replace(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
