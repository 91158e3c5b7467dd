"""Seed-OSS (model_type seed_oss; ByteDance Seed-OSS-36B): Llama whose q/k/v bias (config.attention_bias, default
true) and o bias (config.attention_out_bias, default false) are separate switches."""

from __future__ import annotations

from quantkit.models.family import Family, register


def parse(hf: dict, where: str) -> dict:
    return {"qkv_bias": bool(hf.get("attention_bias", True)), "o_bias": bool(hf.get("attention_out_bias", False))}


SEED_OSS = register(Family("Seed-OSS", ("seed_oss",), parse=parse))
