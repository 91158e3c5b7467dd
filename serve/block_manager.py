"""The KV block pool in pure Python: free list, reference counts, prefix caching, LRU eviction.

Blocks hold block_size tokens of one sequence's KV (all layers). A full block can be cached under
block_key(parent key, its token ids): SHA-256 over the parent's digest and the tokens, so no crafted prompt can
collide with another request's prefix and be served its KV (Python's hash() of a tuple can be made to collide:
vLLM moved to SHA-256 for the same reason), and a hit is served only when the block's stored tokens equal the
sequence's. A cached block whose ref count drops to 0 stays reusable in an LRU
until its id is needed for new tokens. Free ids = never-cached free blocks + the LRU (oldest evicted first).
Every method either succeeds or leaves the state unchanged.

Bounded KV for sliding windows (window set: every layer of the model slides, model_runner.kv_window): as a sequence
advances, release_outside_window drops its reference to each leading block that lies wholly before the window of its
next query (positions < num_computed_tokens - window + 1); the table keeps its positions, the entry becomes FREED,
which no kernel reads (the masked torch path gathers only a window's positions; the whole-cache kernels and Triton
never serve such a model). Dropping a reference is what free() does, so prefix caching and forks stay correct: a
block shared with a fork or another request stays live for them, and a cached block goes to the LRU with its KV
intact (a later request may still hit it). A model with any global layer (Gemma 2/3, Qwen2/3 with
max_window_layers) keeps every block: window is None.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from quantkit.serve.sequence import Sequence

ROOT_KEY = b"quantkit-prefix-v1"
FREED = -1  # a block-table entry whose block was released behind the sliding window (never read)


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """SHA-256 digest (32 bytes) of the parent block's key and this block's token ids (int64, native order)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        """window: every layer attends to at most this many tokens (release_outside_window), or None."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # of each cached block
        self.free_ids: deque[int] = deque(range(num_blocks))  # ref 0, not cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached; least recently used first
        self.cached: dict[bytes, int] = {}  # block key -> block id
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) KV copies to run before the next forward
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found in the cache

    # ---- state
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache
    def full_block_hashes(self, seq: Sequence) -> list[bytes]:
        """Keys of every full block of seq.token_ids (extends seq.block_hashes incrementally)."""
        bs, hashes, tokens = self.block_size, seq.block_hashes, seq.token_ids
        parent = hashes[-1] if hashes else ROOT_KEY
        for i in range(len(hashes), len(tokens) // bs):
            parent = block_key(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached block ids holding seq's leading full blocks; at least one token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        for i, h in enumerate(self.full_block_hashes(seq)[:max_blocks]):
            block_id = self.cached.get(h)
            if block_id is None or self.block_tokens[block_id] != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Offer seq's blocks fully covered by token_ids[:num_tokens] (known, KV written this step) to the cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self.full_block_hashes(seq)
        for i in range(seq.num_cached_blocks, num_full):
            block_id, h = seq.block_table[i], hashes[i]
            if block_id != FREED and self.block_hash[block_id] is None and h not in self.cached:
                self.block_hash[block_id] = h
                self.block_tokens[block_id] = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                self.cached[h] = block_id
        seq.num_cached_blocks = num_full

    # ---- allocation
    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_blocks: list[int] = ()) -> bool:
        """Blocks so seq's table covers num_computed (+ the prefix hits) + num_new_tokens tokens.

        prefix_blocks: from lookup_prefix, only for a sequence with nothing computed; they become the head of
        its table and num_computed_tokens moves past them. False (and no change) when the pool is short.
        """
        num_computed = seq.num_computed_tokens + len(prefix_blocks) * self.block_size
        need = self.blocks_for(num_computed + num_new_tokens) - len(seq.block_table) - len(prefix_blocks)
        revived = sum(1 for b in prefix_blocks if self.ref_counts[b] == 0)
        if need > self.num_free_blocks - revived:
            return False
        if prefix_blocks or seq.num_computed_tokens == 0 and self.enable_prefix_caching and not seq.block_table:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(prefix_blocks) * self.block_size
        for b in prefix_blocks:
            if self.ref_counts[b] == 0:
                del self.evictable[b]
            self.ref_counts[b] += 1
        seq.block_table.extend(prefix_blocks)
        seq.num_computed_tokens = num_computed
        seq.num_cached_blocks = max(seq.num_cached_blocks, len(prefix_blocks))
        for _ in range(max(0, need)):
            seq.block_table.append(self._take_free())
        return True

    def _uncache(self, block_id: int) -> None:
        del self.cached[self.block_hash[block_id]]
        self.block_hash[block_id] = self.block_tokens[block_id] = None

    def _take_free(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            self._uncache(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        """Drop one reference to block_id (nothing for FREED)."""
        if block_id == FREED:
            return
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hash[block_id] is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)
                self.pending_copies = [c for c in self.pending_copies if c[1] != block_id]

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; tail blocks first so they are evicted first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = seq.num_released_blocks = 0

    def release_outside_window(self, seq: Sequence) -> int:
        """With a window: drop seq's references to the blocks no query from position num_computed_tokens on can
        see (their entries become FREED; positions of the others unchanged). -> blocks released."""
        if self.window is None:
            return 0
        end = min(max(0, seq.num_computed_tokens - self.window + 1) // self.block_size, len(seq.block_table))
        released = 0
        for i in range(seq.num_released_blocks, end):
            if seq.block_table[i] != FREED:
                self._release(seq.block_table[i])
                seq.block_table[i] = FREED
                released += 1
        seq.num_released_blocks = max(seq.num_released_blocks, end)
        return released

    def live_blocks(self, seq: Sequence) -> int:
        """Blocks of seq's table it still holds (not FREED)."""
        return sum(1 for b in seq.block_table if b != FREED)

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """child shares parent's full blocks; a partial last block is copied (queued in pending_copies).

        False (no change) when no block is free for the copy.
        """
        num_full = parent.num_computed_tokens // self.block_size
        partial = len(parent.block_table) > num_full
        if partial and not self.num_free_blocks:
            return False
        for block_id in parent.block_table[:num_full]:
            if block_id != FREED:  # released behind the window: the child (same position) needs it no more
                self.ref_counts[block_id] += 1
        child.block_table = parent.block_table[:num_full]
        child.num_released_blocks = min(parent.num_released_blocks, num_full)
        if partial:
            dst = self._take_free()
            self.pending_copies.append((parent.block_table[num_full], dst))
            child.block_table.append(dst)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_blocks = min(parent.num_cached_blocks, num_full)
        child.block_hashes = list(parent.block_hashes[:num_full])
        return True

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every cached block with ref count 0 (they become plain free blocks)."""
        for block_id in self.evictable:
            self._uncache(block_id)
            self.free_ids.append(block_id)
        self.evictable.clear()
