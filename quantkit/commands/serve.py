"""`quantkit serve [MODEL|DIR]`: the paged-KV engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import os
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command(name="serve")(serve)


def serve(
    model: Optional[str] = typer.Argument(None, help="HF folder, quantized folder, GGUF file or hub id; "
                                                     "omitted: the bundled SmolLM2-135M-Instruct"),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on"),
    port: int = typer.Option(8000, help="TCP port"),
    served_model_name: Optional[str] = typer.Option(None, help="Model name clients send (default: MODEL)"),
    api_key: Optional[str] = typer.Option(None, help="Require 'Authorization: Bearer KEY' on /v1/* "
                                                     "(default: $QUANTKIT_API_KEY)"),
    chat_template: Optional[str] = typer.Option(None, help="Jinja chat template file (for models without one)"),
    max_model_len: Optional[int] = typer.Option(None, help="Prompt + output tokens at most "
                                                           "(default: the model's context length)"),
    max_num_seqs: int = typer.Option(128, help="Running sequences at most"),
    max_num_batched_tokens: int = typer.Option(2048, help="Token budget of one engine step"),
    block_size: int = typer.Option(16, help="Tokens per KV-cache block"),
    kv_cache_memory: Optional[int] = typer.Option(None, help="Bytes for the KV-cache pool (default: automatic)"),
    gpu_memory_utilization: float = typer.Option(0.9, help="Fraction of GPU memory to use (CUDA)"),
    enable_prefix_caching: bool = typer.Option(True, "--enable-prefix-caching/--no-enable-prefix-caching",
                                               help="Reuse KV blocks of shared prompt prefixes"),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 or float16"),
    seed: int = typer.Option(0, help="Seed of the engine generator (requests may bring their own)"),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp",
                                             help="Processes (devices) the model is split over: rank 0 runs the "
                                                  "engine, N - 1 workers hold the other shards"),
    speculative_model: Optional[str] = typer.Option(None, help="Draft model for speculative decoding (same "
                                                               "tokenizer), e.g. the W4 checkpoint of MODEL"),
    speculative_method: Optional[str] = typer.Option(None, help="ngram (prompt lookup, no model) or draft "
                                                                "(implied by --speculative-model)"),
    num_speculative_tokens: int = typer.Option(4, help="Draft tokens proposed per step"),
    speculative_disable_by_batch_size: Optional[int] = typer.Option(
        None, help="No speculation in a step with more decoding sequences than this (default: measured per "
                   "method, 8 for ngram, 1 for a draft model)"),
    ngram_prompt_lookup_max: int = typer.Option(4, help="Longest n-gram matched by --speculative-method ngram"),
    ngram_prompt_lookup_min: int = typer.Option(2, help="Shortest n-gram matched by --speculative-method ngram"),
    batch_invariant: bool = typer.Option(True, "--batch-invariant/--no-batch-invariant",
                                         help="bf16 on CPU: greedy output independent of batching, cached prefixes, "
                                              "chunking and speculation (bf16 weights; W4/W8 layers are not)"),
    cuda_graphs: bool = typer.Option(False, "--cuda-graphs/--enforce-eager",
                                     help="CUDA: capture decode steps as CUDA graphs per batch bucket (experimental: "
                                          "not yet validated on a GPU), or run every step eagerly (the default)"),
    cpu_step_plans: bool = typer.Option(True, "--cpu-step-plans/--no-cpu-step-plans",
                                        help="CPU bf16: replay each decode step of up to 64 sequences as one call of "
                                             "its recorded C kernels (same logits), or run every step eagerly"),
    max_request_bytes: int = typer.Option(4 << 20, help="Largest request body, in bytes: a larger one is refused "
                                                         "with a 413 before it is parsed"),
    shutdown_timeout: float = typer.Option(30.0, help="Seconds in-flight requests get to finish after SIGTERM "
                                                      "(new ones get a 503); the rest are then aborted"),
    pooling: str = typer.Option("last", help="/v1/embeddings: pool the final hidden states of an input's last "
                                             "token (vLLM's default for a causal LM), their mean, or the first's "
                                             "(last, mean or cls)"),
    metrics_prefix: str = typer.Option("quantkit", help="/metrics names: quantkit, or vllm (vLLM's names, labels "
                                                        "and buckets, for its dashboards)"),
    tool_call_parser: str = typer.Option("auto", help="How chat replies are parsed into tool_calls: hermes (Qwen, "
                                                      "Hermes), llama3_json, mistral, or auto (from the chat "
                                                      "template)"),
    log_level: str = typer.Option("info", help="debug, info, warning or error"),
) -> None:
    """Serve a model with an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/embeddings,
    /metrics, ...)."""
    from quantkit.serve.cpu_threads import wait_policy_env

    wait_policy_env()  # a bounded OpenMP spin-wait, before torch loads here and in the engine process (inherited)
    from quantkit.serve.config import EngineConfig
    from quantkit.serve.server import ServerOptions, run_server

    engine_config = EngineConfig(
        block_size=block_size, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
        enable_prefix_caching=enable_prefix_caching, dtype=dtype, seed=seed, speculative_model=speculative_model,
        speculative_method=speculative_method, num_speculative_tokens=num_speculative_tokens,
        speculative_disable_by_batch_size=speculative_disable_by_batch_size,
        ngram_prompt_lookup_max=ngram_prompt_lookup_max, ngram_prompt_lookup_min=ngram_prompt_lookup_min,
        pooling=pooling,
        batch_invariant=batch_invariant, tensor_parallel_size=tensor_parallel_size, cuda_graphs=cuda_graphs,
        cpu_step_plans=cpu_step_plans,
    )
    options = ServerOptions(
        model=model, host=host, port=port, served_model_name=served_model_name,
        api_key=api_key or os.environ.get("QUANTKIT_API_KEY") or None, chat_template=chat_template,
        log_level=log_level, max_request_bytes=max_request_bytes, shutdown_timeout=shutdown_timeout,
        metrics_prefix=metrics_prefix, tool_call_parser=tool_call_parser,
    )
    raise typer.Exit(run_server(options, engine_config))
