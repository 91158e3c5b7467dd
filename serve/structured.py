"""Structured output through xgrammar: a JSON schema, any JSON object, a regex, a choice, an EBNF grammar, a tool call.

    GuidedDecoding(kind, value, field)     # SamplingParams.guided: what the request asked for (plain, picklable)
      .validate()                          # part of SamplingParams.validate (the one check of a request): the
                                           #   grammar builds, or ValueError naming the request field (a 400)
    StructuredOutputs(tokenizer, V, eos)   # one per engine: TokenizerInfo (built once, on the first constrained
                                           #   request), a GrammarCompiler, an LRU of compiled grammars
      .start(guided) -> GuidedState        # add_request: compiling is handed to a thread (overlaps the prefill)
    mask_rows(logits, rows, states)        # the sampler: ONE bitmask [len(rows), ceil(V/32)] filled by the rows'
                                           #   matchers, applied to those rows; every other row is left untouched
    GuidedState.advance(token) -> bool     # postprocess, as the token is appended: the matcher accepts it; True
                                           #   when the grammar has terminated (or cannot go on): finish "stop"

A grammar terminates by accepting a stop token (the engine's EOS ids): once the output is complete the mask leaves
only EOS, and the EOS the model then samples ends the sequence the ordinary way (finish_reason "stop").
JSON schemas are compiled without free whitespace (compact JSON, as vLLM's xgrammar backend does by default): every
token then moves the output forward, so a bounded schema closes within a bounded number of tokens.
The model's vocabulary may be larger than the tokenizer's (padded embeddings): TokenizerInfo is built for the
larger of the two and the padding ids are masked out.
Speculative decoding (speculative.py) drafts for constrained sequences too, as vLLM does with xgrammar: the
matcher walks the drafts provisionally and rolls back, so outside a proposer or verify call it always stands after
the sequence's appended tokens:

    GuidedState.valid_prefix(drafts) -> m  # the n-gram proposer keeps the m drafts the grammar accepts
    GuidedState.draft(token)               # the draft model: its rows masked each round (mask_rows), its
      .undo_drafts()                       #   tokens walked, and all of them undone after the last round
    mask_drafts(logits, state, drafts)     # verify: row i of the target's d + 1 rows masked by the grammar after
                                           #   drafts[:i]; a forbidden draft is then rejected like any other
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

GRAMMAR_CACHE_SIZE = 64  # distinct specs kept compiled (per engine) and built (per process, for validation)
# "response_format" and "structured_outputs" hold the request field as sent (resolved to one of the others here)
KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool", "response_format", "structured_outputs")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GuidedDecoding:
    """kind: one of KINDS. value: the schema (dict or JSON text), regex, choices, EBNF text, or for "tool"
    {"format": [open, arguments key, close], "functions": [{"name", "parameters"}]} (the format of the server's
    tool parser, tool_parsers.py, which reads the call back). field: the request field it came from (named by a
    refusal). conflict: another structured-output field the request set as well (a refusal)."""

    kind: str
    value: Any
    field: str
    conflict: str | None = None

    @property
    def key(self) -> str:
        return json.dumps([self.kind, self.value], ensure_ascii=False)  # key order kept: it orders the output

    def validate(self) -> "GuidedDecoding":
        """ValueError starting with the field's name when the grammar cannot be built."""
        if self.conflict is not None:
            raise ValueError(f"{self.conflict} cannot be combined with {self.field}: send one structured-output field.")
        try:
            _grammar(self.key)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(f"{self.field} is not a valid {_WHAT[self.kind]}: {_first_line(e)}") from None
        return self


_WHAT = {"json": "JSON schema", "json_object": "JSON object request", "regex": "regular expression",
         "choice": "list of choices", "grammar": "EBNF grammar", "tool": "tool definition",
         "response_format": "response format", "structured_outputs": "structured output request"}


def _resolve(kind: str, value):
    """response_format / structured_outputs as sent -> (kind, value) of one of the plain kinds."""
    if kind == "response_format":
        kind_of = value.get("type") if isinstance(value, dict) else None
        if kind_of == "json_object":
            return "json_object", None
        if kind_of != "json_schema":
            raise ValueError(f"type must be text, json_object or json_schema, got {kind_of!r}")
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError('json_schema must be an object with a "schema" (and a "name")')
        return "json", spec["schema"]
    if kind == "structured_outputs":
        keys = [k for k in STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, False)]
        if len(keys) != 1:
            raise ValueError(f"set exactly one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}, got {keys or 'none'}")
        return keys[0], value[keys[0]]
    return kind, value


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    # xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:123: "
    if line.startswith("[") and ": " in line:
        line = line.split(": ", 1)[1]
        if line.startswith("/") and ": " in line:
            line = line.split(": ", 1)[1]
    return line[:300]


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _schema(value) -> dict | str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"the schema is not JSON ({e})") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"the schema must be a JSON object, got {type(value).__name__}")
    return json.dumps(value)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _grammar(key: str):
    """The xgrammar Grammar of a GuidedDecoding key (tokenizer-independent; raises on a bad spec)."""
    import xgrammar as xgr

    kind, value = _resolve(*json.loads(key))
    if kind == "json":
        return xgr.Grammar.from_json_schema(_schema(value), any_whitespace=False)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError("the regex must be a non-empty string")
        return xgr.Grammar.from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("the choices must be a non-empty list of non-empty strings")
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in value))
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ValueError("the grammar must be a non-empty string")
        return xgr.Grammar.from_ebnf(value)
    if kind == "tool":  # one call of any of the functions: open + {"name": ..., "<key>": ARGUMENTS} + close
        (open_, key, close), calls = value["format"], []
        for function in value["functions"]:
            head = open_ + '{"name": ' + json.dumps(function["name"]) + f', "{key}": '
            arguments = function.get("parameters") or {"type": "object"}
            calls.append(xgr.Grammar.concat(
                xgr.Grammar.from_ebnf(f"root ::= {_ebnf_literal(head)}"),
                xgr.Grammar.from_json_schema(_schema(arguments), any_whitespace=False),
                xgr.Grammar.from_ebnf(f"root ::= {_ebnf_literal('}' + close)}"),
            ))
        return calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    raise ValueError(f"unknown kind {kind!r}")


class GuidedState:
    """One sequence's matcher (made when its grammar is compiled). seq.matcher holds it."""

    def __init__(self, compiled: Future, vocab_size: int, matcher=None):
        self._compiled = compiled
        self.vocab_size = vocab_size  # of the bitmask: max(model, tokenizer)
        self._matcher = matcher
        self.num_drafted = 0  # draft tokens accepted provisionally (speculation), to roll back

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    def fork(self) -> "GuidedState":
        """A child sequence's state: the same grammar, at the same point."""
        return GuidedState(self._compiled, self.vocab_size,
                           self._matcher.fork() if self._matcher is not None else None)

    def advance(self, token: int) -> bool:
        """Accept the appended token; True when the sequence must end here (the grammar terminated, or the token
        is outside it: only a sampler bound such as min_tokens banning EOS at the end of the grammar can do that)."""
        matcher = self.matcher
        return not matcher.accept_token(token) or matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def draft(self, token: int) -> bool:
        """Accept a draft token provisionally (undo_drafts takes it back); False, the matcher unchanged, when the
        grammar refuses it or has already terminated."""
        matcher = self.matcher
        accepted = not matcher.is_terminated() and matcher.accept_token(token)
        self.num_drafted += accepted
        return accepted

    def undo_drafts(self) -> None:
        """Back to the state after the sequence's appended tokens."""
        if self.num_drafted:
            self.matcher.rollback(self.num_drafted)
            self.num_drafted = 0

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, in order, the grammar accepts from here (the matcher ends where it started)."""
        accepted = 0
        while accepted < len(tokens) and self.draft(tokens[accepted]):
            accepted += 1
        self.undo_drafts()
        return accepted


class StructuredOutputs:
    """The engine's grammar machinery (see the module docstring)."""

    def __init__(self, tokenizer, model_vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = max(model_vocab_size, len(tokenizer))
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler = None
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="quantkit-grammar")

    def _compile(self, key: str):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler.compile_grammar(_grammar(key))

    def start(self, guided: GuidedDecoding) -> GuidedState:
        """The state of a new request's first sequence; its grammar compiles in a thread (once per distinct spec)."""
        key = guided.key
        future = self._compiled.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(self._compile, key)
            self._compiled[key] = future
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return GuidedState(future, self.vocab_size)


def mask_rows(logits: torch.Tensor, rows: list[int], states: list[GuidedState]) -> None:
    """Set to -inf, in place, what each row's grammar forbids next (logits [R, V]; rows index it): one bitmask
    for all of them, one masked copy of those rows written back. Other rows are not touched."""
    import xgrammar as xgr

    vocab_size = states[0].vocab_size
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for j, state in enumerate(states):
        state.matcher.fill_next_token_bitmask(bitmask, j)
    index = torch.tensor(rows, device=logits.device)
    sub = logits[index]
    xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device), vocab_size=min(sub.shape[1], vocab_size))
    logits[index] = sub


def mask_drafts(logits: torch.Tensor, state: GuidedState, drafts: list[int]) -> torch.Tensor:
    """Speculative verification. logits [d + 1, V] of the target at the last token and each of the d drafts ->
    a masked copy whose row i allows what the grammar allows after drafts[:i] (one bitmask for the d + 1 rows).
    Rows past a draft the grammar refuses, or past its end, stay unmasked: verification stops before it uses them
    (the refused draft is -inf in its own row, so it is rejected). The matcher ends where it started."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, state.vocab_size)  # all allowed
    for i in range(len(drafts) + 1):
        if state.terminated:
            break
        state.matcher.fill_next_token_bitmask(bitmask, i)
        if i == len(drafts) or not state.draft(drafts[i]):
            break
    state.undo_drafts()
    masked = logits.clone()
    vocab_size = min(masked.shape[1], state.vocab_size)
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device), vocab_size=vocab_size)
    return masked
