"""Scheduler without a model: token budget, chunked prefill, max_num_seqs, FCFS, preemption, prefix reuse, and a
randomised run that checks no sequence's KV slots are ever overwritten by another."""

from __future__ import annotations

import random

import pytest

from quantkit.serve.block_manager import FREED, BlockManager
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.scheduler import Scheduler
from quantkit.serve.sequence import Request, Sequence, SequenceStatus

SAMPLED = 7


def make_seq(tokens, rid, max_tokens=100):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), None, max_tokens).seqs[0]


def make_scheduler(num_blocks, block_size=4, budget=16, max_seqs=8, caching=False, window=None):
    return Scheduler(BlockManager(num_blocks, block_size, caching, window), budget, max_seqs)


def run_step(sched, kv=None):
    """Play the model: store each computed token in its slot (kv), advance, append a token where one is sampled."""
    out = sched.schedule()
    bs = sched.bm.block_size
    for s in out.scheduled:
        seq = s.seq
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + s.num_new_tokens):
            if kv is not None:
                kv[seq.block_table[pos // bs] * bs + pos % bs] = (seq.token_ids[pos], pos)
        seq.num_computed_tokens += s.num_new_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(SAMPLED)
    return out


def plan(out):
    return [(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_budget_chunks_prefill_and_decodes_go_first():
    sched = make_scheduler(64, budget=16)
    for rid in "abc":
        sched.add(make_seq(range(10), rid))
    assert plan(run_step(sched)) == [("a", 10), ("b", 6)]  # b chunked, c waits
    assert plan(run_step(sched)) == [("a", 1), ("b", 4), ("c", 10)]
    out = run_step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 1)] and out.num_batched_tokens == 3


def test_max_num_seqs():
    sched = make_scheduler(64, budget=100, max_seqs=2)
    seqs = [make_seq(range(5), rid) for rid in "abc"]
    for s in seqs:
        sched.add(s)
    assert plan(run_step(sched)) == [("a", 5), ("b", 5)]
    assert plan(run_step(sched)) == [("a", 1), ("b", 1)]
    sched.remove(seqs[0])
    assert plan(run_step(sched)) == [("b", 1), ("c", 5)]


def test_n_counts_against_max_num_seqs_before_the_fork():
    sched = make_scheduler(64, budget=100, max_seqs=3)
    forked = Request("n3", list(range(5)), SamplingParams(n=3, max_tokens=5), None, 5)
    sched.add(make_seq(range(5), "a"))
    sched.add(forked.seqs[0])
    assert plan(run_step(sched)) == [("a", 5)]  # a + 3 future completions would exceed 3


def test_forked_children_share_blocks_or_wait_at_the_head():
    sched = make_scheduler(4, block_size=4, budget=16)
    request = Request("n4", list(range(6)), SamplingParams(n=4, max_tokens=5), None, 5)
    parent = request.seqs[0]
    sched.add(parent)
    run_step(sched)  # 6 prompt tokens in blocks 0 (full) and 1 (partial); 2 blocks free
    later = make_seq(range(3), "later")
    sched.add(later)
    children = [Sequence(request, i, list(parent.token_ids)) for i in (1, 2, 3)]
    for child in children:
        sched.add_forked(parent, child)
    assert sched.running == [parent, *children[:2]]  # each shares block 0 and copies block 1 into a free one
    assert [c.block_table for c in children[:2]] == [[parent.block_table[0], 2], [parent.block_table[0], 3]]
    assert list(sched.waiting) == [children[2], later] and children[2].block_table == []  # the pool is full


def test_preempts_newest_and_frees_its_blocks():
    sched = make_scheduler(6, block_size=2, budget=100)
    a, b, c = make_seq(range(4), "a"), make_seq(range(10, 14), "b"), make_seq(range(20, 23), "c")
    for s in (a, b, c):
        sched.add(s)
    run_step(sched)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5])
    out = run_step(sched)  # a and b need a 3rd block each: c (newest) goes
    assert [s.request.request_id for s in out.preempted] == ["c"]
    assert plan(out) == [("a", 1), ("b", 1)]
    assert (a.block_table, b.block_table) == ([0, 1, 5], [2, 3, 4])
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.status == SequenceStatus.WAITING
    assert sched.num_preemptions == 1 and c.request.metrics.num_preemptions == 1
    assert list(sched.waiting) == [c]
    sched.remove(a)
    sched.remove(b)
    assert plan(run_step(sched)) == [("c", 4)]  # recompute prompt + the token it had sampled


def test_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(2, block_size=2, budget=100)
    a = make_seq(range(4), "a")
    sched.add(a)
    run_step(sched)
    out = run_step(sched)  # a needs a 3rd block, nobody else to preempt
    assert out.preempted == [a] and out.scheduled == []
    assert list(sched.waiting) == [a]


def test_fcfs_head_is_not_skipped():
    sched = make_scheduler(4, block_size=4, budget=100)
    big, small, later = make_seq(range(12), "big"), make_seq(range(20), "small"), make_seq(range(3), "later")
    sched.add(big)
    run_step(sched)
    sched.add(small)
    sched.add(later)
    out = run_step(sched)  # small needs 5 blocks (only 1 free): later must not jump ahead
    assert plan(out) == [("big", 1)]
    assert list(sched.waiting) == [small, later]


def test_prefix_reuse_skips_cached_tokens():
    sched = make_scheduler(16, block_size=4, budget=100, caching=True)
    a = make_seq(range(11), "a")
    sched.add(a)
    run_step(sched)
    sched.remove(a)
    b = make_seq(list(range(10)) + [42, 43], "b")
    sched.add(b)
    out = run_step(sched)
    assert plan(out) == [("b", 4)]  # blocks [0..3], [4..7] reused, 8.. computed
    assert b.request.metrics.num_cached_prompt_tokens == 8
    assert sched.bm.prefix_cache_hits == 8


@pytest.mark.parametrize("window", [None, 6])
def test_random_load_never_corrupts_and_always_finishes(window):
    """window: blocks behind every sequence's window are released (FREED); what its next query reads is intact."""
    rng = random.Random(0)
    sched = make_scheduler(12, block_size=4, budget=20, max_seqs=6, caching=True, window=window)
    kv: dict[int, tuple[int, int]] = {}
    pending, alive, rid, steps, released = 40, [], 0, 0, False
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    while pending or sched.num_unfinished:
        if pending and rng.random() < 0.5:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            seq = make_seq(tokens, f"r{rid}", max_tokens=rng.randrange(1, 12))
            sched.add(seq)
            alive.append(seq)
            rid, pending = rid + 1, pending - 1
        run_step(sched, kv)
        steps += 1
        assert steps < 5000
        for seq in list(alive):
            if seq.num_output_tokens >= seq.request.max_tokens and seq.status == SequenceStatus.RUNNING:
                sched.remove(seq)
                alive.remove(seq)
        # every running sequence still finds its own tokens in its slots
        refs = [0] * sched.bm.num_blocks
        for seq in sched.running:
            bs = sched.bm.block_size
            first = 0 if window is None else max(0, seq.num_computed_tokens - window + 1)
            for pos in range(first, seq.num_computed_tokens):
                assert kv[seq.block_table[pos // bs] * bs + pos % bs] == (seq.token_ids[pos], pos)
            for b in seq.block_table:
                if b != FREED:
                    refs[b] += 1
            released = released or FREED in seq.block_table
        assert refs == sched.bm.ref_counts
        assert sched.bm.num_free_blocks + sum(1 for r in refs if r) == sched.bm.num_blocks
    assert sched.bm.prefix_cache_hits > 0 and sched.bm.num_used_blocks == 0
    assert (sched.num_preemptions > 0, released) == ((True, False) if window is None else (False, True))  # bounded


def test_drafts_are_scheduled_whole_or_trimmed_never_split():
    sched = make_scheduler(64, budget=100)
    a, b = make_seq(range(5), "a"), make_seq(range(5), "b")
    sched.add(a)
    sched.add(b)
    run_step(sched)
    a.spec_token_ids, b.spec_token_ids = [11, 12, 13], [21, 22, 23]
    sched.max_num_batched_tokens = 6
    out = sched.schedule()
    assert plan(out) == [("a", 4), ("b", 2)]  # a: last token + 3 drafts; b: last token + the 1 draft that fits
    assert b.spec_token_ids == [21]
