"""Every Triton kernel compiles to GPU machine code for H100/H200 (sm_90) with representative tiles, without a GPU:
catches what the CPU interpreter accepts but the compiler rejects (layouts, dot shapes, atomics, shared-memory
limits) before a kernel ever meets a GPU. (A100: `python tests/kernels/kernel_compile_check.py 80`.)

The compiler needs the kernels built as compiler JITFunctions, i.e. imported without TRITON_INTERPRET=1, which the
other kernel tests set for the whole pytest process: so the check runs in a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("kernel_compile_check.py")


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT), "90"], env=env, capture_output=True, text=True, timeout=600,
                         cwd=SCRIPT.parents[2])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert run.stdout.split() == ["compiled", "23", "kernels", "for", "sm_90"], run.stdout
