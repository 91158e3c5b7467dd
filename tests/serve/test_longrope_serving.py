"""Phi-3 longrope through the paged serving engine (fp32, CPU, chunked prefill) against transformers' generate.

Semantics (vLLM's, quantkit/models/layers.py RotaryEmbedding.settle): a server whose max_model_len exceeds
original_max_position_embeddings rotates every position with the long factors, one that does not with the short
ones, so cached K/V never go stale. transformers picks the set per forward (long once a forward's largest position
reaches the original length), so on a prompt longer than that it is the same; on a shorter prompt it starts with the
short set, and the reference there is transformers with short_factor := long_factor.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from quantkit.models.loader import load_model
from quantkit.serve.llm import LLM
from quantkit.serve.sampling_params import SamplingParams
from tests.quantkit.families import LONGROPE, random_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

ORIGINAL, LONGEST = 64, 256  # original_max_position_embeddings, max_position_embeddings
PHI3 = dict(max_position_embeddings=LONGEST, original_max_position_embeddings=ORIGINAL, rope_scaling=LONGROPE)
ENGINE = dict(dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=24, kv_cache_memory=4 << 20)
_g = torch.Generator().manual_seed(64)
SHORT_PROMPT = torch.randint(0, 128, (20,), generator=_g).tolist()
LONG_PROMPT = torch.randint(0, 128, (ORIGINAL + 16,), generator=_g).tolist()  # chunked over 4 steps


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, bundled_dir):
    """(transformers model, its folder, the same weights with the long factors for every length)."""
    hf = random_hf_model("phi3", **PHI3)
    folder = tmp_path_factory.mktemp("phi3-longrope")
    hf.save_pretrained(folder)
    tokenizer = folder / "tokenizer"
    PreTrainedTokenizerFast.from_pretrained(bundled_dir).save_pretrained(tokenizer)
    for f in tokenizer.iterdir():
        shutil.copy(f, folder)
    always_long = random_hf_model("phi3", **{**PHI3, "rope_scaling": {**LONGROPE, "short_factor": LONGROPE["long_factor"]}})
    always_long.load_state_dict(hf.state_dict())
    return hf, folder, always_long


@torch.no_grad()
def generated(hf, prompt: list[int], max_tokens: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


def served(folder, prompts, max_tokens, max_model_len):
    llm = LLM(load_model(str(folder)), max_model_len=max_model_len, **ENGINE)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [out.outputs[0].token_ids for out in outputs]


def test_long_serving_length_uses_the_long_factors_everywhere(phi3):
    """max_model_len 256 > 64: a prompt past the original length equals transformers' generate; a short one crossing
    it while decoding equals transformers with the long factors from token 0, not plain transformers (which rotates
    its first 64 positions with the short set)."""
    hf, folder, always_long = phi3
    got = served(folder, [LONG_PROMPT, SHORT_PROMPT], 60, LONGEST)
    assert got[0] == generated(hf, LONG_PROMPT, 60)
    assert got[1] == generated(always_long, SHORT_PROMPT, 60)
    assert got[1] != generated(hf, SHORT_PROMPT, 60)  # the two semantics differ here: the test tells them apart


def test_short_serving_length_uses_the_short_factors(phi3):
    """max_model_len 64 = the original length: no sequence reaches the switch; a prompt of 20 and 44 tokens more
    (to the last position the server allows) equal transformers' generate."""
    hf, folder, _ = phi3
    assert served(folder, [SHORT_PROMPT], ORIGINAL - len(SHORT_PROMPT), ORIGINAL) == \
        [generated(hf, SHORT_PROMPT, ORIGINAL - len(SHORT_PROMPT))]
