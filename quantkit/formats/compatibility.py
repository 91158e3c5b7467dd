"""Which runtimes load a quantized checkpoint, as data: one row per (runtime, layout, condition) with the verdict,
the reason and where the fact comes from. `quantkit info DIR` prints the verdicts for a folder; `quantkit calibrate`
and `quantkit export` name the runtimes that read what they wrote.

Per runtime the first row whose layout and condition match decides; no matching row is "unknown". A condition maps
Checkpoint fields to the value (or tuple of values) they must have. "measured" rows were run against the real
runtime (vLLM's CPU build 0.32; transformers 5.x with compressed-tensors 0.20.1); the others cite the runtime's own
code or documentation as read, not run here. vLLM is two rows: its CUDA and CPU backends differ on asymmetric GPTQ.
GGUF has no rows: quantkit reads .gguf files as float models and never writes one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from quantkit.config import QuantScheme

RUNTIMES = ("vLLM (CUDA)", "vLLM (CPU)", "transformers", "TGI", "SGLang")
VERDICTS = ("yes", "no", "unknown")
GPTQ = ("gptq", "gptq_v2")
CT = "compressed-tensors"


@dataclass(frozen=True)
class Checkpoint:
    """The facts of a quantized checkpoint that the rules read."""

    layout: str  # gptq | gptq_v2 | awq | compressed-tensors
    bits: int
    group_size: int  # -1: per-channel
    sym: bool
    act_order: bool  # desc_act: g_idx not k // g (static groups are not act-order on disk)
    moe: bool  # the model has MoE experts

    @classmethod
    def of(cls, layout: str, scheme: QuantScheme, moe: bool) -> "Checkpoint":
        return cls(layout, scheme.bits, scheme.group_size, scheme.sym, scheme.act_order and not scheme.static_groups,
                   moe)


@dataclass(frozen=True)
class Rule:
    runtime: str
    layouts: tuple[str, ...]
    when: dict[str, Any]  # Checkpoint field -> required value or tuple of values; {}: any checkpoint of the layouts
    verdict: str  # yes | no | unknown
    reason: str
    source: str

    def matches(self, ck: Checkpoint) -> bool:
        if ck.layout not in self.layouts:
            return False
        return all(getattr(ck, k) in (v if isinstance(v, tuple) else (v,)) for k, v in self.when.items())


# Sources, as read (code paths relative to each project's repository):
# vllm#26092: vllm-project/vllm pull 26092 (merged Oct 2025), gptq_gemm honours checkpoint_format gptq_v2 (true zeros)
# vllm marlin_utils: vllm model_executor/layers/quantization/utils/marlin_utils.py, query_marlin_supported_quant_types
#   (uint4b8 / uint8b128 symmetric, uint4 / uint8 with zero points); gptq_marlin.py TYPE_MAP (symmetric only)
# vllm#39980: vllm-project/vllm issue 39980, asymmetric compressed-tensors MoE refused (vLLM 0.19)
# optimum gptq: huggingface/optimum optimum/gptq/quantizer.py ("gptq_v2 format only supported with gptqmodel");
#   transformers docs quantization/gptq (GPTQModel: asymmetric support; AutoGPTQ no longer supported)
# TGI marlin: text-generation-inference server/text_generation_server/layers/marlin/gptq.py (can_use_gptq_marlin:
#   4/8-bit, group -1/32/64/128, sm80+, asymmetric only for AWQ; repack_gptq_for_marlin)
# TGI config: .../utils/quantization.py (checkpoint_format read only for marlin_24, so gptq_v2 is read as v1)
# TGI ct: .../layers/compressed_tensors/wna16_int.py (W4A16 / W8A16 int on GPTQ-Marlin, zero points when asymmetric)
# SGLang docs: docs.sglang.io advanced_features/quantization (awq, gptq, compressed-tensors: NVIDIA yes)
# SGLang gptq: sglang python/sglang/srt/layers/quantization/gptq (GPTQLinearScheme.use_v2_format)
MEASURED = "measured"

RULES: tuple[Rule, ...] = (
    # vLLM, CUDA
    Rule("vLLM (CUDA)", GPTQ, {"sym": True}, "yes",
         "gptq_marlin (4/8-bit, desc_act too); other group sizes on the gptq_gemm kernel", "vllm marlin_utils"),
    Rule("vLLM (CUDA)", ("gptq_v2",), {"moe": True}, "unknown",
         "asymmetric GPTQ experts: not verified (gptq_marlin, the GPTQ MoE path, is symmetric only)",
         "vllm marlin_utils"),
    Rule("vLLM (CUDA)", ("gptq_v2",), {}, "yes",
         "gptq_gemm with true zeros (releases after Oct 2025), not the faster Marlin kernel", "vllm#26092"),
    Rule("vLLM (CUDA)", ("awq",), {}, "yes", "awq / awq_marlin (4-bit GEMM with zero points)", "vllm marlin_utils"),
    Rule("vLLM (CUDA)", (CT,), {"sym": False, "moe": True}, "no",
         "'Only symmetric quantization is supported for MoE' (compressed-tensors WNA16 MoE)",
         "vllm#39980"),
    Rule("vLLM (CUDA)", (CT,), {}, "yes", "compressed-tensors WNA16 on Marlin (zero points for asymmetric)",
         "vllm marlin_utils"),
    # vLLM, CPU (0.32, measured by bench/runtime_compat.py: it runs quantized models in bfloat16 only, refusing
    # float32 for GPTQ / AWQ and failing at the first compressed-tensors forward)
    Rule("vLLM (CPU)", GPTQ + ("awq", CT), {"bits": 8}, "no",
         "no 8-bit kernel ('Marlin does not support weight_bits = uint8b128'; compressed-tensors: 'Quant type "
         "(uint8b128) not supported by CPUWNA16')", MEASURED),
    Rule("vLLM (CPU)", GPTQ, {"sym": False}, "no",
         "refuses asymmetric GPTQ ('Unsupported quantization config: bits=4, sym=False' for w4)", MEASURED),
    Rule("vLLM (CPU)", ("gptq_v2",), {}, "no", "refuses checkpoint_format gptq_v2", MEASURED),
    Rule("vLLM (CPU)", ("gptq",), {"act_order": True}, "no",
         "refuses desc_act ('GPTQ group activation ordering (desc_act=True) is no longer supported'); "
         "act-order with static groups (no g_idx on disk) loads", MEASURED),
    Rule("vLLM (CPU)", ("gptq",), {}, "yes", "symmetric GPTQ v1 (group size dividing K), bfloat16", MEASURED),
    Rule("vLLM (CPU)", ("awq",), {}, "yes", "AWQ GEMM, bfloat16", MEASURED),
    Rule("vLLM (CPU)", (CT,), {"moe": True}, "unknown", "compressed-tensors MoE experts not measured", ""),
    Rule("vLLM (CPU)", (CT,), {}, "yes", "compressed-tensors W4A16, symmetric or with zero points, bfloat16",
         MEASURED),
    # transformers 5.x
    Rule("transformers", (CT,), {"sym": False}, "no",
         "compressed-tensors 0.20.1: weight_zero_point shape mismatch at load (llm-compressor#1618); "
         "CompressedTensorsConfig(run_compressed=False) loads it dense", MEASURED),
    Rule("transformers", (CT,), {}, "yes", "compressed-tensors", MEASURED),
    Rule("transformers", ("gptq",), {"sym": True}, "yes", "through GPTQModel (pip install gptqmodel)", MEASURED),
    Rule("transformers", ("gptq_v2",), {}, "yes",
         "through GPTQModel only ('gptq_v2 format only supported with gptqmodel'); not run here",
         "optimum gptq"),
    Rule("transformers", ("awq",), {}, "yes", "AWQ GEMM", MEASURED),
    # TGI
    Rule("TGI", ("gptq",), {"sym": True}, "yes",
         "GPTQ-Marlin (4/8-bit, group -1/32/64/128, sm80+), else exllama / triton kernels", "TGI marlin"),
    Rule("TGI", ("gptq_v2",), {"sym": False}, "no",
         "reads every GPTQ folder as v1 (zero - 1 stored) and Marlin refuses asymmetric GPTQ", "TGI config"),
    Rule("TGI", ("gptq_v2",), {}, "unknown",
         "read as v1: right only where GPTQ-Marlin runs it (symmetric zeros unused), wrong on the exllama path",
         "TGI config"),
    Rule("TGI", ("awq",), {}, "yes", "GPTQ-Marlin repack with AWQ zero points, or the AWQ GEMM kernel", "TGI marlin"),
    Rule("TGI", (CT,), {}, "yes", "W4A16 / W8A16 int, symmetric and asymmetric, on GPTQ-Marlin", "TGI ct"),
    # SGLang
    Rule("SGLang", ("gptq",), {"sym": True}, "yes", "gptq / gptq_marlin", "SGLang docs"),
    Rule("SGLang", ("gptq_v2",), {}, "unknown",
         "its non-Marlin GPTQ scheme carries v2 zeros (use_v2_format) but the kernel behind it varies by release",
         "SGLang gptq"),
    Rule("SGLang", ("awq",), {}, "yes", "awq / awq_marlin", "SGLang docs"),
    Rule("SGLang", (CT,), {"sym": True}, "yes", "compressed-tensors WNA16", "SGLang docs"),
    Rule("SGLang", (CT,), {}, "unknown", "asymmetric WNA16 not verified", ""),
)


@dataclass(frozen=True)
class Verdict:
    runtime: str
    verdict: str  # yes | no | unknown
    reason: str
    source: str  # "measured", a source named above; "" when nothing backs it (not measured, no rule)


def compatibility(ck: Checkpoint) -> list[Verdict]:
    """One Verdict per runtime, in RUNTIMES order."""
    out = []
    for runtime in RUNTIMES:
        rule = next((r for r in RULES if r.runtime == runtime and r.matches(ck)), None)
        out.append(Verdict(runtime, rule.verdict, rule.reason, rule.source) if rule else
                   Verdict(runtime, "unknown", "no rule for this layout and scheme", ""))
    return out


def combined(cks: Sequence[Checkpoint]) -> list[Verdict]:
    """Per runtime, the verdict on a checkpoint holding every scheme of `cks` (a mixed-precision folder): "no" when
    it refuses one of them (that one's reason), "yes" when it loads all, else "unknown"."""
    out = []
    for per_scheme in zip(*(compatibility(ck) for ck in cks)):
        deciding = next((v for verdict in ("no", "unknown") for v in per_scheme if v.verdict == verdict), per_scheme[0])
        out.append(deciding)
    return out


def runtime_note(*cks: Checkpoint) -> str:
    """One line naming the runtimes that read a checkpoint of the schemes `cks`, those that do not, and those not
    known."""
    verdicts = combined(cks)
    by_verdict = {v: [x.runtime for x in verdicts if x.verdict == v] for v in VERDICTS}
    parts = [f"{label}: {', '.join(by_verdict[v])}" for v, label in
             (("yes", "loads in"), ("no", "not in"), ("unknown", "unknown for")) if by_verdict[v]]
    return f"{cks[0].layout} {' + '.join(describe(ck) for ck in cks)}: " + "; ".join(parts) + \
        " (quantkit info DIR says why)"


def written_note(folder: Path) -> str:
    """runtime_note for a folder quantkit wrote: the layout and schemes of its quantkit.json (the scheme of every
    quantized layer where its layer table names them, a mixed-precision checkpoint's), MoE from config.json."""
    from quantkit.files import read_json
    from quantkit.formats.checkpoint import META_FILE
    from quantkit.models import ModelConfig

    meta = read_json(Path(folder) / META_FILE)
    s = meta["scheme"]
    base = QuantScheme(s["bits"], s["group_size"], s["sym"], s["act_order"], s["static_groups"])
    names = sorted({row["scheme"] for row in meta.get("layers", []) if "scheme" in row}) or [base.precision_name()]
    moe = ModelConfig.from_hf(read_json(Path(folder) / "config.json")).num_experts > 0
    cks = dict.fromkeys(Checkpoint.of(meta["layout"], base.with_precision(n, META_FILE), moe) for n in names)
    return runtime_note(*cks)


def describe(ck: Checkpoint) -> str:
    """'w4 g128 asym act-order' and the like."""
    group = "per-channel" if ck.group_size == -1 else f"g{ck.group_size}"
    return " ".join([f"w{ck.bits}", group, "sym" if ck.sym else "asym"] + ["act-order"] * ck.act_order
                    + ["MoE"] * ck.moe)

