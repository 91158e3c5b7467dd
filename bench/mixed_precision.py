"""Mixed precision on the bundled SmolLM2-135M-Instruct: the sensitivity table, --target-bpw against uniform W4 g64,
--max-delta's search, and the mixed checkpoint in quantkit, transformers and vLLM-CPU.

    python bench/mixed_precision.py [--model DIR] [--method rtn|gptq] [--target-bpw 4.5] [--max-delta kl=0.05] [--work DIR]
        [--hessian-samples 8] [--kl-windows 1] [--kl-seq-len 256] [--validate-blocks 0,14,29] [--eval-windows 8]
        [--step-bpw 0.5] [--vllm-python /tmp/vllm_venv/bin/python] [--json out.json]

1. Sensitivity (quant/sensitivity.py): H from --hessian-samples x 256 tokens of the shipped calibration set, the proxy
   of every Linear at every candidate scheme, the KL of every Linear quantized alone at its reference scheme on
   --kl-windows x --kl-seq-len tokens of the sonnets (the held-out text `quantkit eval` ships). Reported: Spearman's
   rho of proxy vs measured KL across Linears, and on --validate-blocks the KL measured at every scheme against the
   estimate (measured KL at the reference x proxy ratio).
2. --target-bpw: the mix (quant/mixed_precision.choose_mix on that table) of every candidate scheme, and the mix of
   the 4-bit and float ones only (`--mix-schemes w4g128,w4g64,w4g32,float`: what vLLM-CPU runs), each calibrated by
   --method (GPTQ on --hessian-samples x 256 tokens) and written in the layout `quantkit calibrate` defaults to
   (gptq); uniform W4 g64 the same way. Bits per weight counted from each folder's tensors (formats/footprint.stored_bits), KL and
   perplexity against the FP16 model on wikitext-2 test (neither the calibration set nor the sensitivity text),
   --eval-windows x 512 tokens, through `quantkit eval`'s runner.
3. --max-delta: choose_mix's search on the sonnets; every evaluated mix, the chosen one and the next more aggressive.
4. Both mixes as written (gptq), the 4-bit + float one also exported to compressed-tensors, and uniform W4 g64 (what
   bf16 alone changes): 8 chat prompts, greedy, 32 tokens, in quantkit.LLM fp32, then in bench/runtime_compat.py's
   child mode: vLLM-CPU greedy (fp32 where it allows, else bf16), transformers fp32 teacher-forced on quantkit's
   tokens (its argmax at every position). `--runtimes-only` reruns this step on the folders of an earlier run.
Every figure is printed with the 1-minute load average when it was taken.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
W4_FLOAT = "w4g128,w4g64,w4g32,float"  # --mix-schemes of a mix vLLM-CPU runs (its CPU kernels take uint4 only)


def load() -> float:
    return round(os.getloadavg()[0], 1)


def stamp(what: str, started: float, **figures) -> dict:
    row = {"step": what, "seconds": round(time.perf_counter() - started, 1), "load_1min": load(), **figures}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--method", default="rtn", choices=("rtn", "gptq"))
    ap.add_argument("--target-bpw", type=float, default=4.5)
    ap.add_argument("--max-delta", default="kl=0.05")
    ap.add_argument("--work", type=Path, default=Path("/tmp/mixed_precision"))
    ap.add_argument("--hessian-samples", type=int, default=8)
    ap.add_argument("--kl-windows", type=int, default=1)
    ap.add_argument("--kl-seq-len", type=int, default=256)
    ap.add_argument("--validate-blocks", default="0,14,29")
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--step-bpw", type=float, default=0.5)
    ap.add_argument("--vllm-python", default="/tmp/vllm_venv/bin/python")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--runtimes-only", action="store_true", help="only step 4, on the folders a run left in --work")
    args = ap.parse_args()
    if args.runtimes_only:
        rows = runtimes(args.work / "mixed", args.work / "mixed-w4-float", args.work, args.vllm_python)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return

    import torch

    from quantkit.config import CalibConfig, QuantScheme
    from quantkit.data import calibration_batches
    from quantkit.evals.runner import general_text_file
    from quantkit.models.loader import load_model
    from quantkit.quant.mixed_precision import choose_mix
    from quantkit.quant.sensitivity import sensitivity

    args.work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    loaded = load_model(args.model, dtype=torch.float32)
    base = QuantScheme(4, 64)  # the CLI default for the bundled model: the largest group dividing 576 and 1536
    cfg = CalibConfig(method=args.method, scheme=base, layout="gptq", num_samples=args.hessian_samples, seq_len=256)
    calib = calibration_batches(None, loaded.tokenizer, args.hessian_samples, 256)

    # 1. sensitivity, validated
    t = time.perf_counter()
    windows = calibration_batches(general_text_file(), loaded.tokenizer, args.kl_windows, args.kl_seq_len).input_ids
    table = sensitivity(loaded.model, "llama", base, calib, windows, progress=False,
                        sources={"hessian": "quantkit/calibration_data/general.jsonl", "kl": str(general_text_file())})
    rows.append(stamp("sensitivity", t, linears=len(table.linears), tokens=table.tokens,
                      proxy_vs_kl_spearman=table.rank_correlation()))
    t = time.perf_counter()
    from quantkit.quant.sensitivity import measure_kl

    blocks = [int(b) for b in args.validate_blocks.split(",") if b]
    measure_kl(loaded.model, table.linears, base, windows, schemes="all", blocks=blocks)
    rows.append(stamp("scaling check", t, blocks=blocks, **table.scaling_check()))
    (args.work / "sensitivity.json").write_text(json.dumps(table.to_json(), indent=1))

    # 2. --target-bpw against uniform W4 g64: every candidate, and the 4-bit + float ones vLLM-CPU runs
    folders = {}
    for name, schemes in (("mixed", None), ("mixed-w4-float", W4_FLOAT)):
        t = time.perf_counter()
        mix = choose_mix(loaded, calib, cfg, args.target_bpw, [], None, progress=False, table=table, schemes=schemes)
        folders[name] = write(loaded, calib, mix.cfg, args.work / name, mix.record)
        rows.append(stamp(f"{name}: --target-bpw {args.target_bpw} calibrated and written", t,
                          counts=mix.record["counts"], planned_bpw=mix.record["planned_bpw"],
                          estimated_kl=mix.record["estimated_kl"]))
    t = time.perf_counter()
    folders["uniform-w4g64"] = write(loaded, calib, cfg, args.work / "uniform-w4g64", None)
    rows.append(stamp("uniform W4 g64 calibrated and written", t))
    for name, folder in folders.items():
        t = time.perf_counter()
        rows.append(stamp(f"{name}: wikitext-2 test vs FP16", t, stored_bpw=stored_bpw(loaded, folder),
                          **wikitext(folder, loaded.source, args.eval_windows)))

    # 3. --max-delta
    t = time.perf_counter()
    found = choose_mix(loaded, calib, cfg, None, [args.max_delta], None, log=print, scratch=args.work / "scratch",
                       progress=False, step_bpw=args.step_bpw, eval_windows=args.eval_windows, table=table)
    search = found.record["search"]
    rows.append(stamp("max-delta search", t, thresholds=search["thresholds"], ladder=search["ladder"],
                      rungs=search["rungs"], chosen=search["chosen"], failed=search["failed"]))

    # 4. runtimes
    rows += runtimes(folders["mixed"], folders["mixed-w4-float"], args.work, args.vllm_python)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def write(loaded, calib, cfg, out: Path, record):
    from quantkit.formats.checkpoint import save_checkpoint
    from quantkit.quant.calibrate import calibrate

    model = copy.deepcopy(loaded.model)
    report = calibrate(model, loaded.hf_config, calib if cfg.method != "rtn" else None, cfg, progress=False)
    meta = {"method": cfg.method, "base_model": loaded.source, "recipe": cfg.to_flat(), "layers": report}
    if record is not None:
        meta["mixed_precision"] = record
    return save_checkpoint(out, model, loaded.hf_config, loaded.tokenizer, cfg.layout, meta)


def stored_bpw(loaded, folder: Path) -> float:
    from quantkit.formats.footprint import stored_bits
    from quantkit.quant.sensitivity import quantizable

    shapes = {f"model.layers.{i}.{n}": tuple(loaded.model.model.layers[i].get_submodule(n).weight.shape)
              for i, n in quantizable(loaded.model, "llama")}
    bits, weights = stored_bits(folder, shapes, "llama")
    return bits / weights


def wikitext(folder: Path, base: str, windows: int) -> dict:
    from quantkit.evals.runner import EvalSpec, run

    report = run(EvalSpec(candidate=str(folder), baseline=base, tasks=["wikitext"], windows=windows, seq_len=512))
    m = {r.metric: r for r in report.metrics}
    return {"kl_mean": m["kl_mean"].candidate, "kl_ci": [m["kl_mean"].delta.low, m["kl_mean"].delta.high],
            "ppl_fp16": m["ppl"].baseline, "ppl": m["ppl"].candidate, "top1_agree": m["top1_agree"].candidate}


def runtimes(mixed: Path, w4_float: Path, work: Path, vllm_python: str) -> list[dict]:
    """Greedy tokens in quantkit, transformers and vLLM of the mix of every candidate (gptq), of the 4-bit + float
    mix (gptq, and exported to compressed-tensors) and of uniform W4 g64 (gptq). The other runtimes run in
    bench/runtime_compat.py's child mode (`run_child`: its own venv's python, one process per folder)."""
    import runtime_compat as rc

    from quantkit import LLM, SamplingParams
    from quantkit.export import export
    from quantkit.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in rc.PROMPTS]
    ct = work / "mixed-w4-float-ct"
    if not (ct / "config.json").is_file():
        export(w4_float, "compressed-tensors", ct)
    rows = []
    uniform = work / "uniform-w4g64"  # the same comparison for one scheme everywhere: what bf16 alone changes
    for layout, path in (("gptq", mixed), ("gptq", w4_float), ("compressed-tensors", ct), ("gptq", uniform)):
        t = time.perf_counter()
        method = json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]
        llm = LLM(str(path), dtype="float32")
        params = SamplingParams(temperature=0, max_tokens=rc.MAX_TOKENS, ignore_eos=True)
        ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        # transformers' child scores quantkit's continuations teacher-forced (its argmax at every position)
        request = {"folder": str(path), "prompts": prompts, "quant_method": method, "continuations": ours}
        results = {"transformers": rc.run_child(sys.executable, "transformers", request, getattr(rc, "HF_ENV", {}),
                                                timeout=900)}
        if Path(vllm_python).is_file():
            results["vllm"] = rc.run_child(vllm_python, "vllm", request, rc.VLLM_ENV, timeout=1800)
        figures = {}
        for runtime, result in results.items():
            theirs = result.get("tokens")
            gaps = [] if theirs is None else [first_gap(llm.loaded.model, p, a, b)
                                              for p, a, b in zip(prompts, ours, theirs) if a != b]
            figures[runtime] = {"loads": theirs is not None,
                                "same_as_quantkit": "-" if theirs is None else
                                f"{sum(a == b for a, b in zip(ours, theirs))}/{len(ours)}",
                                "first_diff_logit_gaps": gaps, **{k: v for k, v in result.items() if k != "tokens"}}
        if "vllm" not in results:
            figures["vllm"] = f"not run: {vllm_python} does not exist"
        rows.append(stamp(f"runtimes: {path.name} ({layout})", t, **figures))
        del llm
    return rows


def first_gap(model, prompt: list[int], ours: list[int], theirs: list[int]) -> tuple[int, float]:
    """(position, logit of quantkit's token - logit of the other's) at the first difference, quantkit's fp32 forward:
    a gap near 0 is a near tie a bf16 rounding flips."""
    import torch

    t = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if t is None:  # one stopped early: equal as far as both go
        return min(len(ours), len(theirs)), float("nan")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours[:t]]))[0, -1].float()
    return t, round(float(logits[ours[t]] - logits[theirs[t]]), 4)


if __name__ == "__main__":
    main()
