"""quantkit: FP16 -> calibrated INT4/INT8 checkpoints -> served, with the accuracy delta measured."""

__version__ = "0.1.0"

_LAZY = {"LLM": "quantkit.serve.llm", "SamplingParams": "quantkit.serve.sampling_params"}


def __getattr__(name: str):
    """`from quantkit import LLM, SamplingParams` without importing torch when the CLI starts."""
    if name in _LAZY:
        import importlib

        if name == "LLM":  # a bounded OpenMP spin-wait, set before torch loads (serve/cpu_threads.py)
            importlib.import_module("quantkit.serve.cpu_threads").wait_policy_env()
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
