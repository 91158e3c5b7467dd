"""Arcee (model_type arcee: AFM-4.5B): Llama with an MLP without gate (up_proj, relu(x)^2, down_proj)."""

from __future__ import annotations

from quantkit.models.family import Family, register
from quantkit.models.layers import Relu2MLP
from quantkit.models.nemotron import relu2_only


def parse(hf: dict, where: str) -> dict:
    relu2_only(hf, where)
    return {}


ARCEE = register(Family("Arcee", ("arcee",), parse=parse, mlp=Relu2MLP))
