"""A model's float weights read from its safetensors files one module at a time, for calibration in bounded host
memory: the model is built on the meta device, each decoder block is materialised (float32, CPU) just before it is
calibrated and goes back to meta once its quantized form is in the work folder; the embedding is materialised for
the first block's inputs only; the tensors outside the blocks stream from the shards into the checkpoint.

The values are the loader's (models/loader.py load_state): checkpoint names mapped by the family's split (Phi-3's
fused q/k/v and gate/up, transformers 5's 3-d experts: models/keys.py, which splits a block's tensors among
themselves), cast to the load dtype. A block holds the same numbers whether the whole model was loaded or only the
block, so it calibrates to the same codes.

Tensors are read in units: a decoder block ("model.layers.<i>."), or the module of a tensor outside the blocks
("model.embed_tokens.", "model.norm.", "lm_head."). Units, and every name below, are the model's: a checkpoint that
stores the decoder under other names (a Gemma 3 multimodal one, models/multimodal.py) is renamed by `names`, and the
tensors it names None (the vision tower and projector) are never read.
"""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
from safetensors import safe_open

from quantkit.errors import QuantkitError
from quantkit.files import safetensors_files
from quantkit.formats.safetensors_stream import Stored

_LAYER = re.compile(r"^model\.layers\.\d+\.")
_PIECE_BYTES = 64 << 20  # rows streamed into the checkpoint at once


def unit_of(name: str) -> str:
    """The unit a tensor name belongs to (module docstring)."""
    m = _LAYER.match(name)
    return m[0] if m else name.rpartition(".")[0] + "."


try:
    _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim  # glibc
except (AttributeError, OSError):  # another C library: it returns freed memory by itself, or never
    _MALLOC_TRIM = None


def return_freed_memory() -> None:
    """Give the C heap's free pages back to the OS. glibc keeps freed chunks below its (adaptive, up to 32 MB) mmap
    threshold for reuse, and a process that frees one block's tensors and then reads the next grew by ~60 MB a block
    (3B Llama shapes) without this: fragments, not live tensors."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _ignored(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # older checkpoints store RoPE tables: the model computes them


class LazyWeights:
    """The weights of `model` (a CausalLM built on the meta device) in `folder`'s safetensors, read on demand in
    pieces of rows cast into place (neither a whole file nor a tensor's on-disk copy is ever in memory). `names`:
    stored tensor name -> the model's, None for one not read (default: as stored)."""

    def __init__(self, folder: Path, model, dtype: torch.dtype = torch.float32,
                 names: Optional[Callable[[str], Optional[str]]] = None):
        self.folder, self.model, self.dtype = Path(folder), model, dtype
        self.tied = model.config.tie_word_embeddings
        self.expected: dict[str, list[str]] = {}  # unit -> the model's state-dict names in it, in model order
        self.shapes: dict[str, torch.Size] = {}  # model name -> shape
        for name, t in model.state_dict(keep_vars=True).items():
            if not (self.tied and name == "lm_head.weight"):
                self.expected.setdefault(unit_of(name), []).append(name)
                self.shapes[name] = t.shape
        self.files: dict[str, tuple[Path, str, torch.Size]] = {}  # tensor name -> (its shard, stored name, shape)
        for shard in safetensors_files(self.folder):
            with self._open(self.folder / shard) as f:
                for stored in f.keys():
                    name = names(stored) if names else stored
                    if name is not None:
                        self.files[name] = (self.folder / shard, stored, torch.Size(f.get_slice(stored).get_shape()))
        self.units: dict[str, list[str]] = {}  # unit -> its tensors' names in `files` (before the family's split)
        for name in self.files:
            if not _ignored(name) and not (self.tied and name == "lm_head.weight"):
                self.units.setdefault(unit_of(name), []).append(name)
        stray = sorted(n for u in self.units.keys() - self.expected.keys() for n in self.units[u])
        if stray:
            raise QuantkitError(f"{self.folder}: unexpected tensor {stray[0]!r} ({len(stray)} in all) for this "
                                f"architecture")

    def _open(self, path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise QuantkitError(f"{path}: cannot read safetensors file ({e})") from None

    def _pieces(self, name: str) -> Iterator[torch.Tensor]:
        """Checkpoint tensor `name` in the load dtype, as consecutive blocks of rows (about _PIECE_BYTES each)."""
        path, stored, shape = self.files[name]
        with self._open(path) as f:
            if not shape:
                yield f.get_tensor(stored).to(self.dtype)
                return
            sliced = f.get_slice(stored)
            rows = max(1, _PIECE_BYTES // max(1, self.dtype.itemsize * math.prod(shape[1:])))
            for r0 in range(0, shape[0], rows):
                yield sliced[r0:r0 + rows].to(self.dtype)

    def _read(self, name: str) -> torch.Tensor:
        """Checkpoint tensor `name` in the load dtype, its pieces cast into place."""
        shape = self.files[name][2]
        if not shape:
            return next(self._pieces(name))
        out, r0 = torch.empty(shape, dtype=self.dtype), 0
        for piece in self._pieces(name):
            out[r0:r0 + len(piece)] = piece
            r0 += len(piece)
        return out

    def state(self, unit: str) -> dict[str, torch.Tensor]:
        """The unit's tensors under the model's names, in the load dtype."""
        raw = {name: self._read(name) for name in self.units.get(unit, ())}
        state = self.model.family.model_tensors(raw, self.model.config)
        expected = self.expected[unit]
        missing = [n for n in expected if n not in state]
        if missing:
            raise QuantkitError(f"{self.folder}: weights missing for {len(missing)} tensors, e.g. {missing[0]!r}")
        unexpected = sorted(state.keys() - set(expected))
        if unexpected:
            raise QuantkitError(f"{self.folder}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all) for "
                                f"this architecture")
        return {n: state[n] for n in expected}

    def materialise(self, unit: str) -> None:
        """Give the unit's module (e.g. model.layers.3) its weights, on CPU in the load dtype."""
        module = self.model.get_submodule(unit[:-1])
        state = {name[len(unit):]: t for name, t in self.state(unit).items()}
        module.load_state_dict(state, strict=False, assign=True)

    def release(self, unit: str) -> None:
        """Return the unit's module to the meta device: its memory is freed (and handed back to the OS)."""
        self.model.get_submodule(unit[:-1]).to("meta")
        return_freed_memory()

    def named_tensors(self) -> Iterator[tuple[str, Iterable[torch.Tensor]]]:
        """Every tensor of the model's state dict in its order (the tied lm_head once, as the embedding), each as
        pieces of rows in the load dtype: what the model in memory would hold (calibrate's fingerprint). One
        decoder block, or one piece of a tensor outside the blocks, is in memory at a time."""
        for unit, names in self.expected.items():
            if not _LAYER.match(unit):
                for name in names:
                    yield name, self._pieces(self._on_disk(name))
                continue
            state = self.state(unit)
            for name in names:
                yield name, (state.pop(name),)
            return_freed_memory()

    def _on_disk(self, name: str) -> str:
        """A tensor outside the blocks: in `files` under the model's own name (splits touch only the blocks)."""
        if name not in self.files:
            raise QuantkitError(f"{self.folder}: weights missing for {name!r}")
        path, stored, shape = self.files[name]
        if shape != self.shapes[name]:
            raise QuantkitError(f"{path}: tensor {stored!r} has shape {list(shape)}, the model's is "
                                f"{list(self.shapes[name])}")
        return name

    def stored(self, name: str, dtype: torch.dtype) -> Stored:
        """A tensor outside the blocks (embedding, final norm, lm_head) as the checkpoint holds it, in `dtype`
        (through the load dtype, as the model in memory would give it), read from its shard in pieces of rows."""
        self._on_disk(name)
        return Stored(dtype, tuple(self.shapes[name]), lambda: (piece.to(dtype) for piece in self._pieces(name)))
