"""Compile a kernel's C source once with the system C compiler (cached per source, flags, CPU and torch), load it
with ctypes.

A kernel is `<name>.c` in this folder, which includes the shared headers beside it (common.h: dtype conversions,
exp.h: e^x, silu.h: silu(a) * u, amx.h: AMX tile setup); it is compiled with `-I` this folder. The cache key
hashes the .c file and every .h file here, so editing a header rebuilds every kernel. The library links the
libgomp torch already loaded, so its OpenMP threads are torch's. A machine without a working compiler gets None
(logged once) and the torch paths.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from quantkit.files import cache_root

log = logging.getLogger("quantkit.serve")

SOURCES = Path(__file__).resolve().parent  # the .c and .h files
# -fno-trapping-math lets the vectoriser if-convert clamps; nothing here reads floating-point exception flags
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC",
         "-std=c11"]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # common.h's enum: every kernel's `dtype`


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cache_key(source: Path) -> str:
    """sha256 over the source, every header of its folder, the flags, the CPU's flags and torch's version."""
    digest = hashlib.sha256()
    for path in [source, *sorted(source.parent.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update((" ".join(FLAGS) + _cpu_signature() + torch.__version__).encode())
    return digest.hexdigest()


def _build(source: Path, out: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile source into the shared library out (atomic); extra_flags after FLAGS (tests build narrower
    instruction sets, e.g. -mno-avx512f)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc/cc) found")
    torch_lib = Path(torch.__file__).parent / "lib"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / f"{out.stem}.so"
        gomp = [str(torch_lib / "libgomp.so.1"), f"-Wl,-rpath,{torch_lib}"] if (torch_lib / "libgomp.so.1").exists() else []
        command = [compiler, *FLAGS, *extra_flags, f"-I{source.parent}", str(source), "-o", str(lib), *gomp, "-lm"]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        os.replace(lib, out)


_loaded: dict[str, ctypes.CDLL | None] = {}


def load_library(name: str, signatures: dict[str, list]) -> ctypes.CDLL | None:
    """The compiled library of `<name>.c` (built on first use, then cached on disk, loaded once per process), or
    None when it cannot be built here (logged once). signatures: function name -> ctypes argtypes of each void
    function the callers use (other functions keep ctypes' int return)."""
    if name in _loaded:
        return _loaded[name]
    source = SOURCES / f"{name}.c"
    try:
        path = cache_root() / "kernels" / f"{name}-{_cache_key(source)[:16]}.so"
        if not path.exists():
            _build(source, path)
        lib = ctypes.CDLL(str(path))
        for fn_name, argtypes in signatures.items():
            fn = getattr(lib, fn_name)
            fn.restype, fn.argtypes = None, argtypes
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        log.warning("CPU kernels %s unavailable (%s %s): using the torch path", name, e, detail[-500:])
        lib = None
    _loaded[name] = lib
    return lib
