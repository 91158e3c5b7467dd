"""Per-layer sensitivity: what quantizing one Linear alone to each candidate scheme costs the model, the table the
mixed-precision planner (quant/mixed_precision.py) chooses from.

For every quantizable Linear l (the registry's, in every block) and candidate scheme s (`candidates`):
  proxy[l, s] = sum over output channels n of dW_n H dW_n^T,  dW = W - Q_s(W) (round to nearest), H = X^T X / T
                over l's calibration inputs: the squared output error per token, summed over l's outputs
  kl[l, ref]  = mean over held-out tokens of KL(P_float || P_l) in nats, P_l the model with only l quantized to its
                reference scheme (the coarsest candidate: fewest bits, then the largest group), measured
  loss[l, s]  = kl[l, ref] * proxy[l, s] / proxy[l, ref]                    (0 for a Linear left in float)

Why one measured KL per Linear and the proxy for the rest: measuring every (Linear, scheme) pair is |Linears| x
|schemes| forwards (210 x 4 on the bundled model, each rerunning half the model on average), four times the one per
Linear, which alone took 24 minutes on the shared 2-core CPU (load 5-9, 255 tokens; bench/mixed_precision.py). The
proxy cannot stand in for the KL across Linears: it cannot see how much of a layer's output error reaches the logits
(an early down_proj's error passes through every later block, a k_proj's through a softmax), and on the bundled
model its rank correlation with the measured KL over the 210 Linears is 0.03 (`Sensitivity.rank_correlation`).
Between two schemes of one Linear, KL is second order in the output perturbation (KL ~ d^T F d / 2 for a small d),
so it scales with the output error energy, which the proxy measures: measured at every scheme of 3 blocks
(`measure_kl(..., schemes="all")`), the estimate ranks 45 (Linear, scheme) pairs with rho 0.995, median error 15%.

Cost of the measured KL: the float residual stream at every block input is kept ([W, L, H] per block); a Linear's
variant reruns only its own block, and all variants of one block go through the later blocks as one batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from quantkit.config import FLOAT, QuantScheme
from quantkit.errors import QuantkitError
from quantkit.models.registry import arch_spec
from quantkit.quant.scheme import dequantize, quantize_rtn

# the schemes a Linear may take by default (`quantkit calibrate --mix-schemes` chooses others)
DEFAULT_SCHEMES = ("w4g128", "w4g64", "w4g32", "w8ch", FLOAT)


def candidates(base: QuantScheme, in_features: int, keys: Sequence[str] = DEFAULT_SCHEMES
               ) -> list[Optional[QuantScheme]]:
    """The schemes of `keys` one Linear [.., K] may take (a group size dividing K), coarsest first (fewer bits, then
    larger groups; per-channel is the largest), float (None) last. Symmetry and act-order are the base scheme's (one
    per checkpoint)."""
    schemes = [base.with_precision(k, "--mix-schemes") for k in keys if k != FLOAT]
    fits = [s for s in schemes if s.group_size == -1 or in_features % s.group_size == 0]
    fits.sort(key=lambda s: (s.bits, -(in_features if s.group_size == -1 else s.group_size)))
    return [*fits, *([None] if FLOAT in keys else [])]


def scheme_key(scheme: Optional[QuantScheme]) -> str:
    """The table's name of a candidate: "w4g64", "w8ch", "float"."""
    return FLOAT if scheme is None else scheme.precision_name()


@dataclass
class LinearSensitivity:
    name: str  # full module name, "model.layers.3.mlp.down_proj"
    shape: tuple[int, int]  # (N, K) = (out_features, in_features)
    proxy: dict[str, float]  # scheme key -> sum_n dW_n H dW_n^T (float: 0)
    reference: str  # the scheme key whose KL was measured
    kl: dict[str, float] = field(default_factory=dict)  # scheme key -> measured KL, nats per held-out token

    def loss(self, key: str) -> float:
        """Estimated KL of quantizing this Linear alone to scheme `key` (module docstring)."""
        if key == FLOAT:
            return 0.0
        ref = self.proxy[self.reference]
        kl = self.kl.get(self.reference)
        if kl is None:
            raise QuantkitError(f"{self.name}: no measured KL at {self.reference}: run measure_kl first")
        return 0.0 if ref <= 0 else kl * self.proxy[key] / ref


@dataclass
class Sensitivity:
    linears: list[LinearSensitivity]
    tokens: dict[str, int]  # "hessian": calibration tokens behind H, "kl": held-out tokens behind each KL
    source: dict[str, str] = field(default_factory=dict)  # "hessian" / "kl": where those tokens came from

    def of(self, name: str) -> LinearSensitivity:
        return next(s for s in self.linears if s.name == name)

    def rank_correlation(self) -> float:
        """Spearman's rho between the proxy and the measured KL at each Linear's reference scheme."""
        pairs = [(s.proxy[s.reference], s.kl[s.reference]) for s in self.linears if s.reference in s.kl]
        return spearman(*zip(*pairs)) if len(pairs) > 2 else float("nan")

    def scaling_check(self) -> dict[str, float]:
        """Where KL was measured at schemes besides the reference: Spearman's rho of the estimate (`loss`) against
        the measurement, and the median |estimate / measured - 1|, over those (Linear, scheme) pairs."""
        pairs = [(s.loss(k), v) for s in self.linears for k, v in s.kl.items() if k != s.reference]
        if len(pairs) < 3:
            return {}
        est, measured = np.array(pairs).T
        rel = np.abs(est / np.maximum(measured, 1e-12) - 1)
        return {"pairs": len(pairs), "spearman": spearman(est, measured), "median_rel_error": float(np.median(rel))}

    def to_json(self) -> dict:
        return {"linears": [asdict(s) for s in self.linears], "tokens": self.tokens, "source": self.source}

    @classmethod
    def from_json(cls, data: dict) -> "Sensitivity":
        return cls([LinearSensitivity(**{**s, "shape": tuple(s["shape"])}) for s in data["linears"]],
                   data["tokens"], data.get("source", {}))


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def quantizable(model: nn.Module, model_type: str) -> list[tuple[int, str]]:
    """(block index, block-relative name) of every Linear calibration quantizes, in block and registry order."""
    spec = arch_spec(model_type)
    return [(i, name) for i, block in enumerate(model.model.layers) for name in spec.in_block(block).linears]


@torch.inference_mode()
def input_hessians(model: nn.Module, model_type: str, calib, batch_size: int = 8,
                   advance: Callable[[int], None] = lambda n: None) -> tuple[dict[str, torch.Tensor], int]:
    """{full Linear name: H = X^T X / T [K, K] fp32} over the calibration tokens (the driver's statistics hooks:
    padding and unmasked tokens left out, MoE experts on the tokens routed to them), float model; and T."""
    from quantkit.quant.calibrate import capture_stage, token_mask

    spec = arch_spec(model_type)
    mask = token_mask(calib)
    positions = torch.arange(calib.input_ids.shape[1])
    x = torch.cat([model.embed(calib.input_ids[b:b + batch_size]) for b in range(0, len(calib.input_ids), batch_size)])
    out: dict[str, torch.Tensor] = {}
    for i, block in enumerate(model.model.layers):
        bspec = spec.in_block(block)
        stats = capture_stage(block, list(bspec.linears), x, mask, positions, ("hessian",), batch_size,
                              f"model.layers.{i}.", torch.device("cpu"), bspec.router)
        shared: dict[int, torch.Tensor] = {}  # q/k/v (gate/up) read one input: one H
        for name, st in stats.items():
            if id(st) not in shared:
                shared[id(st)] = st.hessian()
            out[f"model.layers.{i}.{name}"] = shared[id(st)]
        x = torch.cat([block(x[b:b + batch_size], positions) for b in range(0, len(x), batch_size)])
        advance(1)
    return out, int(mask.sum())


@torch.inference_mode()
def proxy_table(model: nn.Module, model_type: str, base: QuantScheme, hessians: dict[str, torch.Tensor],
                keys: Sequence[str] = DEFAULT_SCHEMES) -> list[LinearSensitivity]:
    """Every quantizable Linear's proxy at each of its candidate schemes (a Linear no calibration token reached, an
    MoE expert, is left out: nothing measures it)."""
    table = []
    for i, name in quantizable(model, model_type):
        full = f"model.layers.{i}.{name}"
        if full not in hessians:
            continue
        w = model.model.layers[i].get_submodule(name).weight.detach().float()  # [N, K]
        h = hessians[full]
        proxy = {}
        schemes = candidates(base, w.shape[1], keys)
        if not any(schemes):
            raise QuantkitError(f"--mix-schemes {','.join(keys)}: no quantized scheme fits {full} "
                                f"({w.shape[1]} input features)")
        for s in schemes:
            if s is None:
                proxy[FLOAT] = 0.0
                continue
            dw = w - dequantize(quantize_rtn(w, s, layer=full))
            proxy[scheme_key(s)] = float(((dw @ h) * dw).sum())
        table.append(LinearSensitivity(full, tuple(w.shape), proxy, scheme_key(schemes[0])))
    return table


@torch.inference_mode()
def measure_kl(model: nn.Module, table: Sequence[LinearSensitivity], base: QuantScheme, windows: torch.Tensor,
               schemes: str = "reference", blocks: Optional[Iterable[int]] = None,
               advance: Callable[[int], None] = lambda n: None) -> None:
    """Fill `kl` of the table's Linears: KL(P_float || P with that Linear alone round-to-nearest quantized), mean
    over the scored tokens of `windows` int64 [W, L] (every position after the first predicts the next token).
    schemes: "reference" (each Linear's reference scheme) or "all" (every quantized candidate); blocks: only these.
    model: float, unchanged on return."""
    layers = model.model.layers
    positions = torch.arange(windows.shape[1])
    xs = [model.embed(windows)]  # xs[i]: block i's float input [W, L, H]
    for block in layers:
        xs.append(block(xs[-1], positions))
    kl_to = KLToReference(model, model.model.norm(xs[-1])[:, :-1])
    by_block: dict[int, list[LinearSensitivity]] = {}
    for s in table:
        by_block.setdefault(int(s.name.split(".")[2]), []).append(s)
    wanted = set(by_block) if blocks is None else set(blocks) & set(by_block)
    for i in sorted(wanted):
        variants: list[tuple[LinearSensitivity, str, torch.Tensor]] = []  # (Linear, scheme key, block output)
        for s in by_block[i]:
            linear = layers[i].get_submodule(s.name.split(".", 3)[3])
            keys = [s.reference] if schemes == "reference" else [k for k in s.proxy if k != FLOAT]
            w = linear.weight.data
            for key in keys:
                linear.weight.data = dequantize(quantize_rtn(w.float(), base.with_precision(key), layer=s.name), w.dtype)
                try:
                    variants.append((s, key, layers[i](xs[i], positions)))
                finally:
                    linear.weight.data = w
        y = torch.cat([v[2] for v in variants])  # [V * W, L, H]
        for block in layers[i + 1:]:
            y = block(y, positions)
        for (s, key, _), out in zip(variants, y.split(windows.shape[0])):
            s.kl[key] = kl_to(model.model.norm(out)[:, :-1])
        advance(1)


class KLToReference:
    """Mean KL(P || Q) over tokens for a fixed P: with Q = softmax(z), per token KL = sum_v p log p - sum_v p z +
    logsumexp(z) (sum_v p = 1), so P's probabilities and negative entropy are computed once and each Q costs one
    dot product and one logsumexp over the vocabulary. The terms are O(10) and cancel to KLs of 1e-5 and less (one
    W8 Linear): float64 from the fp32 logits on (fp32 sums leave ~5e-8 nats of error)."""

    def __init__(self, model: nn.Module, hidden: torch.Tensor):
        """hidden: final-normed [..., H] of the float model at the scored positions."""
        self.model = model
        logp = torch.log_softmax(model.logits(hidden).double(), dim=-1)  # [..., V]
        self.p = logp.exp()
        self.neg_entropy = (self.p * logp).sum(-1)  # [...]

    def __call__(self, hidden: torch.Tensor) -> float:
        z = self.model.logits(hidden).double()
        kl = self.neg_entropy - torch.linalg.vecdot(self.p, z) + torch.logsumexp(z, dim=-1)
        return float(kl.clamp_min(0.0).mean())


def sensitivity(model: nn.Module, model_type: str, base: QuantScheme, calib, windows: torch.Tensor,
                batch_size: int = 8, progress: bool = True, sources: Optional[dict[str, str]] = None,
                keys: Sequence[str] = DEFAULT_SCHEMES) -> Sensitivity:
    """The whole table: H from `calib` (quantkit.data.CalibData), proxy at every candidate of `keys`, measured KL at
    each Linear's reference scheme on the held-out `windows` [W, L]."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    n = len(model.model.layers)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), disable=not progress) as bar:
        task = bar.add_task("sensitivity: calibration statistics", total=n)
        hessians, tokens = input_hessians(model, model_type, calib, batch_size, lambda k: bar.advance(task, k))
        table = proxy_table(model, model_type, base, hessians, keys)
        del hessians
        task = bar.add_task("sensitivity: KL of each Linear alone", total=n)
        measure_kl(model, table, base, windows, advance=lambda k: bar.advance(task, k))
    return Sensitivity(table, {"hessian": tokens, "kl": int(windows.shape[0] * (windows.shape[1] - 1))},
                       dict(sources or {}))
