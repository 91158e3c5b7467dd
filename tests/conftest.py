"""Shared fixtures: the bundled model (loaded once per session), tiny random configs of each family, and the data
sets: small subsets shipped in tests/fixtures/data (README.md there), laid out as a QUANTKIT_DATA_DIR mirror."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning OpenMP threads starve on a busy CPU

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURE_DATA = REPO / "tests" / "fixtures" / "data"
# Every test reads the shipped subsets: quantkit eval's standard sets, bench workloads and plan's traces all look in
# $QUANTKIT_DATA_DIR first, so nothing falls through to a sibling data folder or the Hub (set here, over any value
# the caller's shell has, so the tests behave the same in every checkout).
os.environ["QUANTKIT_DATA_DIR"] = str(FIXTURE_DATA)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The data sets the tests read: tests/fixtures/data (the layout of a QUANTKIT_DATA_DIR mirror)."""
    return FIXTURE_DATA


@pytest.fixture(scope="module")
def one_thread():
    """torch on one intra-op thread for a module of tiny-tensor tests: on the shared 2-core machine the second
    thread only adds synchronisation (10-20x slower per op under load). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bundled():
    """quantkit.models.loader.Loaded for the bundled SmolLM2-135M-Instruct, fp32, CPU."""
    from quantkit.models.loader import load_model

    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    from quantkit.models.loader import bundled_model_dir

    return bundled_model_dir()


@pytest.fixture(scope="module")
def family_folder(tmp_path_factory, bundled_dir):
    """name -> the folder of tests/quantkit/families.py's tiny random model of that family (saved once a module)."""
    from tests.quantkit.families import saved_families

    saved = saved_families(tmp_path_factory.mktemp("families"), bundled_dir)
    return lambda name: saved(name)[1]


def tiny_hf_config(model_type: str = "llama", **overrides) -> dict:
    """A tiny random-weight config dict in Hugging Face form (hidden 64, 2 layers, GQA 4:2)."""
    cfg = {
        "model_type": model_type,
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    cfg.update(overrides)
    return cfg
