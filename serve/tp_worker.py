"""A tensor-parallel worker, rank 1..N-1: `python -m quantkit.serve.tp_worker RANK WORLD PORT DEVICE`, started by
TensorParallel.start (serve/tp_group.py).

It joins the groups, receives the WorkerSpec, loads its shard, builds its runner (its share of the KV pool, the block
count agreed with the other ranks), then runs the forward of every StepInputs / DenseInputs rank 0 broadcasts until
it receives None. Exit 0 after that stop; 1 on any error, which makes rank 0's next collective fail at once.
SIGINT and SIGTERM are ignored as in the engine process (`timeout` and Ctrl-C signal the whole process group; rank 0
stops the workers itself), and the worker is killed when the process that started it dies.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys

from quantkit.errors import QuantkitError

log = logging.getLogger("quantkit.serve")


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (prctl PR_SET_PDEATHSIG); nothing elsewhere."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main(rank: int, world: int, port: int, device: str) -> int:
    import torch

    from quantkit.serve.config import EngineConfig
    from quantkit.serve.tp_group import TensorParallel, load_shard
    from quantkit.serve.tp_runner import TPModelRunner

    die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    tp = TensorParallel(rank, world, port, device)
    spec = tp.receive()
    if spec is None:  # rank 0 gave up before sending what to load
        tp.close()
        return 0
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s [tp rank {rank}]: %(message)s")
    try:
        dtype = getattr(torch, spec.dtype)
        loaded = load_shard(spec.source, dtype, tp)
        runner = TPModelRunner(loaded.model, EngineConfig(**spec.engine_config), tp.device, dtype,
                               spec.max_model_len, tp)
        while (inputs := tp.receive()) is not None:
            runner.run(inputs)
    except QuantkitError as e:  # rank 0 meets the same refusal and reports it
        log.error("%s", e)
        return 1
    except Exception:
        log.exception("tensor-parallel worker %d failed", rank)
        return 1
    tp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
