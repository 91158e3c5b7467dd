"""A GGUF file -> a Hugging Face folder the loader reads, through transformers' GGUF reader (once; cached).

transformers rebuilds the llama.cpp architectures below as the matching Hugging Face model (it un-permutes the Q/K
rows llama.cpp permutes for llama, undoes Gemma's norm + 1, restacks MoE experts, dequantizes every tensor);
quantkit saves that model as a safetensors folder with the file's tokenizer and loads it like any checkpoint.
Refused, each with one line: an architecture quantkit does not run from GGUF; a file transformers reads into a model
that is not the file's (tensors it does not place: Mixtral's experts in a llama GGUF, Phi-3 longrope's or Llama 3's
RoPE factors), or into one with weights it had to invent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from quantkit.atomic import temp_dir_beside
from quantkit.errors import QuantkitError
from quantkit.files import cache_root

# llama.cpp's general.architecture -> the model_type transformers builds from it, for the families quantkit runs.
# Mistral's GGUFs are llama ones and load as Llama (as llama.cpp runs them: no sliding window); transformers would
# build Mistral for a general.name of exactly "mistral", and fails to. Mixtral's are llama ones whose experts
# transformers does not read (refused).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen2moe": "qwen2_moe", "qwen3": "qwen3",
                      "qwen3moe": "qwen3_moe", "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text"}
FOLDER_FORMAT = "2"  # in the cache key: folders written before the lossless dtype choice are not reused


def gguf_to_hf_folder(path: Path, out: Optional[Path] = None, dtype: Optional[torch.dtype] = None) -> Path:
    """Dequantize a GGUF file once into a safetensors folder with tokenizer (atomic; reused when it exists).

    out defaults to a cache folder keyed by the file's path, size and mtime. dtype None: float16 when every
    dequantized tensor is exactly a float16, else float32 (the folder holds the file's values exactly)."""
    if out is None:
        stat = path.stat()
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{FOLDER_FORMAT}"
        out = cache_root() / "models" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (out / "config.json").is_file():
        return out
    check_architecture(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers import __version__ as transformers_version

    try:
        hf_model, info = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                              output_loading_info=True)
    except (NotImplementedError, ValueError, KeyError) as e:  # what its GGUF reader raises for what it lacks
        raise QuantkitError(f"{path}: transformers {transformers_version} cannot read this GGUF: {e}") from None
    invented = sorted(info["missing_keys"]) + sorted(k for k, *_ in info["mismatched_keys"])
    if invented:
        raise QuantkitError(f"{path}: transformers {transformers_version} builds {type(hf_model).__name__} from "
                            f"this GGUF without {len(invented)} of its weights (e.g. {invented[0]!r}): not a "
                            f"model quantkit can run")
    state = hf_model.state_dict()
    file_weights, placed = gguf_weight_count(path), weight_count(state)
    if placed != file_weights:
        raise QuantkitError(f"{path}: transformers {transformers_version} places {placed:,} of this GGUF's "
                            f"{file_weights:,} weights in {type(hf_model).__name__}: its GGUF reader drops tensors "
                            f"(Mixtral's experts, Phi-3 longrope's or Llama 3's RoPE factors are such), so the model "
                            f"would not be the file's; load the Hugging Face checkpoint instead")
    if dtype is None:
        dtype = torch.float16 if all(torch.equal(t, t.half().float()) for t in state.values()) else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_config = hf_model.config.to_dict()
    hf_config.pop("quantization_config", None)  # the folder is plain floats now, not GGUF
    hf_config["torch_dtype"] = hf_config["dtype"] = str(dtype).removeprefix("torch.")
    hf_config["architectures"] = [type(hf_model).__name__]  # vLLM picks its model class from this
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    if hf_config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    tmp = temp_dir_beside(out)
    try:
        from safetensors.torch import save_file

        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, default=str))
        tokenizer.save_pretrained(tmp)
        GenerationConfig.from_model_config(hf_model.config).save_pretrained(tmp)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():  # another process did not win the race either
            raise
    return out


def check_architecture(path: Path) -> None:
    """Refuse, before any tensor is read, a GGUF whose architecture quantkit does not run from GGUF."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields.get("general.architecture")
    except (ValueError, OSError) as e:
        raise QuantkitError(f"{path}: not a readable GGUF file ({e})") from None
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise QuantkitError(f"{path}: GGUF architecture {arch!r} is not one quantkit loads (it loads "
                            f"{', '.join(GGUF_ARCHITECTURES)}: the families it runs that transformers reads from GGUF)")


def gguf_weight_count(path: Path) -> int:
    """Elements of every tensor in the file."""
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(path).tensors)


def weight_count(state: dict[str, torch.Tensor]) -> int:
    """Elements of a state dict, a tensor shared under two names (tied embeddings) counted once."""
    return sum({t.data_ptr(): t.numel() for t in state.values()}.values())
