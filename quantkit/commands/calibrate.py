"""`quantkit calibrate [MODEL]`: FP16 -> RTN / GPTQ / AWQ quantized checkpoint, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

GROUP_SIZES = (128, 64, 32)


def default_group_size(hf_config: dict) -> int:
    """The largest of 128/64/32 dividing every Linear's in_features (hidden and intermediate size)."""
    widths = [hf_config["hidden_size"], hf_config["intermediate_size"]]
    if hf_config.get("head_dim"):
        widths.append(hf_config["head_dim"] * hf_config["num_attention_heads"])
    return next((g for g in GROUP_SIZES if all(w % g == 0 for w in widths)), -1)


def check_group_size(scheme, hf_config: dict) -> None:
    """Fail before loading any weights when the group size does not divide a Linear's in_features."""
    heads = hf_config["num_attention_heads"]
    widths = {"self_attn.q_proj": hf_config["hidden_size"], "mlp.down_proj": hf_config["intermediate_size"],
              "self_attn.o_proj": heads * (hf_config.get("head_dim") or hf_config["hidden_size"] // heads)}
    for layer, width in widths.items():
        scheme.groups(width, f"model.layers.N.{layer}")


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
        damp: Optional[float] = typer.Option(None, help="GPTQ dampening, fraction of mean(diag H) (default 0.01)"),
        group_aware: Optional[bool] = typer.Option(None, "--group-aware/--no-group-aware", help="GPTQ without act-order: columns by descending Hessian diagonal inside each group, groups by their largest (default on; nothing changes on disk)"),
        layout: Optional[str] = typer.Option(None, "--format", help="gptq | gptq_v2 | awq | compressed-tensors (default: gptq when sym else gptq_v2; awq for 4-bit AWQ)"),
        data: Optional[str] = typer.Option(None, help="calibration file (jsonl/txt/parquet/datasets folder; default: the general set shipped in quantkit/calibration_data: WikiText-2 prose + GSM8K math, about 80k tokens)"),
        num_samples: Optional[int] = typer.Option(None, "--num-samples", help="calibration samples N (default 128)"),
        seq_len: Optional[int] = typer.Option(None, "--seq-len", help="tokens per sample L (default 512)"),
        data_mode: Optional[str] = typer.Option(None, "--data-mode", help="concat (chunks of a token stream) | rows (one sample per row)"),
        seed: Optional[int] = typer.Option(None, help="sample selection seed (default 0): same seed, same bytes"),
        batch_size: Optional[int] = typer.Option(None, "--batch-size", help="samples per block forward (default 8)"),
        compute_dtype: Optional[str] = typer.Option(None, "--compute-dtype", help="auto | float32 | bfloat16: matmuls of the calibration forwards; statistics stay fp32 (default auto: bfloat16 where the hardware has it)"),
        recipe: Optional[Path] = typer.Option(None, help="recipes/*.yaml; flags override its keys"),
        out: Optional[Path] = typer.Option(None, help="checkpoint folder (default ./<model>-<method>-<scheme>)"),
        work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="finished blocks for resume (default: .<out>.work beside --out)"),
        resume: bool = typer.Option(True, "--resume/--no-resume", help="continue a killed run at its first unfinished block"),
        device: Optional[str] = typer.Option(None, help="compute device for the current block (default: cuda if present, else cpu)"),
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
        from quantkit.files import read_hf_config
        from quantkit.models.loader import load_model, resolve
        from quantkit.quant.calibrate import calibrate, make_method
        from quantkit.recipes import calib_config, load_recipe

        console = Console(stderr=True, soft_wrap=True)  # long paths stay on one line
        rec = load_recipe(recipe) if recipe is not None else None
        flags = dict(model=model, method=method, bits=bits, group_size=group_size, sym=sym, act_order=act_order,
                     static_groups=static_groups, damp=damp, group_aware=group_aware, format=layout, data=data, num_samples=num_samples,
                     seq_len=seq_len, data_mode=data_mode, seed=seed, batch_size=batch_size, compute_dtype=compute_dtype)
        source = flags["model"] or (rec.calib.get("model") if rec else None)
        folder, name = resolve(source)
        hf_config = read_hf_config(folder)
        if hf_config.get("quantization_config"):
            raise QuantkitError(f"{folder} is already quantized: calibrate its float original")
        if group_size is None and not (rec and "group_size" in rec.calib):
            flags["group_size"] = default_group_size(hf_config)
        cfg = calib_config(rec, flags)
        check_group_size(cfg.scheme, hf_config)
        if cfg.method == "awq" and cfg.scheme.bits == 8 and layout is None:
            console.print(f"AWQ GEMM is 4-bit only: writing the 8-bit AWQ weights as {cfg.layout}")
        out = out or Path(f"{Path(name.split(':')[-1]).name}-{cfg.method}-{cfg.scheme.name()}")
        work = work_dir or out.parent / f".{out.name}.work"
        check_writable_folder(out, "--out")
        check_writable_folder(work, "--work-dir")

        started = time.perf_counter()
        torch.manual_seed(cfg.seed)
        loaded = load_model(source, dtype=torch.float32)
        calib = None
        if make_method(cfg, hf_config.get("model_type", "llama")).needs:
            calib = calibration_batches(cfg.data, loaded.tokenizer, cfg.num_samples, cfg.seq_len, cfg.data_mode, cfg.seed)
        elif cfg.data is not None:
            console.print(f"{cfg.method} needs no calibration data: {cfg.data} is not used")
        report = calibrate(loaded.model, loaded.hf_config, calib, cfg, work_dir=work, resume=resume, device=device,
                           log=console.print)
        meta = {
            "method": cfg.method, "scheme_name": cfg.scheme.name(), "base_model": loaded.source,
            "scheme": {"static_groups": cfg.scheme.static_groups}, "recipe": cfg.to_flat(),
            "recipe_file": str(recipe) if recipe else None, "layers": report,
            "time_s": round(time.perf_counter() - started, 1),
        }
        if cfg.method == "gptq":
            meta["damp_percent"] = cfg.damp
        if calib is not None:
            meta["data"] = {"path": calib.stats.get("source"), "fingerprint": calib.fingerprint,
                            "rows": calib.stats.get("rows_used"), "tokens": calib.stats.get("tokens_used"),
                            "samples": calib.stats.get("samples"), "stats": calib.stats}
        save_checkpoint(out, loaded.model, loaded.hf_config, loaded.tokenizer, cfg.layout, meta)
        if work.exists():
            shutil.rmtree(work)
        losses = [e["loss"] for e in report if e.get("loss") is not None]
        fallbacks = [e["name"] for e in report if e.get("fallback")]
        summary = f"wrote {out} ({cfg.method} {cfg.scheme.name()}, {cfg.layout}, {len(report)} layers"
        summary += f", mean loss {sum(losses) / len(losses):.4g}" if losses else ""
        console.print(summary + f", {meta['time_s']} s)")
        if fallbacks:
            console.print(f"warning: {len(fallbacks)} layers fell back to RTN (Hessian not factorisable): {', '.join(fallbacks)}")
