"""One rank of the 2-process gloo group of tests/serve/test_tensor_parallel.py (a light module: each spawned
process imports it): for each model folder, the sharded model's dense logits and its runner's KV pool."""

from __future__ import annotations

import torch

KV_BUDGET = 8 << 20
MAX_MODEL_LEN = 256


def dense_ids(vocab: int = 1024) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def run_rank(rank: int, port: int, folders: list[str], out: str) -> None:
    """torch.multiprocessing.spawn target: rank 0 saves {folder: {logits, blocks, pool_bytes}} to `out`."""
    from quantkit.models.loader import load_model
    from quantkit.models.sharding import shard_model
    from quantkit.serve.config import EngineConfig
    from quantkit.serve.tp_group import TensorParallel
    from quantkit.serve.tp_runner import TPModelRunner

    torch.set_num_threads(1)
    tp = TensorParallel(rank, 2, port, "cpu")
    results = {}
    for folder in folders:
        model = load_model(folder, dtype=torch.float32).model
        shard_model(model, tp.comm)
        with torch.inference_mode():
            logits = model(dense_ids(model.config.vocab_size))
        runner = TPModelRunner(model, EngineConfig(kv_cache_memory=KV_BUDGET, dtype="float32", device="cpu"), "cpu",
                               torch.float32, MAX_MODEL_LEN, tp)
        results[folder] = {"logits": logits, "blocks": runner.num_blocks, "pool_bytes": runner.kv_pool_bytes}
    if rank == 0:
        torch.save(results, out)
    else:
        assert tp.receive() is None  # rank 0's stop
    tp.close()
