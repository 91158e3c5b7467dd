"""Family: what one model family changes in the shared decoder, as data, and the table of families by config.json
model_type. Each family file (llama.py, gemma2.py, ...) registers one instance; quantkit/models/__init__.py imports
them all, so the table is full whenever any of quantkit.models is imported. The quantization facts of the same model
types (GPTQ order, AWQ groups, experts) are in registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.models.blocks import DecoderLayer
from quantkit.models.keys import half_rope_rows, pair_rope_rows
from quantkit.models.layers import MLP, RMSNorm


def no_fields(hf: dict, where: str) -> dict:
    return {}


def same_keys(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    return state


@dataclass(frozen=True)
class Family:
    name: str  # "Gemma 2", in messages
    model_types: tuple[str, ...]  # config.json model_type values it runs
    # (HF config dict, "<name> (<model_type>)" for messages) -> ModelConfig fields beyond the shared ones
    # (config.py); raises QuantkitError for what the family's code does not implement
    parse: Callable[[dict, str], dict] = no_fields
    decoder: type = DecoderLayer  # the block: pre-norm, or Gemma's SandwichDecoderLayer, OLMo 2's PostNormDecoderLayer
    norm: type = RMSNorm  # every RMSNorm of the model (q/k norms too): Llama's, Gemma's (1 + w), OLMo 2's Fp32RMSNorm
    mlp: type = MLP  # the dense MLP class: SwiGLU MLP or GeGLUMLP
    moe: Optional[Callable[..., nn.Module]] = None  # (cfg, linear_cls) -> the MoE block of cfg.sparse_layers
    ffn_name: str = "mlp"  # the block's attribute holding its MLP / MoE block (Mixtral: "block_sparse_moe")
    qk_norm: bool = False  # q and k RMSNormed over head_dim before RoPE (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # with qk_norm: over the whole q / k projection (Hq * D, Hkv * D) instead (OLMo 2)
    qk_norm_after_rope: bool = False  # with qk_norm: after RoPE instead of before (Hunyuan)
    embed_scale: bool = False  # embeddings times sqrt(hidden) rounded to the dtype (Gemma)
    tied: bool = False  # config.tie_word_embeddings when config.json omits it (transformers' default: Gemma, SmolLM3)
    rope_theta: float = 10000.0  # the RoPE base when config.json omits it (transformers' config class's default)
    # checkpoint tensors -> the model's state-dict names (split fused q/k/v, gate/up and 3-d expert tensors;
    # quantkit/models/keys.py); run on the float tensors of every folder the loader reads
    split: Callable[[dict[str, torch.Tensor], object], dict[str, torch.Tensor]] = same_keys
    # RoPE turns interleaved pairs of each head's dims (Cohere, GLM, ERNIE 4.5, Helium): q/k rows reordered into
    # rotate-half's order at load (model_tensors) and back at write (formats/checkpoint.py)
    rope_pairs: bool = False
    # (checkpoint, model) spellings of a module name part the family's checkpoints spell their own way (Hunyuan's
    # ".self_attn.query_layernorm." for ".self_attn.q_norm."): renamed at load (model_tensors), back at write
    renames: tuple[tuple[str, str], ...] = ()
    # model tensor name suffixes loaded as float32 in any model dtype (transformers' _keep_in_fp32_modules_strict:
    # GLM-4.5's router weight and score correction bias)
    fp32_tensors: tuple[str, ...] = ()

    @property
    def stored_as_built(self) -> bool:
        """Whether a checkpoint holds the model's tensors as they are: no split, rename or row order."""
        return self.split is same_keys and not self.rope_pairs and not self.renames

    def model_tensors(self, state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors (float, or the row indices of quantized ones) -> the model's: `renames`, `split`,
        then q/k rows in rotate-half order where the family's RoPE turns pairs."""
        state = self.split({self.model_name(k): t for k, t in state.items()}, cfg)
        return half_rope_rows(state, cfg) if self.rope_pairs else state

    def checkpoint_tensors(self, state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        """The model's tensors (float, or the row indices of quantized ones) -> the checkpoint's names and row order:
        model_tensors' renames and RoPE-pair order undone (its fused splits are undone by formats/fused.fuse)."""
        state = pair_rope_rows(state, cfg) if self.rope_pairs else state
        return {self.checkpoint_name(k): t for k, t in state.items()}

    def model_name(self, name: str) -> str:
        for stored, ours in self.renames:
            name = name.replace(stored, ours)
        return name

    def checkpoint_name(self, name: str) -> str:
        for stored, ours in self.renames:
            name = name.replace(ours, stored)
        return name

    def stored_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype the float tensor `name` (its full model name) is loaded and written in: float32 for the
        fp32_tensors, else `dtype`."""
        return torch.float32 if self.fp32_tensors and name.endswith(self.fp32_tensors) else dtype

    def checkpoint_module(self, name: str) -> str:
        """A module's name (no trailing parameter) as the family's checkpoints spell it."""
        return self.checkpoint_name(name + ".")[:-1]


FAMILIES: dict[str, Family] = {}  # model_type -> its family


def register(family: Family) -> Family:
    for model_type in family.model_types:
        FAMILIES[model_type] = family
    return family


def family_of(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        runs = ", ".join(f"{f.name} ({t})" for t, f in sorted(FAMILIES.items(), key=lambda tf: tf[1].name))
        raise QuantkitError(f"config.json model_type {model_type!r} is not supported: quantkit runs {runs}") from None
