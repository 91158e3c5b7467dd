"""Runs one scheduled step on the model: flat token batch + paged-attention metadata in, logits rows out.

Owns the KV pool (per layer k_cache, v_cache [num_blocks, block_size, Hkv, D], preallocated once from the memory
budget: SERVING.md's capacity formula, serve/capacity.py) and the AttentionBackend. Logits are computed only at
the rows that sample (the last new token of a sequence whose prompt is done; n rows for a request about to
fork) and at prompt positions whose logprobs were asked for.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.serve.attention import AttentionMetadata, TorchPagedAttention, TritonPagedAttention
from quantkit.serve.capacity import capacity_line, kv_bytes_per_token, num_kv_blocks
from quantkit.serve.config import EngineConfig
from quantkit.serve.cpu_attention import load_decode_kernel
from quantkit.serve.cpu_linear import can_pack, pack_linears
from quantkit.serve.scheduler import ScheduledSeq, SchedulerOutput
from quantkit.serve.sequence import Sequence

log = logging.getLogger("quantkit.serve")


@dataclass
class PromptLogprobRows:
    """Logits rows [row, row + count) predict prompt tokens first_token .. first_token + count - 1."""

    seq: Sequence
    row: int
    count: int
    first_token: int


@dataclass
class StepBatch:
    scheduled: list[ScheduledSeq]  # decodes first, then prefill chunks (the token order of input_ids)
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [R]: prompt-logprob rows, then sample rows
    sample_seqs: list[Sequence] = field(default_factory=list)  # per sample row (a forking parent n times)
    sample_generators: list = field(default_factory=list)
    sample_row0: int = 0  # first sample row in the logits
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model, engine_cfg: EngineConfig, device: str, dtype: torch.dtype, max_model_len: int):
        self.model = model
        self.cfg = engine_cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_model_len = max_model_len
        mc = model.config
        self.num_layers, self.num_kv_heads, self.head_dim = mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim
        self.vocab_size = mc.vocab_size
        self.block_size = engine_cfg.block_size
        if can_pack(dtype, self.device):
            log.info("prepacked %d Linear weights for oneDNN (bf16)", pack_linears(model, engine_cfg.max_num_batched_tokens))
        self.bytes_per_token = kv_bytes_per_token(mc, torch.empty((), dtype=dtype).element_size())
        self.num_blocks = self._plan_blocks()
        if self.num_blocks * self.block_size < max_model_len:
            raise QuantkitError(
                f"the KV cache holds {self.num_blocks * self.block_size} tokens, fewer than one sequence of "
                f"max_model_len={max_model_len}: raise --kv-cache-memory (or --gpu-memory-utilization) or lower "
                f"--max-model-len"
            )
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_pool = torch.empty(shape, dtype=dtype, device=self.device)
        if self.device.type == "cpu":
            advise_huge_pages(self.kv_pool)
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(self.num_layers)]
        self.attn = self._backend(self.kv_caches)
        log.info(capacity_line(self.num_blocks, self.block_size, max_model_len))

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _backend(self, kv_caches):
        """cfg.attention_backend: auto (Triton on CUDA fp16/bf16, else torch + the C decode kernel), torch, triton."""
        scale = 1.0 / math.sqrt(self.head_dim)
        choice = self.cfg.attention_backend
        if choice == "triton" or (choice == "auto" and self.device.type == "cuda"
                                  and self.dtype in (torch.float16, torch.bfloat16)):
            return TritonPagedAttention(kv_caches, scale)
        kernel = load_decode_kernel() if choice == "auto" and self.device.type == "cpu" else None
        return TorchPagedAttention(kv_caches, scale, kernel)

    # ---- capacity
    def _plan_blocks(self) -> int:
        """blocks = (budget - weights - activation peak) // (block_size x bytes per token)."""
        if self.cfg.kv_cache_memory is not None:
            return num_kv_blocks(self.cfg.kv_cache_memory, self.block_size, self.bytes_per_token)
        if self.device.type == "cuda":
            peak = self.profile_activation_peak()
            free, total = torch.cuda.mem_get_info(self.device)
            weights = torch.cuda.memory_allocated(self.device)
            budget = total * self.cfg.gpu_memory_utilization - weights - peak
        else:
            import psutil

            available = psutil.virtual_memory().available  # weights are already resident
            budget = min(self.cfg.cpu_kv_cache_max_bytes, self.cfg.cpu_kv_cache_fraction * available)
            budget -= self.activation_bound()
        return num_kv_blocks(budget, self.block_size, self.bytes_per_token)

    def activation_bound(self) -> int:
        """CPU: an upper bound on one step's activations, instead of a profiling forward (a 2048-token prefill
        cost most of the cold start here). Per token, fp32 worst case: residual + normed input + q/k/v + attention
        out + gate/up/act (x 4 bytes); plus the logits of max_num_seqs rows."""
        cfg = self.model.config
        tokens = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        per_token = 3 * cfg.hidden_size + qkv + cfg.num_attention_heads * cfg.head_dim + 3 * cfg.intermediate_size
        rows = min(tokens, self.cfg.max_num_seqs)
        return 4 * (tokens * per_token + 2 * rows * cfg.vocab_size)

    @torch.inference_mode()
    def profile_activation_peak(self) -> int:
        """CUDA: bytes above the allocated set during a forward of max_num_batched_tokens prompt tokens (also warms up)."""
        tokens = min(self.cfg.max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // self.block_size)
        caches = [
            tuple(torch.zeros(blocks, self.block_size, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                              device=self.device) for _ in range(2))
            for _ in range(self.num_layers)
        ]
        attn = self._backend(caches)
        table = torch.arange(blocks, dtype=torch.int32, device=self.device)[None]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens, device=self.device),
            block_tables=table,
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            num_decodes=0, seq_lens_host=[tokens], query_lens_host=[tokens],
        )
        attn.begin_step(meta)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(tokens, device=self.device)
        rows = torch.arange(min(tokens, self.cfg.max_num_seqs), device=self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self.model(ids, positions, attn, rows)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    # ---- one step
    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        """Flatten the scheduled sequences (decodes first) into input ids, positions and attention metadata."""
        order = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)  # stable: decodes keep FCFS order
        bs = self.block_size
        num_decodes = sum(1 for s in order if s.num_new_tokens == 1)
        starts = [s.seq.num_computed_tokens for s in order]
        q_lens = [s.num_new_tokens for s in order]
        seq_lens = [a + b for a, b in zip(starts, q_lens)]
        ids: list[int] = []
        for s, a, b in zip(order, starts, seq_lens):
            toks = s.seq.token_ids
            if b <= len(toks):
                ids.extend(toks[a:b])
            else:  # draft tokens beyond the verified ones
                ids.extend((toks + s.seq.spec_token_ids)[a:b])
        max_blocks = max(len(s.seq.block_table) for s in order)
        tables = np.zeros((len(order), max_blocks), dtype=np.int32)
        for i, s in enumerate(order):
            tables[i, : len(s.seq.block_table)] = s.seq.block_table
        q_lens_np = np.asarray(q_lens, dtype=np.int64)
        qsl = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(q_lens_np, out=qsl[1:])
        seq_index = np.repeat(np.arange(len(order)), q_lens_np)  # [T] which sequence each token belongs to
        positions = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1] - np.asarray(starts, dtype=np.int64), q_lens_np)
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs

        # logits rows: prompt-logprob rows, then sample rows
        rows: list[int] = []
        prompt_rows: list[PromptLogprobRows] = []
        for i, s in enumerate(order):
            seq, req = s.seq, s.seq.request
            if req.prompt_logprobs is None or seq.index != 0:
                continue
            first = max(starts[i], len(req.prompt_logprobs) - 1)  # position p predicts prompt token p + 1
            last = min(seq_lens[i], seq.num_prompt_tokens - 1)
            if last > first:
                prompt_rows.append(PromptLogprobRows(seq, len(rows), last - first, first + 1))
                rows.extend(range(int(qsl[i]) + first - starts[i], int(qsl[i]) + last - starts[i]))
        sample_row0 = len(rows)
        sample_seqs, generators = [], []
        for i, s in enumerate(order):
            seq = s.seq
            if seq_lens[i] < seq.num_tokens + len(seq.spec_token_ids):
                continue  # a prompt chunk that does not reach the end: nothing to sample yet
            req = seq.request
            copies = req.params.n if not req.forked else 1
            for c in range(copies):
                rows.append(int(qsl[i + 1]) - 1)
                sample_seqs.append(seq)
                generators.append(req.generators[c] if (copies > 1 and req.generators) else seq.generator)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            num_decodes=num_decodes, seq_lens_host=seq_lens, query_lens_host=q_lens,
        )
        return StepBatch(
            scheduled=order,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
            sample_seqs=sample_seqs,
            sample_generators=generators,
            sample_row0=sample_row0,
            prompt_rows=prompt_rows,
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch, blocks_to_copy: list[tuple[int, int]]) -> torch.Tensor:
        """-> float32 logits [R, V] at batch.logits_indices (R may be 0)."""
        if blocks_to_copy:
            src = torch.tensor([c[0] for c in blocks_to_copy], device=self.device)
            dst = torch.tensor([c[1] for c in blocks_to_copy], device=self.device)
            self.kv_pool[:, :, dst] = self.kv_pool[:, :, src]
        self.attn.begin_step(batch.meta)
        return self.model(batch.input_ids, batch.positions, self.attn, batch.logits_indices)


def advise_huge_pages(t: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages under a large untouched CPU tensor (fewer TLB misses when the decode
    kernel walks scattered blocks: about 10% faster here); silently nothing elsewhere."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    huge = 1 << 21
    start = (t.data_ptr() + huge - 1) & ~(huge - 1)
    end = t.data_ptr() + t.numel() * t.element_size()
    if end - start >= huge:
        madv_hugepage = 14
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), madv_hugepage)
