"""`quantkit plan` (size a deployment from config + card datasheet) and `quantkit tune` (find the batch size on a live
server that keeps a per-user tokens/s floor)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def plan(
        model: Optional[str] = typer.Argument(None, help="model folder, .gguf or cached Hub id (default: bundled)"),
        gpu: Optional[str] = typer.Option(None, "--gpu", help="h100-80gb | h200 | a100-80gb | a100-40gb | l4 | a10g | rtx-4090 (default h100-80gb unless a custom card is given)"),
        tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", help="cards the model is split over (tensor parallel): weights, KV and capacity per card"),
        memory_gb: Optional[float] = typer.Option(None, "--memory-gb", help="card memory (GB) for a custom card"),
        bandwidth_gbs: Optional[float] = typer.Option(None, "--bandwidth-gbs", help="memory bandwidth (GB/s)"),
        tflops: Optional[float] = typer.Option(None, "--tflops", help="dense fp16 peak (TFLOP/s)"),
        quant: Optional[str] = typer.Option(None, "--quant", help="fp16 | w8 | w4 (default: the folder's own)"),
        group_size: Optional[int] = typer.Option(None, "--group-size", help="quantization group (default: the folder's, else 128)"),
        max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
        memory_fraction: float = typer.Option(0.9, "--memory-fraction", help="share of card memory the engine may use"),
        block_size: int = typer.Option(16, "--block-size"),
        kv_cache_dtype: str = typer.Option("fp16", "--kv-cache-dtype", help="fp16 | bf16 | fp8"),
        max_num_seqs: int = typer.Option(128, "--max-num-seqs"),
        max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens"),
        activation_gb: Optional[float] = typer.Option(None, "--activation-gb", help="activation peak (default: estimated)"),
        kv_cache_gb: Optional[float] = typer.Option(None, "--kv-cache-gb", help="fixed KV pool instead of memory - weights - activations"),
        workload: Optional[str] = typer.Option(None, "--workload", help="sharegpt | alpacaeval | sonnet | azure-conv | azure-code | FILE"),
        max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="output tokens per request of the workload"),
        price_per_hour: Optional[float] = typer.Option(None, "--price-per-hour", help="price of one card in $/hour"),
        data_dir: Optional[Path] = typer.Option(None, "--data-dir"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="also write the plan as JSON"),
    ) -> None:
        """Weights, KV per token, KV capacity, max concurrency, roofline decode tok/s and $ per million tokens (per card
        under --tensor-parallel-size)."""
        from quantkit.benchmark.datasets import workload_lengths
        from quantkit.atomic import write_json
        from quantkit.benchmark.plan import format_plan, gpu_from_args, make_plan, quant_of_folder
        from quantkit.models.llama import ModelConfig
        from quantkit.models.loader import load_tokenizer, read_config, resolve

        folder, name = resolve(model)
        hf = read_config(folder)
        folder_quant, folder_group = quant_of_folder(hf)
        lengths = None
        if workload is not None:
            needs_tokenizer = workload not in ("azure-conv", "azure-code")
            lengths = (workload, workload_lengths(workload, load_tokenizer(model) if needs_tokenizer else None,
                                                  max_tokens, data_dir))
        result = make_plan(
            ModelConfig.from_hf(hf), gpu_from_args(gpu, memory_gb, bandwidth_gbs, tflops),
            quant=quant or folder_quant, group_size=group_size or folder_group, max_model_len=max_model_len,
            memory_fraction=memory_fraction, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, activation_gb=activation_gb,
            kv_cache_bytes=round(kv_cache_gb * 1e9) if kv_cache_gb is not None else None, workload=lengths,
            price_per_hour=price_per_hour, tensor_parallel_size=tensor_parallel_size,
        )
        typer.echo(format_plan(result, name))
        if json_out is not None:
            write_json(json_out, {"model": name, **result})

    @app.command()
    def tune(
        url: str = typer.Option("http://127.0.0.1:8000", "--url", help="base URL of the live server"),
        min_user_tps: float = typer.Option(10.0, "--min-user-tps", help="per-user decode tokens/s floor (default 10: faster than people read)"),
        model: Optional[str] = typer.Option(None, "--model"),
        tokenizer: Optional[str] = typer.Option(None, "--tokenizer"),
        dataset: str = typer.Option("sharegpt", "--dataset"),
        max_tokens: int = typer.Option(128, "--max-tokens", help="output tokens per request (generated to the end)"),
        max_batch: int = typer.Option(64, "--max-batch", help="largest concurrency tried"),
        rounds: int = typer.Option(2, "--rounds", help="requests per step = rounds x concurrency"),
        price_per_hour: Optional[float] = typer.Option(None, "--price-per-hour", help="machine price in $/hour"),
        out: Path = typer.Option(Path("tune"), "--out", help="folder for tune.json and the PNG charts"),
        data_dir: Optional[Path] = typer.Option(None, "--data-dir"),
        seed: int = typer.Option(0, "--seed"),
        api_key: Optional[str] = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
    ) -> None:
        """Sweep concurrency 1, 2, 4, ... against the server; recommend the largest --max-num-seqs keeping the floor."""
        from quantkit.benchmark.charts import draw_tune_charts
        from quantkit.benchmark.client import resolve_model_and_tokenizer
        from quantkit.atomic import write_json
        from quantkit.benchmark.tune import format_tune, sweep

        model_name, tok, _ = resolve_model_and_tokenizer(url, model, tokenizer, api_key)
        result = sweep(url, model_name, tok, min_user_tps, dataset, max_tokens, max_batch, rounds, price_per_hour,
                       data_dir, seed, api_key, progress=lambda line: typer.echo(line, err=True))
        typer.echo(format_tune(result))
        write_json(out / "tune.json", result)
        for path in draw_tune_charts(result, out):
            typer.echo(f"wrote {path}", err=True)
