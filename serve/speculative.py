"""Speculative decoding inside the engine's step (the acceptance rule itself is in spec_decode.py).

    speculator.propose(running)     # before scheduling: drafts -> seq.spec_token_ids (and seq.spec_probs)
    scheduler.schedule()            # a sequence with d drafts gets 1 + d new tokens (drafts dropped, not split,
                                    #   when the budget is short); the runner returns its d + 1 logits rows
    speculator.verify(seq, rows)    # after the forward: the emitted tokens (1..d+1); the engine appends them
                                    #   and rolls num_computed_tokens back past the rejected drafts

KV rollback is free: a rejected draft's KV sits in slots past num_computed_tokens and is overwritten by the next
step. The draft model keeps its own KV pool indexed by the target's block tables (same block ids, same
num_blocks), so it needs no block manager of its own; seq.draft_computed says how much of it is valid.

Speculation is skipped for a step when more than `speculative_disable_by_batch_size` sequences are decoding
(the verification pass then costs more than it saves: bench/spec_decode.py measures where), and for a sequence
whose acceptance rate stays below `speculative_min_acceptance` after MIN_EVIDENCE draft tokens. Sequences with
penalties or an unmet min_tokens are not speculated (their logits depend on the tokens being drafted).

Constrained sequences (structured output, seq.matcher) are speculated under their grammar (structured.py): the
n-gram proposer keeps only the drafts the grammar accepts, the draft model samples each draft from its own masked
distribution, and verify masks target row i by the grammar after drafts[:i] (mask_drafts). Greedy acceptance is
then the masked argmax, and rejection sampling runs on the masked p and q: the emitted tokens have exactly the
distribution of the masked, non-speculative sampler. The postprocessor advances the matcher by the emitted tokens.
"""

from __future__ import annotations

from collections import Counter

import torch

from quantkit.serve.config import EngineConfig
from quantkit.serve.model_runner import ModelRunner
from quantkit.serve.sampler import sampling_probs
from quantkit.serve.sequence import Sequence
from quantkit.serve.spec_decode import ngram_propose, verify_greedy, verify_sampled
from quantkit.serve.structured import mask_drafts, mask_rows

MIN_EVIDENCE = 16  # draft tokens of a sequence before its acceptance rate may switch speculation off


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """logits [R, V], all rows under one request's params -> the distribution the sampler draws from."""
    return sampling_probs(logits, [params] * logits.shape[0])


def is_decoding(seq: Sequence) -> bool:
    """The prompt is done and only the last token's KV is missing: the step computes one token (or drafts)."""
    return seq.num_computed_tokens == seq.num_tokens - 1


class NgramProposer:
    """Prompt lookup: drafts are what followed the latest earlier occurrence of the last n tokens (no model)."""

    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], ks: list[int], generator: torch.Generator) -> None:
        for seq, k in zip(seqs, ks):
            drafts = ngram_propose(seq.token_ids, k, self.max_n, self.min_n)
            if seq.matcher is not None:  # a draft the grammar refuses would be rejected: do not verify it
                del drafts[seq.matcher.valid_prefix(drafts):]
            seq.spec_token_ids = drafts
            seq.spec_probs = None


class DraftModelProposer:
    """A smaller (or quantized) model with the same vocabulary drafts k tokens autoregressively, batched over
    the sequences: catch up its KV (chunks within the token budget), then k single-token rounds. A constrained
    sequence's rows are masked by its grammar each round (the matcher walks the drafts, then rolls back), and its
    drafting stops early where the grammar terminates."""

    def __init__(self, runner: ModelRunner, block_manager, max_num_batched_tokens: int):
        self.runner = runner  # the draft model's runner: num_blocks equal to the target's
        self.bm = block_manager
        self.budget = max_num_batched_tokens

    def propose(self, seqs: list[Sequence], ks: list[int], generator: torch.Generator) -> None:
        # blocks for every slot the draft writes (positions < num_tokens + k - 1) and the target will verify
        ready = [(s, k) for s, k in zip(seqs, ks) if self.bm.allocate(s, 1 + k)]
        if not ready:
            return
        seqs, ks = [s for s, _ in ready], [k for _, k in ready]
        self._catch_up(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        feeds = [([s.token_ids[-1]], s.num_tokens - 1, s.block_table) for s in seqs]
        while active:
            logits = self.runner.last_logits(feeds)  # [len(active), V]
            guided = [row for row, i in enumerate(active) if seqs[i].matcher is not None]
            if guided:  # each matcher stands after its sequence's drafts so far
                logits = logits.clone()
                mask_rows(logits, guided, [seqs[active[row]].matcher for row in guided])
            still, feeds = [], []
            for row, i in enumerate(active):
                seq = seqs[i]
                params = seq.request.params
                if params.greedy:
                    token = int(logits[row].argmax())
                else:
                    q = target_probs(logits[row : row + 1], params)[0]
                    token = int(torch.multinomial(q.cpu(), 1, generator=seq.generator or generator))
                    probs[i].append(q)
                drafts[i].append(token)
                # the grammar refuses a masked token only when the mask left nothing; verify rejects it then
                grammar_open = seq.matcher is None or (seq.matcher.draft(token) and not seq.matcher.terminated)
                if len(drafts[i]) < ks[i] and grammar_open:
                    still.append(i)
                    feeds.append(([token], seq.num_tokens + len(drafts[i]) - 1, seq.block_table))
            active = still
        for i, seq in enumerate(seqs):
            if seq.matcher is not None:
                seq.matcher.undo_drafts()
            seq.spec_token_ids = drafts[i]
            seq.spec_probs = torch.stack(probs[i]) if probs[i] else None
            seq.draft_computed = seq.num_tokens + len(drafts[i]) - 1  # the last draft's KV is not written

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """Write the draft KV of token_ids[draft_computed : num_tokens - 1] (a prompt, or last step's accepted
        tokens), in forwards of at most `budget` tokens."""
        pending = [s for s in seqs if s.draft_computed < s.num_tokens - 1]
        while pending:
            feeds, room = [], self.budget
            for seq in pending:
                take = min(seq.num_tokens - 1 - seq.draft_computed, room)
                if take <= 0:
                    break
                start = seq.draft_computed
                feeds.append((seq.token_ids[start : start + take], start, seq.block_table))
                seq.draft_computed += take
                room -= take
            self.runner.last_logits(feeds, sample=False)
            pending = [s for s in pending if s.draft_computed < s.num_tokens - 1]


class Speculator:
    def __init__(self, cfg: EngineConfig, proposer, max_model_len: int):
        self.cfg = cfg
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.generator = torch.Generator().manual_seed(cfg.seed + 1)
        self.num_drafts = 0  # sequence-steps that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: Counter[int] = Counter()  # draft index -> times accepted

    def eligible(self, seq: Sequence) -> bool:
        params = seq.request.params
        return (not seq.spec_off and seq.request.forked and not params.has_penalties
                and seq.num_output_tokens >= params.min_tokens and is_decoding(seq))

    def propose(self, running: list[Sequence]) -> None:
        decoding = sum(1 for s in running if is_decoding(s))
        if decoding > self.cfg.speculative_disable_by_batch_size:
            return
        seqs, ks = [], []
        for seq in running:
            if not self.eligible(seq):
                continue
            # never draft past what the request may still emit (the verify step adds one token of its own)
            k = min(self.cfg.num_speculative_tokens, seq.request.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if seqs:
            self.proposer.propose(seqs, ks, self.generator)

    def verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        """logits [d + 1, V] of the target at the last real token and each of the d drafts -> emitted tokens;
        clears the drafts and records acceptance."""
        drafts, q = seq.spec_token_ids, seq.spec_probs
        seq.spec_token_ids, seq.spec_probs = [], None
        params = seq.request.params
        if seq.matcher is not None:
            logits = mask_drafts(logits, seq.matcher, drafts)
        if params.greedy:
            emitted = verify_greedy(logits.max(dim=-1).indices.tolist(), drafts)  # the sampler's tie rule
        else:
            emitted = verify_sampled(target_probs(logits, params), drafts, q, seq.generator or self.generator)
        accepted = len(emitted) - 1
        seq.draft_computed = min(seq.draft_computed, seq.num_tokens + accepted)
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        self.accepted_per_position.update(range(accepted))
        seq.spec_drafted += len(drafts)
        seq.spec_accepted += accepted
        poor = seq.spec_accepted < self.cfg.speculative_min_acceptance * seq.spec_drafted
        if seq.spec_drafted >= MIN_EVIDENCE and poor:
            seq.spec_off = True
        return emitted


def spec_stats(speculator: Speculator | None) -> dict:
    """The engine's speculative-decoding counters (zeros when speculation is off)."""
    s = speculator
    return {
        "spec_decode_num_drafts": s.num_drafts if s else 0,
        "spec_decode_num_draft_tokens": s.num_draft_tokens if s else 0,
        "spec_decode_num_accepted_tokens": s.num_accepted_tokens if s else 0,
        "spec_decode_accepted_per_position": dict(sorted(s.accepted_per_position.items())) if s else {},
    }


def build_speculator(cfg: EngineConfig, target_runner: ModelRunner, block_manager, max_model_len: int,
                     draft_model=None) -> Speculator | None:
    """The engine's Speculator for cfg.speculative_method (None when speculation is off)."""
    method = cfg.speculative_method
    if method is None:
        return None
    if method == "ngram":
        proposer = NgramProposer(cfg.ngram_prompt_lookup_max, cfg.ngram_prompt_lookup_min)
    else:
        runner = ModelRunner(draft_model, cfg, str(target_runner.device), target_runner.dtype, max_model_len,
                             num_blocks=target_runner.num_blocks)
        proposer = DraftModelProposer(runner, block_manager, cfg.max_num_batched_tokens)
    return Speculator(cfg, proposer, max_model_len)
