"""Vision-language checkpoints read as their text decoder, a model quantkit runs: quantkit serves text.

WRAPPERS (config.json model_type -> transformers' <X>ForConditionalGeneration):
  gemma3      Gemma 3 4B/12B/27B: SigLIP tower, gemma3_text decoder
  mistral3    Mistral Small 3.1 / 3.2 24B: Pixtral tower, mistral decoder
  llava       LLaVA 1.5 and its fine-tunes: CLIP tower, a llama / mistral / qwen2 / ... decoder
  aya_vision  Aya Vision 8B / 32B: SigLIP tower, cohere2 decoder
  internvl    InternVL3 / 3.5 (the -hf checkpoints): InternViT tower, qwen2 / qwen3 / llama decoder
  llava_next, llava_onevision
              LLaVA-NeXT (1.6) and LLaVA-OneVision: CLIP / SigLIP tower, a llama / mistral / qwen2 decoder
  smolvlm, idefics3
              SmolVLM / SmolVLM2 and Idefics3: SigLIP tower, llama decoder under model.text_model
  glm4v       GLM-4.1V-Thinking: its glm4v_text decoder is GLM-4-0414's (TEXT_AS), its M-RoPE plain on text as below
  qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe
              Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE: a qwen2 / qwen2 / qwen3 / qwen3_moe decoder whose text type
              (qwen2_5_vl_text, ...) transformers has no causal-LM class for (TEXT_AS). Its M-RoPE gives every token
              three position streams; on text alone all three are the token's index, so it is the decoder's plain
              RoPE (mrope_section and mrope_interleaved are dropped). The 4.x hub config.json is flat (the decoder's
              fields at the top level beside vision_config): transformers' config class reads it into text_config.
They share one layout (transformers reads the llava-like ones through its "llava" checkpoint conversion), so one
path reads them; where they differ (text model type, its defaults, class names) transformers' config classes tell:
config.json  {"model_type": <wrapper>, "text_config": {...}, "vision_config": {...}, top level: dtype, token ids, ...}
             -> the decoder's own config.json (what its ForCausalLM's save_pretrained writes): text_config's fields
             (none: the wrapper's default text_config, Mistral Small 3.1's for mistral3); where it lacks them, the
             top level's that describe the whole checkpoint (_INHERITED), then the declared defaults of transformers'
             config class for text_config's model_type (the wrapper's default text type where it names none): what
             transformers fills in, as hub text_configs list only what differs (Gemma 3 4B's has no head counts or
             vocab_size, LLaVA 1.5's little but model_type and vocab_size);
             architectures: transformers' causal-LM class of that model_type;
             tie_word_embeddings: whether the checkpoint stores no lm_head. The configs cannot say: transformers 5
             ties by the wrapper's field (default true for gemma3 and mistral3, and builds such checkpoints without
             an lm_head) unless both tensors are stored and differ; transformers 4 and vLLM by text_config's; Mistral
             Small 3.1's config.json names neither and it stores its own lm_head.
tensors      language_model.model.<x>  (the hub files; transformers 5.25 save_pretrained writes these too) -> model.<x>
             model.language_model.<x>  (transformers' module names since 4.52)                         -> model.<x>
             language_model.lm_head.<x>, lm_head.<x>                                                   -> lm_head.<x>
             model.text_model.<x>  (SmolVLM, Idefics3)                                              -> model.<x>
             model.<x> (Qwen-VL's hub files: the decoder at the top, its tower beside)               -> model.<x>
             [model.]vision_tower.*, [model.]multi_modal_projector.*, [model.]visual.*,
             [model.]vision_model.*, [model.]connector.*, [model.]image_newline                      -> not read
(transformers' Gemma3ForConditionalGeneration skips text_config's final_logit_softcapping, which Gemma3ForCausalLM,
vLLM and quantkit apply; no Gemma 3 release sets it.)
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Optional

from quantkit.errors import QuantkitError

WRAPPERS = ("gemma3", "mistral3", "llava", "aya_vision", "internvl", "llava_next", "llava_onevision", "smolvlm",
            "idefics3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v")
# text type -> (the decoder quantkit runs it as, fields that decoder must be told); module docstring
TEXT_AS = {"qwen2_vl_text": ("qwen2", {}), "qwen2_5_vl_text": ("qwen2", {}), "qwen3_vl_text": ("qwen3", {}),
           "qwen3_vl_moe_text": ("qwen3_moe", {"norm_topk_prob": True}),  # its router always renormalises the top k
           "glm4v_text": ("glm4", {"attention_bias": True})}  # its q/k/v always carry a bias
_INHERITED = ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version")
_DECODER = re.compile(r"^(?:language_model\.model|model\.language_model|model\.text_model)\.")
_LEFT_OUT = re.compile(
    r"^(?:model\.)?(?:vision_tower|multi_modal_projector|visual|vision_model|connector|image_newline)(?:\.|$)")


def is_multimodal(hf: dict) -> bool:
    """A config.json dict of a vision-language checkpoint quantkit reads as its text decoder (WRAPPERS)."""
    return hf.get("model_type") in WRAPPERS


def wrapper_class(hf: dict) -> str:
    """transformers' class of a vision-language config.json dict: "Mistral3ForConditionalGeneration"."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[hf["model_type"]]


def text_config(hf: dict, stored: Iterable[str]) -> dict:
    """A vision-language config.json dict and the checkpoint's stored tensor names -> the config.json of its text
    decoder (module docstring)."""
    from transformers import CONFIG_MAPPING, PreTrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if hf.get("quantization_config"):
        raise QuantkitError(f"config.json quantization_config: a quantized {wrapper_class(hf)} checkpoint is not "
                            "supported: calibrate its float original")
    spec = CONFIG_MAPPING[hf["model_type"]].sub_configs_defaults["text_config"]
    given = hf.get("text_config")
    if given is None:  # as transformers builds it: the wrapper's default, or a flat config's top-level fields
        flat = "hidden_size" in hf
        given = CONFIG_MAPPING[hf["model_type"]](**hf).text_config.to_dict() if flat else spec.init_kwargs
    model_type = given.get("model_type") or spec.model_type
    inherited = {k: hf[k] for k in _INHERITED if hf.get(k) is not None}
    if model_type in TEXT_AS:  # its fields and defaults as its own config class reads them, then the decoder it is
        read = CONFIG_MAPPING[model_type](**given).to_dict()
        model_type, fixed = TEXT_AS[model_type]
        text = {**without_mrope(read), **fixed, **{k: v for k, v in inherited.items() if read.get(k) is None}}
    elif model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        base = PreTrainedConfig.default_config_fields()  # return_dict, ...: no field of the text model's
        defaults = {k: v for k, v in CONFIG_MAPPING[model_type].default_config_fields().items() if k not in base}
        text = {**defaults, **inherited, **given}
    else:
        raise QuantkitError(f"config.json text_config.model_type {model_type!r}: not a text decoder transformers knows")
    return {**text, "model_type": model_type,
            "tie_word_embeddings": "lm_head.weight" not in {text_name(name) for name in stored},
            "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]}


def without_mrope(text: dict) -> dict:
    """A Qwen-VL text config with its M-RoPE read as the plain RoPE it is on text alone (module docstring)."""
    rope = {**(text.get("rope_parameters") or {}), **(text.get("rope_scaling") or {})}
    kinds = {rope.pop("rope_type", None), rope.pop("type", None)} - {None, "default", "mrope"}  # 4.x: type mrope
    if kinds:
        raise QuantkitError(f"config.json text_config: M-RoPE over {kinds.pop()!r} RoPE is not supported")
    rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    plain = {k: v for k, v in text.items() if k != "rope_scaling"}
    return {**plain, "rope_parameters": {**rope, "rope_type": "default"}}


def text_name(name: str) -> Optional[str]:
    """A vision-language checkpoint's tensor name -> the text model's, None for the vision tower and projector."""
    if _LEFT_OUT.match(name):
        return None
    return _DECODER.sub("model.", name).removeprefix("language_model.")


def tensor_names(hf: dict) -> Optional[Callable[[str], Optional[str]]]:
    """How the tensors of a folder with config.json `hf` are named for the model: `text_name`, or None (as stored)."""
    return text_name if is_multimodal(hf) else None
