"""EngineConfig: the knobs of the serving engine (CLI flags of `quantkit serve` map one to one)."""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import QuantkitError

DTYPES = ("auto", "float32", "bfloat16", "float16")
POOLING_METHODS = ("last", "mean", "cls")  # /v1/embeddings (serve/pooling.py); last: vLLM's for a causal LM
# Largest batch of decoding sequences that still speculates, per method, measured by bench/spec_decode.py on the
# 2-core CPU (BENCHMARKS.md): n-gram still 1.06x at 8; the W4 self-draft of a 135M model pays only at 1.
SPEC_MAX_BATCH = {"ngram": 8, "draft": 1}


@dataclass
class EngineConfig:
    """block_size: tokens per KV block.  max_num_batched_tokens: token budget of one step (decodes + prefill
    chunks).  max_num_seqs: running sequences at most.  max_model_len: prompt + output tokens at most (None =
    the model's max_position_embeddings).  kv_cache_memory: bytes for the KV pool (overrides the automatic
    budget; with tensor parallelism, of all ranks together, each holding an even share).
    gpu_memory_utilization: fraction of device memory for weights + activations + KV on CUDA.
    cpu_kv_cache_fraction: on CPU without kv_cache_memory, the KV pool gets this fraction of available RAM
    (capped at cpu_kv_cache_max_bytes).  dtype: compute and KV dtype ("auto": bfloat16 on CPU, the checkpoint's
    float16/bfloat16 on CUDA).  seed: the engine generator for requests without their own seed.
    attention_backend: auto (Triton kernels on CUDA fp16/bf16; on CPU torch SDPA with the C decode kernel),
    torch (pure torch everywhere), triton.
    Speculative decoding (serve/speculative.py): speculative_method ngram (prompt lookup of n-grams between
    ngram_prompt_lookup_min and _max tokens) or draft (speculative_model drafts; set alone, it implies draft);
    num_speculative_tokens drafts per step; off for a step with more than speculative_disable_by_batch_size
    decoding sequences, and for a sequence whose acceptance rate falls below speculative_min_acceptance.
    batch_invariant: bf16 on CPU, a request's greedy tokens do not depend on what it is batched with, on a cached
    prefix, on prompt chunking or on speculation (row-invariant GEMM and attention, serve/prepare.py); holds for
    bf16 weights in layers without sliding window or soft-cap; fp32 and CUDA serving are unchanged by it.
    tensor_parallel_size: ranks the model is split over (serve/tp_group.py: rank 0 runs the engine, the others
    are worker processes; torch.distributed, gloo on CPU, nccl on CUDA); not with speculative decoding yet.
    pooling: how /v1/embeddings pools the final-normed hidden states of an input (POOLING_METHODS).
    cuda_graphs: a CUDA runner captures and replays one graph per decode batch bucket (serve/cuda_graphs.py); off
    by default until it has been measured on a GPU (it has not: BENCHMARKS.md).
    cpu_step_plans: a CPU bf16 runner replays each plain decode step of up to 64 sequences as one recorded call of
    its C kernels (serve/cpu_step_plans.py; the eager forward's logits bit for bit); off: every step runs eagerly.
    """

    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_fraction: float = 0.3
    cpu_kv_cache_max_bytes: int = 4 << 30
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    log_stats_interval: float = 5.0
    attention_backend: str = "auto"
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_disable_by_batch_size: int | None = None  # None: measured default of the method (SPEC_MAX_BATCH)
    speculative_min_acceptance: float = 0.2
    ngram_prompt_lookup_max: int = 4
    ngram_prompt_lookup_min: int = 2
    batch_invariant: bool = True
    pooling: str = "last"
    tensor_parallel_size: int = 1
    cuda_graphs: bool = False
    cpu_step_plans: bool = True

    def __post_init__(self):
        if self.speculative_method is None and self.speculative_model is not None:
            self.speculative_method = "draft"
        if self.speculative_disable_by_batch_size is None:
            self.speculative_disable_by_batch_size = SPEC_MAX_BATCH.get(self.speculative_method, 1)
        checks = [
            ("block_size", self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             "a power of two such as 16"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "at least 1"),
            ("max_num_seqs", self.max_num_seqs >= 1, "at least 1"),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 1, "at least 1"),
            ("kv_cache_memory", self.kv_cache_memory is None or self.kv_cache_memory > 0, "positive bytes"),
            ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "in (0, 1]"),
            ("cpu_kv_cache_fraction", 0.0 < self.cpu_kv_cache_fraction <= 1.0, "in (0, 1]"),
            ("dtype", self.dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
            ("attention_backend", self.attention_backend in ("auto", "torch", "triton"), "auto, torch or triton"),
            ("speculative_method", self.speculative_method in (None, "ngram", "draft"), "ngram or draft"),
            ("speculative_model", (self.speculative_method == "draft") == (self.speculative_model is not None),
             "a model path exactly when speculative_method is draft"),
            ("num_speculative_tokens", self.num_speculative_tokens >= 1, "at least 1"),
            ("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size >= 1, "at least 1"),
            ("speculative_min_acceptance", 0.0 <= self.speculative_min_acceptance <= 1.0, "in [0, 1]"),
            ("ngram_prompt_lookup_min", 1 <= self.ngram_prompt_lookup_min <= self.ngram_prompt_lookup_max,
             "at least 1 and at most ngram_prompt_lookup_max"),
            ("pooling", self.pooling in POOLING_METHODS, f"one of {', '.join(POOLING_METHODS)}"),
            ("tensor_parallel_size", self.tensor_parallel_size >= 1 and (
                self.tensor_parallel_size == 1 or self.speculative_method is None),
             "at least 1, and 1 with speculative decoding (not implemented with tensor parallelism yet)"),
            ("device", self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             "auto, cpu or cuda[:N]"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise QuantkitError(f"engine option {name}={getattr(self, name)!r} is invalid: use {expected}")

    def resolved_device(self) -> str:
        import torch

        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, checkpoint_dtype: str | None = None):
        """The torch dtype for weights, activations and the KV cache."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.resolved_device() == "cpu":
            return torch.bfloat16
        return torch.bfloat16 if checkpoint_dtype == "bfloat16" else torch.float16
