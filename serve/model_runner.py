"""Runs one scheduled step on the model: flat token batch + paged-attention metadata in, logits rows out.

Owns the KV pool (per layer k_cache, v_cache [num_blocks, block_size, Hkv, D], preallocated once from the memory
budget: SERVING.md's capacity formula, serve/capacity.py) and the AttentionBackend. Logits are computed only at
the rows that sample (the last new token of a sequence whose prompt is done; n rows for a request about to
fork) and at prompt positions whose logprobs were asked for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.models.attention import kv_window, unsupported_by_paged_attention
from quantkit.serve.attention import AttentionMetadata, TorchPagedAttention, TritonPagedAttention
from quantkit.serve.capacity import capacity_line, kv_bytes_per_token, num_kv_blocks
from quantkit.serve.config import EngineConfig
from quantkit.serve.cpu_step_plans import Plans, unsupported as unsupported_by_plans
from quantkit.serve.cpu_threads import ThreadGovernor
from quantkit.serve.cuda_graphs import DecodeGraphs, decode_graphs_wanted
from quantkit.kernels.cpu.paged_decode import load_decode_kernel, load_rows_kernel
from quantkit.kernels.cpu.paged_prefill import load_prefill_kernel
from quantkit.serve.prepare import batch_invariant_mode, prepare_model
from quantkit.serve.scheduler import ScheduledSeq, SchedulerOutput
from quantkit.serve.sequence import Sequence

log = logging.getLogger("quantkit.serve")


class FatalStepError(RuntimeError):
    """A step failure no later step can recover from (a tensor-parallel rank died: serve/tp_runner.py):
    LLMEngine.guarded_step raises it at once, and the engine stops."""


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
    logits_indices: torch.Tensor  # int64 [R]: prompt-logprob rows, sample rows, then draft-verifying rows
    sample_seqs: list[Sequence] = field(default_factory=list)  # per sample row (a forking parent n times)
    sample_generators: list = field(default_factory=list)
    sample_row0: int = 0  # first sample row in the logits
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    spec_rows: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, first of its k + 1 rows), last

    @property
    def spec_row0(self) -> int:
        return self.sample_row0 + len(self.sample_seqs)

    def plain_decodes(self) -> int | None:
        """n when each of the n scheduled sequences decodes one token into one sample row (logits rows = tokens
        0..n-1: no prefill chunk, prompt logprobs, fork or draft verify), else None: the steps the decode paths of
        serve/cuda_graphs.py and serve/cpu_step_plans.py take."""
        n = len(self.scheduled)
        if self.meta.num_decodes != n or self.prompt_rows or self.spec_rows or len(self.sample_seqs) != n:
            return None
        if any(row_seq is not s.seq for row_seq, s in zip(self.sample_seqs, self.scheduled)):
            return None  # a fork's n rows of one sequence, and a sequence without a row
        return n


class ModelRunner:
    kv_share = 1  # ranks whose pools split one memory budget (tensor parallelism: serve/tp_runner.py)

    def __init__(self, model, engine_cfg: EngineConfig, device: str, dtype: torch.dtype, max_model_len: int,
                 num_blocks: int | None = None, shared_kv_bytes_per_token: int = 0):
        """num_blocks: a pool of exactly this size (a draft model's pool mirrors the target's block ids);
        shared_kv_bytes_per_token: another pool of num_blocks (the draft's) shares the memory budget."""
        self.model = model
        self.cfg = engine_cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_model_len = max_model_len
        for rotary in model.rotaries():  # one RoPE per position for a sequence's life (longrope: vLLM's choice)
            rotary.settle(max_model_len)
        unsupported = unsupported_by_paged_attention(model)
        if unsupported is not None:  # refused at startup: never wrong output
            raise QuantkitError(f"cannot serve this model: {unsupported}")
        # tokens of KV a sequence keeps behind its next query (every layer slides), or None: all of it
        self.kv_window = kv_window(model.attention_specs)
        mc = model.config
        self.num_layers, self.num_kv_heads, self.head_dim = mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim
        self.vocab_size = mc.vocab_size
        self.block_size = engine_cfg.block_size
        self.batch_invariant = batch_invariant_mode(engine_cfg.batch_invariant, self.device, dtype,
                                                    engine_cfg.attention_backend == "auto")
        self.fused_ops = prepare_model(model, self.device, dtype, engine_cfg.max_num_batched_tokens,
                                       fused_ops=engine_cfg.attention_backend == "auto",
                                       batch_invariant=self.batch_invariant)
        self.bytes_per_token = kv_bytes_per_token(mc, torch.empty((), dtype=dtype).element_size())
        self.num_blocks = num_blocks or self._plan_blocks(self.bytes_per_token + shared_kv_bytes_per_token)
        if self.num_blocks * self.block_size < max_model_len:
            raise QuantkitError(
                f"the KV cache holds {self.num_blocks * self.block_size} tokens, fewer than one sequence of "
                f"max_model_len={max_model_len}: raise --kv-cache-memory (or --gpu-memory-utilization) or lower "
                f"--max-model-len"
            )
        self._allocate_kv(padding_block=decode_graphs_wanted(self))
        self.threads = ThreadGovernor.for_device(self.device)  # CPU: threads to the cores others leave free
        log.info(capacity_line(self.num_blocks, self.block_size, max_model_len))

    def _allocate_kv(self, padding_block: bool) -> None:
        """The KV pool [layers, 2, num_blocks (+ 1: the padding block), block_size, Hkv, D] and the attention
        backend over it; with the padding block, self.graphs runs decode steps bucketed (serve/cuda_graphs.py)."""
        shape = (self.num_layers, 2, self.num_blocks + int(padding_block), self.block_size, self.num_kv_heads,
                 self.head_dim)
        self.kv_pool = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(self.num_layers)]
        if self.device.type == "cpu":
            for cache in (c for pair in self.kv_caches for c in pair):  # the low block ids of every cache
                prefault(cache, PREFAULT_BYTES // (2 * self.num_layers))
        self.attn = self._backend(self.kv_caches)
        capture = self.device.type == "cuda" and self.cfg.cuda_graphs
        self.graphs = DecodeGraphs(self, capture) if padding_block else None
        self.plans = self._step_plans()  # recorded over this pool's caches

    def use_padded_decode(self) -> None:
        """Run decode-only steps through DecodeGraphs' padded buffers from now on (on CPU eagerly: what the tests
        of its input path run). Only before the first step: the KV pool is allocated anew, with the padding block."""
        if self.graphs is None:
            self._allocate_kv(padding_block=True)

    def _step_plans(self) -> Plans | None:
        """Decode steps as recorded C kernel calls (serve/cpu_step_plans.py) when cfg.cpu_step_plans and the model
        is one they cover (else logged once: every step runs eagerly)."""
        if not self.cfg.cpu_step_plans or self.device.type != "cpu":
            return None
        reason = unsupported_by_plans(self)
        if reason is not None:
            log.info("decode step plans off: %s; decode steps run eagerly", reason)
            return None
        return Plans(self)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _backend_kind(self) -> str:
        """cfg.attention_backend: auto (Triton on CUDA fp16/bf16, else torch + the C decode kernel), torch, triton."""
        choice = self.cfg.attention_backend
        if choice == "triton" or (choice == "auto" and self.device.type == "cuda"
                                  and self.dtype in (torch.float16, torch.bfloat16)):
            return "triton"
        return "torch"

    def _backend(self, kv_caches):
        """The backend honours every layer's AttentionSpec (model.attention_specs: scale, window, soft-cap)."""
        specs = self.model.attention_specs
        if self._backend_kind() == "triton":
            return TritonPagedAttention(kv_caches, specs, self.cfg.max_num_seqs, self.model.config.num_attention_heads)
        native = self.cfg.attention_backend == "auto" and self.device.type == "cpu"
        return TorchPagedAttention(kv_caches, specs, load_decode_kernel() if native else None, self.fused_ops,
                                   load_prefill_kernel() if native else None,
                                   load_rows_kernel() if self.batch_invariant else None)

    # ---- capacity
    def _plan_blocks(self, bytes_per_token: int) -> int:
        """blocks = (budget - weights - activation peak) // (block_size x bytes per token)."""
        if self.cfg.kv_cache_memory is not None:
            return num_kv_blocks(self.cfg.kv_cache_memory // self.kv_share, self.block_size, bytes_per_token)
        if self.device.type == "cuda":
            peak = self.profile_activation_peak()
            free, total = torch.cuda.mem_get_info(self.device)
            weights = torch.cuda.memory_allocated(self.device)
            budget = total * self.cfg.gpu_memory_utilization - weights - peak
        else:
            import psutil

            available = psutil.virtual_memory().available  # weights are already resident
            budget = min(self.cfg.cpu_kv_cache_max_bytes, self.cfg.cpu_kv_cache_fraction * available)
            budget = budget / self.kv_share - self.activation_bound()  # this rank's share
        return num_kv_blocks(budget, self.block_size, bytes_per_token)

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
    def flatten(self, feeds: list[tuple[list[int], int, list[int]]]):
        """feeds: per sequence (token ids to run, position of the first, block table), single-token feeds first.
        -> (input_ids [T], positions [T], AttentionMetadata, query_start_loc np.int64 [S + 1])."""
        bs = self.block_size
        starts = [f[1] for f in feeds]
        q_lens = [len(f[0]) for f in feeds]
        seq_lens = [a + b for a, b in zip(starts, q_lens)]
        max_blocks = max(len(f[2]) for f in feeds)
        tables = np.zeros((len(feeds), max_blocks), dtype=np.int32)
        for i, f in enumerate(feeds):
            tables[i, : len(f[2])] = f[2]
        q_lens_np = np.asarray(q_lens, dtype=np.int64)
        qsl = np.zeros(len(feeds) + 1, dtype=np.int64)
        np.cumsum(q_lens_np, out=qsl[1:])
        seq_index = np.repeat(np.arange(len(feeds)), q_lens_np)  # [T] which sequence each token belongs to
        positions = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1] - np.asarray(starts, dtype=np.int64), q_lens_np)
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),
            seq_lens_host=seq_lens, query_lens_host=q_lens,
        )
        ids = [t for f in feeds for t in f[0]]
        return torch.tensor(ids, dtype=torch.int64, device=dev), torch.from_numpy(positions).to(dev), meta, qsl

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        """Flatten the scheduled sequences (decodes first) into input ids, positions and attention metadata."""
        order = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)  # stable: decodes keep FCFS order
        feeds = []
        for s in order:
            seq, a = s.seq, s.seq.num_computed_tokens
            b = a + s.num_new_tokens
            toks = seq.token_ids if b <= seq.num_tokens else seq.token_ids + seq.spec_token_ids  # drafts last
            feeds.append((toks[a:b], a, seq.block_table))
        input_ids, positions, meta, qsl = self.flatten(feeds)
        starts, seq_lens = [f[1] for f in feeds], meta.seq_lens_host

        # logits rows: prompt-logprob rows, then sample rows, then the rows that verify drafts
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
        sample_seqs, generators, verifying = [], [], []
        for i, s in enumerate(order):
            seq = s.seq
            if seq_lens[i] < seq.num_tokens + len(seq.spec_token_ids):
                continue  # a prompt chunk that does not reach the end: nothing to sample yet
            if seq.spec_token_ids:
                verifying.append(i)
                continue
            req = seq.request
            copies = req.params.n if not req.forked else 1
            for c in range(copies):
                rows.append(int(qsl[i + 1]) - 1)
                sample_seqs.append(seq)
                generators.append(req.generators[c] if (copies > 1 and req.generators) else seq.generator)
        spec_rows = []
        for i in verifying:  # the last real token and every draft: k + 1 rows
            spec_rows.append((order[i].seq, len(rows)))
            rows.extend(range(int(qsl[i + 1]) - len(order[i].seq.spec_token_ids) - 1, int(qsl[i + 1])))

        return StepBatch(
            scheduled=order,
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            logits_indices=torch.tensor(rows, dtype=torch.int64, device=self.device),
            sample_seqs=sample_seqs,
            sample_generators=generators,
            sample_row0=sample_row0,
            prompt_rows=prompt_rows,
            spec_rows=spec_rows,
        )

    @torch.inference_mode()
    def last_logits(self, feeds: list[tuple[list[int], int, list[int]]], sample: bool = True) -> torch.Tensor:
        """Run feeds (any order) -> float32 logits [S, V] at each feed's last token, in feed order ([0, V] when
        not sample: the forward only writes KV)."""
        order = sorted(range(len(feeds)), key=lambda i: len(feeds[i][0]) != 1)
        input_ids, positions, meta, qsl = self.flatten([feeds[i] for i in order])
        rows = torch.from_numpy(qsl[1:] - 1).to(self.device) if sample else torch.empty(0, dtype=torch.int64,
                                                                                          device=self.device)
        self.attn.begin_step(meta)
        logits = self.model(input_ids, positions, self.attn, rows)
        if not sample:
            return logits
        out = torch.empty_like(logits)
        out[torch.tensor(order, device=logits.device)] = logits
        return out

    @torch.inference_mode()
    def execute(self, batch: StepBatch, blocks_to_copy: list[tuple[int, int]]) -> torch.Tensor:
        """-> float32 logits [R, V] at batch.logits_indices (R may be 0)."""
        if self.threads is not None:
            self.threads.update()
        if blocks_to_copy:
            src = torch.tensor([c[0] for c in blocks_to_copy], device=self.device)
            dst = torch.tensor([c[1] for c in blocks_to_copy], device=self.device)
            self.kv_pool[:, :, dst] = self.kv_pool[:, :, src]
        bucket = self.graphs.bucket(batch) if self.graphs is not None else None
        if bucket is not None:
            return self.graphs.logits(batch.input_ids, batch.positions, batch.meta, bucket)
        n = batch.plain_decodes() if self.plans is not None else None
        if n is not None and n <= self.plans.top and self.plans.plan(n) is not None:
            return self.plans.logits(batch, n)
        self.attn.begin_step(batch.meta)
        return self.model(batch.input_ids, batch.positions, self.attn, batch.logits_indices)


PREFAULT_BYTES = 512 << 20  # of the KV pool, faulted in at start: the low block ids (handed out first) of each cache


def prefault(t: torch.Tensor, nbytes: int) -> None:
    """Fault in the first `nbytes` of an untouched CPU tensor in one call (Linux MADV_POPULATE_WRITE): a step
    that writes KV into fresh pages otherwise pays a page fault per 4 KiB, 15% of a 2048-token prefill step here.
    (Transparent huge pages cost more than they saved: their faults compact memory, 2.4 s per GiB on this VM.)
    Silently nothing where the kernel or platform lacks it."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    page = 4096
    start = (t.data_ptr() + page - 1) & ~(page - 1)
    end = min(t.data_ptr() + t.numel() * t.element_size(), start + nbytes) & ~(page - 1)
    if end > start:
        madv_populate_write = 23
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), madv_populate_write)
