"""One scheduling step: a token budget over running sequences first, then waiting ones (FCFS).

Running sequences get their next tokens (1 for a decode, 1 + drafts with speculation, the next chunk for a
prompt still being prefilled); when the pool is short the newest running sequence is preempted (blocks freed,
recomputed later). Waiting sequences then get prefill chunks while the budget, max_num_seqs and the pool allow;
the head of the queue is never skipped. Prefill and decode share the step. For a model whose every layer slides, a
running sequence first hands back the blocks behind its window (BlockManager.release_outside_window), so its live
KV stays bounded however long it runs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from quantkit.serve.block_manager import BlockManager
from quantkit.serve.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens of seq.token_ids (+ spec_token_ids) from num_computed_tokens to compute now


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first; the last one is preempted first
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_forked(self, parent: Sequence, child: Sequence) -> None:
        """A child of a forking parent: running on the parent's computed blocks (a partial last block copied), or
        at the head of the queue to recompute its prompt when no block is free for the copy."""
        if self.bm.fork(parent, child):
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            self.waiting.appendleft(child)

    def remove(self, seq: Sequence) -> None:
        """Finished or aborted: out of the queues, blocks back to the pool now."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.bm.free(seq)

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        """The tokens seq still needs (its drafts included), within budget; drafts that do not fit are dropped
        rather than split, so a sequence with drafts always reaches its last position and samples."""
        pending = seq.num_tokens - seq.num_computed_tokens
        if seq.spec_token_ids and pending + len(seq.spec_token_ids) > budget:
            del seq.spec_token_ids[max(0, budget - pending):]
        return min(pending + len(seq.spec_token_ids), budget)

    def _seq_slots(self, seq: Sequence) -> int:
        """Running slots a waiting sequence takes: a request's first sequence forks into n."""
        return 1 if seq.request.forked else seq.request.params.n

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.reset_for_recompute()
        seq.request.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            self.bm.release_outside_window(seq)  # sliding-window models: blocks behind every layer's window
            num_new = self._num_new_tokens(seq, budget)
            while not self.bm.allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
        if not out.preempted:
            num_slots = sum(self._seq_slots(s) for s in self.running)
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if num_slots + self._seq_slots(seq) > self.max_num_seqs:
                    break
                prefix = []
                if seq.num_computed_tokens == 0 and seq.request.params.prompt_logprobs is None:
                    prefix = self.bm.lookup_prefix(seq)
                num_new = min(seq.num_tokens - len(prefix) * self.bm.block_size, budget)
                if not self.bm.allocate(seq, num_new, prefix):
                    break
                self.bm.release_outside_window(seq)  # prefix hits behind its first query's window
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                num_slots += self._seq_slots(seq)
                metrics = seq.request.metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = time.time()
                    metrics.num_cached_prompt_tokens = len(prefix) * self.bm.block_size
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        for s in out.scheduled:
            self.bm.cache_full_blocks(s.seq, s.seq.num_computed_tokens + s.num_new_tokens)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        out.blocks_to_copy = self.bm.take_copies()
        return out
