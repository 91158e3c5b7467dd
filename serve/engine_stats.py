"""The engine's counters and gauges: what LLMEngine.stats() returns (the /metrics endpoint reads it) and the
periodic log line.

Counters are cumulative over the engine's life. The postprocessor counts tokens and finished requests as they
happen; record_step counts the step itself and, every KV_SAMPLE_EVERY steps with sequences running, samples the
KV slot utilisation (the fraction of slots in allocated blocks that hold a real token's KV).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque

from quantkit.serve.block_manager import FREED, BlockManager
from quantkit.serve.scheduler import Scheduler
from quantkit.serve.speculative import Speculator, spec_stats

log = logging.getLogger("quantkit.serve")

KV_SAMPLE_EVERY = 4  # steps between samples of the KV slot utilisation


class EngineStats:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, speculator: Speculator | None,
                 capacity_tokens: int, log_interval: float):
        self.scheduler, self.block_manager, self.speculator = scheduler, block_manager, speculator
        self.capacity_tokens = capacity_tokens
        self.log_interval = log_interval  # seconds between log lines
        self.num_steps = 0
        self.prompt_tokens = 0  # prompt tokens of requests that produced a first token
        self.generation_tokens = 0
        self.computed_tokens = 0  # tokens run through the model (prefill chunks, recompute, decodes)
        self.request_success: Counter[str] = Counter()  # finish reason (a SequenceStatus value, "abort") -> count
        self.kv_slot_samples: deque[float] = deque(maxlen=1024)  # the most recent samples
        self.kv_slot_total = [0.0, 0, 1.0]  # sum, count, min over every sample of the engine's life
        self._last_log = (time.time(), 0, 0)  # time, generation_tokens, computed_tokens at the last log line

    def record_step(self, num_batched_tokens: int) -> None:
        """After a step that ran num_batched_tokens through the model (and settled its outputs)."""
        self.computed_tokens += num_batched_tokens
        self.num_steps += 1
        if self.num_steps % KV_SAMPLE_EVERY == 0 and self.scheduler.running:
            sample = self.kv_slot_utilization()
            self.kv_slot_samples.append(sample)
            total = self.kv_slot_total
            total[0], total[1], total[2] = total[0] + sample, total[1] + 1, min(total[2], sample)

    def kv_slot_utilization(self) -> float:
        """Fraction of slots in allocated blocks that hold a real token's KV (shared blocks counted once)."""
        bs = self.block_manager.block_size
        full: set[int] = set()
        partial = 0
        for seq in self.scheduler.running:
            n_full, rest = divmod(seq.num_computed_tokens, bs)
            full.update(b for b in seq.block_table[:n_full] if b != FREED)  # released behind a window
            partial += rest
        used = self.block_manager.num_used_blocks
        return (len(full) * bs + partial) / (used * bs) if used else 1.0

    def snapshot(self) -> dict:
        """Gauges and cumulative counters (metric names of SERVING.md, without the prefix)."""
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = {s.request.request_id for s in self.scheduler.waiting} - running
        bm = self.block_manager
        slot_sum, slot_count, slot_min = self.kv_slot_total
        return {
            "num_requests_running": len(running),
            "num_requests_waiting": len(waiting),
            "kv_cache_usage_perc": bm.usage,
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_num_blocks": bm.num_blocks,
            "kv_used_blocks": bm.num_used_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "computed_tokens": self.computed_tokens,
            "num_steps": self.num_steps,
            "request_success": dict(self.request_success),
            "kv_slot_utilization_mean": slot_sum / slot_count if slot_count else None,
            "kv_slot_utilization_min": slot_min if slot_count else None,
            "kv_slot_utilization_samples": slot_count,
            **spec_stats(self.speculator),
        }

    def maybe_log(self) -> None:
        """One info line of throughput and state when log_interval has passed since the last one."""
        now = time.time()
        last_time, last_gen, last_computed = self._last_log
        if now - last_time < self.log_interval:
            return
        s = self.snapshot()
        span = now - last_time
        hit_rate = s["prefix_cache_hits"] / s["prefix_cache_queries"] if s["prefix_cache_queries"] else 0.0
        drafted = s["spec_decode_num_draft_tokens"]
        spec = f", draft acceptance {100 * s['spec_decode_num_accepted_tokens'] / drafted:.1f}%" if drafted else ""
        log.info(
            "engine: %.1f gen tok/s, %.1f computed tok/s, running %d, waiting %d, KV usage %.1f%%, "
            "prefix hit rate %.1f%%, preemptions %d%s",
            (self.generation_tokens - last_gen) / span, (self.computed_tokens - last_computed) / span,
            s["num_requests_running"], s["num_requests_waiting"], 100 * s["kv_cache_usage_perc"], 100 * hit_rate,
            s["num_preemptions"], spec,
        )
        self._last_log = (now, self.generation_tokens, self.computed_tokens)
