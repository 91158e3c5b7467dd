"""Gemma 3 multimodal checkpoints (Gemma3ForConditionalGeneration: gemma-3-4b/12b/27b, config.json model_type
"gemma3") read as their text decoder, quantkit's Gemma 3 text model (gemma3_text): quantkit serves text.

config.json  {"model_type": "gemma3", "text_config": {gemma3_text fields}, "vision_config": {SigLIP}, top level:
             dtype, token ids, tie_word_embeddings, image token facts}
             -> the decoder's own config.json (what Gemma3ForCausalLM.save_pretrained writes for it): text_config's
             fields; where it lacks them, the top level's that the decoder inherits (_INHERITED), then
             Gemma3TextConfig's defaults (_TEXT_DEFAULTS: the hub's text_configs list only what differs, the 4B's
             has no head counts, head_dim or vocab_size); tie_word_embeddings is the wrapper's (transformers ties the
             wrapper's lm_head to the embeddings by its own config, default true).
tensors      language_model.model.<x>  (the hub files; transformers 5.25 save_pretrained writes these too) -> model.<x>
             model.language_model.<x>  (transformers' module names since 4.52)                         -> model.<x>
             language_model.lm_head.<x>                                                                -> lm_head.<x>
             [model.]vision_tower.*, [model.]multi_modal_projector.*                                   -> not read
A text checkpoint's config and names pass through unchanged. (transformers' Gemma3ForConditionalGeneration skips
text_config's final_logit_softcapping, which Gemma3ForCausalLM, vLLM and quantkit apply; no Gemma 3 release sets it.)
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from quantkit.errors import QuantkitError

_MODEL_TYPE = "gemma3"  # Gemma3ForConditionalGeneration's
_INHERITED = ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version")
_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                      bos_token_id=2, eos_token_id=1, pad_token_id=0)
_DECODER = re.compile(r"^(?:language_model\.model|model\.language_model)\.")
_LEFT_OUT = re.compile(r"^(?:model\.)?(?:vision_tower|multi_modal_projector)\.")


def is_multimodal(hf: dict) -> bool:
    """A config.json dict of a Gemma 3 multimodal checkpoint."""
    return hf.get("model_type") == _MODEL_TYPE


def text_config(hf: dict) -> dict:
    """config.json dict -> the config.json of its text decoder (module docstring); a text model's, unchanged."""
    if not is_multimodal(hf):
        return hf
    if hf.get("quantization_config"):
        raise QuantkitError("config.json quantization_config: a quantized Gemma 3 multimodal checkpoint is not "
                            "supported: calibrate its float original")
    inherited = {k: hf[k] for k in _INHERITED if hf.get(k) is not None}
    return {**_TEXT_DEFAULTS, **inherited, **(hf.get("text_config") or {}),
            "tie_word_embeddings": hf.get("tie_word_embeddings", True), "architectures": ["Gemma3ForCausalLM"]}


def text_name(name: str) -> Optional[str]:
    """A multimodal checkpoint's tensor name -> the text model's, None for the vision tower and projector."""
    if _LEFT_OUT.match(name):
        return None
    return _DECODER.sub("model.", name).removeprefix("language_model.")


def tensor_names(hf: dict) -> Optional[Callable[[str], Optional[str]]]:
    """How the tensors of a folder with config.json `hf` are named for the model: `text_name`, or None (as stored)."""
    return text_name if is_multimodal(hf) else None
