"""Calibration on the bundled model: wall time, peak RSS and perplexity per method and scheme, quantkit's methods side
by side with llm-compressor's GPTQ on the same calibration tokens.

    python bench/calibrate.py [--runs gptq-w4g64,awq-w4g64,llmc-gptq-w4g64,...] [--data FILE | --data default]
                              [--num-samples 128] [--seq-len 512] [--windows 40] [--domains wikitext,sonnet,...]
                              [--llmcompressor-python /tmp/llmc_venv/bin/python] [--flags "--compute-dtype bfloat16"]
                              [--json calibrate.json] [--keep DIR]

Calibration tokens. --data is ../shared/data/wikitext-2/valid.txt unless told otherwise (the BENCHMARKS.md figures
were measured so); `--data default` is `quantkit calibrate`'s own default, the general set shipped in the package
(quantkit/calibration_data/general.jsonl: `--data` is then not passed, so a run is the CLI as a user gets it). A
child first tokenizes --data once with quantkit's `calibration_batches` (the function `quantkit calibrate` calls,
with CalibConfig's data_mode "concat" and seed 0, --num-samples x --seq-len) and writes the blocks to
calib_tokens.safetensors in the checkpoint folder (input_ids [N, L], lengths [N]) with their fingerprint (sha256
over shapes, tokens, lengths and mask: quantkit.data.fingerprint).

Runs. Each quantkit run is `quantkit calibrate` in a child process with the same --data, --num-samples and
--seq-len (and data_mode, seed left at their defaults); the fingerprint of the blocks it calibrated on, which it
records in its quantkit.json, must equal the dumped one, or the bench stops (so a --flags "--seed 1" is caught).
`gptq-cli-default` passes no method or scheme flag at all: GPTQ as `quantkit calibrate` defaults it (the bundled
model's widths give W4 g64 sym), whatever those defaults are when it runs; its recipe is recorded in the JSON.
`llmc-gptq-w4g64` is llm-compressor's GPTQModifier (W4 sym g64, lm_head ignored, its own dampening and actorder
defaults) in a child process of --llmcompressor-python (a venv with llmcompressor: PEERS.md) running
bench/peer_llmcompressor.py on the bundled model's float folder and exactly the dumped blocks (one
datasets.Dataset row per block: input_ids, attention_mask); it writes compressed-tensors, which quantkit loads. It is
skipped, with a message, when --llmcompressor-python is not given. Wall time and peak RSS of every run come from
os.wait4 on its child (this parent never imports torch, so a forked child starts small); they include loading the
model and writing the checkpoint.

Perplexity follows PEERS.md for every row, in another child: each domain's text read whole, tokenized once without
BOS, non-overlapping 512-token windows, the first --windows (the issue 23 protocol is 20), fp32, mean NLL over the
511 predictions of each window, exp. Domains (bench/generalisation.py's domain_texts): wikitext = wikitext-2 test,
sonnet = Shakespeare's sonnets (11 windows at most), gsm8k = GSM8K test questions + answers, chat = ShareGPT
first-turn prompts (with --data default gsm8k is not held out: the shipped set holds the first 150 GSM8K test
problems, where its windows start; the bench says so under the table). The load average is read at each calibration
start and each perplexity measurement. Prints a markdown table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

BENCH = Path(__file__).resolve().parent
SHARED = BENCH.parents[1] / "shared" / "data" / "wikitext-2"
PEER_SCRIPT = BENCH / "peer_llmcompressor.py"
DOMAINS = ("wikitext", "sonnet", "gsm8k", "chat")  # bench/generalisation.py's domain_texts()
TOKENS = "calib_tokens.safetensors"
# quantkit/calibration_data/README.md: the shipped set holds the first 150 GSM8K test problems, where the gsm8k
# domain's windows start (20 x 512 tokens is about the first 56 problems)
NOT_HELD_OUT = ("with --data default, gsm8k is not held out: the shipped calibration set holds the GSM8K test problems "
                "its windows are cut from")
RUNS = {
    "rtn-w4g64": ["--method", "rtn", "--bits", "4", "--group-size", "64", "--sym"],
    "rtn-w4g64-asym": ["--method", "rtn", "--bits", "4", "--group-size", "64", "--asym"],
    "rtn-w8g64": ["--method", "rtn", "--bits", "8", "--group-size", "64", "--sym"],
    "gptq-cli-default": [],
    "gptq-w4g64": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym"],
    "gptq-w4g64-nogar": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--no-group-aware"],
    "gptq-w4g64-fp32": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--compute-dtype", "float32"],
    "gptq-w4g64-act": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--act-order"],
    "gptq-w4g64-act-static": ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--act-order",
                              "--static-groups"],
    "gptq-w8g64": ["--method", "gptq", "--bits", "8", "--group-size", "64", "--sym"],
    "awq-w4g64": ["--method", "awq", "--bits", "4", "--group-size", "64", "--asym"],
    "awq-w4g64-rtn": ["--method", "awq", "--bits", "4", "--group-size", "64", "--asym", "--awq-rounding", "rtn"],
}
PEER_RUNS = {"llmc-gptq-w4g64": ["--bits", "4", "--group-size", "64"]}  # bench/peer_llmcompressor.py flags


def timed_child(cmd: list[str]) -> tuple[float, float, list[float]]:
    """Run `cmd`; -> (wall s, its peak RSS in GB via wait4, load average at its start). Stops the bench on failure."""
    load = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr}")
    return round(wall, 1), round(usage.ru_maxrss / 1e6, 2), load


def run_calibrate(name: str, flags: list[str], args, folder: Path, tokens: dict) -> dict:
    """One `quantkit calibrate` child: wall time, peak RSS, the per-layer report; checks its calibration tokens."""
    out = folder / name
    data = [] if args.data is None else ["--data", str(args.data)]
    cmd = [sys.executable, "-m", "quantkit.cli", "calibrate", *flags, *args.flags.split(), "--out", str(out),
           "--no-resume", "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), *data]
    wall, rss, load = timed_child(cmd)
    meta = json.loads((out / "quantkit.json").read_text())
    used = (meta.get("data") or {}).get("fingerprint")  # None: RTN reads no data (same_tokens None)
    if used is not None and used != tokens["fingerprint"]:
        raise SystemExit(f"{name} calibrated on other tokens than {tokens['path']} (fingerprint {used} != "
                         f"{tokens['fingerprint']}): its flags change the data, data_mode or seed")
    losses = [e["loss"] for e in meta["layers"] if e.get("loss") is not None]
    return {"run": name, "tool": "quantkit", "flags": " ".join([*flags, *args.flags.split()]), "recipe": meta["recipe"],
            "wall_s": wall, "peak_rss_gb": rss, "load_at_calibration": load,
            "same_tokens": None if used is None else True,
            "mean_layer_loss": sum(losses) / len(losses) if losses else None,
            "fallbacks": sum(bool(e.get("fallback")) for e in meta["layers"]), "folder": str(out)}


def run_peer(name: str, flags: list[str], args, folder: Path, tokens: dict) -> Optional[dict]:
    """llm-compressor's GPTQ in a child of --llmcompressor-python on the dumped tokens; None when not given."""
    if not args.llmcompressor_python:
        print(f"{name}: skipped: pass --llmcompressor-python PYTHON (a venv with llmcompressor, PEERS.md)",
              file=sys.stderr)
        return None
    out = folder / name
    cmd = [args.llmcompressor_python, str(PEER_SCRIPT), "--model", tokens["model_dir"], "--tokens", tokens["path"],
           "--out", str(out), *flags]
    wall, rss, load = timed_child(cmd)
    peer = json.loads((out / "peer.json").read_text())
    return {"run": name, "tool": f"llm-compressor {peer['versions']['llmcompressor']}", "flags": " ".join(flags),
            "peer": peer, "wall_s": wall, "peak_rss_gb": rss, "load_at_calibration": load, "same_tokens": True,
            "folder": str(out)}


def child_json(flags: list[str]) -> dict:
    """Run this script with internal `flags` in a child (it imports torch); -> the JSON of its last stdout line."""
    done = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(flags)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_tokens(path: Path, data: Optional[Path], num_samples: int, seq_len: int) -> None:
    """Tokenize the calibration data as `quantkit calibrate` does and write the blocks to `path`."""
    from safetensors.torch import save_file

    from quantkit.config import CalibConfig
    from quantkit.data import calibration_batches
    from quantkit.models.loader import load_tokenizer, locate

    cfg = CalibConfig()  # data_mode and seed as `quantkit calibrate` defaults them
    calib = calibration_batches(data, load_tokenizer(None), num_samples, seq_len, cfg.data_mode, cfg.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": calib.input_ids.contiguous(), "lengths": calib.lengths.contiguous()}, str(path),
              metadata={"fingerprint": calib.fingerprint, "source": str(calib.stats["source"])})
    print(json.dumps({"path": str(path), "fingerprint": calib.fingerprint, "model_dir": str(locate(None)[0]),
                      "source": calib.stats["source"], "mode": cfg.data_mode, "seed": cfg.seed,
                      "samples": calib.stats["samples"], "seq_len": seq_len, "tokens": int(calib.lengths.sum()),
                      "masked": calib.mask is not None}))


def print_ppl(source: str, windows: int, domains: list[str]) -> None:
    """Perplexity of `source` ("bundled" = the FP16 model) on each domain, and the load average when measured."""
    sys.path.insert(0, str(BENCH))
    from generalisation import domain_texts

    from quantkit.evals.perplexity import perplexity, text_windows
    from quantkit.models.loader import load_model

    loaded = load_model(None if source == "bundled" else source)
    texts = domain_texts()
    load = [round(x, 2) for x in os.getloadavg()]
    ppl, counts = {}, {}
    for d in domains:
        ids = text_windows(loaded.tokenizer, texts[d], 512, windows)
        ppl[d], counts[d] = perplexity(loaded.model, ids).ppl, int(ids.shape[0])
    print(json.dumps({"ppl": ppl, "windows": counts, "load_at_ppl": load}))


def table(rows: list[dict], fp16: dict, domains: list[str]) -> str:
    lines = ["| run | tool | " + " | ".join(f"{d} ppl" for d in domains) + " | wall time | peak RSS | load avg "
             "(calib; ppl) |", "|" + "---|" * (len(domains) + 5),
             "| FP16 (fp32 compute) | - | " + " | ".join(f"{fp16['ppl'][d]:.2f}" for d in domains)
             + f" | - | - | -; {fp16['load_at_ppl'][0] if fp16['load_at_ppl'] else '-'} |"]
    for r in rows:
        cells = [f"{r['ppl'][d]:.2f} ({100 * (r['ppl'][d] / fp16['ppl'][d] - 1):+.1f}%)" for d in domains]
        lines.append(f"| {r['run']} | {r['tool']} | " + " | ".join(cells) + f" | {r['wall_s']:.0f} s | "
                     f"{r['peak_rss_gb']:.2f} GB | {r['load_at_calibration'][0]:.1f}; {r['load_at_ppl'][0]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join([*RUNS, *PEER_RUNS])}")
    ap.add_argument("--data", default=str(SHARED / "valid.txt"),
                    help='calibration file, or "default": the set `quantkit calibrate` uses without --data')
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40, help="512-token windows per domain (issue 23: 20)")
    ap.add_argument("--domains", default="wikitext", help=f"comma list of {', '.join(DOMAINS)}")
    ap.add_argument("--fp16-ppl", type=float, help="the FP16 wikitext perplexity measured before (skips measuring "
                                                   "it; only with --domains wikitext)")
    ap.add_argument("--llmcompressor-python", help="python of a venv with llmcompressor, for the llmc-* runs")
    ap.add_argument("--flags", default="", help='more calibrate flags for every run, e.g. "--compute-dtype bfloat16"')
    ap.add_argument("--json", type=Path, default=Path("calibrate.json"))
    ap.add_argument("--keep", type=Path, help="write the checkpoints here (default: a temporary folder)")
    ap.add_argument("--ppl-of", help=argparse.SUPPRESS)  # internal: print one model's perplexity per domain
    ap.add_argument("--tokens-to", type=Path, help=argparse.SUPPRESS)  # internal: write the calibration blocks
    args = ap.parse_args()
    args.data = None if args.data == "default" else Path(args.data)
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    if args.ppl_of:
        return print_ppl(args.ppl_of, args.windows, domains)
    if args.tokens_to:
        return print_tokens(args.tokens_to, args.data, args.num_samples, args.seq_len)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS and n not in PEER_RUNS]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}: choose from {', '.join([*RUNS, *PEER_RUNS])}")
    if [d for d in domains if d not in DOMAINS] or not domains:
        raise SystemExit(f"--domains {args.domains!r}: choose from {', '.join(DOMAINS)}")
    if args.fp16_ppl is not None and domains != ["wikitext"]:
        raise SystemExit("--fp16-ppl is the wikitext figure: use it only with --domains wikitext")

    folder = args.keep or Path(tempfile.mkdtemp(prefix="quantkit-bench-calibrate-"))
    tokens = child_json(["--tokens-to", str(folder / TOKENS), "--num-samples", str(args.num_samples),
                         "--seq-len", str(args.seq_len), "--data", "default" if args.data is None else str(args.data)])
    ppl_flags = ["--windows", str(args.windows), "--domains", ",".join(domains)]
    fp16 = ({"ppl": {"wikitext": args.fp16_ppl}, "windows": None, "load_at_ppl": None}
            if args.fp16_ppl else child_json(["--ppl-of", "bundled", *ppl_flags]))
    rows = []
    for name in names:
        row = (run_peer(name, PEER_RUNS[name], args, folder, tokens) if name in PEER_RUNS
               else run_calibrate(name, RUNS[name], args, folder, tokens))
        if row is None:
            continue
        row.update(child_json(["--ppl-of", row["folder"], *ppl_flags]))
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{d} {row['ppl'][d]:.3f}" for d in domains) + f", {row['wall_s']} s, "
              f"{row['peak_rss_gb']} GB, load {row['load_at_calibration'][0]}; {row['load_at_ppl'][0]}",
              file=sys.stderr)
    note = NOT_HELD_OUT if args.data is None and "gsm8k" in domains else None
    print(table(rows, fp16, domains) + (f"\n\nnote: {note}" if note else ""))
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "calibration": f"{tokens['samples']} x {args.seq_len} tokens of {tokens['source']} ({tokens['mode']}, "
                             f"seed {tokens['seed']}), fingerprint {tokens['fingerprint']}", "tokens": tokens,
              "perplexity": f"first {args.windows} windows of 512 tokens per domain, fp32", "domains": domains,
              "note": note, "fp16": fp16, "runs": rows}
    args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
