"""The HTTP API against independent references on the bundled model in fp32.

1. Greedy outputs through the HTTP API (official `openai` client, real uvicorn on 127.0.0.1, the engine in its own
process as `quantkit serve` runs it) equal transformers'
`generate` on the bundled model in fp32, token for token, for 16 real prompts (8 chat from AlpacaEval, 8 plain
completions from GSM8K), streamed and not, at concurrency 1 and 16.

Token ids come back exactly through logprobs with vLLM's `return_tokens_as_token_ids`. Where a sequence diverges,
the test requires a numerical tie at that position (both candidates in the server's top-2 and their logprobs
within 1e-3 in the server and in transformers), as vLLM's own correctness tests allow; the rest of that sequence
is then not compared.

2. lm-eval's `local-completions` model pointed at the server (token-id prompts, echo + logprobs) scores 20
ARC-Easy rows exactly as lm-eval's `hf` model scores them with transformers directly: same accuracy, same
per-choice log-likelihoods within 1e-3.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.serve.api_live import live_server, serving_app

pytestmark = pytest.mark.slow

MAX_TOKENS = 20
TIE_TOLERANCE = 1e-3
NUM_CHAT = NUM_COMPLETION = 8
MODEL_NAME = "smollm2-ref"
KV_BYTES = 256 << 20  # fp32: 45 KiB per token, about 5800 tokens (16 prompts in flight fit)


def load_prompts(shared_data) -> tuple[list[list[dict]], list[str]]:
    """The first 8 short AlpacaEval instructions (as chat messages) and the first 8 GSM8K questions."""
    with open(shared_data / "chat-alpacaeval" / "alpaca_eval_gpt4ref.jsonl") as f:
        rows = [json.loads(line) for line in f]
    chats = [r["messages"] for r in rows if len(r["messages"][0]["content"].split()) <= 24][:NUM_CHAT]
    with open(shared_data / "gsm8k" / "test.jsonl") as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(NUM_COMPLETION), f)]
    return chats, [f"Question: {q}\nAnswer:" for q in questions]


@pytest.fixture(scope="module")
def reference(bundled_dir):
    """transformers' own model class on the bundled weights, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(bundled, reference, shared_data):
    """[(kind, payload, prompt ids, transformers token ids, transformers logprobs [T, V])] for the 16 prompts."""
    tokenizer = bundled.tokenizer
    chats, texts = load_prompts(shared_data)
    prompts = [("chat", m, tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True))
               for m in chats] + [("completion", t, t) for t in texts]
    out = []
    for kind, payload, text in prompts:
        ids = tokenizer(text, add_special_tokens=(kind == "completion")).input_ids
        with torch.no_grad():
            gen = reference.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                                     output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, len(ids):].tolist()
        logprobs = torch.log_softmax(torch.cat(gen.logits).float(), dim=-1)
        out.append((kind, payload, ids, tokens, logprobs))
    return out


@pytest.fixture(scope="module")
def url(bundled):
    with serving_app(bundled, MODEL_NAME, process=True, max_model_len=1024, kv_cache_memory=KV_BYTES) as app, \
            live_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def token_id(label: str) -> int:
    assert label.startswith("token_id:"), label
    return int(label.split(":", 1)[1])


def ask(client, kind: str, payload, stream: bool) -> tuple[list[int], list[dict[int, float]]]:
    """One greedy request; the generated token ids and each position's top-2 {id: logprob}."""
    common = dict(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0.0, stream=stream,
                  extra_body={"return_tokens_as_token_ids": True})
    if kind == "chat":
        response = client.chat.completions.create(messages=payload, logprobs=True, top_logprobs=2, **common)
        chunks = response if stream else [response]
        entries = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
        return ([token_id(e.token) for e in entries],
                [{token_id(t.token): t.logprob for t in e.top_logprobs} for e in entries])
    response = client.completions.create(prompt=payload, logprobs=2, **common)
    chunks = response if stream else [response]
    tokens, tops = [], []
    for c in chunks:
        for ch in c.choices:
            if ch.logprobs:
                tokens += [token_id(t) for t in ch.logprobs.tokens]
                tops += [{token_id(k): v for k, v in top.items()} for top in ch.logprobs.top_logprobs]
    return tokens, tops


def compare(case, got: list[int], tops: list[dict[int, float]]) -> str:
    """"equal", or "tie at N" after checking the divergence is a numerical tie; fails otherwise."""
    kind, _, _, expected, ref_logprobs = case
    for pos, (mine, ref) in enumerate(zip(got, expected)):
        if mine == ref:
            continue
        top = tops[pos]
        assert ref in top, f"position {pos}: transformers' token {ref} is not in the server's top-2 {top}"
        server_gap = abs(top[mine] - top[ref])
        ref_gap = abs(ref_logprobs[pos, mine].item() - ref_logprobs[pos, ref].item())
        assert server_gap <= TIE_TOLERANCE and ref_gap <= TIE_TOLERANCE, (
            f"{kind} position {pos}: server {mine} vs transformers {ref} is not a tie "
            f"(logprob gap {server_gap:.2e} in the server, {ref_gap:.2e} in transformers)")
        return f"tie at {pos}"
    assert len(got) == len(expected), f"{kind}: {len(got)} tokens from the server, {len(expected)} from transformers"
    return "equal"


def test_greedy_matches_transformers_one_at_a_time(client, cases):
    """Concurrency 1: odd prompts streamed, even prompts as one JSON response."""
    verdicts = [compare(case, *ask(client, case[0], case[1], stream=i % 2 == 1)) for i, case in enumerate(cases)]
    assert verdicts.count("equal") >= len(cases) - 2, verdicts


def test_greedy_matches_transformers_16_concurrent(client, cases):
    """All 16 prompts in flight together, each in the mode it did not get one at a time."""
    jobs = [(case, i % 2 == 0) for i, case in enumerate(cases)]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        answers = list(pool.map(lambda job: ask(client, job[0][0], job[0][1], stream=job[1]), jobs))
    verdicts = [compare(job[0], *answer) for job, answer in zip(jobs, answers)]
    assert verdicts.count("equal") >= len(jobs) - 2, verdicts


ARC_ROWS = 20
ARC_TASK = """\
task: arc_easy_quantkit
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_local_completions_matches_direct_scoring(url, reference, bundled, bundled_dir, shared_data,
                                                          tmp_path):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    (tmp_path / "arc_easy_quantkit.yaml").write_text(
        ARC_TASK.format(path=shared_data / "arc-easy" / "arc_easy_test.jsonl"))
    tasks = TaskManager(include_path=str(tmp_path))

    def evaluate(model, model_args=None):
        out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["arc_easy_quantkit"],
                                      task_manager=tasks, limit=ARC_ROWS, log_samples=True, batch_size=8)
        samples = sorted(out["samples"]["arc_easy_quantkit"], key=lambda s: s["doc_id"])
        return out["results"]["arc_easy_quantkit"]["acc,none"], samples

    served_acc, served = evaluate("local-completions", {
        "base_url": f"{url}/v1/completions", "model": MODEL_NAME, "tokenizer_backend": "huggingface",
        "tokenizer": str(bundled_dir), "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
    })
    direct_acc, direct = evaluate(HFLM(pretrained=reference, tokenizer=bundled.tokenizer, batch_size=8))
    assert len(served) == len(direct) == ARC_ROWS
    for a, b in zip(served, direct):
        served_ll = [r[0] for r in a["filtered_resps"]]
        direct_ll = [r[0] for r in b["filtered_resps"]]
        assert served_ll == pytest.approx(direct_ll, abs=1e-3), a["doc_id"]
    assert served_acc == direct_acc
