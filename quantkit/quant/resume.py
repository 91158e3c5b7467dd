"""The work folder of a calibration run: each finished block is written durably, so a run killed at any point
continues at the first unfinished block and ends with the same bytes.

    manifest.json            {"fingerprint": {"model", "data", "config", "version"}}: reused only when all match
    block_NNN.safetensors    the block's QTensors (`<linear>.codes/.zeros/.scales[/.g_idx]`) and float tensors;
                             metadata "report": the block's per-layer report (JSON)
    inputs.safetensors       "x": the next block's inputs [N, L, H]; metadata "next_block"
A block counts as done when its file exists and inputs.safetensors says the run is past it (or no inputs are
needed). Every file is written to a temporary name, fsynced and renamed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.quant.scheme import QTensor

QTENSOR_FIELDS = ("codes", "zeros", "scales", "g_idx")


def atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors file written to a temporary name, fsynced, then renamed over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
        raise QuantkitError(f"{path}: unreadable work file ({e}); rerun with --no-resume") from None


class WorkFolder:
    def __init__(self, path: Path, fingerprint: dict[str, str], log: Callable[[str], None]):
        self.path, self.fingerprint, self.log = Path(path), fingerprint, log

    def open(self, resume: bool, needs_inputs: bool) -> int:
        """Prepare the folder; returns the first block to calibrate (0 unless a matching run is resumed)."""
        manifest = self.path / "manifest.json"
        if self.path.exists():
            old = json.loads(manifest.read_text()).get("fingerprint", {}) if manifest.is_file() else {}
            changed = [k for k in self.fingerprint if old.get(k) != self.fingerprint[k]]
            if resume and not changed:
                start = self._done_blocks(needs_inputs)
                if start:
                    self.log(f"resuming from {self.path}: blocks 0-{start - 1} are done")
                return start
            if resume and old:
                self.log(f"{self.path} holds a run with a different {', '.join(changed)}: starting fresh")
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        tmp = manifest.with_name("manifest.json.tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint}, indent=1))
        os.replace(tmp, manifest)
        return 0

    def _done_blocks(self, needs_inputs: bool) -> int:
        n = 0
        while (self.path / f"block_{n:03d}.safetensors").is_file():
            n += 1
        if not needs_inputs:
            return n
        inputs = self.path / "inputs.safetensors"
        if not inputs.is_file():
            return 0
        with safe_open(str(inputs), framework="pt") as f:
            return min(n, int((f.metadata() or {}).get("next_block", 0)))

    def save_block(self, index: int, block: nn.Module, qts: dict[str, QTensor], report: list[dict]) -> None:
        """The block's QTensors and its other float parameters (norms, biases: AWQ rescales norms)."""
        quantized = {f"{name}.weight" for name in qts}
        tensors = {k: v.detach().cpu() for k, v in block.named_parameters() if k not in quantized}
        for name, qt in qts.items():
            tensors.update({f"{name}.{f}": getattr(qt, f) for f in QTENSOR_FIELDS if getattr(qt, f) is not None})
        atomic_save(tensors, self.path / f"block_{index:03d}.safetensors", {"report": json.dumps(report)})

    def load_block(self, index: int, block: nn.Module, linears: Sequence[str],
                   scheme: QuantScheme | Callable[[str], Optional[QuantScheme]]) -> tuple[dict[str, QTensor], list[dict]]:
        """Restore the block's float parameters in place (assigned: a block on the meta device gets them too);
        returns its QTensors and report. scheme: every Linear's, or each one's by name (None: it stayed float)."""
        tensors, meta = _load(self.path / f"block_{index:03d}.safetensors")
        schemes = {n: scheme(n) if callable(scheme) else scheme for n in linears}
        linears = [n for n in linears if schemes[n] is not None]
        quantized = {f"{n}.{f}" for n in linears for f in QTENSOR_FIELDS}
        block.load_state_dict({k: v for k, v in tensors.items() if k not in quantized}, strict=False, assign=True)
        qts = {n: QTensor(*(tensors.get(f"{n}.{f}") for f in QTENSOR_FIELDS), schemes[n].bits, schemes[n].group_size,
                          schemes[n].sym) for n in linears}
        return qts, json.loads(meta["report"])

    def save_inputs(self, next_block: int, x: torch.Tensor) -> None:
        atomic_save({"x": x}, self.path / "inputs.safetensors", {"next_block": str(next_block)})

    def load_inputs(self) -> Optional[torch.Tensor]:
        path = self.path / "inputs.safetensors"
        return _load(path)[0]["x"] if path.is_file() else None

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=False)
