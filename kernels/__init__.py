"""quantkit.kernels: every kernel of the project, each with an asserting launcher and its torch reference.

  triton/   CUDA (Triton): dequant-GEMM/GEMV for the packed W4/W8 weights, paged attention, KV store, fused ops
  cpu/      CPU (C, AMX/AVX-512): the AMX GEMMs, paged decode and prefill attention, fused per-token ops; the C
            sources are real .c/.h files beside their launchers, compiled once per machine and cached

quant/, models/ and serve/ reach kernels only through this package; nothing here imports serve/.

Imported as plain `kernels`, this folder is a name clash, not this package: with the checkout's root on sys.path
(pytest, `python -m` from the checkout) the bare name finds it before the `kernels` distribution (Hugging Face's hub
kernels) that transformers >= 5 imports. It then loads that distribution in its place, so transformers gets what it
asked for; quantkit itself never imports the bare name.
"""

if __name__ == "kernels":
    import importlib.util
    import os
    import sys
    from importlib.machinery import PathFinder

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None:
        raise ImportError(f"no `kernels` distribution installed; {os.path.dirname(__file__)} is quantkit.kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns sys.modules' entry, this distribution
    _spec.loader.exec_module(_module)
