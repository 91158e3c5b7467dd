"""Benchmark workloads: named data sets (or a user FILE) -> prompts with the output length each request asks for.

Data lives in a local mirror (the layout of ../shared/data): `data_dir` (`--data-dir`), else $QUANTKIT_DATA_DIR,
else ../shared/data beside a source checkout (quantkit.data.shared_data_dir); nothing here is shipped in the package:
  sharegpt    chat-sharegpt/      real first-turn ChatGPT prompts; no reply lengths stored -> a fixed output length
  alpacaeval  chat-alpacaeval/    prompts + GPT-4 reference answer length in words -> tokens at TOKENS_PER_WORD
  sonnet      sonnet/sonnet.txt   vLLM's shared-prefix workload: a fixed block of lines + randomly drawn lines
  random      (no file)           random token ids of a fixed length, decoded to text
  FILE        .jsonl rows {"prompt": str} or {"messages": [...]}, optional "output_len"; or .txt, one prompt a line
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from quantkit.errors import QuantkitError

NAMED = ("sharegpt", "alpacaeval", "sonnet", "random")
WORKLOADS = NAMED + ("azure-conv", "azure-code")
DEFAULT_OUTPUT_LEN = 128
# The AlpacaEval README: "tokens ~ 1.3-1.4 x words" for Llama-style tokenizers; its lengths are words.
TOKENS_PER_WORD = 1.35
SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"

_FILES = {
    "sharegpt": "chat-sharegpt/sharegpt_v3_filtered_1000.jsonl",
    "alpacaeval": "chat-alpacaeval/alpaca_eval_gpt4ref.jsonl",
    "sonnet": "sonnet/sonnet.txt",
    "azure-conv": "azure-llm-trace-2023/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "azure-llm-trace-2023/AzureLLMInferenceTrace_code.csv",
}


@dataclass
class BenchPrompt:
    """One request of a workload: either chat `messages` or a plain `text` prompt, and its max_tokens."""

    id: str
    output_len: int
    messages: Optional[list[dict[str, str]]] = None
    text: Optional[str] = None

    def as_messages(self) -> list[dict[str, str]]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.text or ""}]

    def as_text(self, tokenizer: Any) -> str:
        """The prompt string a /v1/completions request sends (chat prompts through the model's chat template)."""
        if self.text is not None:
            return self.text
        return tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)


def default_data_dir() -> Path:
    """$QUANTKIT_DATA_DIR, else <repo>/../shared/data: the same lookup as quantkit eval's local mirror."""
    from quantkit.data import shared_data_dir

    return shared_data_dir()


def data_file(name: str, data_dir: Optional[Path] = None) -> Path:
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    path = root / _FILES[name]
    if not path.is_file():
        raise QuantkitError(
            f"dataset {name!r} needs {path}, which does not exist: pass --data-dir DIR or set QUANTKIT_DATA_DIR "
            f"(the folder holding {_FILES[name]}) or give a prompts FILE (.jsonl or .txt)"
        )
    return path


def load_prompts(
    dataset: str,
    num_prompts: int,
    tokenizer: Any = None,
    max_tokens: Optional[int] = None,
    data_dir: Optional[Path] = None,
    seed: int = 0,
    random_input_len: int = 256,
    sonnet_input_len: int = 550,
    sonnet_prefix_len: int = 200,
) -> list[BenchPrompt]:
    """`num_prompts` prompts of `dataset` (a name in NAMED or a file path), drawn with `seed`.

    max_tokens: every request's output length when given; otherwise the data's own length where it has one
    (alpacaeval) and DEFAULT_OUTPUT_LEN elsewhere. Prompts repeat (cycling the shuffled set) when the data set
    has fewer rows than asked for. sonnet and random need the model's tokenizer.
    """
    if num_prompts < 1:
        raise QuantkitError(f"--num-prompts {num_prompts}: must be at least 1")
    if max_tokens is not None and max_tokens < 1:
        raise QuantkitError(f"--max-tokens {max_tokens}: must be at least 1")
    fixed = max_tokens or DEFAULT_OUTPUT_LEN
    rng = random.Random(seed)
    if dataset == "sonnet":
        _need_tokenizer(dataset, tokenizer)
        lines = data_file(dataset, data_dir).read_text().splitlines()
        return [
            BenchPrompt(f"sonnet-{i}", fixed, text=_sonnet_prompt(lines, tokenizer, sonnet_input_len, sonnet_prefix_len, rng))
            for i in range(num_prompts)
        ]
    if dataset == "random":
        _need_tokenizer(dataset, tokenizer)
        vocab = len(tokenizer)
        return [
            BenchPrompt(f"random-{i}", fixed, text=tokenizer.decode([rng.randrange(vocab) for _ in range(random_input_len)]))
            for i in range(num_prompts)
        ]
    prompts = all_prompts(dataset, max_tokens, data_dir)
    rng.shuffle(prompts)
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def all_prompts(dataset: str, max_tokens: Optional[int] = None, data_dir: Optional[Path] = None) -> list[BenchPrompt]:
    """Every row of a row-based data set (sharegpt, alpacaeval) or prompts FILE, in file order."""
    if dataset in ("sharegpt", "alpacaeval"):
        rows = _read_jsonl(data_file(dataset, data_dir))
        return [_chat_row(dataset, i, row, max_tokens) for i, row in enumerate(rows)]
    if dataset in WORKLOADS:
        raise QuantkitError(f"{dataset!r} is not a row-based prompt set: use sharegpt, alpacaeval or a prompts FILE")
    return read_prompt_file(Path(dataset), max_tokens)


def workload_lengths(
    workload: str, tokenizer: Any = None, max_tokens: Optional[int] = None, data_dir: Optional[Path] = None
) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each request of a workload: an Azure trace's recorded
    (ContextTokens, GeneratedTokens), or a prompt set counted with the tokenizer (chat prompts through the
    chat template; sonnet and random sampled 64 times)."""
    if workload in ("azure-conv", "azure-code"):
        with data_file(workload, data_dir).open(newline="") as f:
            return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    if tokenizer is None:
        raise QuantkitError(f"workload {workload!r} needs the model's tokenizer to count prompt tokens")
    if workload in ("sonnet", "random"):
        prompts = load_prompts(workload, 64, tokenizer, max_tokens, data_dir)
    else:
        prompts = all_prompts(workload, max_tokens, data_dir)
    return [(len(tokenizer.encode(p.as_text(tokenizer), add_special_tokens=False)), p.output_len) for p in prompts]


def read_prompt_file(path: Path, max_tokens: Optional[int]) -> list[BenchPrompt]:
    """A user's prompts: .jsonl ({"prompt"} or {"messages"}, optional "output_len") or .txt (one per line)."""
    if not path.is_file():
        raise QuantkitError(
            f"{path}: no such file; --dataset takes {', '.join(NAMED)} or a prompts FILE (.jsonl or .txt)"
        )
    fixed = max_tokens or DEFAULT_OUTPUT_LEN
    if path.suffix == ".txt":
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        if not lines:
            raise QuantkitError(f"{path}: no prompts (the file has no non-empty lines)")
        return [BenchPrompt(f"{path.name}:{i + 1}", fixed, text=ln) for i, ln in enumerate(lines)]
    prompts = []
    for lineno, row in _read_jsonl_numbered(path):
        where = f"{path}:{lineno}"
        output_len = row.get("output_len", fixed)
        if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
            raise QuantkitError(f'{where}: field "output_len": expected a positive integer, got {output_len!r}')
        output_len = max_tokens or output_len
        if isinstance(row.get("prompt"), str):
            prompts.append(BenchPrompt(f"{path.name}:{lineno}", output_len, text=row["prompt"]))
        elif "messages" in row:
            prompts.append(BenchPrompt(f"{path.name}:{lineno}", output_len, messages=_check_messages(row["messages"], where)))
        else:
            raise QuantkitError(f'{where}: expected a string field "prompt" or a list field "messages"')
    if not prompts:
        raise QuantkitError(f"{path}: no prompts (the file has no rows)")
    return prompts


def _chat_row(dataset: str, index: int, row: dict, max_tokens: Optional[int]) -> BenchPrompt:
    if dataset == "alpacaeval" and max_tokens is None:
        output_len = max(1, round(row["reference_output_len_words"] * TOKENS_PER_WORD))
    else:
        output_len = max_tokens or DEFAULT_OUTPUT_LEN
    return BenchPrompt(row.get("id", f"{dataset}-{index}"), output_len, messages=row["messages"])


def _sonnet_prompt(lines: list[str], tokenizer: Any, input_len: int, prefix_len: int, rng: random.Random) -> str:
    """vLLM's sonnet recipe: instruction + the first lines worth `prefix_len` tokens (shared by every prompt)
    + random further lines until about `input_len` tokens."""
    def count(s: str) -> int:
        return len(tokenizer.encode(s, add_special_tokens=False))

    per_line = sum(count(ln) for ln in lines) / len(lines)
    base = count(SONNET_INSTRUCTION)
    if input_len <= base or prefix_len > input_len:
        raise QuantkitError(
            f"sonnet input length {input_len} must exceed the instruction ({base} tokens) and the prefix ({prefix_len})"
        )
    n_prefix = max(0, round((prefix_len - base) / per_line))
    n_total = max(n_prefix, round((input_len - base) / per_line))
    chosen = lines[:n_prefix] + [rng.choice(lines) for _ in range(n_total - n_prefix)]
    return SONNET_INSTRUCTION + "\n".join(chosen)


def _check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise QuantkitError(f'{where}: field "messages": expected a non-empty list of {{"role", "content"}}')
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise QuantkitError(f'{where}: field "messages[{j}]": expected {{"role": str, "content": str}}')
    return messages


def _need_tokenizer(dataset: str, tokenizer: Any) -> None:
    if tokenizer is None:
        raise QuantkitError(f"dataset {dataset!r} builds prompts from token counts: give the model's tokenizer (--tokenizer)")


def _read_jsonl(path: Path) -> list[dict]:
    return [row for _, row in _read_jsonl_numbered(path)]


def _read_jsonl_numbered(path: Path) -> list[tuple[int, dict]]:
    rows = []
    for lineno, line in enumerate(path.read_text().split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise QuantkitError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise QuantkitError(f"{path}:{lineno}: expected a JSON object per line")
        rows.append((lineno, row))
    return rows
