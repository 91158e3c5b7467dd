"""Quantized checkpoint folders: write one atomically in any layout, read one (quantkit's or another tool's).

A folder holds config.json (with quantization_config), model.safetensors (or model-0000i-of-0000n.safetensors +
model.safetensors.index.json past MAX_SHARD_BYTES), tokenizer files, generation_config.json and quantkit.json
(the caller's meta + layout + scheme + quantkit version + sha256 of every other file). QLinear modules are written
in the chosen layout (gptq | gptq_v2 | awq | compressed-tensors); every other tensor (embeddings, norms,
lm_head, biases of float Linears) in the base model dtype; a tied lm_head is not written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from quantkit.config import LAYOUTS, QuantScheme
from quantkit.atomic import set_plain_mode, temp_dir_beside
from quantkit.errors import QuantkitError
from quantkit.files import read_json, read_safetensors
from quantkit.formats import awq, compressed_tensors, fused, gptq
from quantkit.formats.safetensors_stream import Stored, write_safetensors
from quantkit.models.config import ModelConfig
from quantkit.models.family import FAMILIES
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import QTensor

MAX_SHARD_BYTES = 2 * 1024**3
META_FILE = "quantkit.json"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class _Layout:
    marker: str  # the tensor suffix every quantized Linear of this layout has
    suffixes: tuple[str, ...]  # all tensor suffixes the layout owns (bias aside)
    write: Callable[[QTensor, str], dict[str, torch.Tensor]]  # (qt, module) -> {suffix: tensor}
    read: Callable[[dict[str, torch.Tensor], dict, str], QTensor]  # ({suffix: tensor}, quantization_config, module)


_LAYOUTS = {
    "gptq": _Layout("qweight", gptq.SUFFIXES, lambda qt, m: gptq.linear_tensors(qt, m, v1=True), gptq.read_linear),
    "gptq_v2": _Layout("qweight", gptq.SUFFIXES, lambda qt, m: gptq.linear_tensors(qt, m, v1=False), gptq.read_linear),
    "awq": _Layout("qweight", awq.SUFFIXES, awq.linear_tensors, awq.read_linear),
    "compressed-tensors": _Layout("weight_packed", compressed_tensors.SUFFIXES, compressed_tensors.linear_tensors,
                                  compressed_tensors.read_linear),
}


@dataclass
class QuantizedFolder:
    hf_config: dict
    float_tensors: dict[str, torch.Tensor]  # HF name -> tensor, as stored (embeddings, norms, lm_head, ...)
    qlinears: dict[str, tuple[QTensor, Optional[torch.Tensor]]]  # module name -> (QTensor, bias or None)
    meta: Optional[dict]  # quantkit.json, or None for another tool's folder
    layout: str


def qlinear_modules(model: nn.Module) -> dict[str, QLinear]:
    """Every QLinear of `model` by module name (HF naming)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QLinear)}


def base_dtype(hf_config: dict) -> torch.dtype:
    """The dtype unquantized tensors are written in: config.json torch_dtype/dtype, float16 when absent."""
    name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float16").replace("torch.", "")
    if name not in _DTYPES:
        raise QuantkitError(f"config.json torch_dtype {name!r} is not supported: use float16, bfloat16 or float32")
    return _DTYPES[name]


# ----------------------------------------------------------------------------------------------------- writing


def save_checkpoint(out_dir, model: nn.Module, hf_config: dict, tokenizer, layout: str, meta: dict,
                    max_shard_bytes: int = MAX_SHARD_BYTES, generation_config: Optional[dict] = None,
                    tensors: Optional[dict[str, Stored]] = None) -> Path:
    """Write `model` (QLinear modules + float tensors) as a checkpoint folder at `out_dir`, atomically.

    meta: JSON-serialisable facts for quantkit.json (method, calibration stats, per-layer report, ...); an optional
    meta["scheme"]["static_groups"] and meta["damp_percent"] go into the GPTQ quantization_config.
    generation_config: generation_config.json contents (default: bos/eos/pad token ids from hf_config).
    tensors: the checkpoint's tensors streamed from elsewhere (calibration in bounded memory, quant/bounded.py),
    exactly what `checkpoint_tensors(model, ...)` gives; `model` then only supplies the structure (its QLinears may
    be on the meta device). Default: `checkpoint_tensors` of the model in memory.
    """
    if layout not in LAYOUTS:
        raise QuantkitError(f"--format {layout!r} is not a layout: use one of {', '.join(LAYOUTS)}")
    out = Path(out_dir).expanduser().resolve()
    qlinears = qlinear_modules(model)
    if not qlinears:
        raise QuantkitError("the model has no quantized (QLinear) modules to save: quantize it first")
    scheme, per_module = _schemes(qlinears, layout, (meta.get("scheme") or {}).get("static_groups", False))
    dtype = base_dtype(hf_config)
    family = FAMILIES.get(hf_config.get("model_type"))
    stored = family.checkpoint_module if family is not None else str  # module names as the checkpoint spells them
    skipped = sorted(stored(name) for name, m in model.named_modules()
                     if isinstance(m, nn.Linear) and name != "lm_head")
    per_module = None if per_module is None else {stored(name): s for name, s in per_module.items()}
    if tensors is None:
        tensors = {k: Stored.of(t) for k, t in checkpoint_tensors(model, hf_config, layout, dtype).items()}

    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    config.setdefault("torch_dtype", str(dtype).replace("torch.", ""))
    config["quantization_config"] = quantization_config(scheme, layout, config.get("model_type", "llama"), skipped,
                                                        meta.get("damp_percent"), per_module)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir_beside(out)
    try:
        _write_safetensors(tmp, tensors, max_shard_bytes)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config or _generation_defaults(hf_config))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        from quantkit import __version__

        record = {**meta, "layout": layout, "scheme": _scheme_dict(scheme), "quantkit_version": __version__,
                  "files": {f.name: _sha256(f) for f in sorted(tmp.iterdir()) if f.is_file()}}
        _write_json(tmp / META_FILE, record)
        for f in tmp.iterdir():
            set_plain_mode(f)
            _fsync(f)
        _fsync(tmp)
        _replace_dir(tmp, out)
    except OSError as e:  # a full disk, a quota, permissions changed under us: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise QuantkitError(f"{out}: cannot write the checkpoint ({e.strerror or e}); nothing was written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def quantization_config(scheme: QuantScheme, layout: str, model_type: str, skipped: list[str],
                        damp_percent: Optional[float] = None,
                        per_module: Optional[dict[str, QuantScheme]] = None) -> dict:
    """config.json quantization_config for `layout` (FORMATS.md); `skipped` Linears stay unquantized. per_module:
    each QLinear's scheme when they differ (`scheme` is then the most common one): GPTQ `dynamic` overrides or
    compressed-tensors config groups."""
    if layout in ("gptq", "gptq_v2"):
        return gptq.quantization_config(scheme, layout, model_type, skipped, damp_percent, per_module)
    if layout == "awq":
        return awq.quantization_config(scheme, skipped)
    return compressed_tensors.quantization_config(scheme, skipped, per_module)


def _schemes(qlinears: dict[str, QLinear], layout: str, static_groups: bool
             ) -> tuple[QuantScheme, Optional[dict[str, QuantScheme]]]:
    """(the scheme most QLinears have, {module: scheme} when their bits or group sizes differ else None); act_order
    if any has g_idx. Symmetry is one per checkpoint; AWQ holds one scheme."""
    act_order = any(m.g_idx is not None for m in qlinears.values()) or static_groups
    per_module = {name: QuantScheme(m.bits, m.group_size, m.sym, act_order, static_groups)
                  for name, m in qlinears.items()}
    counts: dict[QuantScheme, int] = {}
    for s in per_module.values():
        counts[s] = counts.get(s, 0) + 1
    base = max(counts, key=counts.get)  # ties: the first in module order
    if len(counts) == 1:
        return base, None
    first_name, first = next(iter(per_module.items()))
    for name, s in per_module.items():
        if layout == "awq" or s.sym != first.sym:
            raise QuantkitError(
                f"layers {first_name} ({first.bits}-bit g{first.group_size} sym={first.sym}) and {name} "
                f"({s.bits}-bit g{s.group_size} sym={s.sym}) differ: a {layout} checkpoint holds one "
                f"{'scheme' if layout == 'awq' else 'symmetry'}"
                + (" (write a mix of bits and group sizes as gptq, gptq_v2 or compressed-tensors)" if layout == "awq" else "")
            )
    return base, per_module


def _scheme_dict(scheme: QuantScheme) -> dict:
    return {"bits": scheme.bits, "group_size": scheme.group_size, "sym": scheme.sym,
            "act_order": scheme.act_order, "static_groups": scheme.static_groups, "name": scheme.name()}


def checkpoint_tensors(module: nn.Module, hf_config: dict, layout: str, dtype: torch.dtype, prefix: str = ""
                       ) -> dict[str, torch.Tensor]:
    """The tensors `module` contributes to the checkpoint, named `prefix` + its state-dict names: the QLinears in
    `layout` (fused where the family's checkpoints fuse them), the other tensors in `dtype`. module: the model, or
    one decoder block with prefix "model.layers.<i>." (a block's tensors do not depend on the rest of the model)."""
    qlinears = qlinear_modules(module)
    entries = {prefix + name: (m.qtensor().to("cpu"), m.bias) for name, m in qlinears.items()}
    entries = fused.as_stored(hf_config, entries)
    tensors = _quantized_tensors(fused.fuse(hf_config.get("model_type", "llama"), entries), layout, dtype)
    family = FAMILIES.get(hf_config.get("model_type"))
    floats = _float_tensors(module, qlinears, hf_config, dtype, family, prefix)
    if family is not None and not family.stored_as_built:  # names and q/k rows as stored (models/keys.py)
        floats = family.checkpoint_tensors(floats, ModelConfig.from_hf(hf_config))
    return {**tensors, **floats}


def _quantized_tensors(entries: dict[str, fused.Entry], layout: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{checkpoint module name: (QTensor, bias)} -> its tensors in `layout` (bias in the base dtype)."""
    out = {}
    for name, (qt, bias) in entries.items():
        parts = _LAYOUTS[layout].write(qt, name)
        out.update({f"{name}.{suffix}": t.contiguous() for suffix, t in parts.items()})
        if bias is not None:
            out[f"{name}.bias"] = bias.detach().to("cpu", dtype).contiguous()
    return out


def _float_tensors(model: nn.Module, qlinears: dict[str, QLinear], hf_config: dict, dtype: torch.dtype, family,
                   prefix: str) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers outside the QLinears, named prefix + their name in `model`, in `dtype` (or
    as the family's stored_dtype says: float32 for its fp32_tensors, as loaded); a tied lm_head is left out."""
    inside = tuple(f"{name}." for name in qlinears)
    tied = hf_config.get("tie_word_embeddings", False)
    out = {}
    for key, t in model.state_dict().items():
        if key.startswith(inside) or (tied and key == "lm_head.weight"):
            continue
        name = prefix + key
        kept = family.stored_dtype(name, dtype) if family is not None else dtype
        out[name] = t.detach().to("cpu", kept if t.is_floating_point() else t.dtype).contiguous()
    return out


def _write_safetensors(folder: Path, tensors: dict[str, Stored], max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when the total exceeds max_shard_bytes; each
    tensor is produced only when its file reaches it (formats/safetensors_stream.py: save_file's bytes)."""
    total = sum(t.nbytes for t in tensors.values())
    if total <= max_shard_bytes:
        write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
        return
    shards: list[dict[str, Stored]] = [{}]
    size = 0
    for name in sorted(tensors):  # greedy, in name order; a tensor larger than the limit gets a shard of its own
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / fname, shard, {"format": "pt"})
        weight_map.update({name: fname for name in shard})
    _write_json(folder / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _generation_defaults(hf_config: dict) -> dict:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: hf_config[k] for k in keys if hf_config.get(k) is not None}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an existing checkpoint at `out` is replaced, anything else refused."""
    if out.exists():
        if not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").is_file()):
            raise QuantkitError(f"{out} exists and is not a model folder: choose another --out or remove it")
        old = temp_dir_beside(out, "old")
        os.replace(out, old / out.name)  # the old folder stays whole until the new one is in place
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    _fsync(out.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------- reading


def read_quantized(folder) -> QuantizedFolder:
    """Read a quantized folder (quantkit's, or GPTQModel/AutoGPTQ, AutoAWQ, llm-compressor output).

    Verifies the sha256 of every file quantkit.json lists; a missing, modified or truncated file is a QuantkitError
    naming it.
    """

    folder = Path(folder)
    meta = _verified_meta(folder)
    hf_config = read_json(folder / "config.json")
    qcfg = _quantization_config(folder, hf_config)
    layout = detect_layout(qcfg, folder)
    tensors = read_safetensors(folder)
    spec = _LAYOUTS[layout]
    marker = spec.marker
    modules = sorted(key[: -len(marker) - 1] for key in tensors if key.endswith("." + marker))
    if not modules:
        raise QuantkitError(f"{folder}: config.json says {layout} but no tensor ends in .{marker}")
    qlinears = {}
    for module in modules:
        parts = {s: tensors.pop(f"{module}.{s}") for s in spec.suffixes if f"{module}.{s}" in tensors}
        qlinears[module] = (spec.read(parts, qcfg, module), tensors.pop(f"{module}.bias", None))
    return QuantizedFolder(hf_config, tensors, fused.split(hf_config, qlinears), meta, layout)


def detect_layout(qcfg: dict, folder: Path) -> str:
    """quantization_config -> gptq | gptq_v2 | awq | compressed-tensors."""
    method = qcfg.get("quant_method")
    if method == "gptq":
        return gptq.checkpoint_format(qcfg)
    if method == "awq":
        return "awq"
    if method == "compressed-tensors":
        if qcfg.get("format") != "pack-quantized":
            raise QuantkitError(f"{folder / 'config.json'}: compressed-tensors format {qcfg.get('format')!r} is not supported: quantkit reads pack-quantized")
        return "compressed-tensors"
    raise QuantkitError(f"{folder / 'config.json'}: quantization_config.quant_method {method!r} is not supported: quantkit reads gptq, awq and compressed-tensors")


def _quantization_config(folder: Path, hf_config: dict) -> dict:
    """config.json quantization_config; older AutoGPTQ/AutoAWQ folders keep it in quantize_config.json /
    quant_config.json instead."""
    if hf_config.get("quantization_config"):
        return hf_config["quantization_config"]
    if (folder / "quantize_config.json").is_file():
        return {"quant_method": "gptq", **read_json(folder / "quantize_config.json")}
    if (folder / "quant_config.json").is_file():
        return {"quant_method": "awq", **read_json(folder / "quant_config.json")}
    raise QuantkitError(f"{folder / 'config.json'}: no quantization_config: not a quantized checkpoint")


def _verified_meta(folder: Path) -> Optional[dict]:
    """quantkit.json (None when absent), after checking the sha256 of every file it lists."""
    path = folder / META_FILE
    if not path.is_file():
        return None
    meta = read_json(path)
    for name, digest in (meta.get("files") or {}).items():
        f = folder / name
        if not f.is_file():
            raise QuantkitError(f"{f}: missing (listed in {META_FILE}): the checkpoint is incomplete")
        if _sha256(f) != digest:
            raise QuantkitError(f"{f}: sha256 does not match {META_FILE} (file modified or truncated): re-create or re-download the checkpoint")
    return meta

