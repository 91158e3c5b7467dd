"""CUDA-graph capture of decode steps, one graph per batch bucket (the scheme of vLLM and nano-vllm).

A decode-only step of n sequences (each runs one token and samples one row: no prefill chunk, no prompt logprobs,
no fork, no speculative verify) runs at the smallest bucket b >= n of capture_sizes():
  1. its inputs are copied into persistent buffers sized for the largest bucket (same storage every step);
  2. rows n..b-1 are padding: token 0 at position 0 with one token of context in the padding block (pool block id
     runner.num_blocks, one block past those the BlockManager hands out), whose slot 0 they write and read, so
     they never touch a real KV block;
  3. the graph captured for b replays the decoder forward (embeddings -> blocks -> final norm, attention through
     the Triton kernels, whose grids depend only on shapes) in one launch;
  4. the lm_head runs eagerly on the n real rows' hidden states: fresh float32 logits [n, V], nothing that aliases
     the graph pool, which every bucket shares.
Every other step, and a batch above the largest bucket, runs eagerly (ModelRunner.execute).
A bucket's graph is captured the first time a step uses it: a warm-up forward with every row padding (Triton
compiles, QLinear repacks, cuBLAS picks its kernels; nothing of it runs inside the graph), then the capture.
On CPU nothing is captured: logits() runs the same padded forward eagerly (how the tests check the input path).
"""

from __future__ import annotations

import bisect
import logging

import torch

from quantkit.models.moe import MoE
from quantkit.serve.attention import AttentionMetadata

log = logging.getLogger("quantkit.serve")

MAX_CAPTURE_SIZE = 512  # sequences: vLLM's largest default capture size; larger decode batches run eagerly


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then multiples of 16, up to the largest decode batch a step can hold
    (max_num_seqs, max_num_batched_tokens and MAX_CAPTURE_SIZE bound it), which is always the last."""
    top = min(max_num_seqs, max_num_batched_tokens, MAX_CAPTURE_SIZE)
    return [s for s in (1, 2, 4, 8, *range(16, top, 16)) if s < top] + [top]


def bucket_for(sizes: list[int], n: int) -> int | None:
    """The smallest bucket holding n sequences, None above the largest (eager)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def decode_graphs_wanted(runner) -> bool:
    """Whether `runner` (a ModelRunner, before its KV pool exists) captures decode graphs: on CUDA, unless
    cfg.cuda_graphs, with one rank (a graph would hold its all-reduces), the Triton attention (the torch backend
    sizes its gathers by the step's longest sequence) and no MoE layer (its expert groups are a host sync)."""
    if runner.device.type != "cuda" or not runner.cfg.cuda_graphs:
        return False
    reason = None
    if runner.cfg.tensor_parallel_size > 1:
        reason = "tensor parallelism"
    elif runner._backend_kind() != "triton":
        reason = f"the torch attention backend ({runner.dtype})"
    elif any(isinstance(m, MoE) for m in runner.model.modules()):
        reason = "MoE layers (data-dependent expert groups)"
    if reason is not None:
        log.info("CUDA graphs off: %s; decode steps run eagerly", reason)
    return reason is None


class DecodeGraphs:
    """The bucketed decode path of one ModelRunner, whose pool holds the padding block (ModelRunner._allocate_kv)."""

    def __init__(self, runner, capture: bool):
        """capture: record and replay CUDA graphs (CUDA); False: run the padded forward eagerly (CPU)."""
        self.runner = runner
        self.capture = capture
        self.sizes = capture_sizes(runner.cfg.max_num_seqs, runner.cfg.max_num_batched_tokens)
        self.padding_block = runner.num_blocks
        self.padding_slot = runner.num_blocks * runner.block_size
        self.width = -(-runner.max_model_len // runner.block_size)  # block-table columns of the longest sequence
        top, dev = self.sizes[-1], runner.device
        # persistent inputs, rows [0, top): the forward reads slices [:b]; rows >= n of a step are padding
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((top,), self.padding_slot, dtype=torch.int64, device=dev)
        self.block_tables = torch.full((top, self.width), self.padding_block, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=dev)  # one token each: constant
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # per bucket the graph's output, final-normed hidden [b, H]
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for every bucket

    def bucket(self, batch) -> int | None:
        """The bucket of a StepBatch (ModelRunner.prepare) whose every sequence decodes one token into one sample
        row (logits rows = tokens 0..n-1), or None: the step runs eagerly."""
        n = batch.plain_decodes()
        if n is None or batch.meta.block_tables.shape[1] > self.width:
            return None
        return bucket_for(self.sizes, n)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               bucket: int) -> torch.Tensor:
        """A decode-only step of n = len(input_ids) <= bucket sequences -> float32 logits [n, V] (row i: sequence
        i), its K/V written at meta.slot_mapping and nowhere else but the padding block."""
        n = input_ids.shape[0]
        if self.capture and bucket not in self.graphs:
            self._capture(bucket)  # before the fill: warm-up and capture run on padding rows only
        self._fill(input_ids, positions, meta, bucket)
        if self.capture:
            self.graphs[bucket].replay()
            hidden = self.hidden[bucket]
        else:
            hidden = self._forward(bucket, list(meta.seq_lens_host) + [1] * (bucket - n))
        return self.runner.model.logits(hidden[:n])

    def _fill(self, input_ids, positions, meta: AttentionMetadata, bucket: int) -> None:
        """Rows [0, n) from the step (block-table columns [0, w) of its width w: no kernel reads a row past its
        seq_len), rows [n, bucket) padding."""
        n, w = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :w].copy_(meta.block_tables)
        self._pad(n, bucket, w)

    def _pad(self, lo: int, hi: int, w: int) -> None:
        """Rows [lo, hi) as padding: token 0 at position 0, one token of context in the padding block."""
        self.input_ids[lo:hi] = 0
        self.positions[lo:hi] = 0
        self.slot_mapping[lo:hi] = self.padding_slot
        self.seq_lens[lo:hi] = 1
        self.block_tables[lo:hi, :w] = self.padding_block

    def _forward(self, bucket: int, seq_lens_host: list[int]) -> torch.Tensor:
        """The decoder forward over buffer rows [0, bucket) -> hidden [bucket, H]. Fresh slices each call: RoPE
        caches its cos/sin per positions tensor, and a capture must compute them inside the graph."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket], query_start_loc=self.query_start_loc[: bucket + 1],
            num_decodes=bucket, seq_lens_host=seq_lens_host, query_lens_host=[1] * bucket,
        )
        attn = self.runner.attn
        attn.begin_step(meta)
        return self.runner.model.hidden(self.input_ids[:bucket], self.positions[:bucket], attn)

    def _capture(self, bucket: int) -> None:
        self._pad(0, bucket, self.width)
        self._forward(bucket, [1] * bucket)  # warm-up, outside the graph
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.hidden[bucket] = self._forward(bucket, [1] * bucket)
        self.graphs[bucket] = graph
        log.info("captured the decode CUDA graph of %d sequences (%d of %d buckets)", bucket, len(self.graphs),
                 len(self.sizes))
