"""`quantkit bench serve` (load test of a live OpenAI-compatible server), `quantkit bench throughput` (offline) and
`quantkit bench step` (where a decode step's time goes)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

bench_app = typer.Typer(help="Measure serving: a live server's latency/throughput, or the engine offline.",
                        no_args_is_help=True)

DATASET_HELP = "sharegpt | alpacaeval | sonnet | random | FILE (.jsonl with prompt or messages, or .txt)"


@bench_app.command("serve")
def serve(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="base URL of any OpenAI-compatible server"),
    model: Optional[str] = typer.Option(None, "--model", help="model name to request (default: the server's first)"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer folder (default: --model, else bundled)"),
    dataset: str = typer.Option("sharegpt", "--dataset", help=DATASET_HELP),
    num_prompts: int = typer.Option(100, "--num-prompts"),
    request_rate: float = typer.Option(float("inf"), "--request-rate", help="Poisson arrivals per second; inf = all at once"),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="requests in flight at most"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="output tokens per request (default: the data's, else 128)"),
    endpoint: str = typer.Option("/v1/chat/completions", "--endpoint", help="/v1/chat/completions or /v1/completions"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="ask the server to generate exactly max_tokens"),
    goodput: Optional[list[str]] = typer.Option(None, "--goodput", help="SLOs in ms, e.g. --goodput ttft:500 --goodput tpot:50"),
    save_result: Optional[Path] = typer.Option(None, "--save-result", help="write metrics + per-request records as JSON"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="folder holding chat-sharegpt/ etc. (default ../shared/data)"),
    seed: int = typer.Option(0, "--seed"),
    random_input_len: int = typer.Option(256, "--random-input-len"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
) -> None:
    """Stream a workload at a server and print the Serving Benchmark Result block."""
    from quantkit.benchmark.client import resolve_model_and_tokenizer, run_benchmark
    from quantkit.benchmark.datasets import load_prompts
    from quantkit.atomic import write_json
    from quantkit.benchmark.metrics import compute_metrics, format_result, parse_goodput, result_json

    slos = parse_goodput(goodput)
    model_name, tok, tok_source = resolve_model_and_tokenizer(url, model, tokenizer, api_key)
    prompts = load_prompts(dataset, num_prompts, tok, max_tokens, data_dir, seed, random_input_len=random_input_len)
    typer.echo(f"{len(prompts)} {dataset} prompts -> {url}{endpoint} model={model_name} (tokenizer: {tok_source}); "
               f"request rate {request_rate}, max concurrency {max_concurrency or 'unlimited'}", err=True)
    run = run_benchmark(url, prompts, tok, model_name, endpoint, request_rate, max_concurrency, seed, ignore_eos,
                        api_key=api_key)
    metrics = compute_metrics(run, slos)
    typer.echo(format_result(metrics))
    errors = [r.error for r in run.records if r.error]
    if errors:
        typer.echo(f"{len(errors)} requests failed; first error: {errors[0]}", err=True)
    if save_result is not None:
        extra = {"dataset": dataset, "num_prompts": num_prompts, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
                 "seed": seed}
        write_json(save_result, result_json(run, metrics, extra))
        typer.echo(f"wrote {save_result}", err=True)


@bench_app.command("throughput")
def throughput(
    model: Optional[str] = typer.Argument(None, help="model folder, .gguf or cached Hub id (default: bundled)"),
    dataset: str = typer.Option("sharegpt", "--dataset", help=DATASET_HELP),
    num_prompts: int = typer.Option(64, "--num-prompts"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="output tokens per request (default: the data's, else 128)"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--stop-at-eos", help="generate exactly max_tokens per request"),
    max_num_seqs: int = typer.Option(128, "--max-num-seqs"),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    kv_cache_memory: Optional[int] = typer.Option(None, "--kv-cache-memory", help="bytes for the KV pool (default: automatic)"),
    dtype: str = typer.Option("auto", "--dtype"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir"),
    seed: int = typer.Option(0, "--seed"),
    random_input_len: int = typer.Option(256, "--random-input-len"),
    save_result: Optional[Path] = typer.Option(None, "--save-result"),
) -> None:
    """Offline tokens/s of the engine itself (quantkit.LLM, no HTTP) on a data set, all prompts at once."""
    from quantkit import LLM
    from quantkit.benchmark.datasets import load_prompts
    from quantkit.atomic import write_json
    from quantkit.benchmark.offline import format_throughput, offline_throughput

    llm = LLM(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              max_model_len=max_model_len, kv_cache_memory=kv_cache_memory, dtype=dtype, seed=seed)
    prompts = load_prompts(dataset, num_prompts, llm.tokenizer, max_tokens, data_dir, seed,
                           random_input_len=random_input_len)
    result = offline_throughput(llm, prompts, ignore_eos)
    typer.echo(format_throughput(result))
    if save_result is not None:
        write_json(save_result, {"model": llm.loaded.source, "dataset": dataset, "max_tokens": max_tokens,
                                 "max_num_seqs": max_num_seqs, **result})


@bench_app.command("step")
def step(
    model: Optional[str] = typer.Argument(None, help="model folder, .gguf or cached Hub id (default: bundled)"),
    batch: str = typer.Option("1,8,64", "--batch", help="comma-separated batch sizes (decoding sequences)"),
    steps: int = typer.Option(16, "--steps", help="decode steps timed per batch size"),
    prompt_len: int = typer.Option(128, "--prompt-len", help="random prompt tokens per sequence"),
    dtype: str = typer.Option("auto", "--dtype"),
    kv_cache_memory: Optional[int] = typer.Option(None, "--kv-cache-memory", help="bytes for the KV pool (default: automatic)"),
) -> None:
    """Per batch size: a decode step's wall time, the time inside the kernels, the host remainder and the memory
    floor (weights + KV bytes over a measured copy bandwidth)."""
    from quantkit.errors import QuantkitError

    try:
        batches = [int(b) for b in batch.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1 or steps < 1 or prompt_len < 1:
        raise QuantkitError(f"--batch must be positive integers like 1,8,64 (got {batch!r}); --steps and "
                            f"--prompt-len at least 1")
    from quantkit.benchmark.step import format_table, profile_steps
    from quantkit.serve.llm import build_engine

    engine = build_engine(model, dtype=dtype, max_num_seqs=max(batches), kv_cache_memory=kv_cache_memory,
                          max_model_len=prompt_len + steps + 8)
    typer.echo(format_table(profile_steps(engine, batches, prompt_len, steps)))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
