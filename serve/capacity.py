"""KV-cache capacity arithmetic (SERVING.md), shared by the engine and `quantkit plan`.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes
  (per device under tensor parallelism: kv_heads / tp, at least 1: quantkit/models/tensor_parallel.py)
blocks = budget bytes // (block_size x bytes per token)
"""

from __future__ import annotations

from quantkit.models.tensor_parallel import kv_heads_per_device


def _field(cfg, name: str, default=None):
    value = cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)
    return default if value is None else value


def kv_bytes_per_token(cfg, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """cfg: a ModelConfig or an HF config.json dict (num_hidden_layers, num_key_value_heads, head_dim); the bytes
    one device caches per token when the model is split over tensor_parallel_size devices."""
    layers = _field(cfg, "num_hidden_layers")
    heads = _field(cfg, "num_attention_heads")
    kv_heads = _field(cfg, "num_key_value_heads", heads)
    head_dim = _field(cfg, "head_dim") or _field(cfg, "hidden_size") // heads
    return 2 * layers * kv_heads_per_device(kv_heads, tensor_parallel_size) * head_dim * dtype_bytes


def num_kv_blocks(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """Whole blocks that fit in budget_bytes (0 when the budget is negative)."""
    return max(0, int(budget_bytes) // (block_size * bytes_per_token))


def capacity_line(num_blocks: int, block_size: int, max_model_len: int) -> str:
    tokens = num_blocks * block_size
    return (
        f"KV cache: {num_blocks} blocks, {tokens} tokens, "
        f"max concurrency at max_model_len {max_model_len}: {tokens / max_model_len:.2f}x"
    )
