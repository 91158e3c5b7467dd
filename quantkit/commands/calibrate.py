"""`quantkit calibrate [MODEL]`: FP16 -> RTN / GPTQ / AWQ quantized checkpoint, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

GROUP_SIZES = (128, 64, 32)


def linear_widths(hf_config: dict) -> dict[str, int]:
    """in_features of every Linear calibration quantizes, from the model built on the meta device (no memory, no
    weights): "model.layers.N.self_attn.q_proj" -> width, experts as "...experts.E.down_proj", in module order."""
    import re

    import torch

    from quantkit.models.config import ModelConfig
    from quantkit.models.model import CausalLM
    from quantkit.models.registry import arch_spec

    class Width(torch.nn.Module):  # a Linear's shape only: thousands of experts build in milliseconds
        def __init__(self, in_features: int, out_features: int, bias: bool = False):
            super().__init__()
            self.in_features, self.out_features = in_features, out_features

    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_hf(hf_config), linear_cls=Width)
    spec, widths = arch_spec(hf_config.get("model_type", "llama")), {}
    for block in model.model.layers:
        quantized = set(spec.in_block(block).linears)
        for name, module in block.named_modules():
            if name in quantized:
                widths.setdefault(re.sub(r"\.experts\.\d+\.", ".experts.E.", f"model.layers.N.{name}"),
                                  module.in_features)
    return widths


def width_fields(hf_config: dict, width: int) -> str:
    """The config.json fields a Linear width comes from (those holding that value), for an error message."""
    names = [k for k, v in hf_config.items()
             if k.endswith(("_size", "head_dim")) and k != "vocab_size" and type(v) is int and v == width]
    heads, head_dim = hf_config["num_attention_heads"], hf_config.get("head_dim")
    if not names and head_dim and heads * head_dim == width:
        names = ["num_attention_heads x head_dim"]
    return f" (config.json {' = '.join(names)})" if names else ""


def default_group_size(widths: dict[str, int]) -> int:
    """The largest of 128/64/32 dividing every Linear's in_features (`linear_widths`)."""
    return next((g for g in GROUP_SIZES if all(w % g == 0 for w in widths.values())), -1)


def check_group_size(scheme, widths: dict[str, int], hf_config: dict) -> None:
    """Fail before loading any weights when the group size does not divide a Linear's in_features."""
    for layer, width in widths.items():
        scheme.groups(width, layer + width_fields(hf_config, width))


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate_command(
        model: Optional[str] = typer.Argument(None, help="HF folder, hub id in the local cache, .gguf (default: bundled SmolLM2-135M-Instruct)"),
        method: Optional[str] = typer.Option(None, help="rtn | gptq | awq (default gptq)"),
        bits: Optional[int] = typer.Option(None, help="4 or 8 (default 4)"),
        group_size: Optional[int] = typer.Option(None, "--group-size", help="columns per scale, -1 per-channel (default: 128, or the largest of 64/32 dividing the model's widths)"),
        sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="fixed zero point (default: sym for gptq/rtn, asym for awq)"),
        act_order: Optional[bool] = typer.Option(None, "--act-order/--no-act-order", help="GPTQ: columns by descending Hessian diagonal"),
        static_groups: Optional[bool] = typer.Option(None, "--static-groups/--no-static-groups", help="GPTQ act-order with groups fit up front (g_idx stays k // g)"),
        damp: Optional[float] = typer.Option(None, help="GPTQ dampening, fraction of mean(diag H) (default 0.1)"),
        group_aware: Optional[bool] = typer.Option(None, "--group-aware/--no-group-aware", help="GPTQ without act-order: columns by descending Hessian diagonal inside each group, groups by their largest (default on; nothing changes on disk)"),
        layout: Optional[str] = typer.Option(None, "--format", help="gptq | gptq_v2 | awq | compressed-tensors (default: gptq when sym; asym and AWQ at 4 bits without an act-order g_idx: awq with groups, compressed-tensors per-channel; else gptq_v2, or compressed-tensors for AWQ)"),
        data: Optional[str] = typer.Option(None, help="calibration file (jsonl/txt/parquet/datasets folder; default: the general set shipped in quantkit/calibration_data: WikiText-2 prose + GSM8K math, about 80k tokens)"),
        num_samples: Optional[int] = typer.Option(None, "--num-samples", help="calibration samples N (default 128)"),
        seq_len: Optional[int] = typer.Option(None, "--seq-len", help="tokens per sample L (default 512)"),
        data_mode: Optional[str] = typer.Option(None, "--data-mode", help="concat (chunks of a token stream) | rows (one sample per row)"),
        seed: Optional[int] = typer.Option(None, help="sample selection seed (default 0): same seed, same bytes"),
        batch_size: Optional[int] = typer.Option(None, "--batch-size", help="samples per block forward (default 8)"),
        compute_dtype: Optional[str] = typer.Option(None, "--compute-dtype", help="auto | float32 | bfloat16: matmuls of the calibration forwards; statistics stay fp32 (default auto: bfloat16 where the hardware has it)"),
        awq_rounding: Optional[str] = typer.Option(None, "--awq-rounding", help="AWQ: gptq (error-compensating rounding of the scaled weights, default) | rtn (the paper's clip search + round to nearest)"),
        moe_min_tokens: Optional[int] = typer.Option(None, "--moe-min-tokens", help="MoE: an expert routed fewer calibration tokens is calibrated on a forced-routing pass (every token, weighted by its router probability); 0 = never (default: the hidden size)"),
        recipe: Optional[Path] = typer.Option(None, help="recipes/*.yaml; flags override its keys"),
        out: Optional[Path] = typer.Option(None, help="checkpoint folder (default ./<model>-<method>-<scheme>)"),
        work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="finished blocks for resume (default: .<out>.work beside --out)"),
        resume: bool = typer.Option(True, "--resume/--no-resume", help="continue a killed run at its first unfinished block"),
        device: Optional[str] = typer.Option(None, help="compute device for the current block (default: cuda if present, else cpu)"),
        target_bpw: Optional[float] = typer.Option(None, "--target-bpw", help="mixed precision: each Linear's scheme (W4 at the group sizes dividing it, W8, or float) chosen for the least estimated KL within this mean bits per weight, scales, zeros and g_idx counted (e.g. 4.5)"),
        max_delta: Optional[List[str]] = typer.Option(None, "--max-delta", help="mixed precision: the smallest mix whose checkpoint passes this quantkit eval gate on --eval-data (repeatable: kl=0.05, ppl=+3%)"),
        mix_schemes: Optional[str] = typer.Option(None, "--mix-schemes", help="mixed precision: the schemes a Linear may take, comma-separated (default w4g128,w4g64,w4g32,w8ch,float where the group divides its width; vLLM-CPU runs 4-bit and float only)"),
        eval_data: Optional[str] = typer.Option(None, "--eval-data", help="mixed precision: held-out data for the per-layer KL and the --max-delta gate (default: the general held-out text quantkit eval ships)"),
        max_host_memory: Optional[str] = typer.Option(None, "--max-host-memory", help="calibrate in bounded host memory, e.g. 6GB or 512MiB: weights are read from the safetensors shards one block at a time, each quantized block is written to the work folder and freed, activations spill there past SIZE, the checkpoint is streamed (same bytes, slower; default: only when the model's float32 weights would take over 80% of the memory available)"),
    ) -> None:
        """Quantize MODEL's decoder Linears and write a checkpoint that vLLM, transformers and quantkit load."""
        import shutil
        import time

        import torch
        from rich.console import Console

        from quantkit.atomic import check_writable_folder
        from quantkit.data import calibration_batches
        from quantkit.errors import QuantkitError
        from quantkit.formats.checkpoint import save_checkpoint
        from quantkit.formats.compatibility import written_note
        from quantkit.files import read_hf_config
        from quantkit.models.loader import load_model, read_config, resolve
        from quantkit.models.multimodal import is_multimodal, wrapper_class
        from quantkit.quant.bounded import host_budget, load_streamed, streamed_tensors
        from quantkit.quant.calibrate import calibrate, make_method
        from quantkit.quant.moe_calibration import moe_summary, resolve_min_tokens, summary_line
        from quantkit.recipes import calib_config, load_recipe

        console = Console(stderr=True, soft_wrap=True)  # long paths stay on one line
        rec = load_recipe(recipe) if recipe is not None else None
        flags = dict(model=model, method=method, bits=bits, group_size=group_size, sym=sym, act_order=act_order,
                     static_groups=static_groups, damp=damp, group_aware=group_aware, format=layout, data=data, num_samples=num_samples,
                     seq_len=seq_len, data_mode=data_mode, seed=seed, batch_size=batch_size, compute_dtype=compute_dtype,
                     moe_min_tokens=moe_min_tokens, awq_rounding=awq_rounding)
        source = flags["model"] or (rec.calib.get("model") if rec else None)
        folder, name = resolve(source)
        hf_config = read_config(folder)
        if hf_config.get("quantization_config"):
            raise QuantkitError(f"{folder} is already quantized: calibrate its float original")
        widths = linear_widths(hf_config)
        if group_size is None and not (rec and "group_size" in rec.calib):
            flags["group_size"] = default_group_size(widths)
        cfg = calib_config(rec, flags)
        check_group_size(cfg.scheme, widths, hf_config)
        if target_bpw is not None or max_delta:
            from quantkit.quant.mixed_precision import check_request

            check_request(cfg, target_bpw, max_delta or [], mix_schemes)
        if cfg.method == "awq" and cfg.scheme.bits == 8 and layout is None:
            console.print(f"AWQ GEMM is 4-bit only: writing the 8-bit AWQ weights as {cfg.layout}")
        out = out or Path(f"{Path(name.split(':')[-1]).name}-{cfg.method}-{cfg.scheme.name()}")
        work = work_dir or out.parent / f".{out.name}.work"
        check_writable_folder(out, "--out")
        check_writable_folder(work, "--work-dir")
        budget = host_budget(max_host_memory, folder, console.print)  # None: the whole model in memory

        started = time.perf_counter()
        torch.manual_seed(cfg.seed)
        loaded, weights = load_streamed(source) if budget is not None else (load_model(source, dtype=torch.float32), None)
        calib = None
        if make_method(cfg, hf_config.get("model_type", "llama")).needs:
            calib = calibration_batches(cfg.data, loaded.tokenizer, cfg.num_samples, cfg.seq_len, cfg.data_mode, cfg.seed)
        elif cfg.data is not None:
            console.print(f"{cfg.method} needs no calibration data: {cfg.data} is not used")
        mix = None
        if target_bpw is not None or max_delta:  # per-layer schemes (quant/mixed_precision.py)
            from quantkit.quant.mixed_precision import choose_mix

            if weights is not None:
                raise QuantkitError("--target-bpw / --max-delta need the float model in memory: drop --max-host-memory")
            mix = choose_mix(loaded, calib, cfg, target_bpw, max_delta or [], eval_data, console.print,
                             scratch=out.parent / f".{out.name}.mix", schemes=mix_schemes)
            cfg = mix.cfg
        report = calibrate(loaded.model, loaded.hf_config, calib, cfg, work_dir=work, resume=resume, device=device,
                           log=console.print, weights=weights, max_host_memory=budget)
        meta = {
            "method": cfg.method, "scheme_name": cfg.scheme.name(), "base_model": loaded.source,
            "scheme": {"static_groups": cfg.scheme.static_groups}, "recipe": cfg.to_flat(),
            "recipe_file": str(recipe) if recipe else None, "layers": report,
            "time_s": round(time.perf_counter() - started, 1),
        }
        if cfg.method == "gptq":
            meta["damp_percent"] = cfg.damp
        moe = {}  # tokens per expert, forced-routing passes (RTN routes nothing)
        if calib is not None:
            moe = moe_summary(report, resolve_min_tokens(cfg.moe_min_tokens, hf_config["hidden_size"]))
        if moe:
            meta["moe"] = moe
        if mix is not None:
            meta["mixed_precision"] = mix.record
        if calib is not None:
            meta["data"] = {"path": calib.stats.get("source"), "fingerprint": calib.fingerprint,
                            "rows": calib.stats.get("rows_used"), "tokens": calib.stats.get("tokens_used"),
                            "samples": calib.stats.get("samples"), "stats": calib.stats}
        tensors = (streamed_tensors(work, loaded.model, weights, loaded.hf_config, cfg, console.print)
                   if weights is not None else None)
        save_checkpoint(out, loaded.model, loaded.hf_config, loaded.tokenizer, cfg.layout, meta, tensors=tensors)
        if work.exists():
            shutil.rmtree(work)
        losses = [e["loss"] for e in report if e.get("loss") is not None]
        fallbacks = [e["name"] for e in report if e.get("fallback")]
        summary = f"wrote {out} ({cfg.method} {cfg.scheme.name()}, {cfg.layout}, {len(report)} layers"
        summary += f", mean loss {sum(losses) / len(losses):.4g}" if losses else ""
        console.print(summary + f", {meta['time_s']} s)")
        console.print(written_note(out), markup=False)
        if is_multimodal(wrapper := read_hf_config(folder)):
            console.print(f"{name} is a vision-language checkpoint ({wrapper_class(wrapper)}): its vision tower and "
                          f"projector were left out, {out} is text-only ({hf_config['architectures'][0]})",
                          markup=False)
        if mix is not None:
            console.print(mix.summary(), markup=False)
        if moe:
            console.print(summary_line(moe))
        if fallbacks:
            console.print(f"warning: {len(fallbacks)} layers fell back to RTN (Hessian not factorisable): {', '.join(fallbacks)}")
