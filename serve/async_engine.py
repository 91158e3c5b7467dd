"""What the HTTP API drives: an engine behind asyncio streams, in this process or in its own.

EngineFrontend keeps the per-request streams: `generate` validates a request (validation.py) and yields cumulative
RequestOutputs from an asyncio.Queue of the caller's event loop; `generate_validated` is the same for a request
validated already (the HTTP API's); `embed` awaits the EmbeddingOutput of one input (pooling.py). A step's outputs
reach each loop in one wake-up. A step that raises fails only the requests it ran (their streams raise
RequestFailedError; LLMEngine.guarded_step); an engine that stops for good ends every stream with EngineDeadError
and sets `errored`. Two back ends:
  AsyncLLMEngine: the LLMEngine stepped by a background thread of this process. Calls from any thread (add,
    abort, shutdown) are queued and applied by the engine thread between steps, so an abort frees its blocks
    before the next step runs. Simple and embeddable, but the engine shares the GIL with the event loop.
  EngineProcess (engine_process.py): the LLMEngine in a child process, fed over a socket; `quantkit serve`
    uses it, so tokenising, SSE and the engine step run on different cores and never wait for each other.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import aclosing
from typing import AsyncIterator, Callable

from quantkit.serve.engine import LLMEngine
from quantkit.serve.outputs import RequestOutput
from quantkit.serve.pooling import EmbeddingJob, EmbeddingOutput
from quantkit.serve.sampling_params import SamplingParams
from quantkit.serve.validation import ValidRequest, validate_request

log = logging.getLogger("quantkit.serve")

_END = object()  # stream sentinel: no more outputs (finished or aborted)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class EngineDeadError(RuntimeError):
    """The engine stopped because its steps kept failing (or its process died); the server should exit."""


class RequestFailedError(RuntimeError):
    """A step running this request raised; the engine aborted the request and goes on with the others."""


class EngineFrontend:
    """The streams of in-flight requests. Subclasses deliver requests to an engine: _send_add, _send_embed,
    _send_abort, _alive, shutdown; and hand back its outputs through _deliver_step / _close / _fail_all."""

    def __init__(self, vocab_size: int, max_model_len: int, max_num_seqs: int, stats: dict):
        self.vocab_size, self.max_model_len, self.max_num_seqs = vocab_size, max_model_len, max_num_seqs
        self.hidden_size = 0  # the model's, the length of an embedding: set by the back end once it is known
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.errored: BaseException | None = None
        self._stats = stats

    def _send_add(self, request_id: str, request: ValidRequest, prompt: str | None) -> None:
        raise NotImplementedError

    def _send_embed(self, request_id: str, job: EmbeddingJob) -> None:
        raise NotImplementedError

    def _send_abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _alive(self) -> bool:
        raise NotImplementedError

    # ---- state
    @property
    def is_running(self) -> bool:
        return self._alive() and self.errored is None and not self._stopping

    def stats(self) -> dict:
        """The latest snapshot of LLMEngine.stats() (refreshed after every step)."""
        return self._stats

    # ---- requests
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request until it finishes. InvalidRequest (a ValueError, before any output) for
        a bad request; otherwise as generate_validated."""
        request = validate_request(prompt_token_ids, params or SamplingParams(), self.vocab_size, self.max_model_len,
                                   self.max_num_seqs)
        async with aclosing(self.generate_validated(request_id, request, prompt)) as outputs:
            async for out in outputs:
                yield out

    async def generate_validated(self, request_id: str, request: ValidRequest,
                                 prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of a request validate_request passed, until it finishes. ValueError when the id is in
        use; EngineDeadError when the engine has failed. Leaving the iteration early aborts the request."""
        async with aclosing(self._stream(request_id, lambda: self._send_add(request_id, request, prompt))) as outputs:
            async for out in outputs:
                yield out

    async def embed(self, request_id: str, job: EmbeddingJob) -> EmbeddingOutput | None:
        """The pooled vector of one input validate_embedding_input passed; None when the engine dropped it unfinished
        (shutting down). Errors as generate_validated; cancelling the await drops the job from the engine's queue."""
        async with aclosing(self._stream(request_id, lambda: self._send_embed(request_id, job))) as outputs:
            async for out in outputs:
                return out
        return None

    async def _stream(self, request_id: str, send: Callable[[], None]):
        """The items delivered for request_id after send() hands it to the engine, until its finished one."""
        if self.errored is not None:
            raise EngineDeadError(f"the engine failed: {self.errored!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, queue)
        send()
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or finished); its stream ends and its blocks are freed before the
        next step."""
        self._send_abort(request_id)

    # ---- delivery (from the thread that reads the engine)
    def _close(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._deliver(stream, item)

    @staticmethod
    def _deliver(stream, item) -> None:
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            log.debug("dropping an output for a closed event loop")

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs: one wake-up per event loop (not one per request), finished streams closed."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
                if stream is not None:
                    batches.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening any more
                log.debug("dropping outputs for a closed event loop")

    def _fail(self, failed: dict[str, str]) -> None:
        """End the streams of requests a failing step aborted ({request id: error})."""
        for request_id, message in failed.items():
            self._close(request_id, RequestFailedError(message))

    def _fail_all(self, item) -> None:
        """End every open stream with `item` (_END, or the error every waiting caller gets)."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self._deliver(stream, item)


class AsyncLLMEngine(EngineFrontend):
    def __init__(self, engine: LLMEngine):
        super().__init__(engine.vocab_size, engine.max_model_len, engine.cfg.max_num_seqs, engine.stats())
        self.hidden_size = engine.model.config.hidden_size
        self.engine = engine
        self._ops: list[Callable[[], None]] = []  # applied by the engine thread, in order
        self._wake = threading.Event()
        self._abort_on_stop = True
        self._thread = threading.Thread(target=self._run, name="quantkit-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model=None, **engine_kwargs) -> "AsyncLLMEngine":
        """Load a model (None = the bundled default) and start its engine; engine_kwargs are EngineConfig fields."""
        from quantkit.serve.llm import build_engine

        return cls(build_engine(model, **engine_kwargs))

    def _alive(self) -> bool:
        return self._thread.is_alive()

    def _send_add(self, request_id: str, request: ValidRequest, prompt: str | None) -> None:
        self._submit(lambda: self._add_now(request_id, request, prompt))

    def _send_embed(self, request_id: str, job: EmbeddingJob) -> None:
        self._submit(lambda: self._embed_now(request_id, job))

    def _send_abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort_now(request_id))

    def shutdown(self, abort_inflight: bool = True, timeout: float | None = None) -> None:
        """Stop the engine thread: abort in-flight requests, or let them finish first. Blocks until it exits."""
        self._abort_on_stop = abort_inflight
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- the engine thread
    def _submit(self, op: Callable[[], None]) -> None:
        with self._lock:
            self._ops.append(op)
        self._wake.set()

    def _add_now(self, request_id: str, request: ValidRequest, prompt: str | None) -> None:
        try:
            self.engine.add_request(request_id, request, prompt=prompt)
        except ValueError as e:  # the id is still in use by an unfinished request
            self._close(request_id, e)

    def _embed_now(self, request_id: str, job: EmbeddingJob) -> None:
        try:
            self.engine.add_embedding(request_id, job)
        except ValueError as e:  # the id is still in use by an unfinished request
            self._close(request_id, e)

    def _abort_now(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._close(request_id, _END)

    def _apply_ops(self) -> None:
        with self._lock:
            ops, self._ops = self._ops, []
        for op in ops:
            op()

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._wake.clear()
                self._apply_ops()
                if self._stopping and (self._abort_on_stop or not engine.has_unfinished()):
                    for request_id in list(engine.requests):
                        self._abort_now(request_id)
                    break
                if not engine.has_unfinished():
                    self._stats = engine.stats()
                    self._wake.wait()
                    continue
                outputs, failed = engine.guarded_step()
                self._stats = engine.stats()
                self._fail(failed)
                self._deliver_step(outputs)
        except BaseException as e:  # the engine is dead: every waiting caller gets the error
            self.errored = e
            log.exception("engine steps keep failing; the engine is stopped")
            self._fail_all(EngineDeadError(f"the engine failed: {e!r}"))
        finally:
            self._stats = engine.stats()
