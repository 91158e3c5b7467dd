"""The checkout's kernels/ folder is quantkit.kernels; the bare name `kernels` is Hugging Face's distribution, which
transformers >= 5 imports whenever it is installed. A `python` started in the checkout's root (as pytest and
`python -m` are) finds the folder first: it must hand the import over, or every transformers model import fails."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from tests.conftest import REPO

PROBE = "import kernels, transformers.modeling_utils; print(kernels.__file__)"


def test_bare_kernels_in_the_checkout_root_is_the_installed_distribution():
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the `kernels` distribution is not installed: transformers does not import it")
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    loaded = run.stdout.strip()
    assert not loaded.startswith(str(REPO / "kernels")), loaded
    assert loaded.endswith("kernels/__init__.py"), loaded


def test_quantkit_kernels_is_the_checkout_folder():
    import quantkit.kernels

    assert quantkit.kernels.__file__ == str(REPO / "kernels" / "__init__.py")
