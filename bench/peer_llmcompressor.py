"""llm-compressor's GPTQ on given calibration tokens: the peer row of bench/calibrate.py.

    /tmp/llmc_venv/bin/python bench/peer_llmcompressor.py --model FLOAT_HF_FOLDER --tokens TOKENS.safetensors
                                                          --out DIR [--bits 4] [--group-size 64]

Runs only in a venv with llmcompressor (PEERS.md: `pip install llmcompressor`, then `pip install torch==2.13.0`);
it imports nothing from quantkit. TOKENS.safetensors is what bench/calibrate.py wrote from quantkit's own
`calibration_batches`: input_ids int64 [N, L] and lengths int64 [N] (real tokens per sample). Each sample becomes one
row of a `datasets.Dataset` (input_ids = its first `lengths` tokens, attention_mask all ones), so llm-compressor
tokenizes nothing and sees exactly quantkit's blocks. The recipe: GPTQModifier on every Linear but lm_head, weights
int W{bits} symmetric, one scale per {group-size} columns, everything else (dampening_frac, actorder, block_size)
llm-compressor's default; oneshot with pipeline "sequential", batch size 1, the model in float32 on the CPU. Writes
DIR as compressed-tensors (save_compressed) with the tokenizer, and DIR/peer.json: the versions, the modifier's
settings as it ran and the token count.
"""

from __future__ import annotations

import argparse
import json
from importlib.metadata import version
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def calibration_dataset(tokens: Path) -> Dataset:
    """Rows of input_ids / attention_mask: sample i's first lengths[i] tokens."""
    t = load_file(str(tokens))
    rows = [ids[:n].tolist() for ids, n in zip(t["input_ids"], t["lengths"].tolist())]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the float Hugging Face folder to quantize")
    ap.add_argument("--tokens", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()

    ds = calibration_dataset(args.tokens)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    weights = {"num_bits": args.bits, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": args.group_size}
    modifier = GPTQModifier(targets="Linear", ignore=["lm_head"],
                            config_groups={"group_0": {"targets": ["Linear"], "weights": weights}})
    longest = max(len(r) for r in ds["input_ids"])
    oneshot(model=model, tokenizer=tokenizer, dataset=ds, recipe=modifier, max_seq_length=longest,
            num_calibration_samples=len(ds), batch_size=1, pipeline="sequential")
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    settings = {k: v for k, v in modifier.model_dump().items()
                if k in ("dampening_frac", "actorder", "block_size", "offload_hessians", "ignore", "targets")}
    record = {"versions": {p: version(p) for p in ("llmcompressor", "compressed-tensors", "torch", "transformers",
                                                  "datasets")},
              "modifier": "GPTQModifier", "settings": settings, "weights": weights, "samples": len(ds),
              "tokens": sum(len(r) for r in ds["input_ids"]), "torch_threads": torch.get_num_threads()}
    (args.out / "peer.json").write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
