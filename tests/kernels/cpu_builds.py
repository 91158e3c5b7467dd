"""A CPU kernel's source built for a narrower instruction set than this CPU's, so that its AVX-512, AVX2 and plain C
paths are each tested on whichever machine runs the suite (a path the CPU cannot run is skipped)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from quantkit.kernels.cpu import build

# a build -> the flags after build.FLAGS that give it, and the CPU flags it needs to run
NARROWER = {"avx512": (("-mno-avx512bf16",), {"avx512f", "avx512bw", "avx512dq", "avx512vl"}),
            "avx2": (("-mno-avx512f",), {"avx2", "fma", "f16c"}),
            "portable": (("-mno-avx512f", "-mno-avx2", "-mno-fma"), set())}


def cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as f:
        return next((line.split() for line in f if line.startswith("flags")), [])


def narrower_library(stem: str, extra_flags: tuple[str, ...], directory: Path, signatures: dict[str, list],
                     needs: set[str] = frozenset()) -> ctypes.CDLL:
    """kernels/cpu/<stem>.c built with extra_flags into directory; signatures: function -> ctypes argtypes of
    its void functions. Skips the test when the CPU lacks one of needs."""
    missing = set(needs) - set(cpu_flags())
    if missing:
        pytest.skip(f"the CPU has no {', '.join(sorted(missing))}")
    path = directory / f"{stem}-{'_'.join(f.lstrip('-') for f in extra_flags) or 'native'}.so"
    build._build(build.SOURCES / f"{stem}.c", path, extra_flags)
    lib = ctypes.CDLL(str(path))
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    return lib
