"""The serving code keeps its shape: LLMEngine.step reads in a few lines, and a request is checked in one place
(serve/validation.py) whichever way it comes in, with the same words."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import httpx
import pytest

from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.validation import InvalidRequest, context_length_message
from tests.serve.api_live import live_server, serving_app

SERVE = Path(__file__).resolve().parents[2] / "serve"
MAX_STEP_LINES = 15
MAX_MODEL_LEN = 64
OUT_OF_VOCABULARY = "prompt: token id 49152 is out of vocabulary (size 49152)"  # the bundled model's vocabulary
TOO_LONG = (
    "This model's maximum context length is 64 tokens. However, you requested 10 output tokens and your prompt "
    "contains at least 60 input tokens, for a total of at least 70 tokens. Please reduce the length of the input "
    "prompt or the number of requested output tokens."
)


def serve_modules() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text(), filename=str(path)) for path in sorted(SERVE.glob("*.py"))}


def functions(tree: ast.Module):
    return (node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def strings(tree: ast.Module) -> list[str]:
    """Every string literal, f-string pieces included."""
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


# ---- shape ---------------------------------------------------------------------------------------------------


def test_engine_step_is_at_most_15_lines():
    engine_class = next(node for node in serve_modules()["engine.py"].body
                        if isinstance(node, ast.ClassDef) and node.name == "LLMEngine")
    step = next(node for node in engine_class.body if isinstance(node, ast.FunctionDef) and node.name == "step")
    assert step.end_lineno - step.lineno + 1 <= MAX_STEP_LINES


def test_one_function_raises_too_long_and_one_message_says_out_of_vocabulary():
    modules = serve_modules()
    too_long_callers = {(name, fn.name) for name, tree in modules.items() for fn in functions(tree)
                        for call in ast.walk(fn) if isinstance(call, ast.Call)
                        and getattr(call.func, "id", None) == "context_length_message"}
    assert too_long_callers == {("validation.py", "validate_request")}
    vocabulary_messages = [(name, s) for name, tree in modules.items() for s in strings(tree)
                           if "out of vocabulary" in s or "out of range for a vocabulary" in s]
    assert vocabulary_messages == [("validation.py", " is out of vocabulary (size ")]
    context_messages = {name for name, tree in modules.items() for s in strings(tree) if "maximum context length" in s}
    assert context_messages == {"validation.py"}


def test_the_engine_trusts_its_requests():
    engine = serve_modules()["engine.py"]
    called = {getattr(call.func, "id", getattr(call.func, "attr", None)) for call in ast.walk(engine)
              if isinstance(call, ast.Call)}
    assert not called & {"validate_request", "validate", "check_token_ids"}


# ---- the same refusal through every entry point --------------------------------------------------------------


@pytest.fixture(scope="module")
def served(bundled):
    """A live HTTP server on the bundled model (max_model_len 64) and its front end."""
    with serving_app(bundled, "smollm2", max_model_len=MAX_MODEL_LEN, kv_cache_memory=8 << 20) as app:
        with live_server(app) as url:
            yield url, app.state.serving.engine


@pytest.mark.slow
def test_llm_refuses_with_the_exact_messages(bundled):
    from quantkit.serve.llm import LLM

    llm = LLM(bundled, max_model_len=MAX_MODEL_LEN, kv_cache_memory=8 << 20)
    with pytest.raises(InvalidRequest) as e:
        llm.generate([[49152]], SamplingParams(max_tokens=4))
    assert str(e.value) == OUT_OF_VOCABULARY
    with pytest.raises(InvalidRequest) as e:
        llm.generate([[5] * 60], SamplingParams(max_tokens=10))
    assert str(e.value) == TOO_LONG == context_length_message(MAX_MODEL_LEN, 10, 60)
    with pytest.raises(InvalidRequest) as e:  # n sequences that could never be scheduled together
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, n=llm.engine.cfg.max_num_seqs + 1))
    assert e.value.param == "n"
    assert not llm.engine.has_unfinished()


@pytest.mark.slow
def test_front_end_refuses_with_the_exact_messages(served):
    _, engine = served
    for ids, max_tokens, message in [([49152], 4, OUT_OF_VOCABULARY), ([5] * 60, 10, TOO_LONG)]:
        with pytest.raises(InvalidRequest) as e:
            asyncio.run(anext(engine.generate("bad", ids, SamplingParams(max_tokens=max_tokens))))
        assert str(e.value) == message


@pytest.mark.slow
def test_http_api_refuses_with_the_exact_messages_and_fields(served):
    url, _ = served
    with httpx.Client(base_url=url, timeout=60) as http:
        for ids, max_tokens, message, param in [([49152], 4, OUT_OF_VOCABULARY, "prompt"),
                                                ([5] * 60, 10, TOO_LONG, "max_tokens")]:
            response = http.post("/v1/completions", json={"model": "smollm2", "prompt": ids, "max_tokens": max_tokens})
            assert response.status_code == 400
            assert response.json()["error"] == {"message": message, "type": "BadRequestError", "param": param,
                                                 "code": 400}
