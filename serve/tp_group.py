"""Tensor-parallel serving over torch.distributed: the processes, their groups, and what rank 0 broadcasts.

Rank 0 is the engine: scheduler, block manager, sampler and detokenizer run there once (in the process `quantkit
serve`'s engine runs in, or the caller's for quantkit.LLM). TensorParallel.start spawns ranks 1..N-1 as worker
processes (`python -m quantkit.serve.tp_worker`, serve/tp_worker.py), each holding its shard of the model
(quantkit/models/sharding.py) and of the KV pool (serve/tp_runner.py) and running every step's forward on the inputs
rank 0 broadcasts. Every rank loads the same source with load_shard: the checkpoint on the CPU, its share kept, then
moved to its device (cuda:base+rank on CUDA). On the CPU each rank takes cores / N threads unless OMP_NUM_THREADS
says otherwise.

Groups (a TCP rendezvous on 127.0.0.1 at a free port):
  model    gloo on CPU, nccl on CUDA: the forward's collectives (an all-reduce after the embedding and after every
           row-parallel layer, the logits gather to rank 0); STEP_TIMEOUT bounds how long one waits for a stuck rank
  control  gloo: rank 0 broadcasts the WorkerSpec, then each step's StepInputs (or DenseInputs), then None to stop.
           Workers wait on it while the engine idles, so its timeout is IDLE_TIMEOUT.
Faults: a rank that dies closes its sockets, and the others' pending or next collective raises at once ("Connection
closed by peer"). Rank 0 then marks the group broken and raises TensorParallelError, a FatalStepError: the engine
stops (`quantkit serve` exits 1, its streams end with an error); the workers exit on their own error. A worker also
dies with the process that started it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from quantkit.serve.attention import AttentionMetadata
from quantkit.serve.model_runner import FatalStepError

log = logging.getLogger("quantkit.serve")

STEP_TIMEOUT = timedelta(minutes=5)
IDLE_TIMEOUT = timedelta(days=3650)


class TensorParallelError(FatalStepError):
    """A tensor-parallel forward failed: a rank died or stalled, or the ranks fell out of step."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: the CPU for every rank, or the CUDA device `rank` places after `device`'s."""
    d = torch.device(device)
    return "cpu" if d.type == "cpu" else f"cuda:{(d.index or 0) + rank}"


class TorchCollectives:
    """quantkit.models.sharding.Collectives on a torch.distributed group."""

    def __init__(self, rank: int, world: int, group):
        self.rank, self.world, self.group = rank, world, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., n] -> [..., world * n] on rank 0; every rank has x's shape, so no rows means no collective
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.world * x.shape[-1]) if self.rank == 0 else x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else x


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker loads and runs, as rank 0 resolved it."""

    source: Optional[str]  # load_model's source (None: the bundled default)
    engine_config: dict  # EngineConfig fields
    dtype: str  # "float32", "bfloat16", ...
    max_model_len: int
    log_level: str


@dataclass
class StepInputs:
    """One step's forward inputs (the field names ModelRunner.execute reads from a StepBatch)."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [R]
    blocks_to_copy: list[tuple[int, int]]

    def to(self, device) -> "StepInputs":
        meta = dataclasses.replace(self.meta, **{f.name: getattr(self.meta, f.name).to(device)
                                                for f in dataclasses.fields(self.meta)
                                                if isinstance(getattr(self.meta, f.name), torch.Tensor)})
        return StepInputs(self.input_ids.to(device), self.positions.to(device), meta, self.logits_indices.to(device),
                          self.blocks_to_copy)


@dataclass
class DenseInputs:
    """A dense forward to the final-normed hidden states (the embeddings' model.hidden): input_ids int64 [B, L]."""

    input_ids: torch.Tensor

    def to(self, device) -> "DenseInputs":
        return DenseInputs(self.input_ids.to(device))


class TensorParallel:
    """One rank's membership of the tensor-parallel group; rank 0's also owns the worker processes."""

    def __init__(self, rank: int, world: int, port: int, device: str, workers: tuple = ()):
        self.rank, self.world, self.device = rank, world, rank_device(device, rank)
        self.workers: list[subprocess.Popen] = list(workers)  # rank 0: ranks 1..N-1
        self.broken: Optional[str] = None  # why the group can run no more steps
        self.closed = False
        cuda = torch.device(self.device).type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        elif "OMP_NUM_THREADS" not in os.environ:  # the ranks share this host's cores
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=STEP_TIMEOUT)
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.comm = TorchCollectives(rank, world, dist.group.WORLD)

    @classmethod
    def start(cls, world: int, device: str) -> "TensorParallel":
        """Rank 0: spawn ranks 1..world-1 and join the groups with them (call `send(WorkerSpec)` next)."""
        port = free_port()
        workers = [subprocess.Popen([sys.executable, "-m", "quantkit.serve.tp_worker", str(rank), str(world),
                                     str(port), device]) for rank in range(1, world)]
        try:
            tp = cls(0, world, port, device, workers)
        except BaseException:
            for worker in workers:
                worker.kill()
                worker.wait()
            raise
        atexit.register(tp.close)
        log.info("tensor parallel: %d ranks (workers %s)", world, ", ".join(str(w.pid) for w in workers))
        return tp

    # ---- the control group
    def send(self, obj) -> None:
        """Rank 0: broadcast obj (a WorkerSpec, StepInputs, DenseInputs, or None to stop) to the workers."""
        dist.broadcast_object_list([obj], src=0, group=self.control)

    def receive(self):
        """A worker: the next object rank 0 sends (blocks while the engine idles)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def agree_min(self, value: int) -> int:
        """The smallest `value` of all ranks, on every rank (while they start: rank 0 names a worker that died)."""
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        except RuntimeError as e:
            if self.rank == 0:
                raise TensorParallelError(f"a tensor-parallel worker failed while starting: {self.exited_workers()}"
                                          f"{type(e).__name__}: {e} (its error is in the log above)") from e
            raise
        return int(t)

    # ---- faults
    @contextlib.contextmanager
    def step(self):
        """Rank 0, around everything a step sends and runs: any exception is fatal (TensorParallelError)."""
        if self.broken is not None:
            raise TensorParallelError(f"the tensor-parallel group is broken: {self.broken}")
        try:
            yield
        except Exception as e:
            self.broken = f"{self.exited_workers()}{type(e).__name__}: {e}"
            raise TensorParallelError(f"a tensor-parallel step failed: {self.broken}") from e

    def exited_workers(self, wait: float = 2.0) -> str:
        """'rank R (pid P) exited with code C; ' for each worker that has exited (waiting up to `wait` s for one)."""
        deadline = time.monotonic() + wait
        while all(w.poll() is None for w in self.workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "".join(f"rank {rank} (pid {w.pid}) exited with code {w.returncode}; "
                       for rank, w in enumerate(self.workers, 1) if w.poll() is not None)

    def abort(self, reason: str) -> None:
        """Rank 0, when the ranks may be out of step (a start that failed half way): kill the workers, leave."""
        self.broken = self.broken or reason
        self.close()

    def close(self) -> None:
        """Stop the workers (rank 0) and leave the groups; a later TensorParallel may start in this process."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.rank == 0 and self.broken is None:
            with contextlib.suppress(RuntimeError):
                self.send(None)
        for worker in self.workers:  # a broken group's workers are of no more use
            try:
                worker.wait(timeout=0 if self.broken else 10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        dist.destroy_process_group()


def load_shard(source: Optional[str], dtype: torch.dtype, tp: TensorParallel):
    """load_model(source) on the CPU, this rank's share kept (sharding.shard_model), moved to its device -> Loaded."""
    from quantkit.models.loader import load_model
    from quantkit.models.sharding import shard_model

    loaded = load_model(source, dtype=dtype, device="cpu")
    shard_model(loaded.model, tp.comm)
    loaded.model.to(tp.device)
    return loaded


def start_rank0(source: Optional[str], hf_config: dict, cfg, dtype: torch.dtype):
    """This process as rank 0 of cfg.tensor_parallel_size ranks serving `source` (its config.json `hf_config`):
    refuses a model the ranks cannot split before any weight loads, starts the workers, tells them what to load,
    loads rank 0's shard -> (TensorParallel, Loaded)."""
    from quantkit.models.config import ModelConfig
    from quantkit.models.sharding import check_shardable

    model_cfg = ModelConfig.from_hf(hf_config)
    check_shardable(model_cfg, cfg.tensor_parallel_size, (hf_config.get("quantization_config") or {}).get("group_size"))
    tp = TensorParallel.start(cfg.tensor_parallel_size, cfg.resolved_device())
    try:
        tp.send(WorkerSpec(source, dataclasses.asdict(cfg), str(dtype).removeprefix("torch."),
                           cfg.max_model_len or model_cfg.max_position_embeddings,
                           logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()))
        return tp, load_shard(source, dtype, tp)
    except BaseException:
        tp.abort("rank 0 failed to load its shard")
        raise
