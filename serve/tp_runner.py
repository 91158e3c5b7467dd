"""The ModelRunner of one tensor-parallel rank: its shard of the model and its share of the KV pool (serve/tp_group.py).

KV pool: the model's config is the shard's (quantkit/models/sharding.py), so the runner's bytes per token count only
this rank's KV heads; the memory budget (kv_cache_memory, or the CPU's automatic one) is the whole pool's, split
evenly over the N ranks (ModelRunner.kv_share), and the ranks agree on the smallest block count (rank 0's one
BlockManager hands out block ids that every rank's pool holds). So for one budget B, block size b and full bytes per
token P:
    num_kv_heads divisible by N   each rank caches P / N per token in B / N: blocks = B // (b P), as with one
                                  worker, and each worker's pool is 1/N of the bytes (half at N = 2)
    num_kv_heads < N              each rank caches one whole head, replicated N / num_kv_heads times:
                                  blocks = (B / N) // (b P / num_kv_heads), fewer than one worker's
On CUDA the automatic budget is each device's own memory and is not split (kv_cache_memory still is).

Rank 0's execute broadcasts the step's StepInputs, then runs its own forward; the workers run the same forward
(`run`) on what they receive. An exception anywhere in a tensor-parallel forward leaves the ranks out of step, so on
rank 0 it is a TensorParallelError (fatal: the engine stops) rather than one failed step.
"""

from __future__ import annotations

import logging

import torch

from quantkit.serve.config import EngineConfig
from quantkit.serve.model_runner import ModelRunner, StepBatch
from quantkit.serve.tp_group import DenseInputs, StepInputs, TensorParallel

log = logging.getLogger("quantkit.serve")


class TPModelRunner(ModelRunner):
    def __init__(self, model, engine_cfg: EngineConfig, device: str, dtype: torch.dtype, max_model_len: int,
                 tp: TensorParallel):
        """model: this rank's shard (sharding.shard_model); every rank constructs its runner at the same time."""
        self.tp = tp
        self.kv_share = tp.world
        super().__init__(model, engine_cfg, device, dtype, max_model_len)
        self.pooling_model = BroadcastDense(model, tp)  # what rank 0's embeddings Pooler runs
        log.info("tensor parallel rank %d of %d: KV pool of %d bytes (%d KV head(s) per layer)", tp.rank, tp.world,
                 self.kv_pool_bytes, self.num_kv_heads)

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pool.numel() * self.kv_pool.element_size()

    def _plan_blocks(self, bytes_per_token: int) -> int:
        return self.tp.agree_min(super()._plan_blocks(bytes_per_token))

    def execute(self, batch: StepBatch, blocks_to_copy: list[tuple[int, int]]) -> torch.Tensor:
        """Rank 0: send the step to the workers, then the forward all ranks run -> float32 logits [R, V]."""
        with self.tp.step():
            self.tp.send(StepInputs(batch.input_ids, batch.positions, batch.meta, batch.logits_indices,
                                    list(blocks_to_copy)).to("cpu"))
            return super().execute(batch, blocks_to_copy)

    @torch.inference_mode()
    def run(self, inputs: StepInputs | DenseInputs) -> None:
        """A worker: the forward rank 0 sent (its logits, or hidden states, are rank 0's to use)."""
        inputs = inputs.to(self.device)
        if isinstance(inputs, DenseInputs):
            self.model.hidden(inputs.input_ids)
        else:
            ModelRunner.execute(self, inputs, inputs.blocks_to_copy)


class BroadcastDense:
    """Rank 0's model as serve/pooling.py's Pooler uses it: hidden(ids) first sends the dense forward to the
    workers."""

    def __init__(self, model, tp: TensorParallel):
        self.model, self.tp = model, tp

    def parameters(self):
        return self.model.parameters()

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        with self.tp.step():
            self.tp.send(DenseInputs(input_ids.cpu()))
            return self.model.hidden(input_ids)
