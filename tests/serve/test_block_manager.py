"""BlockManager on tiny pools: exact block ids, ref counts, prefix hits, LRU eviction, forks, atomic failure."""

from __future__ import annotations

from quantkit.serve.block_manager import FREED, BlockManager
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.sequence import Request


def make_seq(tokens, request_id="r"):
    return Request(request_id, list(tokens), SamplingParams(max_tokens=4), None, max_tokens=4).seqs[0]


def test_allocate_and_free_exact_ids():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_seq(range(10)), make_seq(range(100, 105))
    assert bm.allocate(a, 10) and a.block_table == [0, 1, 2]
    assert bm.allocate(b, 5) and b.block_table == [3, 4]
    assert bm.num_free_blocks == 3 and bm.usage == 5 / 8
    a.num_computed_tokens = 10
    assert bm.allocate(a, 2) and a.block_table == [0, 1, 2]  # 12 tokens still fit in 3 blocks
    assert bm.allocate(a, 3) and a.block_table == [0, 1, 2, 5]  # 13..15 need a 4th
    bm.free(a)
    assert a.block_table == [] and bm.ref_counts[:3] == [0, 0, 0]
    assert list(bm.free_ids) == [6, 7, 5, 2, 1, 0]  # tail first
    assert bm.num_used_blocks == 2


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = make_seq(range(12)), make_seq(range(50, 60))
    assert bm.allocate(a, 12)
    before = (list(bm.free_ids), list(bm.ref_counts), dict(bm.cached), bm.prefix_cache_queries)
    assert not bm.allocate(b, 10)
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert (list(bm.free_ids), list(bm.ref_counts), dict(bm.cached), bm.prefix_cache_queries) == before


def test_prefix_hits_share_blocks_and_count_tokens():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(list(range(14)))
    assert bm.lookup_prefix(a) == []
    assert bm.allocate(a, 14)
    bm.cache_full_blocks(a, 14)  # blocks 0..2 are full (12 tokens), block 3 holds 2
    assert bm.cached == {a.block_hashes[i]: i for i in range(3)}
    b = make_seq(list(range(10)) + [99, 98, 97])  # shares 2 full blocks, differs inside the third
    hits = bm.lookup_prefix(b)
    assert hits == [0, 1]
    assert bm.allocate(b, 13 - 8, hits)
    assert b.block_table == [0, 1, 4, 5] and b.num_computed_tokens == 8  # 13 tokens: 4 blocks
    assert bm.ref_counts[:6] == [2, 2, 1, 1, 1, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (14 + 13, 8)


def test_hit_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = make_seq(range(8))
    bm.allocate(a, 8)
    bm.cache_full_blocks(a, 8)
    assert bm.lookup_prefix(make_seq(range(8))) == [0]  # 2 full blocks cached, but the last token must run
    assert bm.lookup_prefix(make_seq(range(9))) == [0, 1]


def test_hash_chain_depends_on_parent():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    bm.cache_full_blocks(a, 5)
    # same second block [3, 4] after a different first block: no hit at all
    assert bm.lookup_prefix(make_seq([9, 9, 3, 4, 5])) == []


def test_lru_eviction_of_unreferenced_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_seq([1, 2, 3, 4, 0], "a"), make_seq([5, 6, 7, 8, 0], "b")
    assert bm.allocate(a, 5) and a.block_table == [0, 1, 2]
    bm.cache_full_blocks(a, 5)
    bm.free(a)  # 0, 1 cached -> LRU (tail first: 1 then 0); 2 (partial) -> free list
    assert list(bm.evictable) == [1, 0] and list(bm.free_ids) == [3, 2]
    assert bm.num_free_blocks == 4
    assert bm.allocate(b, 5) and b.block_table == [3, 2, 1]  # free list first, then the LRU head (block 1)
    assert bm.block_hash[1] is None and list(bm.evictable) == [0]
    c = make_seq([1, 2, 3, 4, 7], "c")
    assert bm.lookup_prefix(c) == [0]  # block 0 ([1, 2]) survived, its child [3, 4] was evicted
    assert bm.allocate(c, 3, [0]) is False  # needs 2 new blocks, only block 0 itself is free
    bm.free(b)
    assert bm.allocate(c, 3, [0]) and c.block_table[0] == 0 and c.num_computed_tokens == 2


def test_revived_block_leaves_lru():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 3])
    bm.allocate(a, 3)
    bm.cache_full_blocks(a, 3)
    bm.free(a)
    b = make_seq([1, 2, 9])
    hits = bm.lookup_prefix(b)
    assert hits == [0] and 0 in bm.evictable
    assert bm.allocate(b, 1, hits)
    assert 0 not in bm.evictable and bm.ref_counts[0] == 1
    # two free blocks remain (1 and 2): only 2 new blocks fit, block 0 is pinned
    assert bm.num_free_blocks == 1


def test_fork_shares_full_blocks_and_copies_partial():
    bm = BlockManager(num_blocks=6, block_size=4)
    parent = make_seq(range(10))
    bm.allocate(parent, 10)
    parent.num_computed_tokens = 10
    child = make_seq(range(10), "child")
    assert bm.fork(parent, child)
    assert child.block_table == [0, 1, 3] and bm.ref_counts[:4] == [2, 2, 1, 1]
    assert bm.take_copies() == [(2, 3)] and bm.take_copies() == []
    bm.free(parent)
    assert bm.ref_counts[:4] == [1, 1, 0, 1]


def test_free_drops_pending_copy_of_freed_destination():
    bm = BlockManager(num_blocks=4, block_size=4)
    parent, child = make_seq(range(6)), make_seq(range(6), "c")
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    assert bm.fork(parent, child)
    bm.free(child)
    assert bm.take_copies() == []


def test_fork_refused_without_a_free_block():
    bm = BlockManager(num_blocks=2, block_size=4)
    parent, child = make_seq(range(6)), make_seq(range(6), "c")
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    assert not bm.fork(parent, child)
    assert child.block_table == [] and bm.ref_counts == [1, 1]


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    bm.cache_full_blocks(a, 5)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.cached == {} and not bm.evictable and bm.num_free_blocks == 4
    assert bm.lookup_prefix(make_seq([1, 2, 3, 4, 5])) == []


def test_block_keys_are_sha256_of_the_parent_key_and_the_tokens():
    import hashlib
    import struct

    from quantkit.serve.block_manager import ROOT_KEY

    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq([5, 6, 7, 8, 9, 10, 11, 12, 13])
    first = hashlib.sha256(ROOT_KEY + struct.pack("=4q", 5, 6, 7, 8)).digest()
    second = hashlib.sha256(first + struct.pack("=4q", 9, 10, 11, 12)).digest()
    assert bm.full_block_hashes(seq) == [first, second]  # the partial third block has no key
    other = make_seq([5, 6, 7, 8, 9, 10, 11, 2**40])  # same first block, a different second
    assert bm.full_block_hashes(other)[0] == first and bm.full_block_hashes(other)[1] != second


def test_a_key_collision_is_not_served_another_prompts_blocks(monkeypatch):
    """Even if two different blocks got one key, the stored tokens are compared before a hit is served."""
    from quantkit.serve import block_manager

    monkeypatch.setattr(block_manager, "block_key", lambda parent, tokens: b"same key for every block")
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq([1, 2, 3, 4, 5])
    assert bm.allocate(a, 5)
    bm.cache_full_blocks(a, 5)
    assert bm.lookup_prefix(make_seq([9, 9, 9, 9, 5])) == []  # colliding key, other tokens: a miss
    assert bm.lookup_prefix(make_seq([1, 2, 3, 4, 6])) == [a.block_table[0]]  # the same tokens still hit


def test_blocks_behind_the_window_are_released_keeping_positions():
    """window 6, blocks of 4: the next query at position p reads p - 5 .. p, so block i goes once 4(i + 1) <= p - 5."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, window=6)
    a = make_seq(range(14))
    assert bm.allocate(a, 14) and a.block_table == [0, 1, 2, 3]
    a.num_computed_tokens = 13
    assert bm.release_outside_window(a) == 2 and a.block_table == [FREED, FREED, 2, 3]  # query 13 reads 8..13
    assert bm.live_blocks(a) == 2 and bm.ref_counts[:2] == [0, 0] and list(bm.free_ids)[-2:] == [0, 1]
    assert bm.release_outside_window(a) == 0
    child = make_seq(range(14), "c")
    assert bm.fork(a, child) and child.block_table[:3] == [FREED, FREED, 2]  # FREED entries are not referenced
    assert bm.ref_counts[2] == 2 and child.num_released_blocks == 2
    assert bm.allocate(a, 4) and a.block_table == [FREED, FREED, 2, 3, 5]  # 4: the child's copy of block 3
    a.num_computed_tokens = 17
    assert bm.release_outside_window(a) == 1 and bm.ref_counts[2] == 1  # still the child's
    bm.free(a)
    bm.free(child)
    assert bm.num_used_blocks == 0 and sorted(bm.free_ids) == list(range(8))


def test_released_cached_blocks_stay_reusable_prefixes():
    bm = BlockManager(num_blocks=8, block_size=4, window=4)
    a = make_seq(range(12))
    assert bm.allocate(a, 12)
    bm.cache_full_blocks(a, 12)
    a.num_computed_tokens = 12
    assert bm.release_outside_window(a) == 2 and list(bm.evictable) == [0, 1]  # cached: to the LRU, KV intact
    b = make_seq(list(range(12)) + [99])
    assert bm.lookup_prefix(b) == [0, 1, 2]
    bm.free(a)
    assert bm.num_used_blocks == 0
