"""The engine in its own process: EngineProcess (the server side) and main() (the child, `python -m`).

The child loads the model, builds the LLMEngine and steps it; the server process keeps HTTP, tokenising and SSE.
They share no GIL, so neither waits for the other. The child's OpenMP threads spin-wait for a bounded time
(serve/cpu_threads.wait_policy_env: short enough not to fight other processes for a busy core, long enough that a
quiet step does not pay passive waits, which ran 1.7x slower on 2 cores), unless the user set a policy.

Wire: one socketpair, pickled tuples (multiprocessing.connection framing).
  server -> child: ("add", request_id, ValidRequest, prompt) | ("embed", request_id, EmbeddingJob)
                   | ("abort", request_id)
                   | ("shutdown", abort_inflight)
  child -> server: ("ready", vocab_size, max_model_len, hidden_size, stats) | ("failed", message)   (once, at start)
                   ("step", [RequestOutput | EmbeddingOutput], stats) after every step
                   | ("stats", stats) when it goes idle
                   ("errored", {request_id: message}) before the "step" of a step that raised (those failed)
                   ("refused", request_id, message) | ("dead", message) | ("stopped", stats)   (the last)
The child applies every message that has arrived before it runs the next step, so an abort frees its blocks
before that step, as in the in-process engine.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection

from quantkit.errors import QuantkitError
from quantkit.serve.async_engine import _END, EngineDeadError, EngineFrontend
from quantkit.serve.config import EngineConfig
from quantkit.serve.cpu_threads import SERVICE_PIDS_ENV, wait_policy_env
from quantkit.serve.pooling import EmbeddingJob
from quantkit.serve.validation import ValidRequest

log = logging.getLogger("quantkit.serve")


class EngineProcess(EngineFrontend):
    """EngineFrontend over a child process that owns the LLMEngine of `model` (None = the bundled default)."""

    def __init__(self, model: str | None, config: EngineConfig, log_level: str = "info"):
        """Starts the child, which loads the model meanwhile; call wait_ready() before anything else."""
        super().__init__(0, 0, config.max_num_seqs, {})
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "quantkit.serve.engine_process", str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()],
                                      env=wait_policy_env({**os.environ, SERVICE_PIDS_ENV: str(os.getpid())}))
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._send(model, asdict(config), log_level)
        self._reader = threading.Thread(target=self._read, name="quantkit-engine-reader", daemon=True)

    def wait_ready(self, timeout: float = 900.0) -> "EngineProcess":
        """Block until the child has built its engine; QuantkitError with the child's message when it could not."""
        self.vocab_size, self.max_model_len, self.hidden_size, self._stats = self._receive_ready(timeout)
        self._reader.start()
        return self

    def _send(self, *msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _receive_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if time.monotonic() > deadline:
                self._proc.kill()
                raise QuantkitError(f"the engine process did not get ready within {timeout:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            code = self._proc.wait()
            raise QuantkitError(f"the engine process exited with code {code} while loading the model "
                                f"(its error is in the log above)") from None
        if msg[0] == "failed":
            self._proc.wait()
            raise QuantkitError(msg[1])
        return msg[1:]

    # ---- EngineFrontend
    def _alive(self) -> bool:
        return self._proc.poll() is None

    def _send_add(self, request_id: str, request: ValidRequest, prompt: str | None) -> None:
        self._send("add", request_id, request, prompt)

    def _send_embed(self, request_id: str, job: EmbeddingJob) -> None:
        self._send("embed", request_id, job)

    def _send_abort(self, request_id: str) -> None:
        self._close(request_id, _END)  # later outputs of this id find no stream and are dropped
        try:
            self._send("abort", request_id)
        except OSError:  # the child is gone: nothing left to free
            pass

    def shutdown(self, abort_inflight: bool = True, timeout: float | None = None) -> None:
        """Stop the child: abort in-flight requests, or let them finish first. Blocks until it exits."""
        self._stopping = True
        try:
            self._send("shutdown", abort_inflight)
        except OSError:
            pass
        if self._reader.ident is not None:
            self._reader.join(timeout)
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop within %s s: killing it", timeout)
            self._proc.kill()
            self._proc.wait()

    def _read(self) -> None:
        """The reader thread: child messages -> streams, until "stopped" or the socket closes; open streams then
        end (with an EngineDeadError when the child died)."""
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == "step":
                    self._stats = rest[1]
                    self._deliver_step(rest[0])
                elif kind in ("stats", "stopped"):
                    self._stats = rest[0]
                    if kind == "stopped":
                        break
                elif kind == "errored":
                    self._fail(rest[0])
                elif kind == "refused":
                    self._close(rest[0], ValueError(rest[1]))
                else:  # "dead"
                    self.errored = EngineDeadError(rest[0])
                    break
        except (EOFError, OSError):
            if not self._stopping:
                self.errored = EngineDeadError(f"the engine process exited (code {self._proc.wait()})")
        finally:
            if self.errored is not None:
                log.error("the engine is stopped: %s", self.errored)
            self._fail_all(_END if self.errored is None else EngineDeadError(f"the engine failed: {self.errored!r}"))


# ---- the child ------------------------------------------------------------------------------------------------


def keep_freed_memory() -> None:
    """glibc: serve large temporaries from the heap and keep freed memory for the next step. By default a block over
    the mmap threshold is mapped fresh and unmapped when freed, so every prefill activation (megabytes per matmul
    output) lands on new pages and pays a page fault per 4 KiB: 16% of a bf16 prefill step, 29% of a W4 one here.
    The heap then stays at the peak of one step's activations. Nothing elsewhere than glibc."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 256 << 20)
    mallopt(m_trim_threshold, 1 << 30)


def serve_forever(engine, conn: Connection) -> None:
    """Apply messages, step while there is work, send outputs; returns after a shutdown message."""
    stop = None  # set by ("shutdown", abort_inflight)
    while True:
        busy = engine.has_unfinished()
        if stop is not None and (stop or not busy):
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
            conn.send(("stopped", engine.stats()))
            return
        if not busy or conn.poll():
            while True:  # everything that has arrived (blocking for the first one when idle)
                msg = conn.recv()
                if msg[0] in ("add", "embed"):
                    try:
                        if msg[0] == "add":
                            engine.add_request(msg[1], msg[2], prompt=msg[3])
                        else:
                            engine.add_embedding(msg[1], msg[2])
                    except ValueError as e:
                        conn.send(("refused", msg[1], str(e)))
                elif msg[0] == "abort":
                    engine.abort_request(msg[1])
                else:
                    stop = msg[1]
                if not conn.poll():
                    break
            if not engine.has_unfinished():
                conn.send(("stats", engine.stats()))
            continue
        outputs, failed = engine.guarded_step()
        if failed:
            conn.send(("errored", failed))
        conn.send(("step", outputs, engine.stats()))


def main(fd: int) -> int:
    from quantkit.serve.llm import build_engine

    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, systemd and `timeout` signal the whole group: the
        signal.signal(sig, signal.SIG_IGN)  # server drains and then stops us itself (we exit when it is gone)
    keep_freed_memory()
    conn = Connection(fd)
    model, engine_kwargs, log_level = conn.recv()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = build_engine(model, **engine_kwargs)
    except QuantkitError as e:
        conn.send(("failed", str(e)))
        return 1
    except Exception as e:
        traceback.print_exc()
        conn.send(("failed", f"loading the model failed: {type(e).__name__}: {e}"))
        return 1
    conn.send(("ready", engine.vocab_size, engine.max_model_len, engine.model.config.hidden_size, engine.stats()))
    try:
        serve_forever(engine, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the server process is gone: nothing to serve
        return 0
    except Exception as e:
        log.exception("engine steps keep failing; the engine is stopped")
        try:
            conn.send(("dead", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
