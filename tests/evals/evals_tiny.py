"""Tiny random-weight model folders with the bundled tokenizer, loadable by quantkit.models.loader.load_model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from quantkit.models.llama import LlamaForCausalLM, ModelConfig
from tests.conftest import tiny_hf_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def tiny_config() -> dict:
    return dict(tiny_hf_config("llama", vocab_size=49152, max_position_embeddings=512),
                architectures=["LlamaForCausalLM"], torch_dtype="float32")


def tiny_model(seed: int = 0, noise: float = 0.0) -> LlamaForCausalLM:
    """Seeded random weights; noise > 0 perturbs every Linear of the decoder (a stand-in "candidate")."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_config())).eval()
    if noise:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layers" in name and p.dim() == 2:
                    p.add_(noise * torch.randn(p.shape, generator=gen))
    return model


def save_tiny(model: LlamaForCausalLM, out: Path) -> Path:
    from safetensors.torch import save_file

    from quantkit.models.loader import bundled_model_dir

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(tiny_config()))
    for name in TOKENIZER_FILES:
        if (bundled_model_dir() / name).is_file():
            shutil.copy(bundled_model_dir() / name, out / name)
    return out
