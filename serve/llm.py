"""The offline API on the serving engine: `LLM(model).generate(prompts, params) -> list[RequestOutput]`."""

from __future__ import annotations

import itertools
import json
from dataclasses import fields

from quantkit.errors import QuantkitError
from quantkit.serve.config import EngineConfig
from quantkit.serve.engine import LLMEngine
from quantkit.serve.outputs import RequestOutput
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.validation import validate_request

ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


def eos_token_ids(tokenizer, folder) -> list[int]:
    """The tokenizer's EOS plus generation_config.json's eos_token_id(s) (what transformers' generate stops on)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    path = folder / "generation_config.json" if folder is not None else None
    if path is not None and path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def build_engine(model=None, **engine_kwargs) -> LLMEngine:
    """Load `model` (None = the bundled default, a path, a hub id, or a loaded `Loaded`) and build its engine.

    engine_kwargs: EngineConfig fields; dtype "auto" = bfloat16 on CPU, the checkpoint's half type on CUDA.
    With tensor_parallel_size N > 1 this process becomes rank 0 and starts N - 1 workers (serve/tp_group.py), each
    loading its shard of `model` (a path or hub id then, not a Loaded).
    """
    from quantkit.models.loader import Loaded, load_model, read_config, resolve

    unknown = set(engine_kwargs) - ENGINE_FIELDS
    if unknown:
        raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
    cfg = EngineConfig(**engine_kwargs)
    tp = None
    if isinstance(model, Loaded):
        if cfg.tensor_parallel_size > 1:
            raise QuantkitError("tensor_parallel_size > 1 needs the model's path or hub id (every rank loads its own "
                                "shard), not a loaded model")
        loaded = model
    else:
        folder, _ = resolve(model)
        hf = read_config(folder)
        dtype = cfg.resolved_dtype(hf.get("torch_dtype") or hf.get("dtype"))
        if cfg.tensor_parallel_size > 1:
            from quantkit.serve.tp_group import start_rank0

            tp, loaded = start_rank0(model, hf, cfg, dtype)
        else:
            loaded = load_model(model, dtype=dtype, device=cfg.resolved_device())
    draft = None
    if cfg.speculative_model is not None:
        draft = load_model(cfg.speculative_model, dtype=next(loaded.model.parameters()).dtype,
                           device=cfg.resolved_device()).model
    try:
        engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, eos_token_ids(loaded.tokenizer, loaded.path), draft,
                           tensor_parallel=tp)
    except BaseException:
        if tp is not None:
            tp.abort("rank 0 failed to build its engine")
        raise
    engine.loaded = loaded
    return engine


class LLM:
    """LLM(model=None (the bundled default) | path | hub id | Loaded, **EngineConfig fields)."""

    def __init__(self, model=None, **engine_kwargs):
        self.engine = build_engine(model, **engine_kwargs)
        self.loaded = self.engine.loaded
        self.tokenizer = self.loaded.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. InvalidRequest (a ValueError) for a bad one,
        before any runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        requests = [validate_request(self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt, p,
                                     engine.vocab_size, engine.max_model_len, engine.cfg.max_num_seqs)
                    for prompt, p in zip(prompts, params)]
        order = []
        for prompt, request in zip(prompts, requests):
            rid = f"offline-{next(self._ids)}"
            engine.add_request(rid, request, prompt=prompt if isinstance(prompt, str) else None)
            order.append(rid)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(order):
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in order]

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (this LLM cannot generate afterwards)."""
        if self.engine.tensor_parallel is not None:
            self.engine.tensor_parallel.close()
