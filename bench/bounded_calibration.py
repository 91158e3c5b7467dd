"""Calibration in bounded host memory on a ~3B-parameter Llama-shaped model: peak RSS against the weights' size, and
the checkpoint against an unbounded run's.

    python bench/bounded_calibration.py --dir /tmp/qk_3b [--method rtn] [--budget 25%] [--num-samples 12]
                                        [--seq-len 256] [--layers 28] [--no-unbounded] [--json FILE]

--dir caches the model: random weights (seeded; N(0, 0.02), norms N(1, 0.1)) of hidden 3072, 28 layers, 24 query /
8 KV heads of 128, intermediate 8192, the bundled tokenizer's vocabulary (49152, untied lm_head): 3.1B parameters,
6.2 GB of bf16 safetensors in shards of at most 2 GB, built once by a child process. Then `quantkit calibrate` runs
in a child twice, one after the other: with --max-host-memory (default 25% of the weight bytes) and without (the
whole model in memory: its float32 weights, 2x the bf16 bytes; not started with less than 2.5x the weight bytes
available, and refused if the CLI switched to the bounded path by itself). Peak RSS is each child's ru_maxrss from
os.wait4 (this parent never imports torch); the checkpoints' safetensors files are compared byte for byte (sha256).
--layers below 28 builds a slice of the same shapes (a block's working set, e.g. GPTQ's, without hours of solves).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
             num_key_value_heads=8, head_dim=128, vocab_size=49152)
SHARD_BYTES = 2 * 1000**3


def hf_config(layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPE, "num_hidden_layers": layers,
            "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2}


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF Llama checkpoint names -> shapes, in checkpoint order."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                       p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (cfg["vocab_size"], h)})
    return shapes


def build(folder: Path, layers: int) -> None:
    """The random-weight model folder (run in a child: torch stays out of this process)."""
    import math

    import torch
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    from quantkit.models.loader import bundled_model_dir

    cfg = hf_config(layers)
    shapes = tensor_shapes(cfg)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for k, names in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            t = torch.empty(shapes[name])
            if "norm" in name:
                t.normal_(1.0, 0.1, generator=gen)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            tensors[name] = t.to(torch.bfloat16)
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
        print(f"wrote {fname} ({len(names)} tensors)", file=sys.stderr)
    total = sum(2 * math.prod(s) for s in shapes.values())
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    PreTrainedTokenizerFast.from_pretrained(bundled_model_dir()).save_pretrained(tmp)
    os.replace(tmp, folder)


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("model-*.safetensors"))


def calibrate(folder: Path, name: str, args, extra: list[str]) -> dict:
    """One `quantkit calibrate` child: wall time, peak RSS (its own, via wait4), its log."""
    out, work = folder.parent / f"{folder.name}-{name}", folder.parent / f".{folder.name}-{name}.work"
    cmd = [sys.executable, "-m", "quantkit.cli", "calibrate", str(folder), "--method", args.method, "--bits", "4",
           "--group-size", "128", "--out", str(out), "--work-dir", str(work), "--no-resume", *extra]
    if args.method != "rtn":
        cmd += ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len)]
    print(" ".join(cmd), file=sys.stderr)
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "QUANTKIT_DEBUG": "1"})
    log = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{name} failed:\n{log[-4000:]}")
    return {"run": name, "command": " ".join(cmd[1:]), "wall_s": round(wall, 1), "log": log, "out": out,
            "peak_rss_bytes": usage.ru_maxrss * 1024}  # ru_maxrss: KiB on Linux


def sha256s(folder: Path) -> dict[str, str]:
    digests = {}
    for path in sorted(folder.glob("model*.safetensors")):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        digests[path.name] = h.hexdigest()
    return digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the model is built once (about 6.2 GB)")
    parser.add_argument("--method", default="rtn", choices=["rtn", "gptq", "awq"])
    parser.add_argument("--budget", default="25%", help="--max-host-memory: a size, or a percentage of the weights")
    parser.add_argument("--num-samples", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--no-unbounded", action="store_true", help="skip the whole-model run and the comparison")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = args.dir / f"llama-3b-{args.layers}l-bf16"
    if args.build_only:
        build(folder, args.layers)
        return
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--dir", str(args.dir), "--layers", str(args.layers),
                        "--build-only"], check=True)
    weights = weight_bytes(folder)
    budget = (f"{int(weights * float(args.budget[:-1]) / 100)}" if args.budget.endswith("%") else args.budget)
    load = [open("/proc/loadavg").read().split()[0]]
    runs = [calibrate(folder, "bounded", args, ["--max-host-memory", budget])]
    load.append(open("/proc/loadavg").read().split()[0])
    if not args.no_unbounded:
        available = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo")
                         if line.startswith("MemAvailable"))
        if available < 2.5 * weights:  # the CLI's own rule (quant/bounded.py): float32 (2x) within 80% of it
            raise SystemExit(f"the unbounded run needs about {2.5 * weights / 1e9:.0f} GB, {available / 1e9:.0f} GB "
                             f"are available: not started (rerun later, or --no-unbounded)")
        runs.append(calibrate(folder, "unbounded", args, []))
        load.append(open("/proc/loadavg").read().split()[0])
        if "one block at a time" in runs[1]["log"]:
            raise SystemExit("the unbounded run switched to the bounded path (too little memory free): no comparison")
    print(f"\n{args.method}, {weights / 1e9:.2f} GB of bf16 weights ({folder}), --max-host-memory {budget} bytes, "
          f"load average {' / '.join(load)} (start / after each run)\n")
    print("| run | peak RSS (GB) | RSS / weight bytes | wall (s) |")
    print("|---|---|---|---|")
    for r in runs:
        print(f"| {r['run']} | {r['peak_rss_bytes'] / 1e9:.2f} | {r['peak_rss_bytes'] / weights:.1%} | {r['wall_s']} |")
    result = {"method": args.method, "weight_bytes": weights, "budget": budget, "loadavg": load,
              "runs": [{k: v for k, v in r.items() if k not in ("log", "out")} for r in runs]}
    if not args.no_unbounded:
        a, b = sha256s(runs[0]["out"]), sha256s(runs[1]["out"])
        result["identical"] = a == b and bool(a)
        print(f"\ncheckpoint safetensors byte-identical to the unbounded run's: {result['identical']} "
              f"({len(a)} files)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
