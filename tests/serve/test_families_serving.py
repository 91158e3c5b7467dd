"""Every family through the paged serving engine (fp32, CPU, chunked prefill) against quantkit's dense path (which
tests/quantkit/test_families.py holds equal to transformers): per-layer scales, sliding windows and soft-caps in
the paged attention, MoE batching, KV blocks released behind the window, and the real HTTP server."""

from __future__ import annotations

import pytest
import torch

from quantkit.models.loader import load_model
from quantkit.serve.block_manager import FREED
from quantkit.serve.llm import LLM
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.validation import validate_request
from tests.quantkit.families import FAMILIES, MOE_FAMILIES, WINDOW, saved_families
from tests.serve.api_live import live_server, serving_app

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

BLOCK = 4
MAX_TOKENS = 32
SERVED = [name for name in FAMILIES if name != "phi3-longrope"]  # vLLM semantics: test_longrope_serving.py
_g = torch.Generator().manual_seed(18)
PROMPTS = [torch.randint(0, 128, (n,), generator=_g).tolist() for n in (5, 17, 40, 4 * WINDOW)]  # 64 > 4 windows
ENGINE = dict(dtype="float32", device="cpu", block_size=BLOCK, max_num_batched_tokens=24, max_model_len=128,
              kv_cache_memory=4 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)  # the tiny models' EOS is arbitrary


@pytest.fixture(scope="module")
def folders(tmp_path_factory, bundled_dir):
    """name -> the family's tiny checkpoint folder (saved once)."""
    saved = saved_families(tmp_path_factory.mktemp("serving-families"), bundled_dir)
    return lambda name: saved(name)[1]


_dense: dict = {}


@torch.inference_mode()
def dense_greedy(name, model, prompt):
    """Greedy tokens of quantkit's dense forward, the whole sequence recomputed each token (before serving
    prepares the model)."""
    key = name, tuple(prompt)
    if key not in _dense:
        ids = list(prompt)
        for _ in range(MAX_TOKENS):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        _dense[key] = ids[len(prompt):]
    return _dense[key]


def served(folder, **options):
    """quantkit.LLM on a fresh load of folder (serving prepares the model it is given), fp32 CPU, chunked prefill."""
    return LLM(load_model(str(folder)), **{**ENGINE, **options})


def tokens(outputs):
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("name", SERVED)
def test_paged_greedy_equals_the_dense_path(name, folders):
    reference = load_model(str(folders(name))).model
    expected = [dense_greedy(name, reference, p) for p in PROMPTS]
    llm = served(folders(name))
    assert tokens(llm.generate(PROMPTS, GREEDY)) == expected, name


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_16_concurrent_requests_equal_one_at_a_time(name, folders):
    g = torch.Generator().manual_seed(16)
    prompts = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (16,), generator=g)]
    llm = served(folders(name), enable_prefix_caching=False)
    alone = [tokens(llm.generate([p], GREEDY))[0] for p in prompts]
    assert tokens(llm.generate(prompts, GREEDY)) == alone, name


def test_windowed_model_keeps_its_kv_bounded(folders):
    """Mistral (every layer slides over 16 tokens): a 64-token prompt and 32 tokens more hold at most
    ceil(16 / 4) + 1 blocks (+1 being filled) once decoding; n=2 forks over released entries and a second request
    hits the prefix cache on blocks released to its LRU; all equal the dense path."""
    reference = load_model(str(folders("mistral"))).model
    prompt = PROMPTS[-1]
    expected = dense_greedy("mistral", reference, prompt)
    llm = served(folders("mistral"), max_num_batched_tokens=8)
    engine = llm.engine
    bm = engine.block_manager
    assert bm.window == WINDOW
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)]
    bound = -(-WINDOW // BLOCK) + 1 + 1
    final = {}
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", validate_request(prompt, p, engine.vocab_size, engine.max_model_len,
                                                     engine.cfg.max_num_seqs))
        peak, released = 0, False
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            for seq in engine.scheduler.running:
                released |= FREED in seq.block_table
                if seq.num_computed_tokens >= len(prompt):
                    peak = max(peak, bm.live_blocks(seq))
                else:  # a prefill chunk of 8 on top of the window
                    assert bm.live_blocks(seq) <= -(-(WINDOW + 8) // BLOCK) + 1
        assert released and 0 < peak <= bound, (peak, bound)
    assert final["r0"].outputs[0].token_ids == expected
    assert [c.token_ids for c in final["r1"].outputs] == [expected, expected]
    assert final["r1"].metrics.num_cached_prompt_tokens > 0  # served from blocks released behind r0's window
    assert bm.num_used_blocks == 0


@pytest.mark.parametrize("name", ["gemma2", "mixtral"])  # soft-caps and alternating windows; MoE with windows
def test_http_server_serves_the_family(name, folders):
    import openai

    prompts = PROMPTS[2:]
    offline = served(folders(name)).generate(prompts, GREEDY)
    with serving_app(load_model(str(folders(name))), name, **ENGINE) as app, live_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.completions.create(model=name, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True})
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [out.outputs[0].text for out in offline]
    assert response.usage.completion_tokens == MAX_TOKENS * len(prompts)


def test_alternating_rotaries_keep_one_rope_table_each(folders):
    """Gemma 3's local and global layers alternate two inv_freq tensors: the fused ops keep a table for each."""
    llm = served(folders("gemma3"))
    ops = llm.engine.runner.fused_ops
    if ops is None:
        pytest.skip("the fused CPU kernels do not build here")
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    rotaries = list(llm.loaded.model.rotaries())
    assert len(rotaries) == 2 and all(id(r.inv_freq) in ops._rope for r in rotaries)
    tables = [ops._rope[id(r.inv_freq)][2] for r in rotaries]
    positions = torch.arange(8)
    assert all(ops.rope_table(positions, r) is t for r, t in zip(rotaries * 2, tables * 2))  # no rebuild
