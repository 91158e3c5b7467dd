"""Does a calibration generalise? Perplexity on the calibration domain's test split AND on held-out domains.

    nice -n 10 python bench/generalisation.py [--configs gptq,gptq-damp0.1,...] [--windows 20] [--seq-len 512]
                                              [--work /tmp/quantkit-generalisation] [--json generalisation.json]
                                              [--tag T] [--fresh NAME,...] [--remeasure] [--list]

Every configuration calibrates the bundled model (W4 g64 symmetric unless it says otherwise; 128 x 512 tokens of
wikitext-2 valid, the CLI defaults, unless it says otherwise) in this process through
`quantkit.quant.calibrate.calibrate` (the function `quantkit calibrate` calls), then measures perplexity with the
PEERS.md protocol (the text tokenized once without BOS, non-overlapping 512-token windows, the first 20, each window
in fp32, mean NLL over its 511 predictions, exp; evals/perplexity.py) on:

  wikitext   wikitext-2 test                      (the calibration domain's test split)
  sonnet     Shakespeare's sonnets 1-37            (poetry; 23 KB: all the windows it holds, 11 of 512)
  gsm8k      GSM8K test, question + worked answer  (math word problems)
  chat       ShareGPT first-turn user prompts      (chat: instructions, code, other languages)

None of the held-out sets is in any calibration set. FP32 and RTN run as references in the same run. The quantized
weights of each configuration, and each measurement (perplexity is deterministic: the same weights and windows give
the same bits), are cached under --work (keyed by the configuration's flat keys and --tag), so a rerun only does what
is new; `--fresh` recalibrates and remeasures, `--remeasure` remeasures (change --tag after a change to the
quantization code). Each row records the load average at calibration and at measurement
(os.getloadavg) and the calibration's wall and CPU seconds. "mean loss" = the mean over the four domains of
ln(ppl / ppl_FP32) (nats per token lost to quantization); "worst" = the largest relative increase.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantkit.config import CalibConfig  # noqa: E402
from quantkit.data import calibration_batches, read_rows, read_text, row_text, shared_data_dir  # noqa: E402
from quantkit.evals.perplexity import perplexity, text_windows  # noqa: E402

BASE = {"bits": 4, "group_size": 64}  # what `quantkit calibrate` picks for the bundled model (576 columns)
MIX = "mix"  # data key: the mixed calibration file built under --work
# name -> the flat CalibConfig keys it changes (quantkit.config.CALIB_KEYS); None = the FP32 model itself
CONFIGS: dict[str, dict | None] = {
    "fp32": None,
    "rtn": {"method": "rtn"},
    "rtn-asym": {"method": "rtn", "sym": False, "format": "gptq_v2"},
    "rtn-clip": {"method": "rtn", "clip_search": True},  # bench only: RTN with the clip search of GPTQ's quantizer
    "awq": {"method": "awq"},  # asymmetric (the CLI default for AWQ)
    "gptq": {"method": "gptq"},  # the CLI default before issue 23: GAR, damp 0.01, compute auto (bf16 on AMX)
    "gptq-damp0.05": {"method": "gptq", "damp": 0.05},
    "gptq-damp0.1": {"method": "gptq", "damp": 0.1},
    "gptq-damp0.3": {"method": "gptq", "damp": 0.3},
    "gptq-nogar": {"method": "gptq", "group_aware": False},
    "gptq-act": {"method": "gptq", "act_order": True},
    "gptq-act-static": {"method": "gptq", "act_order": True, "static_groups": True},  # the shipped recipe
    "gptq-static": {"method": "gptq", "static_groups": True},  # GAR order, qparams fit up front on W
    "gptq-nogar-static": {"method": "gptq", "group_aware": False, "static_groups": True},
    "gptq-static-clip": {"method": "gptq", "static_groups": True, "clip_search": True},
    "gptq-act-static-fp32": {"method": "gptq", "act_order": True, "static_groups": True, "compute_dtype": "float32"},
    "gptq-fp32": {"method": "gptq", "compute_dtype": "float32"},
    "gptq-n32": {"method": "gptq", "num_samples": 32},
    "gptq-n256": {"method": "gptq", "num_samples": 256},
    "gptq-seq2048": {"method": "gptq", "num_samples": 32, "seq_len": 2048},
    "gptq-mix": {"method": "gptq", "data": MIX},
    "gptq-clip": {"method": "gptq", "clip_search": True},
    "gptq-clip-damp0.1": {"method": "gptq", "clip_search": True, "damp": 0.1},
    "gptq-act-static-clip": {"method": "gptq", "act_order": True, "static_groups": True, "clip_search": True},
    "gptq-act-static-clip-damp0.05": {"method": "gptq", "act_order": True, "static_groups": True, "clip_search": True,
                                      "damp": 0.05},
    "gptq-act-static-clip-fp32": {"method": "gptq", "act_order": True, "static_groups": True, "clip_search": True,
                                  "compute_dtype": "float32"},
    "gptq-act-static-clip-asym": {"method": "gptq", "act_order": True, "static_groups": True, "clip_search": True,
                                  "sym": False, "format": "gptq_v2"},
    "gptq-act-clip": {"method": "gptq", "act_order": True, "clip_search": True},
    "awq-mix": {"method": "awq", "data": MIX},
}
DOMAINS = ("wikitext", "sonnet", "gsm8k", "chat")


def domain_texts() -> dict[str, str]:
    d = shared_data_dir()
    gsm = [f"{r.prompt}\n{r.answer}" for r in read_rows(d / "gsm8k" / "test.jsonl")]
    chat = [r.messages[0]["content"] for r in read_rows(d / "chat-sharegpt" / "sharegpt_v3_filtered_1000.jsonl")]
    return {"wikitext": read_text(d / "wikitext-2" / "test.txt"),
            "sonnet": (d / "sonnet" / "sonnet.txt").read_text().replace("\r\n", "\n"),
            "gsm8k": "\n\n".join(gsm), "chat": "\n\n".join(chat)}


def build_mix(path: Path, tokenizer, seed: int = 0) -> Path:
    """A jsonl of text rows: wikitext-2 valid, HellaSwag contexts + endings, PIQA goals + solutions, ARC-Easy
    questions + answers, about a quarter of the tokens each, shuffled (seeded). None is a held-out domain."""
    if path.is_file():
        return path
    d = shared_data_dir()
    sources = {"wikitext": [r.text for r in read_rows(d / "wikitext-2" / "valid.txt")],
               "hellaswag": [row_text(r) for r in read_rows(d / "hellaswag" / "hellaswag_val_3000.jsonl")],
               "piqa": [row_text(r) for r in read_rows(d / "piqa" / "piqa_validation.jsonl")],
               "arc": [row_text(r) for r in read_rows(d / "arc-easy" / "arc_easy_test.jsonl")]}
    counts = {k: [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in v] for k, v in sources.items()}
    budget = min(sum(c) for c in counts.values())  # every source gives the same number of tokens
    rows = []
    for name, texts in sources.items():
        used = 0
        for text, n in zip(texts, counts[name]):
            if used >= budget:
                break
            rows.append(text)
            used += n
    random.Random(seed).shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    os.replace(tmp, path)
    return path


def calib_config(name: str, work: Path, tokenizer) -> CalibConfig:
    flat = {**BASE, **CONFIGS[name]}
    if flat.get("data") == MIX:
        flat["data"] = str(build_mix(work / "mix.jsonl", tokenizer))
    return CalibConfig.from_flat(flat)


# keys added to CalibConfig after checkpoints were cached: left out of the cache key while they hold these values
LATER_KEYS = {"clip_search": False, "moe_min_tokens": None}


def cache_key(cfg: CalibConfig, tag: str) -> str:
    """The identity of a calibrated checkpoint: every flat key of its CalibConfig (so a configuration that only
    restates the defaults shares the cache of the defaults) and the tag."""
    flat = {k: v for k, v in cfg.to_flat().items() if k not in LATER_KEYS or LATER_KEYS[k] != v}
    return hashlib.sha256(json.dumps([flat, tag], sort_keys=True).encode()).hexdigest()[:12]


def quantize(name: str, pristine, loaded, work: Path, fresh: bool, version: str) -> tuple[dict, dict]:
    """-> ({"qts": {Linear name: QTensor}, "floats": {name: float tensor the calibration changed (AWQ's folded
    norms)}}, calibration info), from the cache under `work` when present."""
    from quantkit.quant.calibrate import calibrate
    from quantkit.quant.qlinear import QLinear
    from quantkit.quant.scheme import quantize_rtn

    cfg = calib_config(name, work, loaded.tokenizer)
    path = work / "ckpt" / f"{cache_key(cfg, version)}.pt"
    if path.is_file() and not fresh:
        saved = torch.load(path, weights_only=False)
        return {"qts": saved["qts"], "floats": saved.get("floats", {})}, {**saved["info"], "cached": True}
    model = copy.deepcopy(pristine)
    calib = None
    if cfg.method != "rtn":
        calib = calibration_batches(cfg.data, loaded.tokenizer, cfg.num_samples, cfg.seq_len, cfg.data_mode, cfg.seed)
    load_before = os.getloadavg()
    wall, cpu = time.perf_counter(), time.process_time()
    if cfg.method == "rtn" and cfg.clip_search:  # a reference, not a CLI method: RTN with GPTQ's clip search
        report, qts = [], {n: quantize_rtn(m.weight.detach().float(), cfg.scheme, n, clip=True)
                           for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    else:
        report = calibrate(model, loaded.hf_config, calib, cfg, work_dir=None, progress=False,
                           log=lambda s: print(f"  {s}", file=sys.stderr))
        qts = {n: m.qtensor() for n, m in model.named_modules() if isinstance(m, QLinear)}
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    losses = [e["loss"] for e in report if e.get("loss") is not None]
    before = pristine.state_dict()
    floats = {n: t.clone() for n, t in model.state_dict().items()  # AWQ folds its scales into the norms
              if n in before and t.is_floating_point() and not torch.equal(t, before[n])}
    info = {"flat": cfg.to_flat(), "calib_wall_s": round(wall, 1), "calib_cpu_s": round(cpu, 1),
            "load_at_calibration": [round(x, 2) for x in load_before], "threads": torch.get_num_threads(),
            "mean_layer_loss": sum(losses) / len(losses) if losses else None,
            "damp_escalations": sum(1 for e in report if e.get("damp") not in (None, cfg.damp)),
            "fallbacks": sum(bool(e.get("fallback")) for e in report),
            "tokens": None if calib is None else int(calib.lengths.sum()), "cached": False}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"qts": qts, "floats": floats, "info": info}, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    return {"qts": qts, "floats": floats}, info


def with_weights(pristine, saved: dict):
    """The float model with the calibration's changed float tensors and each quantized Linear's weight =
    dequantize(QTensor) in fp32: the same fp32 math as QLinear's CPU fp32 path (dequantize, then F.linear), without
    re-dequantizing on every call."""
    from quantkit.quant.scheme import dequantize

    model = copy.deepcopy(pristine)
    model.load_state_dict(saved["floats"], strict=False)
    for name, qt in saved["qts"].items():
        model.get_submodule(name).weight.data = dequantize(qt, torch.float32)
    return model


def measure(model, windows: dict[str, torch.Tensor]) -> dict[str, float]:
    return {d: perplexity(model, w).ppl for d, w in windows.items()}


def table(rows: list[dict], fp32: dict[str, float]) -> str:
    head = ("| config | " + " | ".join(DOMAINS) + " | mean loss (nats) | worst | beats RTN on all | calib wall / CPU s"
            " | load avg (calib; ppl) |")
    lines = [head, "|" + "---|" * (len(DOMAINS) + 6)]
    rtn = next((r["ppl"] for r in rows if r["config"] == "rtn"), None)
    for r in rows:
        ppl = r["ppl"]
        cells = [f"{ppl[d]:.2f}" if r["config"] == "fp32" else f"{ppl[d]:.2f} ({100 * (ppl[d] / fp32[d] - 1):+.0f}%)"
                 for d in DOMAINS]
        beats = "-" if rtn is None or r["config"] in ("fp32", "rtn") else (
            "yes" if all(ppl[d] < rtn[d] for d in DOMAINS) else "no (" + ", ".join(d for d in DOMAINS
                                                                                     if ppl[d] >= rtn[d]) + ")")
        info = r.get("info") or {}
        t = f"{info['calib_wall_s']:.0f} / {info['calib_cpu_s']:.0f}" if info.get("calib_wall_s") is not None else "-"
        la = info.get("load_at_calibration")
        load = f"{la[0]:.1f}" if la else "-"
        lines.append(f"| {r['config']} | " + " | ".join(cells) + f" | {r['mean_loss']:.4f} | {r['worst_pct']:+.1f}% | "
                     f"{beats} | {t} | {load}; {r['load_at_ppl'][0]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma list (fp32 and rtn are always added)")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantkit-generalisation"))
    ap.add_argument("--json", type=Path, default=Path("/tmp/quantkit-generalisation/generalisation.json"))
    ap.add_argument("--tag", default="1", help="part of the cache key: change it when the quantization code changes")
    ap.add_argument("--fresh", default="", help="comma list of configs to recalibrate even when cached")
    ap.add_argument("--remeasure", action="store_true", help="measure perplexity again even where it is cached")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    args = ap.parse_args()
    if args.list:
        for name, flat in CONFIGS.items():
            print(f"{name}: {flat}")
        return
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}: choose from {', '.join(CONFIGS)}")
    names = list(dict.fromkeys(["fp32", "rtn", *names]))
    fresh = {n.strip() for n in args.fresh.split(",") if n.strip()}

    from quantkit.models.loader import load_model

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    loaded = load_model(None, dtype=torch.float32)
    pristine = loaded.model.eval()
    texts = domain_texts()
    windows = {d: text_windows(loaded.tokenizer, texts[d], args.seq_len, args.windows) for d in DOMAINS}
    version = args.tag
    rows = []
    fp32 = None
    for name in names:
        t0 = time.perf_counter()
        key = "fp32" if CONFIGS[name] is None else cache_key(calib_config(name, args.work, loaded.tokenizer), version)
        measured = args.work / "ppl" / f"{key}-{args.windows}x{args.seq_len}.json"
        if measured.is_file() and name not in fresh and not args.remeasure:  # deterministic: same weights, same ppl
            cached = json.loads(measured.read_text())
            info, ppl, load = cached["info"], cached["ppl"], cached["load_at_ppl"]
        else:
            if CONFIGS[name] is None:
                info, model = None, pristine
            else:
                saved, info = quantize(name, pristine, loaded, args.work, name in fresh, version)
                model = with_weights(pristine, saved)
            load = [round(x, 2) for x in os.getloadavg()]
            ppl = measure(model, windows)
            measured.parent.mkdir(parents=True, exist_ok=True)
            measured.write_text(json.dumps({"info": info, "ppl": ppl, "load_at_ppl": load,
                                            "measured": time.strftime("%Y-%m-%d %H:%M:%S")}))
        fp32 = fp32 or ppl
        nll = {d: float(torch.log(torch.tensor(ppl[d] / fp32[d]))) for d in DOMAINS}
        rows.append({"config": name, "flat": None if info is None else info["flat"], "ppl": ppl, "info": info,
                     "mean_loss": sum(nll.values()) / len(nll),
                     "worst_pct": max(100 * (ppl[d] / fp32[d] - 1) for d in DOMAINS),
                     "load_at_ppl": load, "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{name}: " + ", ".join(f"{d} {ppl[d]:.2f}" for d in DOMAINS) + f" ({rows[-1]['seconds']} s, load "
              f"{load[0]:.2f}{'' if info is None or not info['cached'] else ', cached'})", file=sys.stderr, flush=True)
    out = table(rows, fp32)
    note = (f"\nbundled SmolLM2-135M-Instruct, W4 g64 (sym unless named asym); perplexity: first {args.windows} x "
            f"{args.seq_len}-token windows per domain (" + ", ".join(f"{d} {windows[d].shape[0]}" for d in DOMAINS)
            + f"), fp32; {started} - {time.strftime('%H:%M:%S')}; {os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads; peak RSS "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
    print(out + "\n" + note)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"started": started, "windows": {d: int(w.shape[0]) for d, w in windows.items()},
                                     "seq_len": args.seq_len, "tag": version, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
