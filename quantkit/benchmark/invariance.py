"""Batch invariance of greedy decoding: the same prompts' greedy tokens under the schedules that used to change them
(bench/batch_invariance.py, tests/serve/test_batch_invariance.py).

    runs = greedy_runs(model, tokenizer, prompts, max_tokens, True, eos_ids, kv_bytes, max_model_len, draft=draft)
    runs["batched"].tokens[i] == runs["alone"].tokens[i]      # what batch invariance promises

Each mode is a fresh engine over the same model (prepared for serving by the first; the engine prepares a model in
place, so a run with the other batch_invariant setting needs its own copy of the model, and of the draft):
  alone        one request at a time, no prefix cache: the reference
  batched      all at once, prompts chunked by a small token budget (chunk_budget), no prefix cache
  prefix_warm  all at once, a second time, on an engine whose prefix cache holds the first pass's blocks
  ngram        all at once, n-gram speculation on every step (no batch-size or acceptance switch-off)
  draft        all at once, the draft model speculating on every step (given a draft)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from quantkit.config import QuantScheme
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import quantize_rtn
from quantkit.serve.config import EngineConfig
from quantkit.serve.engine import LLMEngine
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.validation import validate_request

MODES = ("alone", "batched", "prefix_warm", "ngram", "draft")
ALWAYS_SPECULATE = dict(speculative_disable_by_batch_size=1 << 20, speculative_min_acceptance=0.0)


@dataclass
class Run:
    tokens: list[list[int]]  # per prompt, its greedy output token ids
    stats: dict  # the engine's stats() after the run (prefix-cache hits, drafted and accepted tokens)


def rtn_draft(model: nn.Module, bits: int = 4, group_size: int = 64) -> nn.Module:
    """A copy of an unprepared model whose decoder-layer Linears are RTN-quantized QLinears (the W4 self-draft of
    bench/spec_decode.py, made in memory); the lm_head and embeddings stay as they are."""
    draft = copy.deepcopy(model)
    scheme = QuantScheme(bits=bits, group_size=group_size, sym=False)
    for layer in draft.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    qt = quantize_rtn(child.weight.detach().float(), scheme)
                    bias = None if child.bias is None else child.bias.detach()
                    setattr(parent, name, QLinear.from_qtensor(qt, bias).to(child.weight.dtype))
    return draft.eval()


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, at_once: bool) -> list[list[int]]:
    """Every prompt to completion (all queued together, or each alone after the previous finished) -> token ids."""
    tokens: list[list[int]] = [[] for _ in prompts]
    groups = [range(len(prompts))] if at_once else [[i] for i in range(len(prompts))]
    for group in groups:
        for i in group:  # a finished request's id is free again
            engine.add_request(str(i), validate_request(prompts[i], params, engine.vocab_size, engine.max_model_len,
                                                        engine.cfg.max_num_seqs))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens[int(out.request_id)] = out.outputs[0].token_ids
    return tokens


def greedy_runs(model, tokenizer, prompts: list[list[int]], max_tokens: int, batch_invariant: bool,
                eos_token_ids: list[int], kv_cache_memory: int, max_model_len: int, chunk_budget: int = 64,
                draft=None, modes: tuple[str, ...] = MODES) -> dict[str, Run]:
    """The greedy tokens of `prompts` under each mode (module docstring), engines in model's dtype on its device."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    common = dict(kv_cache_memory=kv_cache_memory, max_model_len=max_model_len, batch_invariant=batch_invariant)

    def engine(draft_model=None, **options) -> LLMEngine:
        return LLMEngine(model, tokenizer, EngineConfig(**common, **options), eos_token_ids, draft_model)

    runs: dict[str, Run] = {}
    for mode in modes:
        if mode == "alone":
            e = engine(enable_prefix_caching=False)
            tokens = run_engine(e, prompts, params, at_once=False)
        elif mode == "batched":
            e = engine(enable_prefix_caching=False, max_num_batched_tokens=chunk_budget)
            tokens = run_engine(e, prompts, params, at_once=True)
        elif mode == "prefix_warm":
            e = engine(enable_prefix_caching=True)
            run_engine(e, prompts, params, at_once=True)
            tokens = run_engine(e, prompts, params, at_once=True)
        elif mode == "ngram":
            e = engine(enable_prefix_caching=False, speculative_method="ngram", **ALWAYS_SPECULATE)
            tokens = run_engine(e, prompts, params, at_once=True)
        elif mode == "draft":
            if draft is None:
                continue
            e = engine(draft, enable_prefix_caching=False, speculative_method="draft",
                       speculative_model="in-memory", **ALWAYS_SPECULATE)
            tokens = run_engine(e, prompts, params, at_once=True)
        else:
            raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
        runs[mode] = Run(tokens, e.stats())
    return runs
