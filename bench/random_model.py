"""A random-weight checkpoint in a released model's shape, for speed figures of families with no bundled model.

    python bench/random_model.py gemma3-270m /tmp/gemma3-270m

transformers builds the model from the released config.json's shape fields (SHAPES: its layers, widths, heads,
attention pattern), with the bundled SmolLM2 tokenizer's vocabulary (49152 tokens) in place of the family's own,
so the embedding and lm_head are smaller than the release's; saved in bf16 with that tokenizer. Its outputs are
noise: use it for timing, never for quality.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

VOCAB = 49152  # the bundled tokenizer's
# name -> (model_type, the released config's shape fields)
SHAPES = {
    "gemma3-270m": ("gemma3_text", dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        query_pre_attn_scalar=256, sliding_window=512, rope_theta=1e6,
                                        rope_local_base_freq=1e4, max_position_embeddings=32768)),
    # Qwen3-30B-A3B's layer (8 of its 128 experts active per token, each 768 wide) in 8 layers of 32 experts, not
    # 48 of 128: the same bytes per token and layer, in 2.6 GB of bf16 instead of 61
    "qwen3-moe-8l": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                                       num_hidden_layers=8, num_experts=32, num_experts_per_tok=8,
                                       norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                                       head_dim=128, rope_theta=1e6, max_position_embeddings=40960)),
    "olmo2-1b": ("olmo2", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=32, rope_theta=5e5,
                               max_position_embeddings=4096)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.models.loader import bundled_model_dir

    model_type, fields = SHAPES[args.shape]
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    for f in bundled_model_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, args.out)
    print(f"{args.shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters in {args.out}")


if __name__ == "__main__":
    main()
