"""`quantkit eval CANDIDATE`: accuracy delta against the baseline with 95% intervals, report files and a gate."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_command(
        candidate: str = typer.Argument(..., help="the quantized model folder (or any model the loader takes)"),
        baseline: Optional[str] = typer.Option(None, help="default: base_model recorded in quantkit.json"),
        data: Optional[List[Path]] = typer.Option(None, "--data", help="your own data file (repeatable)"),
        tasks: Optional[str] = typer.Option(
            None, help="comma list: wikitext, arc_easy, piqa, hellaswag, an lm-eval task name or a data file "
                       "run through lm-eval (default: wikitext,arc_easy when no --data). The four standard sets "
                       "come from a local mirror in $QUANTKIT_DATA_DIR (arc-easy/arc_easy_test.jsonl, "
                       "piqa/piqa_validation.jsonl, hellaswag/hellaswag_val_3000.jsonl, wikitext-2/test.txt) "
                       "or, online, from the Hugging Face Hub through datasets"),
        limit: Optional[int] = typer.Option(500, help="rows per task / data file"),
        windows: Optional[int] = typer.Option(40, help="text windows per task / data file"),
        seq_len: int = typer.Option(512, "--seq-len", help="perplexity window length L"),
        max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="greedy tokens for prompt+answer rows"),
        max_delta: Optional[List[str]] = typer.Option(
            None, "--max-delta", help="gate, repeatable: acc=-1.0 (points), ppl=+3% (relative), kl=0.05"),
        recipe: Optional[Path] = typer.Option(None, help="a recipe YAML whose max_delta thresholds apply"),
        out: Optional[Path] = typer.Option(None, help="report folder (default: CANDIDATE/eval)"),
        general: bool = typer.Option(True, "--general/--no-general",
                                     help="with --data: also the delta on a general held-out text (Shakespeare's "
                                          "sonnets, shipped) and a warning when the two deltas disagree in sign"),
    ) -> None:
        """Evaluate CANDIDATE against its baseline on the same data: perplexity, KL, top-1 agreement,
        multiple-choice accuracy, generation; paired-bootstrap intervals; exit 1 when a --max-delta is breached."""
        import sys

        from rich.console import Console

        from quantkit.errors import QuantkitError
        from quantkit.evals.gate import parse_threshold
        from quantkit.evals.report import print_table, write
        from quantkit.evals.runner import EvalSpec, run

        thresholds = [parse_threshold(s) for s in max_delta or []]
        if recipe is not None:
            thresholds += recipe_thresholds(recipe)
        spec = EvalSpec(
            candidate=candidate, baseline=baseline, data=list(data or []),
            tasks=[t.strip() for t in tasks.split(",") if t.strip()] if tasks else None,
            limit=limit, windows=windows, seq_len=seq_len, max_new_tokens=max_new_tokens, thresholds=thresholds,
            general=general,
        )
        console = Console(stderr=True)
        report = run(spec, console=console)
        out_dir = out if out is not None else (Path(candidate) / "eval" if Path(candidate).is_dir() else Path("quantkit-eval"))
        print_table(report, Console())
        paths = write(report, out_dir)
        console.print(f"wrote {paths['json']}, {paths['md']}, {paths['png']}")
        for w in report.warnings:
            print(w, file=sys.stderr)
        for b in report.gate["breaches"]:
            print(f"gate breached: {b['message']}", file=sys.stderr)
        if report.gate["unchecked"]:  # a gate that checked nothing must not pass
            measured = sorted({f"{m.task}/{m.metric}" for m in report.metrics})
            raise QuantkitError(f"--max-delta {', '.join(report.gate['unchecked'])}: no task measured that metric "
                                f"(measured: {', '.join(measured) or 'nothing'}); the report is in {paths['json']}")
        if report.gate["breaches"]:
            raise typer.Exit(code=1)


def recipe_thresholds(path: Path):
    """The recipe's `max_delta` gate (quantkit.recipes validates the file)."""
    from quantkit.errors import QuantkitError
    from quantkit.evals.gate import thresholds_from_mapping
    from quantkit.recipes import GATE_KEY, load_recipe

    recipe = load_recipe(path)
    if not recipe.max_delta:
        raise QuantkitError(f'{path}: no "{GATE_KEY}" thresholds to apply (e.g. {GATE_KEY}: {{acc: -1.0, ppl: "+3%"}})')
    return thresholds_from_mapping(recipe.max_delta, recipe.where[GATE_KEY])
