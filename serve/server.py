"""`quantkit serve`'s process: load the model, start the engine, run uvicorn, shut down cleanly.

SIGTERM / SIGINT: the server drains (api.Admission): new requests get a 503 JSON error (/health too) while those in
flight finish, for up to --shutdown-timeout seconds; then the engine is stopped, which aborts the rest: a stream
ends with an error event and `data: [DONE]`, a JSON request gets a 503. uvicorn then finds nothing in flight, and
the process exits 0. A second signal stops at once.
The engine dies (its process is killed, or its steps keep failing): open requests get a 503 (streams an error event
and [DONE]), and the server exits with code 1 within a second or so, for a supervisor to restart it; it never
lingers answering 503s. Restarting the engine in place would mean reloading the model while clients wait.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import uvicorn

from quantkit.errors import QuantkitError
from quantkit.serve.config import EngineConfig
from quantkit.serve.metrics import PREFIXES as METRICS_PREFIXES
from quantkit.serve.protocol import MAX_REQUEST_BYTES
from quantkit.serve.tool_parsers import CHOICES as TOOL_CALL_PARSERS

log = logging.getLogger("quantkit.serve")

GRACEFUL_SHUTDOWN_S = 30.0
ENGINE_STOP_S = 30.0  # for the engine to stop once told to


@dataclass
class ServerOptions:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    chat_template: str | None = None  # a Jinja file
    log_level: str = "info"
    max_request_bytes: int = MAX_REQUEST_BYTES
    shutdown_timeout: float = GRACEFUL_SHUTDOWN_S  # seconds in-flight requests get to finish after SIGTERM
    metrics_prefix: str = "quantkit"  # or vllm: /metrics under vLLM's names and labels (metrics.py)
    tool_call_parser: str = "auto"  # or hermes, llama3_json, mistral (tool_parsers.py)

    def __post_init__(self):
        if self.max_request_bytes < 1 or self.shutdown_timeout < 0:
            raise QuantkitError(f"--max-request-bytes {self.max_request_bytes} / --shutdown-timeout "
                                f"{self.shutdown_timeout}: use at least 1 byte and 0 seconds")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise QuantkitError(f"--metrics-prefix {self.metrics_prefix}: use one of {', '.join(METRICS_PREFIXES)}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise QuantkitError(f"--tool-call-parser {self.tool_call_parser}: use one of "
                                f"{', '.join(TOOL_CALL_PARSERS)}")


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise QuantkitError(f"--chat-template {path}: no such file (give a Jinja chat template file)")
    return file.read_text()


def model_info(source: str, hf_config: dict, engine_config: EngineConfig) -> dict[str, str]:
    """Labels of the quantkit:model_info gauge."""
    quant = hf_config.get("quantization_config") or {}
    method = quant.get("quant_method") or quant.get("format") or "none"
    bits = quant.get("bits") or quant.get("w_bit") or ""
    return {"source": str(source), "quantization": f"{method}{bits}", "dtype": str(engine_config.dtype)}


def default_served_name(model: str | None) -> str:
    if model is None:
        from quantkit.models.loader import BUNDLED_NAME

        return BUNDLED_NAME
    return model


class DrainingServer(uvicorn.Server):
    """uvicorn with our shutdown: a signal drains the app first (api.Admission.drain, then engine.shutdown for what
    is left), and a dead engine ends the serving loop (checked every tick, 0.1 s)."""

    def __init__(self, config: uvicorn.Config, engine, admission, grace_s: float):
        super().__init__(config)
        self.engine, self.admission, self.grace_s = engine, admission, grace_s
        self.signalled = False
        self.drain: asyncio.Future | None = None

    def handle_exit(self, sig, frame) -> None:  # a signal handler: only flags, the loop acts on them
        if self.signalled:
            self.should_exit = self.force_exit = True
        self.signalled = True

    async def on_tick(self, counter: int) -> bool:
        if self.signalled and self.drain is None:
            log.info("draining: refusing new requests, %g s for those in flight", self.grace_s)
            abort = partial(self.engine.shutdown, abort_inflight=True, timeout=ENGINE_STOP_S)
            self.drain = asyncio.ensure_future(self.admission.drain(self.grace_s, abort))
        if self.engine.errored is not None or (self.drain is not None and self.drain.done()):
            return True
        return await super().on_tick(counter)


def run_server(options: ServerOptions, engine_config: EngineConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    chat_template = read_chat_template(options.chat_template)

    from transformers import AutoTokenizer

    from quantkit.files import read_hf_config
    from quantkit.models.loader import resolve
    from quantkit.serve.api import build_app
    from quantkit.serve.engine_process import EngineProcess

    folder, source = resolve(options.model)  # a GGUF is converted here, once, before the engine process loads it
    hf_config = read_hf_config(folder)
    engine = EngineProcess(options.model, engine_config, options.log_level)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)  # while the engine process loads the weights
        engine.wait_ready()
    except BaseException:
        engine.shutdown(timeout=10)
        raise
    name = options.served_model_name or default_served_name(options.model)
    app = build_app(engine, tokenizer, name, engine.max_model_len, api_key=options.api_key,
                    chat_template=chat_template, model_info=model_info(source, hf_config, engine_config),
                    max_request_bytes=options.max_request_bytes, metrics_prefix=options.metrics_prefix,
                    tool_call_parser=options.tool_call_parser)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False)
    server = DrainingServer(config, engine, app.state.admission, options.shutdown_timeout)
    # Signals outside the serving loop (while the engine stops) are ignored: the shutdown is under way.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log.info("serving %s as %r on http://%s:%d", source, name, options.host, options.port)
    try:
        server.run()
    finally:
        engine.shutdown(abort_inflight=True, timeout=ENGINE_STOP_S)
    if engine.errored is not None:
        log.error("the engine died (%s): exiting with code 1 for a supervisor to restart the server", engine.errored)
        return 1
    log.info("shut down cleanly")
    return 0
