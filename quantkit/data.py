"""User data -> validated rows -> token tensors.

Files: `.jsonl` (one JSON object per line), `.txt` (one row per non-blank line), `.parquet`, or a folder written by
`datasets.Dataset.save_to_disk`. Row kinds, told apart by their fields:
  text        {"text"}
  completion  {"prompt", "completion"}                       mask = completion tokens
  chat        {"messages": [{"role", "content"}, ...]}       model's chat template; mask = assistant tokens
  choice      {"question" | "context", "choices", "answer": int}
  answer      {"prompt" | "question", "answer": str | number} greedy generation is checked against `answer`
Every problem is a QuantkitError `file:line: field "x": what is wrong` (parquet / dataset folders count rows from 1).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from quantkit.errors import QuantkitError

KNOWN_FIELDS = 'text; prompt + completion; messages; question/context + choices + answer; prompt + answer'
CONCAT_SEPARATOR = "\n\n"
DEFAULT_CALIBRATION = "general.jsonl"  # in quantkit/calibration_data/


@dataclass(frozen=True)
class Row:
    kind: str  # "text" | "completion" | "chat" | "choice" | "answer"
    where: str  # "file:line", for error messages
    text: Optional[str] = None  # text rows
    prompt: Optional[str] = None  # completion / answer rows; question or context of choice rows
    prompt_field: Optional[str] = None  # "prompt" | "question" | "context"
    completion: Optional[str] = None
    messages: Optional[tuple[dict, ...]] = None
    choices: Optional[tuple[str, ...]] = None
    answer: Any = None  # int index for choice rows, str for answer rows
    id: Optional[str] = None


@dataclass
class CalibData:
    input_ids: torch.Tensor  # int64 [N, L], right-padded with the pad token in "rows" mode
    mask: Optional[torch.Tensor]  # bool [N, L]: assistant / completion tokens; None when every row is plain text
    lengths: torch.Tensor  # int64 [N]: real tokens per sample (L in "concat" mode)
    stats: dict = field(default_factory=dict)
    fingerprint: str = ""


def shared_data_dir() -> Path:
    """The local mirror of the standard data sets: $QUANTKIT_DATA_DIR, else ../shared/data beside a source checkout
    (layout: evals/standard_sets.py; tests/fixtures/data is a tiny one)."""
    env = os.environ.get("QUANTKIT_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "data"


def default_calibration_file() -> Path:
    """The general calibration set shipped in the package (quantkit/calibration_data/README.md: WikiText-2 valid
    articles and GSM8K problems, about 80k tokens of the bundled tokenizer: enough for 128 x 512 in concat mode)."""
    path = Path(__file__).resolve().parent / "calibration_data" / DEFAULT_CALIBRATION
    if not path.is_file():
        raise QuantkitError(f"no calibration data given and the shipped default {path} is missing (a broken "
                            f"install?): pass --data FILE")
    return path


# ---------------------------------------------------------------- reading rows


def read_rows(path: str | Path) -> list[Row]:
    """Every row of a user data file, validated (errors name the file, the line and the field)."""
    path = Path(path)
    if not path.exists():
        raise QuantkitError(f"{path}: no such file or folder")
    if path.is_dir():
        records = _dataset_dir_records(path)
    elif path.suffix == ".jsonl":
        records = _jsonl_records(path)
    elif path.suffix == ".txt":
        records = _txt_records(path)
    elif path.suffix == ".parquet":
        records = _parquet_records(path)
    else:
        raise QuantkitError(
            f"{path}: unsupported data file type {path.suffix!r}: use .jsonl, .txt, .parquet or a datasets folder"
        )
    rows = [_row_from_record(rec, f"{path}:{line}") for line, rec in records]
    if not rows:
        raise QuantkitError(f"{path}: empty file: no rows (expected one row per line with {KNOWN_FIELDS})")
    return rows


def read_text(path: str | Path) -> str:
    """The text of a data file for perplexity: a .txt file read whole, else its "text" rows joined with "\\n\\n"."""
    path = Path(path)
    if path.suffix == ".txt" and path.is_file():
        text = "".join(line for _, line in _utf8_lines(path))
        if not text.strip():
            raise QuantkitError(f"{path}: empty file: no text")
        return text
    texts = [r.text for r in read_rows(path) if r.kind == "text"]
    if not texts:
        raise QuantkitError(f'{path}: no "text" rows to measure perplexity on')
    return CONCAT_SEPARATOR.join(texts)


def _utf8_lines(path: Path) -> Iterable[tuple[int, str]]:
    """(line number from 1, line with its newline) of a UTF-8 text file; invalid bytes name their line and column."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise QuantkitError(f"{path}:{line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                    f"{e.start + 1}): save the file as UTF-8") from None


def _jsonl_records(path: Path) -> Iterable[tuple[int, Any]]:
    for line_no, line in _utf8_lines(path):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as e:
            raise QuantkitError(f"{path}:{line_no}: malformed JSON at column {e.colno}: {e.msg}") from None


def _txt_records(path: Path) -> Iterable[tuple[int, Any]]:
    for line_no, line in _utf8_lines(path):
        if line.strip():
            yield line_no, {"text": line.rstrip("\n")}


def _parquet_records(path: Path) -> Iterable[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise QuantkitError(f"{path}: not a readable parquet file ({e})") from None
    return enumerate(table.to_pylist(), start=1)


def _dataset_dir_records(path: Path) -> Iterable[tuple[int, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise QuantkitError(f"{path}: a folder, but not one written by datasets' save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise QuantkitError(f"{path}: holds splits {sorted(ds)}: pass one split's folder, e.g. {path / sorted(ds)[0]}")
        ds = next(iter(ds.values()))
    return enumerate(ds, start=1)


# ---------------------------------------------------------------- validating rows


def _row_from_record(rec: Any, where: str) -> Row:
    if not isinstance(rec, dict):
        raise QuantkitError(f"{where}: expected a JSON object with {KNOWN_FIELDS}, got {type(rec).__name__}")
    rid = None if rec.get("id") is None else str(rec["id"])
    if "messages" in rec:
        return Row("chat", where, messages=_messages(rec, where), id=rid)
    if "choices" in rec:
        return _choice_row(rec, where, rid)
    if "text" in rec:
        return Row("text", where, text=_string(rec, "text", where), id=rid)
    if "prompt" in rec and "completion" in rec:
        return Row("completion", where, prompt=_string(rec, "prompt", where), prompt_field="prompt",
                   completion=_string(rec, "completion", where), id=rid)
    prompt_field = "prompt" if "prompt" in rec else "question" if "question" in rec else None
    if prompt_field and "answer" in rec:
        answer = rec["answer"]
        if isinstance(answer, int) and not isinstance(answer, bool):
            raise QuantkitError(f'{where}: missing field "choices": an integer "answer" indexes a list of choices')
        if not isinstance(answer, (str, float)) or isinstance(answer, bool):
            raise QuantkitError(f'{where}: field "answer": expected a string, got {type(answer).__name__}')
        return Row("answer", where, prompt=_string(rec, prompt_field, where), prompt_field=prompt_field,
                   answer=str(answer), id=rid)
    if prompt_field == "prompt":
        raise QuantkitError(f'{where}: missing field "completion" (or "answer") next to "prompt"')
    if prompt_field == "question" or "context" in rec:
        raise QuantkitError(f'{where}: missing field "choices" (and "answer") for a multiple-choice row')
    raise QuantkitError(f"{where}: no known fields (has {sorted(rec)}): expected {KNOWN_FIELDS}")


def _string(rec: dict, name: str, where: str) -> str:
    value = rec.get(name)
    if not isinstance(value, str):
        raise QuantkitError(f'{where}: field "{name}": expected a string, got {type(value).__name__}')
    return value


def _messages(rec: dict, where: str) -> tuple[dict, ...]:
    messages = rec["messages"]
    if not isinstance(messages, list):
        raise QuantkitError(f'{where}: field "messages": expected a list of {{"role", "content"}}, got {type(messages).__name__}')
    if not messages:
        raise QuantkitError(f'{where}: field "messages": empty list')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise QuantkitError(f'{where}: field "messages[{i}]": expected an object, got {type(m).__name__}')
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise QuantkitError(f'{where}: field "messages[{i}].{key}": expected a string, got {type(m.get(key)).__name__}')
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def _choice_row(rec: dict, where: str, rid: Optional[str]) -> Row:
    prompt_field = "question" if "question" in rec else "context" if "context" in rec else None
    if prompt_field is None:
        raise QuantkitError(f'{where}: missing field "question" (or "context") for a multiple-choice row')
    prompt = _string(rec, prompt_field, where)
    choices = rec["choices"]
    if not isinstance(choices, list):
        raise QuantkitError(f'{where}: field "choices": expected a list of strings, got {type(choices).__name__}')
    if not choices:
        raise QuantkitError(f'{where}: field "choices": empty list: give at least two choices')
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            raise QuantkitError(f'{where}: field "choices[{i}]": expected a string, got {type(c).__name__}')
    if "answer" not in rec:
        raise QuantkitError(f'{where}: missing field "answer" (0-based index into "choices")')
    answer = rec["answer"]
    if not isinstance(answer, int) or isinstance(answer, bool):
        raise QuantkitError(f'{where}: field "answer": expected an integer index into "choices", got {type(answer).__name__}')
    if not 0 <= answer < len(choices):
        raise QuantkitError(
            f'{where}: field "answer": {answer} is out of range for {len(choices)} choices (0..{len(choices) - 1})'
        )
    return Row("choice", where, prompt=prompt, prompt_field=prompt_field, choices=tuple(choices), answer=answer, id=rid)


# ---------------------------------------------------------------- rows -> tokens


def row_text(row: Row) -> str:
    """Plain text of a non-chat row (a choice row reads as its question followed by the right answer)."""
    if row.kind == "text":
        return row.text
    if row.kind == "completion":
        return row.prompt + row.completion
    if row.kind == "choice":
        return f"{row.prompt} {row.choices[row.answer]}"
    if row.kind == "answer":
        return f"{row.prompt} {row.answer}"
    raise QuantkitError(f"{row.where}: a chat row has no plain text: it goes through the chat template")


def chat_spans(tokenizer, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans of each assistant turn (end-of-turn included).

    A turn starts where rendering the earlier messages with the generation prompt ends, and ends where rendering the
    messages up to it ends (templates render conversations incrementally); its content is searched for otherwise.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise QuantkitError(f'{where}: field "messages": the tokenizer has no chat template: use "text" rows instead')

    def render(msgs: list[dict], generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raises TemplateError / ValueError for conversations it refuses
            raise QuantkitError(f'{where}: field "messages": the chat template refused it: {e}') from None

    text = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        upto = render(messages[: i + 1])
        if not text.startswith(upto):
            raise QuantkitError(f'{where}: field "messages": the chat template does not render turns incrementally')
        before = render(messages[:i], generation_prompt=True) if i else ""
        start = len(before) if i and upto.startswith(before) else upto.rfind(m["content"])
        if start < 0:
            raise QuantkitError(f'{where}: field "messages[{i}].content": not found in the rendered conversation')
        spans.append((start, len(upto)))
    return text, spans


def tokenize_row(row: Row, tokenizer) -> tuple[list[int], Optional[list[bool]]]:
    """ids (no special tokens added beyond what a chat template writes) and the loss mask, or None = all tokens."""
    if row.kind == "chat":
        text, spans = chat_spans(tokenizer, list(row.messages), row.where)
    elif row.kind == "completion":
        text, spans = row.prompt + row.completion, [(len(row.prompt), len(row.prompt) + len(row.completion))]
    else:
        return tokenizer(row_text(row), add_special_tokens=False)["input_ids"], None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(s <= start < e for s, e in spans) for start, _ in enc["offset_mapping"]]
    return enc["input_ids"], mask


# ---------------------------------------------------------------- calibration batches


def calibration_batches(
    path: Optional[str | Path],
    tokenizer,
    num_samples: int,
    seq_len: int,
    mode: str = "concat",
    seed: int = 0,
) -> CalibData:
    """N samples x L tokens from a data file (None = the shipped general set, default_calibration_file()).

    concat: rows tokenized one by one, joined with the tokens of "\\n\\n" into one stream, cut into non-overlapping
            L-token chunks; N chunks picked at random (seeded), kept in stream order.
    rows:   one sample per row (N rows picked at random, seeded): truncated to L, right-padded with the pad token.
    Fewer than N samples are returned when the data holds fewer (stats["samples"] says how many).
    """
    if mode not in ("concat", "rows"):
        raise QuantkitError(f"calibration mode {mode!r} is unknown: use concat or rows")
    if num_samples < 1 or seq_len < 2:
        raise QuantkitError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples} x {seq_len}")
    path = Path(path) if path is not None else default_calibration_file()
    rows = read_rows(path)
    tokenized = [tokenize_row(r, tokenizer) for r in rows]
    has_mask = any(m is not None for _, m in tokenized)
    rng = random.Random(seed)
    if mode == "concat":
        data = _concat_samples(tokenized, tokenizer, num_samples, seq_len, has_mask, rng)
    else:
        data = _row_samples(tokenized, tokenizer, num_samples, seq_len, has_mask, rng)
    data.stats.update(source=str(path), mode=mode, seed=seed, seq_len=seq_len, samples_requested=num_samples,
                      samples=int(data.input_ids.shape[0]), rows_total=len(rows))
    data.stats["rows_dropped"] = len(rows) - data.stats["rows_used"]
    if data.stats["samples"] == 0:
        raise QuantkitError(
            f"{path}: {data.stats['tokens_total']} tokens in {len(rows)} rows give no sample of {seq_len} tokens: "
            f"lower --seq-len or add data"
        )
    data.fingerprint = fingerprint(data)
    return data


def _concat_samples(tokenized, tokenizer, n: int, seq_len: int, has_mask: bool, rng: random.Random) -> CalibData:
    sep = tokenizer(CONCAT_SEPARATOR, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    mask: list[bool] = []
    owner: list[int] = []  # row index of each stream token, -1 for separators
    for i, (row_ids, row_mask) in enumerate(tokenized):
        if i:
            ids += sep
            mask += [False] * len(sep)
            owner += [-1] * len(sep)
        ids += row_ids
        mask += row_mask if row_mask is not None else [True] * len(row_ids)
        owner += [i] * len(row_ids)
    chunks = len(ids) // seq_len
    picked = sorted(rng.sample(range(chunks), min(n, chunks)))
    starts = [c * seq_len for c in picked]
    stream = torch.tensor(ids, dtype=torch.int64)
    input_ids = torch.stack([stream[s : s + seq_len] for s in starts]) if starts else torch.zeros(0, seq_len, dtype=torch.int64)
    out_mask = None
    if has_mask:
        m = torch.tensor(mask, dtype=torch.bool)
        out_mask = torch.stack([m[s : s + seq_len] for s in starts]) if starts else torch.zeros(0, seq_len, dtype=torch.bool)
    rows_used = {owner[t] for s in starts for t in range(s, s + seq_len)} - {-1}
    used = len(starts) * seq_len
    stats = dict(rows_used=len(rows_used), tokens_total=len(ids), tokens_used=used, tokens_dropped=len(ids) - used)
    return CalibData(input_ids, out_mask, torch.full((len(starts),), seq_len, dtype=torch.int64), stats)


def _row_samples(tokenized, tokenizer, n: int, seq_len: int, has_mask: bool, rng: random.Random) -> CalibData:
    nonempty = [i for i, (row_ids, _) in enumerate(tokenized) if row_ids]
    picked = sorted(rng.sample(nonempty, min(n, len(nonempty))))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(picked), seq_len), pad, dtype=torch.int64)
    out_mask = torch.zeros(len(picked), seq_len, dtype=torch.bool)
    lengths = torch.zeros(len(picked), dtype=torch.int64)
    for b, i in enumerate(picked):
        row_ids, row_mask = tokenized[i]
        k = min(len(row_ids), seq_len)
        input_ids[b, :k] = torch.tensor(row_ids[:k])
        out_mask[b, :k] = torch.tensor(row_mask[:k]) if row_mask is not None else True
        lengths[b] = k
    total = sum(len(t) for t, _ in tokenized)
    used = int(lengths.sum())
    stats = dict(rows_used=len(picked), tokens_total=total, tokens_used=used, tokens_dropped=total - used)
    return CalibData(input_ids, out_mask if has_mask else None, lengths, stats)


def fingerprint(data: CalibData) -> str:
    """sha256 over the shapes, tokens, real lengths and mask: the identity of the calibration set."""
    h = hashlib.sha256()
    h.update(repr(tuple(data.input_ids.shape)).encode())
    h.update(data.input_ids.contiguous().numpy().tobytes())
    h.update(data.lengths.contiguous().numpy().tobytes())
    if data.mask is not None:
        h.update(data.mask.contiguous().numpy().tobytes())
    return h.hexdigest()
