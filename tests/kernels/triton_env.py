"""Import first in kernel test modules: runs Triton kernels in the CPU interpreter unless TRITON_INTERPRET=0.

TRITON_INTERPRET must be set before triton is imported (it decides how @triton.jit builds kernels). With
TRITON_INTERPRET=0 and a CUDA GPU the same tests run compiled on the GPU; without triton the module is skipped.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

INTERPRET = bool(triton.knobs.runtime.interpret)
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
