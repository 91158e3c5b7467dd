"""Engine throughput and an attention check on random-weight models of real shapes: for a lent GPU machine, which
has no model files, no data sets and no network.

    python bench/engine_gpu.py --prepare DIR     # here: DIR/tokenizer/ (the bundled model's) + DIR/prompts.json
                                                 #   (chat-templated ShareGPT prompts, the ones serve_vs_naive sends)
    python bench/engine_gpu.py --inputs DIR [--shapes smollm2-135m,llama3-8b] [--schemes bf16,w4,w8]
                               [--num-prompts 64] [--output-len 128] [--eager] [--out engine_gpu.json]

Greedy with ignore_eos: every request produces exactly --output-len tokens whatever the weights are, so a random
model of a real shape does the same work per step as the trained one. Weights: N(0, 0.02) as transformers
initializes Llama, in bfloat16; W4/W8 are RTN (symmetric, group 128, or 64 where 128 does not divide a width)
of those weights, served through QLinear's Triton kernels. The timed engines replay CUDA graphs of their decode
steps (--eager: not; the sixteenth session's H200 figures, BENCHMARKS.md, were eager: the option was off).

Before the timed runs, on the first shape: the Triton paged-attention backend and the torch one (SDPA over
gathered blocks), both in bfloat16, against the same model in float32: the largest difference of the prompt
tokens' logprobs (prefill kernel) and of the generated tokens' logprobs up to the first differing token (decode
kernel); then a seeded
top-p/top-k sampling run with n=2 (the sampler's device path).
After each timed run, `quantkit bench step`'s table of that engine (--step-batches): per decode step the wall
time, the time the GPU was busy, the host's remainder and the memory floor. Prints one JSON line per run and a
markdown table last; --out gets every figure (atomic write).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

SHAPES = {  # config.json fields; the vocabulary is the bundled tokenizer's
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rope_theta=100000.0, tie_word_embeddings=True),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
}
VOCAB = 49152


def prepare(folder: Path) -> None:
    """Write the tokenizer and the prompts (token ids) this script reads on the GPU machine."""
    from engine_throughput import chat_prompts

    from quantkit.atomic import write_json
    from quantkit.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    tok.save_pretrained(folder / "tokenizer")
    prompts = chat_prompts(tok, "sharegpt", 256, 1024)
    write_json(folder / "prompts.json", prompts)
    print(f"wrote {folder}/tokenizer and {len(prompts)} prompts")


def group_size(shape: str) -> int:
    """128 where it divides every Linear's input width (SmolLM2's 576 takes 64, as its GPTQ checkpoints do)."""
    widths = (SHAPES[shape]["hidden_size"], SHAPES[shape]["intermediate_size"])
    return 128 if all(w % 128 == 0 for w in widths) else 64


def build(shape: str, scheme: str, device: str, dtype=None):
    """A random-weight LlamaForCausalLM of `shape` on `device` in `dtype` (bfloat16); W4/W8: every decoder Linear
    RTN-quantized into a QLinear. The same weights for every scheme and dtype. -> (model, hf_config)."""
    import torch

    from quantkit.config import QuantScheme
    from quantkit.models.llama import LlamaForCausalLM, ModelConfig
    from quantkit.quant.qlinear import QLinear
    from quantkit.quant.scheme import quantize_rtn

    hf = dict(model_type="llama", vocab_size=VOCAB, max_position_embeddings=4096, rms_norm_eps=1e-5,
              **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(ModelConfig.from_hf(hf)).to(device)  # the RoPE frequencies are built on CPU
    with torch.no_grad():  # transformers' Llama init (initializer_range 0.02): logits of a realistic scale
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    model.to(dtype or torch.bfloat16)
    if scheme != "bf16":
        q = QuantScheme(bits=int(scheme[1]), group_size=group_size(shape), sym=True)
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, torch.nn.Linear):
                        setattr(parent, name, QLinear.from_qtensor(quantize_rtn(child.weight.float(), q)))
    return model.eval(), hf


def engine(model, hf, tokenizer, folder: Path, kv_bytes: int, **kw):
    from quantkit import LLM
    from quantkit.models.loader import Loaded

    loaded = Loaded(model=model, tokenizer=tokenizer, hf_config=hf, source="random", path=folder)
    return LLM(loaded, kv_cache_memory=kv_bytes, max_num_seqs=256, **kw)


def attention_check(shape: str, device: str, tokenizer, folder: Path, kv_bytes: int, prompts) -> dict:
    """The Triton and the torch attention backends in bfloat16, each against the same model in float32 (torch
    attention): max |logprob difference| on the prompt tokens, and on the generated tokens up to the first one
    that differs; then the sampler's non-greedy path. On CUDA the Triton run is the default path the timed runs take
    (attention_backend auto: Triton attention, TritonOps' norms, RoPE and SiLU, the stacked projections)."""
    import torch

    from quantkit import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    runs = {}
    default = "auto" if device == "cuda" else "triton"
    for name, dtype, backend in (("fp32", torch.float32, "torch"), ("triton", None, default),
                                 ("torch", None, "torch")):
        model, hf = build(shape, "bf16", device, dtype)
        llm = engine(model, hf, tokenizer, folder, kv_bytes, attention_backend=backend)
        runs[name] = llm.generate(prompts, params)
        del llm, model
        free()
    result = {}
    for name in ("triton", "torch"):
        result[name] = logprob_diffs(runs[name], runs["fp32"])
    model, hf = build(shape, "bf16", device)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1, max_tokens=16, ignore_eos=True, n=2)
    llm = engine(model, hf, tokenizer, folder, kv_bytes)
    outs = llm.generate(prompts, sampled)  # the sampler's non-greedy path on the device
    del llm, model
    free()
    return {"prompts": len(prompts), "vs_fp32": result,
            "sampled_tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)}


def logprob_diffs(runs, reference) -> dict:
    """Max |logprob difference| of prompt tokens, and of generated tokens up to each output's first differing
    token; how many outputs are identical."""
    prompt_diff = decode_diff = 0.0
    identical = 0
    for a, b in zip(runs, reference):
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            prompt_diff = max(prompt_diff, max(abs(pa[t] - pb[t]) for t in pa if t in pb))
        oa, ob = a.outputs[0], b.outputs[0]
        identical += oa.token_ids == ob.token_ids
        for ta, tb, la, lb in zip(oa.token_ids, ob.token_ids, oa.logprobs, ob.logprobs):
            if ta != tb:
                break
            decode_diff = max(decode_diff, abs(la[ta] - lb[tb]))
    return {"prompt_logprob_max_diff": prompt_diff, "decode_logprob_max_diff": decode_diff,
            "identical_outputs": identical}


def profile(fn, *args) -> None:
    """cProfile of fn(*args): the 25 functions with the most own time, to stdout (where a step's host time goes)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn, *args)
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", type=Path, help="write the inputs folder here and exit")
    ap.add_argument("--inputs", type=Path, help="the folder --prepare wrote")
    ap.add_argument("--shapes", default="smollm2-135m,llama3-8b")
    ap.add_argument("--schemes", default="bf16,w4,w8", help="bf16, w4, w8 (RTN, symmetric, group 128 or 64)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--device", default="cuda", help="cuda (cpu only checks the script, on a tiny shape)")
    ap.add_argument("--profile", action="store_true", help="also cProfile 16 steps of each engine")
    ap.add_argument("--step-batches", default="1,8,64",
                    help="`quantkit bench step`'s table of each engine at these batch sizes (GPU busy time, the "
                         "host's remainder, the memory floor); empty: none")
    ap.add_argument("--kv-cache-gib", type=float, default=24.0, help="KV pool per engine")
    ap.add_argument("--eager", action="store_true",
                    help="every step eagerly (EngineConfig.cuda_graphs off, its default); without it the timed "
                         "engines replay CUDA graphs of their decode steps")
    ap.add_argument("--out", type=Path, default=Path("engine_gpu.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.prepare:
        prepare(args.prepare)
        return 0
    from engine_throughput import run

    from quantkit.atomic import write_json
    from quantkit.benchmark.step import format_table, profile_steps
    from transformers import AutoTokenizer

    import torch

    kv_bytes = int(args.kv_cache_gib * 2**30)
    tokenizer = AutoTokenizer.from_pretrained(args.inputs / "tokenizer")
    prompts = json.loads((args.inputs / "prompts.json").read_text())[: args.num_prompts]
    if args.device == "cpu":  # a script check: one tiny shape
        SHAPES["tiny"] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)
    else:
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = {"device": args.device if args.device == "cpu" else torch.cuda.get_device_name(), "runs": []}
    for i, shape in enumerate(args.shapes.split(",")):
        if i == 0:
            t0 = time.perf_counter()
            results["attention_check"] = {"shape": shape, **attention_check(shape, args.device, tokenizer, args.inputs,
                                                                           kv_bytes, prompts[:8])}
            print(json.dumps(results["attention_check"]), f"({time.perf_counter() - t0:.1f} s)", flush=True)
        for scheme in args.schemes.split(","):
            t0 = time.perf_counter()
            model, hf = build(shape, scheme, args.device)
            built = time.perf_counter() - t0
            backend = "torch" if args.device == "cpu" else "auto"
            llm = engine(model, hf, tokenizer, args.inputs, kv_bytes, attention_backend=backend,
                         cuda_graphs=not args.eager)
            ready = time.perf_counter() - t0
            run(llm, prompts[:4], 8)  # warm-up: kernel compiles and autotuning
            run(llm, prompts, 8)  # the batch sizes of the timed run (autotuning is keyed on rows)
            warm = time.perf_counter() - t0
            _, r = run(llm, prompts, args.output_len)
            if args.profile:
                profile(run, llm, prompts, 16)
            name = scheme if scheme == "bf16" else f"{scheme}g{group_size(shape)}"
            row = {"shape": shape, "scheme": name, "cuda_graphs": llm.engine.runner.graphs is not None,
                   "num_prompts": len(prompts), "output_len": args.output_len, "build_s": built, "ready_s": ready,
                   "warm_s": warm, **r}
            if args.step_batches:
                try:  # a device run is one shot: a profiler failure must not cost the schemes after this one
                    row["step_profile"] = profile_steps(llm.engine, [int(b) for b in args.step_batches.split(",")])
                    print(f"{shape} {name}, decode steps:\n{format_table(row['step_profile'])}", flush=True)
                except Exception as exc:  # noqa: BLE001 - recorded in the row and printed, never lost
                    row["step_profile_error"] = repr(exc)
                    print(f"{shape} {name}: the step table failed: {exc!r}", flush=True)
            if args.device != "cpu":
                row["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            results["runs"].append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
                              if k != "step_profile"}), flush=True)
            write_json(args.out, results)
            del llm, model
            free()
    print("\n| shape | scheme | CUDA graphs | output tok/s | ms/step | steps | engine ready s |\n"
          "|---|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['shape']} | {r['scheme']} | {'yes' if r['cuda_graphs'] else 'no'} | {r['output_tok_s']:.0f} | "
              f"{r['ms_per_step']:.2f} | {r['steps']} | {r['ready_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
