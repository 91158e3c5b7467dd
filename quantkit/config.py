"""Small validated dataclasses shared by the CLI, recipes and the library.

CLI flags and recipe YAML are two constructors of the same objects; validation lives here.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from quantkit.errors import QuantkitError

LAYOUTS = ("gptq", "gptq_v2", "awq", "compressed-tensors")


@dataclass(frozen=True)
class QuantScheme:
    """Weight-only integer quantization of every Linear in the decoder blocks.

    bits: 4 or 8.  group_size: columns (input features) sharing one scale/zero, -1 = one group per row.
    sym: zero fixed at 2^(bits-1) (GPTQ / compressed-tensors convention) vs a searched zero point.
    act_order: GPTQ desc_act (columns processed by descending diag(H); g_idx non-monotonic unless static_groups).
    """

    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = False
    static_groups: bool = False

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise QuantkitError(f"bits={self.bits} is not supported: use 4 or 8")
        if self.group_size != -1 and (self.group_size < 1 or self.group_size % 8 != 0):
            raise QuantkitError(
                f"group_size={self.group_size} is not supported: use -1 (per-channel) or a multiple of 8 such as 32, 64, 128"
            )

    @property
    def pack_factor(self) -> int:
        """Codes per int32 word."""
        return 32 // self.bits

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def groups(self, in_features: int, layer: str = "") -> int:
        """Number of groups G for a Linear with `in_features` columns; errors when g does not divide K."""
        if self.group_size == -1:
            return 1
        if in_features % self.group_size != 0:
            fits = [str(g) for g in (128, 64, 32, 16, 8) if in_features % g == 0][:2]
            hint = f"e.g. {' or '.join(fits)}" if fits else "no multiple of 8 does"
            raise QuantkitError(
                f"group_size={self.group_size} does not divide in_features={in_features} of layer {layer or '?'}: "
                f"choose a group size that divides {in_features} ({hint}) or -1 for per-channel"
            )
        return in_features // self.group_size

    def group_of(self, in_features: int) -> int:
        """The effective group length (K itself for per-channel)."""
        return in_features if self.group_size == -1 else self.group_size

    def name(self) -> str:
        g = "ch" if self.group_size == -1 else f"g{self.group_size}"
        return f"w{self.bits}{g}{'' if self.sym else '-asym'}{'-act' if self.act_order else ''}"

    def with_precision(self, name: str, where: str = "layer_schemes") -> "QuantScheme":
        """This scheme at the bits and group size `name` says ("w8g64", "w4ch": QuantScheme.name() without the
        suffixes); symmetry and act-order stay (a checkpoint holds them once for all its layers)."""
        m = re.fullmatch(r"w(\d+)(?:g(\d+)|(ch))", name)
        if m is None:
            raise QuantkitError(f"{where}: scheme {name!r} is not a scheme name such as w4g64, w8g128 or w8ch "
                                f"(or {FLOAT!r} for a layer left unquantized)")
        return dataclasses.replace(self, bits=int(m[1]), group_size=-1 if m[3] else int(m[2]))

    def precision_name(self) -> str:
        """"w4g64" / "w8ch": what `with_precision` takes."""
        return f"w{self.bits}{'ch' if self.group_size == -1 else f'g{self.group_size}'}"


FLOAT = "float"  # a layer_schemes entry: the Linear is left unquantized (written in the checkpoint's float dtype)


METHODS = ("rtn", "gptq", "awq")
DATA_MODES = ("concat", "rows")
# flat keys (recipe YAML and `quantkit calibrate` flags) -> the type each must have
CALIB_KEYS: dict[str, type] = {
    "model": str, "method": str, "bits": int, "group_size": int, "sym": bool, "act_order": bool,
    "static_groups": bool, "format": str, "data": str, "num_samples": int, "seq_len": int, "data_mode": str,
    "seed": int, "damp": float, "group_aware": bool, "block_size": int, "batch_size": int, "compute_dtype": str,
    "clip_search": bool, "moe_min_tokens": int, "layer_schemes": dict, "awq_rounding": str,
}
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
AWQ_ROUNDINGS = ("gptq", "rtn")


def default_layout(method: str, scheme: QuantScheme) -> str:
    """The layout the most runtimes load (bench/runtime_compat.py measures vLLM-CPU and transformers; BENCHMARKS.md).
    Symmetric GPTQ/RTN -> GPTQ v1. Asymmetric at 4 bits without an act-order g_idx (and AWQ): AWQ GEMM when grouped,
    compressed-tensors per-channel (AWQ needs groups) -- vLLM-CPU refuses asymmetric GPTQ (gptq_v2) but loads these,
    the same codes. Else gptq_v2 for GPTQ/RTN (only GPTQ holds an act-order g_idx; 8-bit: transformers reads it
    through gptqmodel) and compressed-tensors for 8-bit AWQ (AWQ GEMM is 4-bit only)."""
    if scheme.sym and method != "awq":
        return "gptq"
    if scheme.bits == 4 and (not scheme.act_order or scheme.static_groups):
        return "awq" if scheme.group_size != -1 else "compressed-tensors"
    return "compressed-tensors" if method == "awq" else "gptq_v2"


@dataclass(frozen=True)
class CalibConfig:
    """One calibration run. `quantkit calibrate` flags and recipe YAML both build it through `from_flat`."""

    method: str = "gptq"
    scheme: QuantScheme = field(default_factory=QuantScheme)
    layout: str = "gptq"  # on-disk layout of the checkpoint (LAYOUTS)
    data: Optional[str] = None  # calibration file; None = the general set shipped in quantkit/calibration_data
    num_samples: int = 128
    seq_len: int = 512
    data_mode: str = "concat"  # "concat": chunks of a token stream; "rows": one sample per row
    seed: int = 0
    # GPTQ dampening, fraction of mean(diag H); 0.1 with clip_search: the pair that beats RTN on every held-out domain
    # (bench/generalisation.py, BENCHMARKS.md: GPTQ at damp 0.01 without it lost to RTN on sonnets and chat)
    damp: float = 0.1
    # GPTQ without act-order: process each group's columns by descending diag(H) and the groups by their largest
    # diag(H) (group-aware reordering, Gafni et al. 2025, GPTQModel's default); groups stay k // g, so nothing
    # changes on disk (no g_idx) and qparams are still fit on the updated columns as each group starts
    group_aware: bool = True
    # GPTQ: each group's scale (and zero) from the shrink p * [min, max], p in {1, 0.99, ..., 0.50}, with the least
    # squared rounding error (quant/scheme.py clip_search) instead of plain min/max
    clip_search: bool = True
    block_size: int = 128  # GPTQ lazy-batch columns
    # AWQ: how the scaled weights W s are rounded. "gptq": GPTQ (damp, group_aware, clip_search, block_size above) on
    # the scaled input's Hessian; "rtn": the paper's clip search + round to nearest. gptq is below rtn on wikitext-2
    # test, sonnets and chat alike (BENCHMARKS.md: 30.77 / 83.28 / 14.45 against 33.75 / 86.71 / 14.72)
    awq_rounding: str = "gptq"
    batch_size: int = 8  # calibration samples per block forward
    # matmuls of the calibration forwards: "bfloat16" autocasts them (weights, residual stream and statistics stay
    # fp32); "auto" = bfloat16 where the hardware has it (CUDA, CPUs with AVX512-BF16/AMX), else float32
    compute_dtype: str = "auto"
    # MoE: an expert routed fewer calibration tokens is calibrated on a forced-routing pass (quant/moe_calibration.py);
    # None = the hidden size (fewer give a singular Hessian); 0 = never (an unreached expert is rounded to nearest)
    moe_min_tokens: Optional[int] = None
    model: Optional[str] = None  # None = the bundled default
    # mixed precision (quant/mixed_precision.py): full module name ("model.layers.3.mlp.down_proj") -> its scheme, or
    # None to leave that Linear unquantized; Linears not named take `scheme`. Flat form: {precision name | "float":
    # [module names]} (`with_precision`)
    layer_schemes: Optional[Mapping[str, Optional[QuantScheme]]] = None

    def __post_init__(self):
        s, where = self.scheme, f"method {self.method}"
        if self.method not in METHODS:
            raise QuantkitError(f"method {self.method!r} is unknown: use one of {', '.join(METHODS)}")
        if self.layout not in LAYOUTS:
            raise QuantkitError(f"format {self.layout!r} is unknown: use one of {', '.join(LAYOUTS)}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise QuantkitError(f"compute_dtype {self.compute_dtype!r} is unknown: use one of {', '.join(COMPUTE_DTYPES)}")
        if self.awq_rounding not in AWQ_ROUNDINGS:
            raise QuantkitError(f"awq_rounding {self.awq_rounding!r} is unknown: use one of {', '.join(AWQ_ROUNDINGS)}")
        if self.data_mode not in DATA_MODES:
            raise QuantkitError(f"data_mode {self.data_mode!r} is unknown: use one of {', '.join(DATA_MODES)}")
        if s.act_order and self.method != "gptq":
            raise QuantkitError(f"act_order is a GPTQ option; {where} does not reorder columns: drop --act-order")
        if s.static_groups and self.method != "gptq":
            raise QuantkitError(f"static_groups is a GPTQ option; drop --static-groups for {where}")
        if self.layout == "gptq" and not s.sym:
            raise QuantkitError(
                "format gptq (v1) stores zero - 1 and cannot hold asymmetric zeros: use --format gptq_v2, awq or "
                "compressed-tensors, or --sym"
            )
        if self.layout == "awq" and s.bits != 4:
            raise QuantkitError("format awq (AWQ GEMM) is 4-bit only: use --format gptq_v2 or compressed-tensors for 8 bits")
        if self.layout in ("awq", "compressed-tensors") and s.act_order and not s.static_groups:
            raise QuantkitError(f"format {self.layout} has no g_idx for act-order: add --static-groups or use "
                                f"--format gptq or gptq_v2")
        if not 0.0 <= self.damp <= 1.0:
            raise QuantkitError(f"damp={self.damp} must lie in [0, 1] (a fraction of mean(diag H); the default is 0.1)")
        for name in ("num_samples", "block_size", "batch_size"):
            if getattr(self, name) < 1:
                raise QuantkitError(f"{name}={getattr(self, name)} must be at least 1")
        if self.seq_len < 2:
            raise QuantkitError(f"seq_len={self.seq_len} must be at least 2")
        if self.moe_min_tokens is not None and self.moe_min_tokens < 0:
            raise QuantkitError(f"moe_min_tokens={self.moe_min_tokens} must be at least 0 (0: no forced-routing pass)")
        if self.layer_schemes:
            if self.method == "awq":
                raise QuantkitError("per-layer schemes take --method gptq or rtn: AWQ searches one scale per "
                                    "scaling group for one scheme")
            schemes = {s for s in self.layer_schemes.values() if s is not None} | {s}
            if self.layout == "awq" and len(schemes) > 1:
                raise QuantkitError("format awq holds one scheme for every quantized layer: write a mix of schemes as "
                                    "--format gptq, gptq_v2 or compressed-tensors")

    def scheme_of(self, module: str) -> Optional[QuantScheme]:
        """The scheme of the Linear `module` (full name), None when it stays unquantized."""
        if self.layer_schemes is None or module not in self.layer_schemes:
            return self.scheme
        return self.layer_schemes[module]

    @classmethod
    def from_flat(cls, flat: dict[str, Any], where: dict[str, str] | None = None, origin: str = "") -> "CalibConfig":
        """Flat keys (CALIB_KEYS) -> CalibConfig; missing keys take the defaults (AWQ defaults to asymmetric).
        Error messages name `where[key]` (`recipe.yaml:3`) for a bad value and `origin` for a bad combination."""
        where = where or {}
        for key, value in flat.items():
            at = where.get(key, key)
            if key not in CALIB_KEYS:
                raise QuantkitError(f"{at}: unknown key {key!r} (known: {', '.join(CALIB_KEYS)})")
            want = CALIB_KEYS[key]
            ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                ok = True
            if not ok and value is not None:
                raise QuantkitError(f"{at}: {key} must be {want.__name__}, got {value!r}")
        method = flat.get("method") or "gptq"
        scheme_keys = ("bits", "group_size", "act_order", "static_groups")
        scheme_args = {k: flat[k] for k in scheme_keys if flat.get(k) is not None}
        scheme_args["sym"] = flat["sym"] if flat.get("sym") is not None else method != "awq"
        try:
            scheme = QuantScheme(**scheme_args)
            args = {k: flat[k] for k in ("data", "num_samples", "seq_len", "data_mode", "seed", "block_size",
                                        "batch_size", "model", "compute_dtype", "group_aware", "clip_search",
                                        "moe_min_tokens", "awq_rounding")
                    if flat.get(k) is not None}
            if flat.get("damp") is not None:
                args["damp"] = float(flat["damp"])
            if flat.get("layer_schemes"):
                args["layer_schemes"] = _layer_schemes(flat["layer_schemes"], scheme, where.get("layer_schemes",
                                                                                                "layer_schemes"))
            layout = flat.get("format") or default_layout(method, scheme)
            return cls(method=method, scheme=scheme, layout=layout, **args)
        except QuantkitError as e:
            raise QuantkitError(f"{origin}: {e}" if origin else str(e)) from None

    def to_flat(self) -> dict[str, Any]:
        """The flat keys that rebuild this config (what a recipe holds); `from_flat(to_flat())` == self."""
        s = self.scheme
        return {"model": self.model, "method": self.method, "bits": s.bits, "group_size": s.group_size, "sym": s.sym,
                "act_order": s.act_order, "static_groups": s.static_groups, "format": self.layout, "data": self.data,
                "num_samples": self.num_samples, "seq_len": self.seq_len, "data_mode": self.data_mode,
                "seed": self.seed, "damp": self.damp, "group_aware": self.group_aware, "block_size": self.block_size,
                "batch_size": self.batch_size, "compute_dtype": self.compute_dtype, "clip_search": self.clip_search,
                "moe_min_tokens": self.moe_min_tokens, "layer_schemes": self.flat_layer_schemes(),
                "awq_rounding": self.awq_rounding}

    def flat_layer_schemes(self) -> Optional[dict[str, list[str]]]:
        """layer_schemes as {precision name | "float": [module names]} (None without per-layer schemes)."""
        if not self.layer_schemes:
            return None
        out: dict[str, list[str]] = {}
        for module, s in sorted(self.layer_schemes.items()):
            out.setdefault(FLOAT if s is None else s.precision_name(), []).append(module)
        return out

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything that changes the calibrated weights (the work folder is reused only when these match)."""
        fields = {
            "method": self.method, "scheme": self.scheme.__dict__, "data_mode": self.data_mode,
            "num_samples": self.num_samples, "seq_len": self.seq_len, "seed": self.seed, "damp": self.damp,
            "group_aware": self.group_aware, "block_size": self.block_size, "batch_size": self.batch_size,
            "compute_dtype": self.compute_dtype, "clip_search": self.clip_search, "moe_min_tokens": self.moe_min_tokens,
            "awq_rounding": self.awq_rounding,
        }
        if self.layer_schemes:
            fields["layer_schemes"] = self.flat_layer_schemes()
        return fields


def _layer_schemes(flat: dict, base: QuantScheme, where: str) -> dict[str, Optional[QuantScheme]]:
    """{precision name | "float": [module names]} -> {module name: QuantScheme or None}."""
    out: dict[str, Optional[QuantScheme]] = {}
    for name, modules in flat.items():
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise QuantkitError(f"{where}: {name} must list module names, got {modules!r}")
        scheme = None if name == FLOAT else base.with_precision(str(name), where)
        for module in modules:
            if module in out:
                raise QuantkitError(f"{where}: {module} is listed under two schemes")
            out[module] = scheme
    return out
