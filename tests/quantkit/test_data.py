"""quantkit.data on the bundled model's real tokenizer: row kinds, chat masks, calibration batches, errors."""

import json
from pathlib import Path

import pytest
import torch

from quantkit.data import (
    CONCAT_SEPARATOR,
    calibration_batches,
    fingerprint,
    read_rows,
    default_calibration_file,
    read_text,
    tokenize_row,
)
from quantkit.errors import QuantkitError


@pytest.fixture(scope="module")
def tok():
    from quantkit.models.loader import load_tokenizer

    return load_tokenizer(None)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "Six."},
]


# ---------------------------------------------------------------- reading


def test_row_kinds_from_jsonl(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [
        {"text": "plain"},
        "",
        {"prompt": "Q: ", "completion": "A"},
        {"messages": CHAT},
        {"id": 7, "question": "q?", "choices": ["a", "b"], "answer": 1},
        {"context": "ctx", "choices": ["x", "y", "z"], "answer": 0},
        {"prompt": "2+2=", "answer": "4"},
        {"question": "3+3=", "answer": 6.0},
    ])
    rows = read_rows(f)
    assert [r.kind for r in rows] == ["text", "completion", "chat", "choice", "choice", "answer", "answer"]
    assert [r.where for r in rows] == [f"{f}:{n}" for n in (1, 3, 4, 5, 6, 7, 8)]  # blank line 2 skipped
    assert rows[3].prompt == "q?" and rows[3].choices == ("a", "b") and rows[3].answer == 1 and rows[3].id == "7"
    assert rows[4].prompt_field == "context"
    assert rows[6].answer == "6.0"


def test_txt_parquet_and_datasets_folder_give_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["first line", "second line", "third"]
    (tmp_path / "d.txt").write_text("first line\n\nsecond line\nthird\n")
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "dd"))
    for name in ("d.txt", "d.parquet", "ds", "dd"):
        assert [r.text for r in read_rows(tmp_path / name)] == texts, name
    assert [r.where for r in read_rows(tmp_path / "d.txt")] == [f"{tmp_path / 'd.txt'}:{n}" for n in (1, 3, 4)]
    assert read_text(tmp_path / "d.txt") == "first line\n\nsecond line\nthird\n"
    assert read_text(tmp_path / "d.parquet") == CONCAT_SEPARATOR.join(texts)


def test_the_data_sets_read(shared_data):
    """Every line of the fixture subsets becomes one row of the right kind (the reference: json.loads per line)."""
    def lines(rel):
        return [json.loads(line) for line in (shared_data / rel).read_text().splitlines() if line.strip()]

    arc = read_rows(shared_data / "arc-easy" / "arc_easy_test.jsonl")
    assert len(arc) == len(lines("arc-easy/arc_easy_test.jsonl")) and all(r.kind == "choice" and len(r.choices) == 4 for r in arc)
    assert [r.answer for r in arc] == [rec["answer"] for rec in lines("arc-easy/arc_easy_test.jsonl")]
    gsm = read_rows(shared_data / "gsm8k" / "test.jsonl")
    assert [(r.kind, r.prompt) for r in gsm] == [("answer", rec["question"]) for rec in lines("gsm8k/test.jsonl")]
    chats = read_rows(shared_data / "chat-sharegpt" / "sharegpt_v3_filtered_1000.jsonl")
    assert [r.kind for r in chats] == ["chat"] * len(lines("chat-sharegpt/sharegpt_v3_filtered_1000.jsonl"))


def test_the_default_calibration_set_is_shipped_and_fills_128_x_512(tok):
    """No --data: the general set in quantkit/calibration_data (never a sibling data folder) gives the default
    128 x 512 concat samples in full, from both of its domains."""
    import quantkit

    path = default_calibration_file()
    assert path.parent == Path(quantkit.__file__).resolve().parent / "calibration_data"
    assert (path.parent / "README.md").is_file()
    rows = read_rows(path)
    assert {r.id.split("-")[0] for r in rows} == {"wikitext", "gsm8k"}
    data = calibration_batches(None, tok, num_samples=128, seq_len=512)
    assert data.input_ids.shape == (128, 512) and data.stats["samples"] == 128
    assert data.stats["source"] == str(path) and data.stats["tokens_total"] >= 128 * 512


# ---------------------------------------------------------------- tokens and masks


def test_chat_tokens_match_the_template_and_mask_only_assistant_turns(tok, tmp_path):
    (row,) = read_rows(write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}]))
    ids, mask = tokenize_row(row, tok)
    assert ids == list(tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"])
    masked = tok.decode([t for t, m in zip(ids, mask) if m])
    assert masked == "It is 4.<|im_end|>\nSix.<|im_end|>\n"
    # the first masked token is the first token after "<|im_start|>assistant\n"
    first = mask.index(True)
    assert tok.decode(ids[first - 4 : first]) == "<|im_start|>assistant\n"


def test_completion_mask_covers_the_completion(tok, tmp_path):
    (row,) = read_rows(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "The capital of France is", "completion": " Paris."}]))
    ids, mask = tokenize_row(row, tok)
    assert ids == tok("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == " Paris."
    assert tok.decode([t for t, m in zip(ids, mask) if not m]) == "The capital of France is"


def test_concat_batches_are_chunks_of_the_token_stream(tok, tmp_path):
    texts = [f"Row number {i} talks about topic {i * 7 % 13} at some length." for i in range(40)]
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    sep = tok(CONCAT_SEPARATOR, add_special_tokens=False)["input_ids"]
    stream = []
    for i, t in enumerate(texts):
        stream += (sep if i else []) + tok(t, add_special_tokens=False)["input_ids"]
    data = calibration_batches(f, tok, num_samples=5, seq_len=32, mode="concat", seed=3)
    assert data.input_ids.shape == (5, 32) and data.input_ids.dtype == torch.int64 and data.mask is None
    chunks = {tuple(stream[s : s + 32]) for s in range(0, len(stream) - 31, 32)}
    assert all(tuple(r.tolist()) in chunks for r in data.input_ids)
    assert len({tuple(r.tolist()) for r in data.input_ids}) == 5
    s = data.stats
    assert (s["tokens_total"], s["tokens_used"], s["tokens_dropped"]) == (len(stream), 160, len(stream) - 160)
    assert s["rows_total"] == 40 and s["rows_used"] + s["rows_dropped"] == 40 and 5 <= s["rows_used"] < 40
    again = calibration_batches(f, tok, num_samples=5, seq_len=32, mode="concat", seed=3)
    other = calibration_batches(f, tok, num_samples=5, seq_len=32, mode="concat", seed=4)
    assert again.fingerprint == data.fingerprint == fingerprint(again)
    assert other.fingerprint != data.fingerprint and len(data.fingerprint) == 64


def test_rows_mode_truncates_pads_and_keeps_the_chat_mask(tok, tmp_path):
    f = write_jsonl(tmp_path / "m.jsonl", [{"text": "short text"}, {"messages": CHAT}, {"text": "word " * 100}])
    data = calibration_batches(f, tok, num_samples=8, seq_len=48, mode="rows")
    lengths = [len(tokenize_row(r, tok)[0]) for r in read_rows(f)]
    assert data.input_ids.shape == (3, 48) and data.stats["samples"] == 3 and data.stats["samples_requested"] == 8
    assert data.lengths.tolist() == [min(n, 48) for n in lengths]
    assert data.stats["tokens_used"] == sum(min(n, 48) for n in lengths)
    assert data.stats["tokens_dropped"] == sum(lengths) - data.stats["tokens_used"]
    assert (data.input_ids[0, lengths[0]:] == tok.pad_token_id).all()
    chat_ids, chat_mask = tokenize_row(read_rows(f)[1], tok)
    assert data.input_ids[1, : min(len(chat_ids), 48)].tolist() == chat_ids[:48]
    assert data.mask[1, : min(len(chat_ids), 48)].tolist() == chat_mask[:48]
    assert data.mask[0, : lengths[0]].all() and not data.mask[0, lengths[0] :].any()  # text rows: all real tokens


# ---------------------------------------------------------------- errors: one test per kind


def error_of(path, tok=None):
    with pytest.raises(QuantkitError) as e:
        read_rows(path) if tok is None else calibration_batches(path, tok, 4, 16)
    return str(e.value)


def test_malformed_json_line(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, '{"text": "unterminated'])
    assert error_of(f).startswith(f"{f}:2: malformed JSON")


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_invalid_utf8_names_the_file_line_and_column(tmp_path, suffix):
    f = tmp_path / f"latin1{suffix}"
    f.write_bytes('{"text": "fine"}\n{"text": "caf'.encode() + b"\xe9" + b'"}\n')
    assert error_of(f) == f"{f}:2: not UTF-8 text (byte 0xe9 at column 14): save the file as UTF-8"
    if suffix == ".txt":
        with pytest.raises(QuantkitError, match=r"latin1\.txt:2: not UTF-8"):
            read_text(f)


def test_line_that_is_not_an_object(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"text": "ok"}, "[1, 2]"])
    assert error_of(f).startswith(f"{f}:3: expected a JSON object")


def test_missing_field(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"prompt": "no completion"}])
    assert error_of(f).startswith(f'{f}:2: missing field "completion"')
    g = write_jsonl(tmp_path / "bad2.jsonl", [{"question": "q", "choices": ["a", "b"]}])
    assert error_of(g).startswith(f'{g}:1: missing field "answer"')
    h = write_jsonl(tmp_path / "bad3.jsonl", [{"choices": ["a", "b"], "answer": 0}])
    assert error_of(h).startswith(f'{h}:1: missing field "question"')
    k = write_jsonl(tmp_path / "bad4.jsonl", [{"question": "q", "answer": 1}])
    assert error_of(k).startswith(f'{k}:1: missing field "choices"')
    u = write_jsonl(tmp_path / "bad5.jsonl", [{"body": "x"}])
    assert error_of(u).startswith(f"{u}:1: no known fields")


def test_wrong_type(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"text": 3}])
    assert error_of(f) == f'{f}:1: field "text": expected a string, got int'
    g = write_jsonl(tmp_path / "bad2.jsonl", [{"text": "ok"}, {"messages": [{"role": "user", "content": None}]}])
    assert error_of(g).startswith(f'{g}:2: field "messages[0].content": expected a string')
    h = write_jsonl(tmp_path / "bad3.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": "1"}])
    assert error_of(h).startswith(f'{h}:1: field "answer": expected an integer')
    k = write_jsonl(tmp_path / "bad4.jsonl", [{"question": "q", "choices": ["a", 2], "answer": 0}])
    assert error_of(k).startswith(f'{k}:1: field "choices[1]": expected a string')


def test_empty_file(tmp_path):
    for name in ("empty.jsonl", "empty.txt"):
        (tmp_path / name).write_text("\n  \n")
        assert error_of(tmp_path / name).startswith(f"{tmp_path / name}: empty file")


def test_answer_out_of_range(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": 0}] * 4
                    + [{"question": "q", "choices": ["a", "b"], "answer": 2}])
    assert error_of(f) == f'{f}:5: field "answer": 2 is out of range for 2 choices (0..1)'


def test_empty_choices(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"context": "c", "choices": [], "answer": 0}])
    assert error_of(f).startswith(f'{f}:1: field "choices": empty list')


def test_empty_messages(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"messages": []}])
    assert error_of(f).startswith(f'{f}:1: field "messages": empty list')


def test_parquet_row_errors_name_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["q1", "q2"], "choices": [["a", "b"], ["a", "b"]], "answer": [1, 5]}),
                   tmp_path / "mc.parquet")
    assert error_of(tmp_path / "mc.parquet").startswith(f'{tmp_path / "mc.parquet"}:2: field "answer": 5 is out of range')


def test_unsupported_and_missing_files(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    assert "unsupported data file type '.csv'" in error_of(tmp_path / "d.csv")
    assert error_of(tmp_path / "nope.jsonl") == f"{tmp_path / 'nope.jsonl'}: no such file or folder"
    (tmp_path / "plain").mkdir()
    assert "not one written by datasets' save_to_disk" in error_of(tmp_path / "plain")


def test_too_little_data_for_one_sample(tok, tmp_path):
    f = write_jsonl(tmp_path / "tiny.jsonl", [{"text": "hi"}])
    assert "give no sample of 16 tokens" in error_of(f, tok)
