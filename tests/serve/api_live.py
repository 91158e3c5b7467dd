"""A real uvicorn server on 127.0.0.1 (free port, background thread) for the HTTP API tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(app, startup_timeout: float = 60.0) -> Iterator[str]:
    """Serve `app` until the block exits; yields the base URL (http://127.0.0.1:PORT)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def serving_app(loaded, served_model_name: str, process: bool = False, **engine_options):
    """build_app over a fresh engine for an already loaded model; the engine is shut down on exit.

    process=False: an AsyncLLMEngine (a thread of this process) on `loaded` itself; process=True: the EngineProcess
    `quantkit serve` runs, a child that loads loaded.path in loaded's dtype."""
    from quantkit.serve.api import build_app
    from quantkit.serve.async_engine import AsyncLLMEngine
    from quantkit.serve.config import EngineConfig
    from quantkit.serve.engine_process import EngineProcess
    from quantkit.serve.llm import build_engine

    if process:
        dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
        engine = EngineProcess(str(loaded.path), EngineConfig(dtype=dtype, **engine_options), "warning").wait_ready()
    else:
        engine = AsyncLLMEngine(build_engine(loaded, **engine_options))
    try:
        yield build_app(engine, loaded.tokenizer, served_model_name, engine.max_model_len)
    finally:
        engine.shutdown(abort_inflight=True)
