"""Calibration in bounded host memory (quantkit calibrate --max-host-memory): when it is used, the model it
calibrates, and the checkpoint it streams.

When: with --max-host-memory SIZE, or when the model's float32 weights (what loading it whole holds; the file's
pages they are cast from are page cache the kernel reclaims) would take more than 80% of the memory available;
otherwise the model is loaded whole, which reads every tensor once and keeps finished blocks in memory.
The model: built on the meta device, its weights read per block (quant/lazy_weights.py); calibrate() writes every
block to the work folder and frees it, and spills the activations past the budget (quant/activation_store.py).
The checkpoint: every finished block comes back from the work folder, becomes the tensors
`formats.checkpoint.checkpoint_tensors` gives for it (the function that serves a model in memory: the same bytes),
is written once to <work>/assembly/block_NNN.safetensors and freed; the tensors outside the blocks (embedding, final
norm, lm_head) are read from the source shards in pieces; save_checkpoint streams them all into its shards.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.safetensors_stream import Stored, write_safetensors
from quantkit.quant.lazy_weights import LazyWeights

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_size(text: str, flag: str = "--max-host-memory") -> int:
    """'6GB' / '1.5G' (powers of 1000), '512MiB' (powers of 1024), '1000000' (bytes) -> bytes."""
    m = _SIZE.match(text.lower())
    if m is None or m[2] not in _UNITS or float(m[1]) * _UNITS[m[2]] < 1:
        raise QuantkitError(f"{flag} {text!r} is not a size: give a number with a unit, e.g. 6GB, 1.5GB or 512MiB "
                            f"(KB/MB/GB/TB: powers of 1000; KiB/MiB/GiB/TiB: of 1024; no unit: bytes)")
    return int(float(m[1]) * _UNITS[m[2]])


def host_budget(flag: Optional[str], folder: Path, log: Callable[[str], None]) -> Optional[int]:
    """Bytes calibration may hold in host memory, or None to load the whole model (module docstring)."""
    if flag is not None:
        return parse_size(flag)
    import psutil

    float32, available = _float32_bytes(folder), psutil.virtual_memory().available
    if float32 <= 0.8 * available:
        return None
    log(f"the model's float32 weights ({float32 / 1e9:.1f} GB) would take more than 80% of the memory available "
        f"({available / 1e9:.1f} GB): calibrating one block at a time, as with --max-host-memory "
        f"{available // 2 / 1e9:.1f}GB")
    return available // 2


def _float32_bytes(folder: Path) -> int:
    """The model's tensors in float32 (a multimodal checkpoint's vision tower and projector not counted: not read)."""
    from safetensors import safe_open

    from quantkit.files import safetensors_files
    from quantkit.models.loader import tensor_names_of

    names, total = tensor_names_of(folder), 0
    for shard in safetensors_files(folder):
        with safe_open(str(folder / shard), framework="pt") as f:
            total += sum(4 * torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys()
                         if names is None or names(k) is not None)
    return total


def load_streamed(source: Optional[str]):
    """-> (models.loader.Loaded with the model on the meta device, its LazyWeights), for calibrate(weights=...)."""
    from transformers import AutoTokenizer

    from quantkit.models.config import ModelConfig
    from quantkit.models.loader import Loaded, read_config, resolve, tensor_names_of
    from quantkit.models.model import CausalLM

    folder, name = resolve(source)
    hf_config = read_config(folder)
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(hf_config)).eval()
    weights = LazyWeights(folder, model, names=tensor_names_of(folder))
    return Loaded(model=model, tokenizer=AutoTokenizer.from_pretrained(folder), hf_config=hf_config, source=name,
                  path=folder), weights


def streamed_tensors(work_dir: Path, model, weights: LazyWeights, hf_config: dict, cfg,
                     log: Callable[[str], None] = print) -> dict[str, Stored]:
    """The checkpoint's tensors (in cfg.layout) of a model calibrated with `weights` and `cfg` (CalibConfig) into
    `work_dir` (module docstring), for save_checkpoint(tensors=...)."""
    from quantkit.formats.checkpoint import base_dtype, checkpoint_tensors
    from quantkit.models.registry import arch_spec
    from quantkit.quant.calibrate import swap_in_qlinear
    from quantkit.quant.resume import WorkFolder

    dtype = base_dtype(hf_config)
    work, spec = WorkFolder(work_dir, {}, log), arch_spec(hf_config.get("model_type", "llama"))
    folder = Path(work_dir) / "assembly"
    folder.mkdir(exist_ok=True)

    def block_tensors(i: int, block) -> dict[str, Stored]:
        """Block i from the work folder -> its checkpoint tensors, written once to `folder`; the block is freed."""
        prefix = f"model.layers.{i}."
        qts, _ = work.load_block(i, block, spec.in_block(block).linears, lambda name: cfg.scheme_of(prefix + name))
        for name in list(qts):
            swap_in_qlinear(block, name, qts.pop(name))
        tensors = checkpoint_tensors(block, hf_config, cfg.layout, dtype, prefix)
        weights.release(prefix)
        path = folder / f"block_{i:03d}.safetensors"
        write_safetensors(path, {name: Stored.of(t) for name, t in tensors.items()})
        return {name: _stored_in(path, name, t) for name, t in tensors.items()}

    out: dict[str, Stored] = {}
    for i, block in enumerate(model.model.layers):
        out.update(block_tensors(i, block))
    tied = hf_config.get("tie_word_embeddings", False)
    for name, t in model.state_dict(keep_vars=True).items():
        if not name.startswith("model.layers.") and not (tied and name == "lm_head.weight"):
            out[name] = weights.stored(name, dtype if t.is_floating_point() else t.dtype)
    return out


def _stored_in(path: Path, name: str, t: torch.Tensor) -> Stored:
    """Tensor `name` (dtype and shape of t) of the safetensors file at `path`, read when the writer reaches it."""
    from safetensors import safe_open

    def pieces():
        with safe_open(str(path), framework="pt") as f:
            yield f.get_tensor(name)
    return Stored(t.dtype, tuple(t.shape), pieces)
