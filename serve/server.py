"""`quantkit serve`'s process: load the model, start the engine, run uvicorn, shut down cleanly.

SIGTERM / SIGINT: uvicorn stops accepting connections and lets in-flight requests finish for up to
GRACEFUL_SHUTDOWN_S seconds (then cancels them, which aborts their engine requests); the engine is shut down and
the process exits 0.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.serve.config import EngineConfig

log = logging.getLogger("quantkit.serve")

GRACEFUL_SHUTDOWN_S = 30


@dataclass
class ServerOptions:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    chat_template: str | None = None  # a Jinja file
    log_level: str = "info"


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


def run_server(options: ServerOptions, engine_config: EngineConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code."""
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    chat_template = read_chat_template(options.chat_template)

    import uvicorn

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
                    chat_template=chat_template, model_info=model_info(source, hf_config, engine_config))
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it caught once it has shut down; these handlers make that a no-op, so a
    # graceful shutdown ends with exit code 0 instead of death by signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log.info("serving %s as %r on http://%s:%d", source, name, options.host, options.port)
    try:
        server.run()
    finally:
        engine.shutdown(abort_inflight=True)
    log.info("shut down cleanly")
    return 0
