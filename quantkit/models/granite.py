"""Granite (IBM Granite 3.x dense, model_type granite): Llama with four multipliers from config.json, each at the
shared code's hook: embeddings times embedding_multiplier (CausalLM.embed), attention scale attention_multiplier
instead of 1 / sqrt(head_dim) (AttentionSpec), each sublayer's output times residual_multiplier before the residual
add (DecoderLayer.residual), logits divided by logits_scaling (CausalLM.finish_logits). transformers' defaults are 1."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.models.family import Family, register

MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")


def parse(hf: dict, where: str) -> dict:
    fields = {name: float(hf.get(name, 1.0)) for name in MULTIPLIERS}
    if fields["logits_scaling"] == 0.0:
        raise QuantkitError(f"{where}: logits_scaling is 0 (logits are divided by it)")
    return fields


GRANITE = register(Family("Granite", ("granite",), parse=parse))
