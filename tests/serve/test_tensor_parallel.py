"""Tensor-parallel serving (serve/tp_group.py, quantkit/models/sharding.py, quantkit/quant/shard.py) against
references that do not shard.

1. Slices: every row and column slice of a quantized weight (4 and 8 bit, with and without act-order g_idx)
   dequantizes to exactly that slice of the full W'; QLinear shards concatenated (column-parallel) or summed
   (row-parallel) give the full layer's output.
2. A real gloo group of 2 processes: a tiny random Llama, its KV heads split (2 over 2 ranks) or one replicated,
   sharded on each rank gives transformers' logits on the dense forward; for one KV budget each worker's pool is
   half the bytes of one worker's (split heads: the same blocks; the replicated head: half the blocks).
3. `quantkit serve --tensor-parallel-size 2` (the official openai client; rank 0 in the engine process, one
   worker process) on tiny random Llama checkpoints built with transformers (bf16 weights, GPTQ W4, GPTQ W4
   act-order, AWQ W4) and `--tensor-parallel-size 3` on the bundled SmolLM2-135M (9 heads, 3 KV heads): fp32
   greedy tokens identical to one rank (quantkit.LLM) for 16 real prompts (8 AlpacaEval chats, 8 GSM8K questions),
   logprobs within LOGPROB_TOL; quantkit.LLM(..., tensor_parallel_size=2) the same.
   The same group splits MoE blocks (every expert's and shared expert's channels, the block reduced once) and the
   MLPs without gate: Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, ERNIE 4.5 MoE, Hunyuan MoE, StarCoder2 and Nemotron
   give transformers' logits; quantkit.LLM(tensor_parallel_size=2) serves Qwen2-MoE as one rank does.
4. Refusals before any weight loads (9 heads over 2 ranks, groups that do not divide a shard (also an expert's), a
   loaded model); a worker SIGKILLed mid-stream ends the stream with an error event and the server exits 1.
The measured differences are printed (pytest -s shows them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.quant import shard as qshard
from quantkit.quant.qlinear import QLinear
from quantkit.quant.scheme import QTensor, canonical_g_idx, contiguous_groups, dequantize, fit_qparams, quantize
from quantkit.config import QuantScheme
from tests.serve.api_live import free_port
from tests.serve.test_api_reference import load_prompts
from tests.serve.test_faults import API_KEY, quantkit_serve
from tests.serve.tp_ranks import KV_BUDGET, MAX_MODEL_LEN, dense_ids, run_rank

MAX_TOKENS = 12
LOGPROB_TOL = 1e-4  # fp32: only the all-reduce's summation order differs
TINY = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
            max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


# ---- 1. slices of one quantized weight ------------------------------------------------------------------------


def act_order_g_idx(k: int, g: int, seed: int, within: int | None = None) -> torch.Tensor:
    """GPTQ act-order's g_idx: column perm[i] in group i // g for a random permutation (within: of each run of
    `within` columns only, so every group stays inside its run)."""
    gen = torch.Generator().manual_seed(seed)
    span = within or k
    perm = torch.cat([torch.randperm(span, generator=gen) + s for s in range(0, k, span)])
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    return g_idx


def quantized(n: int, k: int, bits: int, g: int, g_idx: torch.Tensor | None, seed: int = 0) -> QTensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    scheme = QuantScheme(bits=bits, group_size=g, sym=False)
    scales, zeros = fit_qparams(w, scheme, g_idx)
    codes = quantize(w, scales, zeros, bits, g, g_idx)
    return QTensor(codes, zeros, scales, canonical_g_idx(g_idx, k, g), bits, g, False)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("order", ["groups", "act-order", "act-order-whole", "per-channel"])
def test_slices_dequantize_to_the_slices_of_the_full_weight(bits, order):
    n, k, g, world = 48, 128, 16, 2
    g_idx = {"act-order": act_order_g_idx(k, g, 1), "act-order-whole": act_order_g_idx(k, g, 2, within=k // world)}
    qt = quantized(n, k, bits, -1 if order == "per-channel" else g, g_idx.get(order))
    full = dequantize(qt)
    rows = torch.tensor([3, 0, 47, 20])
    assert torch.equal(dequantize(qshard.rows(qt, rows)), full[rows])
    for r in range(world):
        lo, hi = r * k // world, (r + 1) * k // world
        part = qshard.columns(qt, lo, hi, "layer")
        assert torch.equal(dequantize(part), full[:, lo:hi]), (order, r)
        if order == "act-order-whole":  # whole groups per worker: an ordinary act-order slice the kernels take
            assert part.group_size == g and contiguous_groups(part) is not None
        if order == "act-order":  # groups split between workers: each keeps every group it references
            assert part.scales.shape[1] >= len(torch.unique(qt.g_idx[lo:hi]))


def test_a_column_slice_that_splits_a_group_is_refused():
    qt = quantized(16, 96, 4, 32, None)
    with pytest.raises(QuantkitError, match=r"layer model\.layers\.0\.mlp\.down_proj: input columns 0\.\.48 .*"
                                            r"whole groups of 32"):
        qshard.columns(qt, 0, 48, "model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("act_order", [False, True])
def test_qlinear_shards_reproduce_the_full_layer(act_order):
    from quantkit.models.sharding import take_columns, take_rows

    n, k, g = 64, 128, 32
    layer = QLinear.from_qtensor(quantized(n, k, 4, g, act_order_g_idx(k, g, 3) if act_order else None),
                                 torch.randn(n, generator=torch.Generator().manual_seed(4)))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))
    full = layer(x)
    columns = torch.cat([take_rows(layer, r * n // 2, n // 2, "q")(x) for r in range(2)], dim=-1)
    assert torch.equal(columns, full)
    parts = [take_columns(layer, r * k // 2, (r + 1) * k // 2, "o") for r in range(2)]
    summed = sum(part(x[:, r * k // 2 : (r + 1) * k // 2]) for r, (part, _) in enumerate(parts)) + parts[0][1]
    assert parts[0][1] is not None and all(part.bias is None for part, _ in parts)  # the bias is added once
    torch.testing.assert_close(summed, full, rtol=1e-5, atol=1e-5)


# ---- model folders --------------------------------------------------------------------------------------------


def tiny_folder(out: Path, bundled_dir: Path, kv_heads: int = 2, dtype: torch.dtype = torch.float32,
                vocab_size: int = 49152) -> Path:
    """A random-weight Llama built and saved by transformers (safetensors) with the bundled tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "vocab_size": vocab_size}, num_key_value_heads=kv_heads)
    LlamaForCausalLM(config).eval().to(dtype).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (bundled_dir / name).is_file():
            shutil.copy(bundled_dir / name, out / name)
    return out


def quantize_folder(src: Path, out: Path, method: str, act_order: bool = False) -> Path:
    """src calibrated on 8 random sequences (GPTQ or AWQ, W4 g32) and saved as a checkpoint."""
    from quantkit.config import CalibConfig
    from quantkit.data import CalibData
    from quantkit.formats.checkpoint import save_checkpoint
    from quantkit.models.loader import load_model
    from quantkit.quant.calibrate import calibrate

    loaded = load_model(str(src), dtype=torch.float32)
    ids = torch.randint(0, TINY["vocab_size"], (8, 64), generator=torch.Generator().manual_seed(1))
    cfg = CalibConfig.from_flat({"method": method, "group_size": 32, "num_samples": 8, "seq_len": 64,
                                 **({"act_order": True} if act_order else {})})
    calibrate(loaded.model, loaded.hf_config, CalibData(ids, None, torch.full((8,), 64), {}, "tp"), cfg,
              progress=False, log=lambda line: None)
    return save_checkpoint(out, loaded.model, loaded.hf_config, loaded.tokenizer, cfg.layout, {"method": method})


@pytest.fixture(scope="module")
def folders(tmp_path_factory, bundled_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    fp32 = tiny_folder(root / "fp32", bundled_dir)
    return {"bf16": tiny_folder(root / "bf16", bundled_dir, dtype=torch.bfloat16), "fp32": fp32,
            "gptq": quantize_folder(fp32, root / "gptq", "gptq"),
            "gptq-act-order": quantize_folder(fp32, root / "gptq-act", "gptq", act_order=True),
            "awq": quantize_folder(fp32, root / "awq", "awq")}


def test_the_act_order_checkpoint_splits_groups_between_workers(folders):
    """What the act-order serving test exercises: GPTQ's groups are scattered over K, so a worker's half of
    o_proj / down_proj references groups whose other columns the other worker holds."""
    from quantkit.formats.checkpoint import read_quantized

    qlinears = read_quantized(folders["gptq-act-order"]).qlinears
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"):
        qt = qlinears[name][0]
        half = qt.shape[1] // 2
        assert qt.g_idx is not None and len(torch.unique(qt.g_idx[:half])) > half // 32, name


# ---- 2. a real gloo group of two processes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, bundled_dir) -> dict[int, tuple[Path, dict]]:
    """kv_heads (2: split over the ranks, 1: replicated) -> (folder, rank 0's results from tests/serve/tp_ranks.py)."""
    root = tmp_path_factory.mktemp("gloo")
    folders = {kv: tiny_folder(root / f"kv{kv}", bundled_dir, kv_heads=kv, vocab_size=1024) for kv in (2, 1)}
    out = root / "rank0.pt"
    torch.multiprocessing.spawn(run_rank, args=(free_port(), [str(f) for f in folders.values()], str(out)), nprocs=2)
    results = torch.load(out)
    return {kv: (folder, results[str(folder)]) for kv, folder in folders.items()}


SHARDED_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "ernie4_5_moe", "hunyuan_moe", "starcoder2",
                    "nemotron"]  # MoE blocks (shared experts: plain, gated, GLM's dense first layer), gate-less MLPs


@pytest.fixture(scope="module")
def two_rank_families(tmp_path_factory, family_folder) -> dict[str, dict]:
    """tests/quantkit/families.py's models of SHARDED_FAMILIES -> rank 0's results from tests/serve/tp_ranks.py."""
    folders = {name: str(family_folder(name)) for name in SHARDED_FAMILIES}
    out = tmp_path_factory.mktemp("gloo-families") / "rank0.pt"
    torch.multiprocessing.spawn(run_rank, args=(free_port(), list(folders.values()), str(out)), nprocs=2)
    results = torch.load(out)
    return {name: results[folder] for name, folder in folders.items()}


@pytest.mark.parametrize("name", SHARDED_FAMILIES)
def test_two_gloo_ranks_split_moe_and_gate_less_blocks_as_transformers_computes_them(name, family_folder,
                                                                                    two_rank_families, one_thread):
    """Every expert's and shared expert's channels split over the ranks, the block's output reduced once."""
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        model = AutoModelForCausalLM.from_pretrained(family_folder(name), dtype=torch.float32).eval()
        expected = model(dense_ids(model.config.vocab_size)).logits
    got = two_rank_families[name]["logits"]
    assert (got - expected).abs().max().item() < 1e-4, name
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_two_gloo_ranks_give_transformers_logits_and_half_the_kv_bytes(kv_heads, two_ranks, one_thread):
    from transformers import LlamaForCausalLM

    from quantkit.models.loader import load_model
    from quantkit.serve.config import EngineConfig
    from quantkit.serve.model_runner import ModelRunner

    folder, sharded = two_ranks[kv_heads]
    with torch.inference_mode():
        expected = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(dense_ids()).logits
        model = load_model(str(folder), dtype=torch.float32).model
        unsharded = model(dense_ids())
    one = ModelRunner(model, EngineConfig(kv_cache_memory=KV_BUDGET, dtype="float32", device="cpu"), "cpu",
                      torch.float32, MAX_MODEL_LEN)
    one_bytes = one.kv_pool.numel() * one.kv_pool.element_size()
    diff = (sharded["logits"] - expected).abs().max().item()
    print(f"\nkv_heads={kv_heads}: max |logit TP=2 - transformers| {diff:.2e}, TP=1 - transformers "
          f"{(unsharded - expected).abs().max().item():.2e}, TP=2 - TP=1 "
          f"{(sharded['logits'] - unsharded).abs().max().item():.2e}; KV per worker {sharded['pool_bytes']} bytes, "
          f"{sharded['blocks']} blocks (one worker: {one_bytes} bytes, {one.num_blocks} blocks)")
    assert diff < 1e-4
    assert torch.equal(sharded["logits"].argmax(-1), expected.argmax(-1))
    assert sharded["pool_bytes"] == one_bytes // 2  # the same budget, split over two workers
    # split heads: each worker caches half of every token, so the blocks stay; one head replicated: they halve
    assert sharded["blocks"] == (one.num_blocks if kv_heads == 2 else one.num_blocks // 2)


# ---- 3. greedy outputs through quantkit serve and the openai client -------------------------------------------


@pytest.fixture(scope="module")
def prompts(shared_data, bundled) -> list[list[int]]:
    """The 16 real prompts as token ids: 8 AlpacaEval chats through the chat template, 8 GSM8K questions."""
    tokenizer = bundled.tokenizer
    chats, texts = load_prompts(shared_data)
    rendered = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chats]
    return ([tokenizer(t, add_special_tokens=False).input_ids for t in rendered]
            + [tokenizer(t).input_ids for t in texts])


def greedy(llm, prompts) -> list[tuple[list[int], list[dict[int, float]]]]:
    """(token ids, top-2 logprobs per token) of each prompt from a quantkit.LLM."""
    from quantkit.serve.sampling_params import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def one_rank(model, prompts) -> list[tuple[list[int], list[dict[int, float]]]]:
    """greedy() on one rank, fp32."""
    from quantkit.serve.llm import LLM

    return greedy(LLM(model, dtype="float32", kv_cache_memory=256 << 20, max_model_len=1024), prompts)


def served(base: str, prompts) -> list[tuple[list[int], list[dict[int, float]]]]:
    """The same, asked of a server with the official openai client, the 16 prompts concurrently."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=600)

    def ask(ids):
        response = client.completions.create(model=client.models.list().data[0].id, prompt=ids,
                                             max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2,
                                             extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
        lp = response.choices[0].logprobs
        as_id = lambda label: int(label.removeprefix("token_id:"))  # noqa: E731
        return [as_id(t) for t in lp.tokens], [{as_id(k): v for k, v in top.items()} for top in lp.top_logprobs]

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(ask, prompts))


def assert_same_greedy(got, expected, what: str) -> None:
    diffs = []
    for i, ((ids, tops), (ref_ids, ref_tops)) in enumerate(zip(got, expected)):
        assert ids == ref_ids, f"{what}: prompt {i} differs from one rank: {ids} vs {ref_ids}"
        diffs += [abs(top[t] - ref[t]) for top, ref in zip(tops, ref_tops) for t in ref]
    print(f"\n{what}: 16 prompts x {MAX_TOKENS} greedy tokens identical to one rank; max |logprob difference| "
          f"{max(diffs):.2e} over {len(diffs)} top-2 logprobs")
    assert len(got) == len(expected) == 16 and max(diffs) < LOGPROB_TOL


def kv_pool_bytes(log: str) -> list[int]:
    return [int(line.split("KV pool of ")[1].split()[0]) for line in log.splitlines() if "KV pool of " in line]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "gptq", "gptq-act-order", "awq"])
def test_serve_tp2_greedy_equals_one_rank(name, folders, prompts, tmp_path):
    expected = one_rank(str(folders[name]), prompts)
    with quantkit_serve(folders[name], tmp_path, "--tensor-parallel-size", "2", "--dtype", "float32",
                        "--max-num-seqs", "16", max_model_len=1024) as server:
        assert_same_greedy(served(server.base, prompts), expected, f"{name}, TP=2 via quantkit serve")
        pools = kv_pool_bytes(server.log())
    # one worker would hold 2 layers x 2 (K, V) x 2 KV heads x 32 x 4 bytes = 1 KiB per token in all of the 32 MiB
    # budget (32768 tokens); each of the two holds its one KV head of the same 32768 tokens in half of it
    assert pools == [(32 << 20) // 2] * 2 and "KV cache: 2048 blocks, 32768 tokens" in server.log()


@pytest.mark.slow
def test_serve_bundled_tp3_greedy_equals_one_rank(bundled, prompts, tmp_path):
    expected = one_rank(bundled, prompts)
    with quantkit_serve(bundled.path, tmp_path, "--tensor-parallel-size", "3", "--dtype", "float32",
                        "--max-num-seqs", "16", "--kv-cache-memory", str(192 << 20), max_model_len=1024) as server:
        assert_same_greedy(served(server.base, prompts), expected, "SmolLM2-135M, TP=3 via quantkit serve")


def embedding(llm, ids: list[int]) -> torch.Tensor:
    """The engine's pooled embedding of one input (what /v1/embeddings returns)."""
    from quantkit.serve.pooling import EmbeddingJob

    llm.engine.add_embedding("embed-0", EmbeddingJob(ids))
    outputs, failed = llm.engine.guarded_step()
    assert not failed and len(outputs) == 1
    return outputs[0].embedding


def test_llm_tp2_greedy_and_embeddings_equal_one_rank(folders, prompts):
    from quantkit.serve.llm import LLM

    folder = str(folders["gptq-act-order"])
    options = dict(dtype="float32", kv_cache_memory=256 << 20, max_model_len=1024)
    one = LLM(folder, **options)
    expected, expected_vector = greedy(one, prompts), embedding(one, prompts[0])
    llm = LLM(folder, **options, tensor_parallel_size=2)
    try:
        got, vector = greedy(llm, prompts), embedding(llm, prompts[0])
    finally:
        llm.shutdown()
    assert_same_greedy(got, expected, "GPTQ act-order, quantkit.LLM(tensor_parallel_size=2)")
    torch.testing.assert_close(vector, expected_vector, rtol=0, atol=1e-5)


def test_llm_tp2_greedy_of_a_moe_model_equals_one_rank(family_folder):
    """Qwen2-MoE (a dense layer, MoE blocks with a gated shared expert) through the paged engine on two ranks."""
    from quantkit.serve.llm import LLM

    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=rng).tolist() for n in (5, 17, 30)]
    options = dict(dtype="float32", kv_cache_memory=64 << 20, max_model_len=256)
    expected = greedy(LLM(str(family_folder("qwen2_moe")), **options), prompts)
    llm = LLM(str(family_folder("qwen2_moe")), **options, tensor_parallel_size=2)
    try:
        got = greedy(llm, prompts)
    finally:
        llm.shutdown()
    for (ids, tops), (ref_ids, ref_tops) in zip(got, expected):
        assert ids == ref_ids
        assert max(abs(top[t] - ref[t]) for top, ref in zip(tops, ref_tops) for t in ref) < LOGPROB_TOL


# ---- 4. refusals and a dead worker ----------------------------------------------------------------------------


def test_what_cannot_be_split_is_refused_before_weights_load(bundled):
    from quantkit.models.config import ModelConfig
    from quantkit.models.sharding import check_shardable
    from quantkit.serve.config import EngineConfig
    from quantkit.serve.llm import LLM, build_engine
    from tests.conftest import tiny_hf_config

    with pytest.raises(QuantkitError) as refused:  # the bundled model: 9 heads, 3 KV heads
        build_engine(None, tensor_parallel_size=2)
    assert str(refused.value) == ("--tensor-parallel-size 2 cannot split this model (config.json): "
                                  "num_attention_heads=9 is not divisible by 2; num_key_value_heads=3 neither "
                                  "divides by 2 nor divides it")
    with pytest.raises(QuantkitError, match=r"intermediate_size=512 / 2 = 256 columns per device is not a "
                                            r"multiple of group size 96"):
        check_shardable(ModelConfig.from_hf({**TINY, "num_key_value_heads": 2, "model_type": "llama"}), 2, 96)
    moe = ModelConfig.from_hf(tiny_hf_config("qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=48))
    with pytest.raises(QuantkitError, match=r"moe_intermediate_size=48 / 2 = 24 columns per device is not a multiple "
                                            r"of group size 32"):
        check_shardable(moe, 2, 32)
    with pytest.raises(QuantkitError, match="needs the model's path or hub id"):
        LLM(bundled, tensor_parallel_size=2)
    for bad in ({"tensor_parallel_size": 0}, {"tensor_parallel_size": 2, "speculative_method": "ngram"}):
        with pytest.raises(QuantkitError, match="engine option tensor_parallel_size="):
            EngineConfig(**bad)


def worker_pid(server_pid: int) -> int:
    """The tensor-parallel worker: a child of the engine process `quantkit serve` started."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            for grandchild in Path(f"/proc/{child}/task/{child}/children").read_text().split():
                if b"quantkit.serve.tp_worker" in Path(f"/proc/{grandchild}/cmdline").read_bytes():
                    return int(grandchild)
    raise AssertionError("no tensor-parallel worker")


@pytest.mark.slow
def test_a_killed_worker_ends_the_stream_with_an_error_and_the_server_exits_1(folders, tmp_path):
    with quantkit_serve(folders["fp32"], tmp_path, "--tensor-parallel-size", "2", max_model_len=512) as server:
        body = {"prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with server.http.stream("POST", "/v1/completions", json=body) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            next(lines)
            os.kill(worker_pid(server.proc.pid), signal.SIGKILL)
            killed = time.monotonic()
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == 503 and "tensor-parallel step failed: rank 1" in error["message"], error
        assert server.proc.wait(timeout=30) == 1
        print(f"\nworker SIGKILLed: the stream ended and the server exited 1 after {time.monotonic() - killed:.1f} s")
        assert "exiting with code 1" in server.log()
