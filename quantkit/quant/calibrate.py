"""The calibration driver shared by every method (RTN, GPTQ, AWQ). The whole loop is `calibrate` below:

    x = embed(tokens)                                   # [N, L, H], on CPU, computed once
    for each block (only this block on the compute device):
        for each stage (the registry's true-sequential order [k,v,q] -> [o] -> [up,gate] -> [down]; AWQ: one stage):
            run the block over x with hooks accumulating each stage Linear's input statistics (stopping early)
            method.quantize_stage -> QTensors; those Linears now compute with their dequantized weights
        x = block(x)                                    # the quantized block's outputs feed the next block
        nn.Linear -> QLinear; the block is written durably to the work folder (a rerun resumes after it)
The methods (quant/rtn.py, gptq.py, awq.py) only see weights and statistics: `needs` names the statistics
("hessian": X^T X, "magnitude": sum |x|), `true_sequential` whether they take the stages one at a time.
MoE blocks: each expert's Linears are recorded on exactly the tokens routed to it (the router's output, read by a
hook, says which); an expert routed fewer than cfg.moe_min_tokens is recorded instead on a forced-routing pass (every
token, weighted by its router probability: quant/moe_calibration.py).
Bounded memory (`weights`, quantkit calibrate --max-host-memory): the model is on the meta device, each block is read
from the safetensors shards just before it runs and freed once written (quant/lazy_weights.py), x spills to the work
folder when it does not fit (quant/activation_store.py), and the checkpoint streams from the work folder
(quant/bounded.py). The same numbers meet the same operations in the same order, so the codes are the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

import quantkit
from quantkit.config import CalibConfig
from quantkit.errors import QuantkitError
from quantkit.kernels.cpu.capability import onednn_bf16
from quantkit.models.registry import arch_spec
from quantkit.quant.activation_store import INPUTS, NEXT, Activations, Successor, fits
from quantkit.quant.awq import AWQ, accumulate_magnitude
from quantkit.quant.gptq import GPTQ, accumulate_hessian, finish_hessian
from quantkit.quant.hooked_pass import ForwardDone, hooked_pass
from quantkit.quant.lazy_weights import LazyWeights
from quantkit.quant.moe_calibration import force_starved_experts, resolve_min_tokens, stats_report
from quantkit.quant.resume import WorkFolder
from quantkit.quant.rtn import RTN
from quantkit.quant.scheme import QTensor, dequantize

class InputStats:
    """Statistics of one Linear input over the calibration tokens (Linears fed the same tensor share one)."""

    def __init__(self, k: int, needs: tuple[str, ...], device):
        self.h_sum = torch.zeros(k, k, device=device) if "hessian" in needs else None  # [K, K] fp32
        self.abs_sum = torch.zeros(k, device=device) if "magnitude" in needs else None  # [K] fp32
        self.tokens = self.samples = 0

    def add(self, tokens: torch.Tensor, samples: int) -> None:
        """tokens [T, K]: the inputs that count; samples: how many calibration samples they come from."""
        if self.h_sum is not None:
            accumulate_hessian(self.h_sum, tokens)
        if self.abs_sum is not None:
            accumulate_magnitude(self.abs_sum, tokens)
        self.tokens += tokens.shape[0]
        self.samples += samples

    def finite(self) -> bool:
        return all(bool(torch.isfinite(t).all()) for t in (self.h_sum, self.abs_sum) if t is not None)

    def hessian(self) -> torch.Tensor:
        return finish_hessian(self.h_sum, self.tokens)

    def magnitude(self) -> torch.Tensor:
        return self.abs_sum / max(self.tokens, 1)


class Replay:
    """Outputs of block submodules whose Linears are all quantized (self_attn once [k,v,q] and [o] are), recorded
    by the first forward that runs them and replayed by the later forwards of the same block, which skip
    recomputing them. A replayed output is the recorded tensor, so nothing downstream changes by a bit."""

    def __init__(self, block: nn.Module, linears):
        self.block = block
        self.members: dict[str, set[str]] = {}  # submodule path -> the Linears under it
        for name in linears:
            parent = name.rpartition(".")[0]
            if parent:
                self.members.setdefault(parent, set()).add(name)
        self.outputs: dict[str, list[torch.Tensor]] = {}  # path -> one output per batch, in call order

    @contextlib.contextmanager
    def forward(self, done: set[str], batches: int, record: bool = True):
        swapped, handles = [], []
        for path, members in self.members.items():
            if not members <= done:
                continue
            module = self.block.get_submodule(path)
            if len(self.outputs.get(path, ())) == batches:
                swapped.append((path, module))
                set_submodule(self.block, path, _Replayed(self.outputs[path]))
            elif record:
                keep = self.outputs[path] = []
                handles.append(module.register_forward_hook(lambda m, args, out, keep=keep: keep.append(out)))
        try:
            yield
        finally:
            for path, module in swapped:
                set_submodule(self.block, path, module)
            for handle in handles:
                handle.remove()


class _Replayed(nn.Module):
    def __init__(self, outputs: list[torch.Tensor]):
        super().__init__()
        self.outputs, self.calls = outputs, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.outputs[self.calls - 1]


def make_method(cfg: CalibConfig, model_type: str):
    if cfg.layer_schemes:  # each Linear by the method of its own scheme (quant/per_layer.py)
        from quantkit.quant.per_layer import PerLayerSchemes

        return PerLayerSchemes(cfg, lambda c: make_method(c, model_type))
    if cfg.method == "rtn":
        return RTN(cfg.scheme)
    gptq = GPTQ(cfg.scheme, cfg.damp, cfg.block_size, cfg.group_aware, cfg.clip_search)
    if cfg.method == "gptq":
        return gptq
    return AWQ(cfg.scheme, arch_spec(model_type), rounding=gptq if cfg.awq_rounding == "gptq" else None)


def token_mask(calib) -> torch.Tensor:
    """bool [N, L]: real (unpadded) tokens, restricted to assistant/completion tokens when the data has a mask."""
    n, seq = calib.input_ids.shape
    valid = torch.arange(seq)[None, :] < calib.lengths[:, None]
    return valid & calib.mask if calib.mask is not None else valid


def check_tokens(mask: torch.Tensor, hidden: int, cfg: CalibConfig, log: Callable[[str], None]) -> None:
    samples, tokens = mask.shape[0], int(mask.sum())
    if tokens < hidden:
        raise QuantkitError(
            f"calibration data gives {tokens} tokens ({samples} samples x {mask.shape[1]}), fewer than the hidden "
            f"size {hidden} a full-rank statistic needs: add data or raise --num-samples / --seq-len"
        )
    if samples < cfg.num_samples:
        log(f"warning: the data holds {samples} samples of {cfg.seq_len} tokens, fewer than --num-samples "
            f"{cfg.num_samples}: calibrating on {tokens} tokens")


def model_fingerprint(tensors: Iterable[tuple[str, Iterable[torch.Tensor]]], hf_config: dict) -> str:
    """sha256 of the config and of every tensor of the model's state dict, in order, each tensor once: (name, its
    consecutive pieces of rows), so a tensor hashes the same whole or streamed."""
    h = hashlib.sha256(json.dumps(hf_config, sort_keys=True, default=str).encode())
    for name, pieces in tensors:
        h.update(name.encode())
        for t in pieces:
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # buffer: no copy
    return h.hexdigest()


def resident_tensors(model: nn.Module) -> Iterator[tuple[str, tuple[torch.Tensor]]]:
    """The state dict of a model in memory, tied weights once (LazyWeights.named_tensors gives it streamed)."""
    seen = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            yield name, (t,)


def resolve_compute_dtype(compute_dtype: str, device: torch.device) -> str:
    if compute_dtype != "auto":
        return compute_dtype
    fast = device.type == "cuda" or (device.type == "cpu" and onednn_bf16())
    return "bfloat16" if fast else "float32"


def autocast(device: torch.device, compute_dtype: str):
    """Matmuls in bfloat16 (weights and the residual stream stay float32) when compute_dtype asks for it."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=compute_dtype == "bfloat16")


def capture_stage(block: nn.Module, names: list[str], x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                  needs: tuple[str, ...], batch_size: int, prefix: str, device,
                  router: str = "") -> dict[str, InputStats]:
    """Run the block over x [N, L, H] (CPU) in batches; returns each named Linear's input statistics (none for a
    Linear that was never called: an expert no token reached). router: the block's MoE router, whose output says
    which tokens each expert's input rows are."""
    stats: dict[str, InputStats] = {}
    batch: dict = {}  # this batch's mask, range, Linears called, routed rows, and seen: id(input) -> (input, stats)

    def counted(name: str, inp: torch.Tensor) -> tuple[torch.Tensor, int]:
        """-> (the rows of inp [..., K] that count [T, K], how many samples they come from)."""
        m = batch["mask"]  # [B, L]
        rows = batch["routed"].get(name.rpartition(".")[0])  # an expert's input rows: these flat tokens [n]
        if rows is None:
            keep, samples = m.reshape(-1), int(m.any(dim=1).sum())
        else:
            keep = m.reshape(-1)[rows]
            samples = int((rows[keep] // m.shape[1]).unique().numel())
        flat = inp.reshape(-1, inp.shape[-1])
        return (flat if bool(keep.all()) else flat[keep]), samples

    def hook(name):
        def record(module, args):
            inp, seen = args[0], batch["seen"]
            if id(inp) in seen:
                stats.setdefault(name, seen[id(inp)][1])
            else:
                st = stats.setdefault(name, InputStats(inp.shape[-1], needs, inp.device))
                st.add(*counted(name, inp))
                if not st.finite():  # a NaN/inf input poisons the sums: checking them is cheaper than x
                    raise QuantkitError(
                        f"calibration inputs of {prefix}{name} contain NaN/inf (samples {batch['range']}): the model "
                        f"overflows on this data in {inp.dtype}; load it in float32 or check the data"
                    )
                seen[id(inp)] = (inp, st)
            batch["called"].add(name)
            if len(batch["called"]) == len(names):
                raise ForwardDone
        return record

    moe_path = router.rpartition(".")[0]

    def route(module, args, logits):
        moe = block.get_submodule(moe_path)
        batch["routed"] = {f"{moe_path}.experts.{e}": tokens for e, tokens, _ in moe.groups(moe.select(logits)[1])}

    hooked_pass(block, {n: hook(n) for n in names}, {router: route} if router else {}, x, mask, positions, batch_size,
                device, batch, fresh=lambda: {"called": set(), "routed": {}, "seen": {}})
    return stats


def observed(stage: list[str], spec) -> list[str]:
    """The Linears whose inputs a stage records: its own, and the statistics source of each AWQ group feeding them
    (an MoE block's router, whose input is every token the experts share out)."""
    extra = [g.stats_of for g in spec.awq_groups if g.stats_of not in stage and set(g.linears) & set(stage)]
    return stage + list(dict.fromkeys(extra))


def block_forward(block: nn.Module, x: Activations, positions: torch.Tensor, batch_size: int, device,
                  out: Successor) -> Activations:
    """x [N, L, H] (CPU) -> block(x) [N, L, H] (CPU), gathered batch by batch in `out`."""
    for b0 in range(0, len(x), batch_size):
        out.add(block(x[b0:b0 + batch_size].to(device), positions).cpu())
    return out.finish()


def first_inputs(model: nn.Module, input_ids: torch.Tensor, batch_size: int, weights: Optional[LazyWeights],
                 work: Optional[WorkFolder], spill: bool) -> Activations:
    """x = embed(input_ids) [N, L, H], the first block's inputs (spilled: written batch by batch to the work folder;
    streamed weights: the embedding is materialised for this only)."""
    if weights is not None:
        weights.materialise("model.embed_tokens.")
    try:
        if not spill:
            return Activations(model.embed(input_ids))
        shape = (*input_ids.shape, model.config.hidden_size)
        out = Successor(torch.Size(shape), model.model.embed_tokens.weight.dtype, work.path / NEXT, 0)
        for b0 in range(0, input_ids.shape[0], batch_size):
            out.add(model.embed(input_ids[b0:b0 + batch_size]))
        x = out.finish()
        x.persist(work, 0)
        return x
    finally:
        if weights is not None:
            weights.release("model.embed_tokens.")


def block_bytes(layers: nn.ModuleList) -> int:
    """The largest decoder block's parameters, in bytes (meta-device blocks count as materialised)."""
    return max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers)


def set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def swap_in_qlinear(block: nn.Module, name: str, qt: QTensor) -> None:
    from quantkit.quant.qlinear import QLinear

    bias = block.get_submodule(name).bias
    set_submodule(block, name, QLinear.from_qtensor(qt, None if bias is None else bias.detach()))


def calibrate(model: nn.Module, hf_config: dict, calib, cfg: CalibConfig, work_dir: Optional[Path] = None,
              resume: bool = True, device: Optional[str] = None, progress: bool = True,
              log: Callable[[str], None] = print, weights: Optional[LazyWeights] = None,
              max_host_memory: Optional[int] = None) -> list[dict]:
    """Quantize every decoder-block Linear of `model` in place (nn.Linear -> QLinear); returns the per-layer report.

    calib: quantkit.data.CalibData, or None for methods that need no data (RTN).
    work_dir: where finished blocks are kept (None: no resume); removed by the caller after the checkpoint is saved.
    weights: `model` is on the meta device and its weights stream from these (calibration in bounded memory): each
    block is materialised before it is calibrated and back on meta (QLinears included) once written to work_dir,
    from which quant/bounded.py streams the checkpoint.
    max_host_memory: bytes; the activations spill to work_dir when they would not fit (activation_store.fits).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = arch_spec(hf_config.get("model_type", "llama"))
    method = make_method(cfg, hf_config.get("model_type", "llama"))
    needs_data = bool(method.needs)
    compute_dtype = resolve_compute_dtype(cfg.compute_dtype, device)
    if needs_data and calib is None:
        raise QuantkitError(f"--method {cfg.method} needs calibration data: pass --data FILE")
    layers = model.model.layers
    if work_dir is None and (weights is not None or max_host_memory is not None):
        raise QuantkitError("calibration in bounded memory writes every block to a work folder: pass work_dir")
    min_tokens = resolve_min_tokens(cfg.moe_min_tokens, model.config.hidden_size)

    work = None
    start = 0
    if work_dir is not None:
        fingerprint = {"model": model_fingerprint(weights.named_tensors() if weights else resident_tensors(model),
                                                  hf_config),
                       "data": calib.fingerprint if needs_data else "none",
                       "config": json.dumps({**cfg.fingerprint_fields(), "compute_dtype": compute_dtype}, sort_keys=True),
                       "version": quantkit.__version__}
        work = WorkFolder(work_dir, fingerprint, log)
        start = work.open(resume, needs_data)

    report: list[dict] = []
    for i in range(start):  # finished blocks come back from the work folder
        qts, block_report = work.load_block(i, layers[i], spec.in_block(layers[i]).linears,
                                            lambda name, prefix=f"model.layers.{i}.": cfg.scheme_of(prefix + name))
        for name, qt in qts.items():
            swap_in_qlinear(layers[i], name, qt)
        if weights is not None:
            weights.release(f"model.layers.{i}.")
        report += block_report

    x = mask = positions = None
    spill = False
    if needs_data:
        mask = token_mask(calib)
        check_tokens(mask, model.config.hidden_size, cfg, log)
        x_bytes = calib.input_ids.numel() * model.config.hidden_size * model.model.embed_tokens.weight.element_size()
        spill = not fits(x_bytes, block_bytes(layers), max_host_memory)
        if spill:
            log(f"activations [{', '.join(map(str, calib.input_ids.shape))}, {model.config.hidden_size}] "
                f"({x_bytes / 1e6:.0f} MB, 3x that while a block runs) do not fit --max-host-memory with one block's "
                f"weights ({block_bytes(layers) / 1e6:.0f} MB): they spill to {work.path / INPUTS}")
        if start:
            x = Activations(path=work.path / INPUTS) if spill else Activations(work.load_inputs())
        else:
            with torch.no_grad():
                x = first_inputs(model, calib.input_ids, cfg.batch_size, weights, work, spill)  # [N, L, H]
        positions = torch.arange(calib.input_ids.shape[1], device=device)

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} blocks"),
               TimeElapsedColumn(), TextColumn("{task.fields[status]}")]
    with Progress(*columns, disable=not progress) as bar, torch.no_grad():
        task = bar.add_task(f"{cfg.method} {cfg.scheme.name()}", total=len(layers), completed=start, status="")
        for i in range(start, len(layers)):
            prefix = f"model.layers.{i}."
            if weights is not None:
                weights.materialise(prefix)
            block = layers[i].to(device)
            bspec = spec.in_block(block)  # experts expanded; a dense layer of an MoE model has none
            stages = [list(s) for s in bspec.sequential] if method.true_sequential else [list(bspec.linears)]
            qts: dict[str, QTensor] = {}
            block_report: list[dict] = []
            replay, batches = Replay(block, bspec.linears), -(-len(x) // cfg.batch_size) if needs_data else 0
            for stage in stages:
                t0 = time.perf_counter()
                # spilled: nothing the size of x is kept (the finished attention is recomputed, not replayed)
                with autocast(device, compute_dtype), replay.forward(set(qts), batches, record=not spill):
                    stats = (capture_stage(block, observed(stage, bspec), x, mask, positions, method.needs,
                                           cfg.batch_size, prefix, device, bspec.router) if needs_data else {})
                if needs_data and bspec.router:  # experts routed too few tokens: the forced pass replaces theirs
                    with autocast(device, compute_dtype), replay.forward(set(qts), batches, record=False):
                        stats.update(force_starved_experts(block, stage, stats, x, mask, positions, method.needs,
                                                           cfg.batch_size, prefix, device, bspec, min_tokens))
                for name, qt, info in method.quantize_stage(block, stage, stats, prefix):
                    if needs_data:  # later stages and the block's outputs see the quantized weights
                        linear = block.get_submodule(name)
                        linear.weight.data = dequantize(qt, linear.weight.dtype)
                    qts[name] = qt.to("cpu")
                    st, t1 = stats.get(name), time.perf_counter()
                    # time_s: since the previous layer; a stage's first layer includes the forward that fed it
                    block_report.append({"name": prefix + name, **stats_report(st), **info,
                                         "time_s": round(t1 - t0, 3)})
                    t0 = t1
                    loss = info.get("loss")
                    bar.update(task, status=f"{name} loss {loss:.4g}" if loss is not None else name)
            if needs_data:
                with autocast(device, compute_dtype), replay.forward(set(qts), batches, record=False):
                    x = block_forward(block, x, positions, cfg.batch_size, device, x.successor(i + 1))
            block.cpu()
            if work is not None:
                work.save_block(i, block, qts, block_report)
                if needs_data:
                    x.persist(work, i + 1)  # after the block: a resumed run trusts inputs only past durable blocks
            for name, qt in qts.items():
                swap_in_qlinear(block, name, qt)
            if weights is not None:
                weights.release(prefix)
            qts = stats = replay = None  # freed before the next block is read
            report += block_report
            bar.update(task, advance=1)
    return report
