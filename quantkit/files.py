"""Reading the files a model folder holds, and where quantkit caches what it builds. A leaf: it imports nothing of
quantkit but the error type, so the loader, the checkpoint reader and the kernel build all read through it without
importing each other.

(Writes are atomic and live in quantkit/atomic.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from quantkit.errors import QuantkitError


def cache_root() -> Path:
    """$QUANTKIT_CACHE, else ~/.cache/quantkit: converted bundled models, compiled CPU kernels."""
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))


def read_json(path: Path) -> dict:
    """A JSON file, or a QuantkitError naming the file (and the line of a syntax error)."""
    if not path.is_file():
        raise QuantkitError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise QuantkitError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


def read_hf_config(folder: Path) -> dict:
    """folder/config.json as a dict."""
    return read_json(folder / "config.json")


def safetensors_files(folder: Path) -> list[str]:
    """The folder's model.safetensors, or the shards its model.safetensors.index.json names."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(read_json(index)["weight_map"].values()))
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise QuantkitError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                        "(only safetensors weights load)")


def read_safetensors(folder: Path, names: Optional[Callable[[str], Optional[str]]] = None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's model.safetensors, or of the shards its index names, under `names(stored name)`
    (None: as stored); one it names None is not read (a multimodal checkpoint's vision tower: models/multimodal.py)."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(folder):
        try:
            with safe_open(str(folder / shard), framework="pt") as f:
                for stored in f.keys():
                    name = names(stored) if names else stored
                    if name is not None:
                        state[name] = f.get_tensor(stored)
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise QuantkitError(f"{folder / shard}: cannot read safetensors file ({e})") from None
    return state
