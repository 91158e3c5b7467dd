"""Independent reference: the bundled FP16 model's ARC-Easy accuracy from quantkit eval equals lm-eval's own HF
backend (transformers' model, lm-eval's request building and metrics) on the same rows and prompt format."""

from __future__ import annotations

import pytest

ROWS = 50


@pytest.mark.slow
def test_arc_easy_accuracy_equals_lm_eval_hf_backend(bundled_dir):
    import lm_eval

    from quantkit.evals.lm_eval_bridge import task_manager
    from quantkit.evals.runner import EvalSpec, run

    report = run(EvalSpec(candidate=str(bundled_dir), baseline=str(bundled_dir), tasks=["arc_easy"], limit=ROWS))
    ours = {m.metric: m for m in report.metrics}
    assert ours["acc"].n == ROWS and ours["acc"].baseline == ours["acc"].candidate

    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={bundled_dir},dtype=float32,device=cpu",
                                 tasks=["qk_arc_easy"], task_manager=task_manager(include_defaults=False),
                                 limit=ROWS, batch_size=16, bootstrap_iters=0, log_samples=False)
    theirs = hf["results"]["qk_arc_easy"]
    assert ours["acc"].candidate == pytest.approx(100 * theirs["acc,none"], abs=0.1)
    assert ours["acc_norm"].candidate == pytest.approx(100 * theirs["acc_norm,none"], abs=0.1)
    assert 30 < ours["acc"].candidate < 90  # a real signal, not chance (25%) or a broken prompt
