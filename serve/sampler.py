"""Turn logits rows into tokens: penalties, min_tokens, greedy / temperature + top-k / top-p / min-p, seeds.

Logprobs come from the model's own distribution (log_softmax of the raw logits, before penalties and
temperature), as vLLM returns them by default. A sample of p is argmax(p / E) with E ~ Exp(1) drawn from the
row's generator (the request's seeded one, else the engine's), so a seeded request samples the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.kernels.cpu.logits import first_argmax
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.structured import mask_rows

NEG_INF = float("-inf")


@dataclass
class SamplerOutput:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # per row, only where params.logprobs is not None
    chosen_logprobs: list[float | None]


def logprob_dicts(logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[dict[int, float]]:
    """logprobs [R, V], chosen [R] -> per row {top-k ids in descending order..., chosen (if not among them)}."""
    kmax = max(ks)
    top_vals, top_ids = (logprobs.topk(kmax, dim=-1) if kmax else (logprobs[:, :0], chosen[:, None][:, :0]))
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    top_vals, top_ids, chosen_ids = top_vals.tolist(), top_ids.tolist(), chosen.tolist()
    out = []
    for i, k in enumerate(ks):
        entry = dict(zip(top_ids[i][:k], top_vals[i][:k]))
        entry.setdefault(chosen_ids[i], chosen_lp[i])
        out.append(entry)
    return out


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[R, V] int32 occurrence counts (padding goes to an extra column that is dropped)."""
    width = max((len(t) for t in token_lists), default=0)
    idx = torch.full((len(token_lists), max(width, 1)), vocab, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        if tokens:
            idx[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.int32)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return counts[:, :vocab].to(device)


def apply_penalties(logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]],
                    params: list[SamplingParams]) -> torch.Tensor:
    """vLLM's rules: repetition penalty on tokens seen in prompt or output (divide positive logits, multiply
    negative ones), frequency (x count) and presence (x seen) penalties on output tokens. logits [R, V]."""
    vocab, device = logits.shape[1], logits.device
    out_counts = _token_counts(outputs, vocab, device)
    seen = (_token_counts(prompts, vocab, device) > 0) | (out_counts > 0)
    rep = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * out_counts - pres * (out_counts > 0)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, top-p (smallest set with mass >= p, at least one token) and min-p masks. logits [R, V]."""
    rows, vocab = logits.shape
    device = logits.device
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], NEG_INF)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], NEG_INF)
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)[:, None]
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), NEG_INF)
    return logits


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V] -> the distribution each row samples from: temperature, then top-k / top-p / min-p."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    return filter_logits(logits / temps[:, None], params).softmax(dim=-1)


class Sampler:
    def __init__(self, eos_token_ids: set[int], seed: int = 0):
        self.eos_token_ids = set(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list, generators: list[torch.Generator | None]) -> SamplerOutput:
        """logits [R, V] float32, one row per sample; seqs[i] the Sequence the row samples for."""
        params = [s.request.params for s in seqs]
        ks = [p.logprobs for p in params]
        raw_logprobs = None
        if any(k is not None for k in ks):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._constrain(logits, seqs, params)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = first_argmax(logits)  # the first maximum, as torch.max (a C kernel on CPU)
        else:
            tokens = self._sample(logits, params, generators, greedy)
        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        chosen: list[float | None] = [None] * len(seqs)
        rows = [i for i, k in enumerate(ks) if k is not None]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            dicts = logprob_dicts(raw_logprobs[index], tokens[index], [ks[i] for i in rows])
            for i, d in zip(rows, dicts):
                logprobs[i] = d
                chosen[i] = d[token_list[i]]
        return SamplerOutput(token_list, logprobs, chosen)

    def _constrain(self, logits: torch.Tensor, seqs: list, params: list[SamplingParams]) -> torch.Tensor:
        """Penalties, min_tokens (EOS / stop ids masked until min_tokens outputs exist), then the grammar mask of
        constrained rows (structured.py). A row none of them applies to is returned bit for bit as it came."""
        pen_rows = [i for i, p in enumerate(params) if p.has_penalties]
        ban_rows = [i for i, (s, p) in enumerate(zip(seqs, params)) if s.num_output_tokens < p.min_tokens]
        guided_rows = [i for i, s in enumerate(seqs) if getattr(s, "matcher", None) is not None]
        if not pen_rows and not ban_rows and not guided_rows:
            return logits
        logits = logits.clone()
        if pen_rows:
            index = torch.tensor(pen_rows, device=logits.device)
            sub = [seqs[i] for i in pen_rows]
            logits[index] = apply_penalties(
                logits[index], [s.token_ids[: s.num_prompt_tokens] for s in sub],
                [s.output_token_ids for s in sub], [params[i] for i in pen_rows],
            )
        for i in ban_rows:
            banned = set(params[i].stop_token_ids) | (set() if params[i].ignore_eos else self.eos_token_ids)
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                logits[i, banned] = NEG_INF
        if guided_rows:
            mask_rows(logits, guided_rows, [seqs[i].matcher for i in guided_rows])
        return logits

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], generators, greedy: list[bool]):
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=logits.device)
            tokens[index] = logits[index].max(dim=-1).indices
        rows = [i for i, g in enumerate(greedy) if not g]
        index = torch.tensor(rows, device=logits.device)
        probs = sampling_probs(logits[index], [params[i] for i in rows])
        noise = torch.empty(probs.shape, dtype=torch.float32)  # on CPU: the generators are CPU generators
        shared = []
        for j, i in enumerate(rows):
            if generators[i] is None:
                shared.append(j)
            else:
                noise[j].exponential_(generator=generators[i])
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1]).exponential_(generator=self.generator)
        tokens[index] = (probs / noise.clamp_min_(1e-30).to(probs.device)).argmax(dim=-1)
        return tokens
