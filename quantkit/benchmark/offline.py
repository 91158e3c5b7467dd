"""`quantkit bench throughput`: the engine driven directly (quantkit.LLM, no HTTP), every prompt submitted at once.

Prompts are token ids (chat prompts through the model's chat template), generated greedily to their output length
(ignore_eos by default, so every request produces exactly that many tokens). Time = the generate call only.
"""

from __future__ import annotations

import time
from typing import Any


def offline_throughput(llm: Any, prompts: list, ignore_eos: bool = True) -> dict[str, Any]:
    """Run `prompts` (BenchPrompt) through `llm` (quantkit.LLM) once; counts and rates of that run."""
    from quantkit import SamplingParams

    tok = llm.tokenizer
    ids = [tok.encode(p.as_text(tok), add_special_tokens=False) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=p.output_len, ignore_eos=ignore_eos) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(ids, params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(i) for i in ids)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "requests": len(prompts),
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }


def format_throughput(r: dict[str, Any]) -> str:
    return (f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tokens_per_s']:.2f} total tokens/s, "
            f"{r['output_tokens_per_s']:.2f} output tokens/s\n"
            f"({r['requests']} requests, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens "
            f"in {r['elapsed_s']:.2f} s)")
