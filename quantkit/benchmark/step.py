"""`quantkit bench step`: where a decode step's time goes, per batch size (the engine driven directly).

For each batch size B: B requests of random prompt tokens (greedy, ignore_eos) are added and prefilled, a few
warm-up steps run, then `steps` decode steps are timed. Per step (means over the timed steps):
  wall     engine.step()'s wall time (schedule, forward, sampling, outputs)
  kernels  on CPU, time inside the compute kernels during those steps: every call into the C kernels (the
           functions of each library kernels/cpu/build.py loaded, and the attention backend's decode/prefill
           kernels), torch's F.linear and F.scaled_dot_product_attention, and torch's packed int4/int8 kernels
           (tinygemm.matmul); outermost calls only, so nothing counts twice and kernels <= wall (a step replayed
           from its plan, serve/cpu_step_plans.py, is one call: run_plan). On CUDA, the time the GPU was busy:
           the union of every kernel's, copy's and fill's interval on the device (torch.profiler's CUDA activity,
           CUDA-graph replays included)
  host     wall - kernels: Python, scheduling, sampling, the small torch ops and the launchers' own checks; on
           CUDA, the time the GPU waited for the host (the host's CPU time says nothing there: a synchronising
           host spins, so its CPU time equals the wall time whoever sets the pace)
  floor    the bytes one step must read (the weights the kernels stream, stream_bytes below: a MoE block's experts
           at the share the step's tokens route to under uniform routing, exactly top_k at batch 1; plus the KV
           cache of the batch's contexts) over the bandwidth of a large tensor copy (read + written bytes / time)
The CPU timing wrappers cost ~1 us per kernel call, included in wall and host. Under the table: the bandwidth, and
per batch size the kernels taking the most time per step (calls per step in brackets; C functions by their C name).
"""

from __future__ import annotations

import ctypes
import dataclasses
import random
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

COLUMNS = ["batch", "wall ms", "kernels ms", "host ms", "kernel %", "weights MB", "KV MB", "floor ms", "wall/floor"]


class KernelTimer:
    """Accumulates the seconds spent in the compute kernels (module docstring) while active."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.seconds, self.calls, self._depth = 0.0, 0, 0
        self.by_name: dict[str, list] = {}  # kernel name -> [seconds, calls]

    def _timed(self, fn, name: str):
        entry = self.by_name.setdefault(name, [0.0, 0])

        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds += elapsed
                self.calls += 1
                entry[0] += elapsed
                entry[1] += 1
                self._depth -= 1

        return timed

    def _targets(self) -> Iterator[tuple[Any, str]]:
        """(object, attribute) of every kernel entry point to wrap."""
        from quantkit.kernels.cpu import build, tinygemm

        for lib in build._loaded.values():
            if lib is not None:
                yield from ((lib, name) for name, fn in list(vars(lib).items()) if isinstance(fn, ctypes._CFuncPtr))
        for name in ("decode_kernel", "prefill_kernel"):
            if isinstance(getattr(self.runner.attn, name, None), ctypes._CFuncPtr):
                yield self.runner.attn, name
        yield from ((F, "linear"), (F, "scaled_dot_product_attention"), (tinygemm, "matmul"))

    @contextmanager
    def active(self):
        saved = [(obj, name, getattr(obj, name)) for obj, name in self._targets()]
        try:
            for obj, name, fn in saved:
                setattr(obj, name, self._timed(fn, getattr(fn, "__name__", name)))
            yield self
        finally:
            for obj, name, fn in saved:
                setattr(obj, name, fn)


class DeviceKernelTimer:
    """KernelTimer's interface on CUDA: seconds = the time the GPU was busy while active (module docstring)."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        self.by_name: dict[str, list] = {}  # kernel name -> [seconds, launches]

    @contextmanager
    def active(self):
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield self
            torch.cuda.synchronize()
        spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == DeviceType.CUDA]  # microseconds
        for start, end, name in spans:
            entry = self.by_name.setdefault(name, [0.0, 0])
            entry[0] += (end - start) / 1e6
            entry[1] += 1
        self.seconds, self.calls = busy_seconds([(start, end) for start, end, _ in spans]), len(spans)


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of intervals (start, end) in microseconds, in seconds."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


def _storages(module: nn.Module) -> dict[int, int]:
    """{storage address: bytes} of the weights `module`'s decode step reads: each linear's kernel weight
    (PackedLinear's packed copy, QLinear's backend copies in use, else its buffers; plain Linear weights) and every
    other parameter except embedding tables (a step reads only its tokens' rows); a storage shared by several
    modules once."""
    from quantkit.quant.qlinear import QLinear
    from quantkit.serve.cpu_linear import PackedLinear

    seen: dict[int, int] = {}

    def add(obj) -> None:
        if isinstance(obj, torch.Tensor):
            seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                add(item)
        elif dataclasses.is_dataclass(obj):  # the Triton kernels' PackedWeight
            add([getattr(obj, f.name) for f in dataclasses.fields(obj)])

    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    linear_weights = set()
    for child in module.modules():
        if isinstance(child, PackedLinear):
            add([child.vnni if child.vnni is not None else child.onednn, child.bias])
        elif isinstance(child, QLinear):
            used = [v for v in child._prepared.values() if v is not None]
            add(used if used else list(child.buffers()))
        elif isinstance(child, nn.Linear):
            add([child.weight, child.bias])
            linear_weights.add(id(child.weight))
    for p in module.parameters():
        if id(p) not in embeddings or id(p) in linear_weights:
            add(p)
    return seen


def stream_bytes(model: nn.Module, tokens: int = 1) -> int:
    """Bytes of weights a decode step of `tokens` tokens reads (_storages), each MoE block's routed experts counted
    at the share of them such a step routes to under uniform routing, moe.routed_share (exactly top_k at 1 token)."""
    from quantkit.models.moe import MoE, routed_share

    total = sum(_storages(model).values())
    for block in model.modules():
        if isinstance(block, MoE):
            experts = sum(_storages(block.experts).values())
            total -= round(experts * (1 - routed_share(block.top_k, len(block.experts), tokens)))
    return total


def copy_bandwidth(device: torch.device = torch.device("cpu"), nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Bytes per second of a large tensor copy on `device` (read + written bytes over the best of `repeats`)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_batch(engine: Any, batch: int, prompt_len: int, steps: int, warmup: int = 2, seed: int = 0) -> dict:
    """Add `batch` random prompts, prefill them, time `steps` decode steps; one row (module docstring) without
    the floor."""
    from quantkit.serve.sampling_params import SamplingParams
    from quantkit.serve.validation import validate_request

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0.0, ignore_eos=True)
    ids = [f"step-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(engine.vocab_size) for _ in range(prompt_len)]
        engine.add_request(rid, validate_request(prompt, params, engine.vocab_size, engine.max_model_len,
                                                engine.cfg.max_num_seqs))
    try:
        started: set[str] = set()
        while len(started) < batch:  # prefill (chunked by the step budget) until every request has a token
            started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
        for _ in range(warmup):
            engine.step()
        timer = DeviceKernelTimer() if engine.runner.device.type == "cuda" else KernelTimer(engine.runner)
        with timer.active():
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = (time.perf_counter() - start) / steps
    finally:
        for rid in ids:
            engine.abort_request(rid)
    context = prompt_len + warmup + 1 + steps / 2  # mean tokens in each sequence's cache over the timed steps
    kernels = {name: (sec / steps, calls / steps) for name, (sec, calls) in timer.by_name.items() if calls}
    return {"batch": batch, "wall_s": wall, "kernel_s": timer.seconds / steps, "kernel_calls": timer.calls / steps,
            "kernels": kernels, "kv_bytes": batch * context * engine.runner.bytes_per_token}


def profile_steps(engine: Any, batches: list[int], prompt_len: int = 128, steps: int = 16,
                  bandwidth: float | None = None) -> list[dict]:
    """One row per batch size (module docstring), with the floor over `bandwidth` (copy_bandwidth() when None)."""
    rows = [profile_batch(engine, b, prompt_len, steps) for b in batches]
    bandwidth = bandwidth or copy_bandwidth(engine.runner.device)
    for row in rows:  # (after the forwards: QLinear builds its kernel copies lazily)
        weights = stream_bytes(engine.runner.model, row["batch"])
        row.update(weight_bytes=weights, bandwidth=bandwidth, floor_s=(weights + row["kv_bytes"]) / bandwidth)
    return rows


def format_table(rows: list[dict]) -> str:
    """A markdown table of profile_steps' rows (COLUMNS), the bandwidth underneath."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        host = r["wall_s"] - r["kernel_s"]
        cells = [str(r["batch"]), f"{r['wall_s'] * 1e3:.2f}", f"{r['kernel_s'] * 1e3:.2f}", f"{host * 1e3:.2f}",
                 f"{100 * r['kernel_s'] / r['wall_s']:.0f}", f"{r['weight_bytes'] / 1e6:.1f}",
                 f"{r['kv_bytes'] / 1e6:.2f}", f"{r['floor_s'] * 1e3:.2f}", f"{r['wall_s'] / r['floor_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if rows:
        lines.append(f"copy bandwidth {rows[0]['bandwidth'] / 1e9:.1f} GB/s (read + written), "
                     f"{torch.get_num_threads()} threads")
    for r in rows:
        top = sorted(r["kernels"].items(), key=lambda kv: -kv[1][0])[:6]
        lines.append(f"batch {r['batch']} kernels per step: " + ", ".join(
            f"{name} {sec * 1e3:.2f} ms ({calls:.0f})" for name, (sec, calls) in top))
    return "\n".join(lines)


def decode_rate(engine: Any, prompt: list[int], tokens: int, deadline_s: float = float("inf"),
                request_id: str = "decode-rate") -> tuple[float, int]:
    """One greedy request (ignore_eos) alone in `engine`: prefilled, then (decode tokens per second, steps) over
    `tokens` decode steps or as many as start within deadline_s."""
    from quantkit.serve.sampling_params import SamplingParams
    from quantkit.serve.validation import validate_request

    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, validate_request(prompt, params, engine.vocab_size, engine.max_model_len,
                                                    engine.cfg.max_num_seqs))
    try:
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass  # the prefill
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished() and time.perf_counter() - start < deadline_s:
            engine.step()
            steps += 1
        return steps / (time.perf_counter() - start), steps
    finally:
        engine.abort_request(request_id)


def rtn_quantize_linears(model: nn.Module, scheme: Any) -> int:
    """Replace every Linear calibration quantizes (sensitivity.quantizable: not the MoE routers) by an RTN QLinear of
    `scheme`, in place (benchmarks of quantized serving without a checkpoint on disk); returns how many."""
    from quantkit.quant.qlinear import QLinear
    from quantkit.quant.scheme import quantize_rtn
    from quantkit.quant.sensitivity import quantizable

    swaps = []
    for i, name in quantizable(model, model.config.model_type):
        parent_name, _, child_name = name.rpartition(".")
        parent = model.model.layers[i].get_submodule(parent_name)
        swaps.append((parent, child_name, getattr(parent, child_name)))
    for parent, name, child in swaps:
        qt = quantize_rtn(child.weight.detach().float(), scheme)
        bias = None if child.bias is None else child.bias.detach()
        setattr(parent, name, QLinear.from_qtensor(qt, bias))
    return len(swaps)
