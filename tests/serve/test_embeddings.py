"""/v1/embeddings against transformers on the bundled model in fp32.

The reference is transformers' own AutoModel on the bundled folder: `last_hidden_state` (after the final norm, what
vLLM pools), pooled the same way (last token, mean, first token) and L2-normalised. The server is the engine in
its own process as `quantkit serve` runs it (EngineProcess), driven by the official `openai` client on 127.0.0.1;
error bodies are read raw with httpx. The pooling methods and the engine's interleaving of embeddings with
generation are checked on the LLMEngine itself, with exact batch sizes.
"""

from __future__ import annotations

import base64
import json
import threading

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from quantkit.serve.pooling import EmbeddingJob
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.validation import validate_request
from tests.serve.api_live import live_server, serving_app

pytestmark = pytest.mark.slow

MODEL_NAME = "smollm2-embed"
MAX_MODEL_LEN = 64
STEP_TOKENS = 256  # max_num_batched_tokens of the server: 4 inputs of 60 tokens per embedding forward
KV_BYTES = 16 << 20  # fp32: 45 KiB per token, about 360 tokens
HIDDEN = 576  # SmolLM2-135M
MIN_COSINE = 0.99999  # fp32 on both sides (the issue asks for 0.999)
TEXTS = ["Paged attention stores keys and values in blocks.", "Hello", "Quantized weights, served fast!"]
TOKEN_INPUT = [504, 3458, 282, 4690, 314, 260, 1345]


@pytest.fixture(scope="module")
def reference(bundled_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(bundled_dir, dtype=torch.float32).eval()


def expected(reference, ids: list[int], pooling: str = "last", normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = reference(torch.tensor([ids])).last_hidden_state[0]  # [L, H], after the final norm
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    return F.normalize(vector, dim=-1) if normalize else vector


def cosine(a, b) -> float:
    return F.cosine_similarity(torch.from_numpy(np.array(a, dtype=np.float32)), b, dim=0).item()


@pytest.fixture(scope="module")
def url(bundled):
    with serving_app(bundled, MODEL_NAME, process=True, max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_BYTES,
                     max_num_batched_tokens=STEP_TOKENS) as app, live_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def oai(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def error_of(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param, error
    return error["message"]


# ---- through the HTTP API ------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_vectors_match_transformers(oai, bundled, reference, encoding_format):
    """None: the client asks for base64 itself and decodes it; asked for explicitly, it hands the string over."""
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    out = oai.embeddings.create(model=MODEL_NAME, input=TEXTS, **extra)
    ids = [bundled.tokenizer(text).input_ids for text in TEXTS]
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == MODEL_NAME and out.object == "list"
    for d, input_ids in zip(out.data, ids):
        vector = d.embedding
        if encoding_format == "base64":
            vector = np.frombuffer(base64.b64decode(vector), dtype="<f4")
        assert len(vector) == HIDDEN and d.object == "embedding"
        assert cosine(vector, expected(reference, input_ids)) > MIN_COSINE
        assert abs(torch.tensor(vector).norm().item() - 1.0) < 1e-5
    total = sum(len(i) for i in ids)
    assert (out.usage.prompt_tokens, out.usage.total_tokens) == (total, total)


def test_token_inputs_truncation_and_options(oai, bundled, reference):
    single = oai.embeddings.create(model=MODEL_NAME, input=TOKEN_INPUT, encoding_format="float")
    assert len(single.data) == 1 and single.usage.prompt_tokens == len(TOKEN_INPUT)
    assert cosine(single.data[0].embedding, expected(reference, TOKEN_INPUT)) > MIN_COSINE
    lists = [TOKEN_INPUT, TOKEN_INPUT[:3], [42]]
    many = oai.embeddings.create(model=MODEL_NAME, input=lists, dimensions=HIDDEN)
    assert many.usage.prompt_tokens == sum(map(len, lists))
    for d, ids in zip(many.data, lists):
        assert cosine(d.embedding, expected(reference, ids)) > MIN_COSINE
    kept = oai.embeddings.create(model=MODEL_NAME, input=TOKEN_INPUT, extra_body={"truncate_prompt_tokens": 3})
    assert kept.usage.prompt_tokens == 3  # vLLM keeps the last k tokens
    assert cosine(kept.data[0].embedding, expected(reference, TOKEN_INPUT[-3:])) > MIN_COSINE
    text = TEXTS[0]
    bare = oai.embeddings.create(model=MODEL_NAME, input=text, encoding_format="float",
                                 extra_body={"add_special_tokens": False, "normalize": False})
    raw = expected(reference, bundled.tokenizer(text, add_special_tokens=False).input_ids, normalize=False)
    vector = torch.tensor(bare.data[0].embedding)
    assert torch.allclose(vector, raw, rtol=1e-4, atol=1e-4) and abs(vector.norm().item() - 1.0) > 0.1


def test_bad_inputs_are_400_naming_the_field(http):
    def post(**body):
        return http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": "Hi", **body})

    assert "must not be empty" in error_of(post(input=[]), "input")
    assert error_of(post(input=[5] * (MAX_MODEL_LEN + 1)), "input") == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens in the input for "
        "embedding generation. Please reduce the length of the input.")
    assert error_of(post(input=[[5, 6], [49152]]), "input") == "input: token id 49152 is out of vocabulary (size 49152)"
    assert "at least one token" in error_of(post(input=[""]), "input")
    assert "'float' or 'base64'" in error_of(post(encoding_format="binary"), "encoding_format")
    assert error_of(post(dimensions=128), "dimensions").startswith(
        f'Model "{MODEL_NAME}" does not support matryoshka representation')
    error_of(post(dimensions=0), "dimensions")
    error_of(post(truncate_prompt_tokens=MAX_MODEL_LEN + 1), "truncate_prompt_tokens")
    error_of(post(input=[{"text": "Hi"}]), "input")
    assert http.post("/v1/embeddings", json={"model": "gpt-9", "input": "Hi"}).status_code == 404
    assert post(truncate_prompt_tokens=-1).status_code == 200


def test_generation_is_not_stalled_by_a_queue_of_embeddings(http, oai, bundled, reference):
    """A stream that starts first finishes while a request of 32 inputs (8 bounded forwards) is still queued, with
    the same tokens it has alone; the embeddings are right too."""
    body = {"model": MODEL_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    alone = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    inputs = [[(7 * i + j) % 1000 + 100 for j in range(60)] for i in range(32)]
    done: dict[str, object] = {}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        chunks = [next(lines)]

        def embed() -> None:
            done["embeddings"] = oai.embeddings.create(model=MODEL_NAME, input=inputs, encoding_format="float")
            done.setdefault("stream_first", False)

        worker = threading.Thread(target=embed)
        worker.start()
        chunks += list(lines)
        done.setdefault("stream_first", True)
        worker.join(timeout=120)
    text = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks if c != "data: [DONE]")
    assert text == alone and done["stream_first"] is True
    for i in (0, 13, 31):
        assert cosine(done["embeddings"].data[i].embedding, expected(reference, inputs[i])) > MIN_COSINE


# ---- the engine: pooling methods, bounded forwards between generation steps ---------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_engine_pooling_methods_match_transformers(bundled, reference, pooling):
    from quantkit.serve.llm import build_engine

    engine = build_engine(bundled, max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_BYTES, pooling=pooling)
    ids = [bundled.tokenizer(text).input_ids for text in TEXTS]
    for i, input_ids in enumerate(ids):
        engine.add_embedding(f"e{i}", EmbeddingJob(input_ids))
    outputs, failed = engine.guarded_step()
    assert not failed and [o.request_id for o in outputs] == ["e0", "e1", "e2"] and not engine.has_unfinished()
    for out, input_ids in zip(outputs, ids):
        assert out.num_prompt_tokens == len(input_ids)
        assert cosine(out.embedding, expected(reference, input_ids, pooling)) > MIN_COSINE


def test_in_process_front_end_embeds_and_refuses_an_id_in_use(bundled, reference):
    import asyncio

    from quantkit.serve.async_engine import AsyncLLMEngine
    from quantkit.serve.llm import build_engine

    front = AsyncLLMEngine(build_engine(bundled, max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_BYTES))

    async def both():
        return await asyncio.gather(front.embed("a", EmbeddingJob(TOKEN_INPUT)), front.embed("a", EmbeddingJob([5])),
                                    return_exceptions=True)

    try:
        assert front.hidden_size == HIDDEN
        first, second = asyncio.run(both())
    finally:
        front.shutdown()
    assert cosine(first.embedding, expected(reference, TOKEN_INPUT)) > MIN_COSINE
    assert isinstance(second, ValueError) and "already in use" in str(second)


def test_engine_runs_one_bounded_forward_per_step_beside_generation(bundled):
    """max_num_batched_tokens 64, inputs of 20 tokens: 3 per forward (3 x 20 <= 64 < 4 x 20), one forward per
    engine iteration, each beside one decode step of the running request; an abort leaves the queue."""
    from quantkit.serve.llm import build_engine

    engine = build_engine(bundled, max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_BYTES, max_num_batched_tokens=64)
    engine.add_request("gen", validate_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0,
                                                                         ignore_eos=True),
                                               engine.vocab_size, MAX_MODEL_LEN, 8))
    for i in range(8):
        engine.add_embedding(f"e{i}", EmbeddingJob(list(range(100, 120))))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_embedding("gen", EmbeddingJob([5]))
    assert engine.abort_request("e7")
    per_step = []
    while engine.has_unfinished():
        outputs, failed = engine.guarded_step()
        assert not failed
        per_step.append(([o.request_id for o in outputs if o.request_id.startswith("e")],
                         [len(o.outputs[0].token_ids) for o in outputs if o.request_id == "gen"]))
    assert per_step == [(["e0", "e1", "e2"], [1]), (["e3", "e4", "e5"], [2]), (["e6"], [3]), ([], [4]), ([], [5])]
