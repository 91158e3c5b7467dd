"""The calibration activations: the hidden states between decoder blocks, x [N, L, H] (N samples of L tokens, in
the model's dtype: float32 as quantkit calibrate loads models), read a batch of samples at a time by every forward
of a block (`x[b0:b1]`) and replaced by the block's outputs.

In memory x is one tensor. Spilled (calibration in bounded memory, when x does not fit the budget: `fits`) it is the
work folder's inputs.safetensors, of which a slice reads only the rows asked for; the block's outputs are written
batch by batch to inputs.next.safetensors, which replaces it once the block is durable (`persist`): the file a
resumed run starts from (quant/resume.py), whichever way it was written. Both hold the same numbers, so where x
lives changes no result.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from quantkit.formats.safetensors_stream import DTYPES, RowWriter

INPUTS = "inputs.safetensors"  # the work folder's inputs of its next block (quant/resume.py)
NEXT = "inputs.next.safetensors"  # the next block's inputs while they are written


def fits(x_bytes: int, block_bytes: int, budget: Optional[int]) -> bool:
    """Whether x stays in memory: x, the block's outputs gathered beside it and the attention outputs replayed
    from the block's first forwards (each about x's size: 3 x) next to one block's float32 weights, within
    `budget` bytes (None: no budget)."""
    return budget is None or 3 * x_bytes + block_bytes <= budget


class Activations:
    """x [N, L, H]: `tensor` in memory, or `path`, a safetensors file holding it as tensor "x"."""

    def __init__(self, tensor: Optional[torch.Tensor] = None, path: Optional[Path] = None):
        self.tensor, self.path = tensor, path
        if tensor is not None:
            self.shape, self.dtype = tensor.shape, tensor.dtype
        else:
            with safe_open(str(path), framework="pt") as f:
                x = f.get_slice("x")
                self.shape = torch.Size(x.get_shape())
                self.dtype = {name: dtype for dtype, name in DTYPES.items()}[x.get_dtype()]

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        """x[b0:b1] [B, L, H]: samples b0..b1-1 (read from the file when spilled)."""
        if self.tensor is not None:
            return self.tensor[rows]
        with safe_open(str(self.path), framework="pt") as f:
            return f.get_slice("x")[rows]

    def successor(self, next_block: int) -> "Successor":
        """Where the block's outputs (the inputs of `next_block`) are gathered, batch by batch in sample order: in
        memory, or (spilled) beside this file."""
        return Successor(self.shape, self.dtype, None if self.path is None else self.path.parent / NEXT, next_block)

    def persist(self, work, next_block: int) -> None:
        """Make x the work folder's inputs of `next_block`, once the block that computed it is durable."""
        if self.tensor is not None:
            work.save_inputs(next_block, self.tensor)
            return
        target = work.path / INPUTS
        if self.path != target:
            os.replace(self.path, target)
            dir_fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            self.path = target


class Successor:
    """The next block's inputs [N, L, H], gathered batch by batch in sample order: into one preallocated tensor, or
    (`path`) straight into a safetensors file with metadata next_block."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, path: Optional[Path], next_block: int):
        self.path = path
        if path is None:
            self.tensor, self.rows = torch.empty(shape, dtype=dtype), 0
        else:
            self.writer = RowWriter(path, "x", dtype, tuple(shape), {"next_block": str(next_block)})

    def add(self, rows: torch.Tensor) -> None:
        """rows [B, L, H] on CPU: the next B samples' outputs."""
        if self.path is None:
            self.tensor[self.rows:self.rows + rows.shape[0]] = rows
            self.rows += rows.shape[0]
        else:
            self.writer.write(rows)

    def finish(self) -> Activations:
        if self.path is None:
            return Activations(tensor=self.tensor)
        self.writer.close()
        return Activations(path=self.path)
