"""The OpenAI-compatible HTTP API (routes as vLLM's server has them); `build_app` is the whole surface.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings (api_embeddings.py), GET /v1/models,
GET /v1/models/{id} (the served model's card; any other id is a 404), GET /health, GET /metrics, POST /tokenize,
POST /detokenize, GET /version. Anything else is a 404 in the OpenAI error shape.
Every error body is {"error": {"message", "type", "param", "code"}}, whatever failed (an unexpected exception is a
500 in that shape, its traceback logged once); a request validation.py refuses is a 400 naming the field. With an
API key, /v1/*, /tokenize and /detokenize need `Authorization: Bearer <key>` (401 otherwise).
A body over max_request_bytes is a 413 before it is parsed; parsing (protocol.parse_request), tokenizing and chat
templates run in Serving's thread pool, so no request holds up the event loop and the others.
Draining (server.py, on SIGTERM): Admission refuses new requests with a 503 while those in flight finish.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantkit import __version__
from quantkit.serve.api_embeddings import embeddings_response, prepare_embeddings
from quantkit.serve.api_generate import (
    Serving, chat_prompt, chat_response, chat_stream, check_model, completion_response, completion_stream,
    prepare_chat, prepare_completion, stream_events, tokenize_text, unless_disconnected,
)
from quantkit.serve.metrics import ServerMetrics
from quantkit.serve.tool_parsers import choose as choose_tool_parser
from quantkit.serve.protocol import (
    MAX_REQUEST_BYTES, APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
    TokenizeRequest, parse_request,
)
from quantkit.serve.validation import InvalidRequest, check_token_ids

log = logging.getLogger("quantkit.serve.api")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
GUARDED_PATHS = ("/v1/", "/tokenize/", "/detokenize/")  # behind the API key, when there is one
DRAIN_POLL_S = 0.05
ABORTED_FLUSH_S = 10.0  # after the grace period: time for the aborted requests' error responses to go out


def error_response(error: APIError) -> Response:
    """The error body as JSONResponse renders it, but never failing: a lone surrogate in the message becomes its
    JSON escape (backslashreplace writes exactly `\\udXXXX`)."""
    body = json.dumps(error.body(), ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")
    return Response(body, status_code=error.status, media_type="application/json")


class BearerAuth:
    """ASGI middleware: GUARDED_PATHS need `Authorization: Bearer <key>`. Pure ASGI, so disconnects still reach
    the handlers (a BaseHTTPMiddleware would hide them)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"] + "/").startswith(GUARDED_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                denied = error_response(APIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                                                      "<key>' with the key the server was started with."))
                await denied(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Admission:
    """The HTTP requests in flight (AdmissionGate counts them); `drain` stops admitting and waits them out."""

    def __init__(self):
        self.in_flight = 0
        self.draining = False

    async def drain(self, grace_s: float, abort) -> None:
        """Refuse new requests (503), give those in flight up to grace_s to finish, then call abort() (blocking:
        run in a thread; it must end every engine stream) and wait for their error responses to go out."""
        self.draining = True
        if not await self._idle_within(grace_s):
            log.info("aborting the %d requests still in flight after the %g s grace period", self.in_flight, grace_s)
            await asyncio.get_running_loop().run_in_executor(None, abort)
            await self._idle_within(ABORTED_FLUSH_S)

    async def _idle_within(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        return not self.in_flight


class AdmissionGate:
    """ASGI middleware feeding Admission: counts each HTTP request until its response is sent; draining, a new one
    gets a 503."""

    def __init__(self, app, admission: Admission):
        self.app = app
        self.admission = admission

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.admission.draining:
            await error_response(APIError(503, "The server is shutting down."))(scope, receive, send)
            return
        self.admission.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.in_flight -= 1


async def read_body(raw_request: Request, max_bytes: int) -> bytes:
    """The body, or a 413 as soon as it is known to be over max_bytes (by its Content-Length, or while it arrives
    when it has none)."""
    too_large = APIError(413, f"The request body is over the server's limit of {max_bytes} bytes "
                              "(--max-request-bytes).")
    declared = raw_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in raw_request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(engine, tokenizer, served_model_name: str, max_model_len: int, api_key: str | None = None,
              chat_template: str | None = None, model_info: dict[str, str] | None = None,
              max_request_bytes: int = MAX_REQUEST_BYTES, metrics_prefix: str = "quantkit",
              tool_call_parser: str = "auto") -> FastAPI:
    """The FastAPI app serving `engine` (an EngineFrontend) under the name `served_model_name`.

    chat_template: a Jinja template used instead of the tokenizer's. model_info: labels of the
    quantkit:model_info gauge (e.g. source, quantization). metrics_prefix: quantkit or vllm (metrics.py).
    tool_call_parser: hermes, llama3_json, mistral, or auto (the chat template's family; tool_parsers.py).
    app.state.admission drains it (server.py).
    """
    metrics = ServerMetrics(served_model_name, model_info or {}, max_model_len, metrics_prefix)
    parser = choose_tool_parser(tool_call_parser, chat_template or getattr(tokenizer, "chat_template", None))
    log.info("tool calls: the %s parser (--tool-call-parser %s)", parser.name, tool_call_parser)
    serving = Serving(engine, tokenizer, served_model_name, max_model_len, chat_template, metrics, parser)
    admission = Admission()
    created = int(time.time())
    app = FastAPI(title="quantkit", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(AdmissionGate, admission=admission)

    @app.exception_handler(APIError)
    async def _api_error(_, error: APIError):
        return error_response(error)

    @app.exception_handler(InvalidRequest)
    async def _invalid_request(_, error: InvalidRequest):
        return error_response(APIError(400, str(error), error.param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(raw_request: Request, error: StarletteHTTPException):
        if error.status_code == 404:
            return error_response(APIError(404, f"Not found: {raw_request.method} {raw_request.url.path}"))
        return error_response(APIError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def _unexpected(_, error: Exception):  # starlette logs the traceback once this response is sent
        return error_response(APIError(500, f"Internal server error: {type(error).__name__}: {error}"))

    def require_engine() -> None:
        if not engine.is_running:
            raise APIError(503, "The engine is not running: see the server log for the error that stopped it.")

    async def parsed(raw_request: Request, request_cls, then):
        """(request, then(request)): the body read, then parsed and `then` worked out in the pool."""
        body = await read_body(raw_request, max_request_bytes)

        def work():
            request = parse_request(request_cls, body)
            return request, then(request)

        return await serving.offload(work)

    async def generate(raw_request: Request, request_cls, prepare, stream, respond):
        """The shared shape of both generation routes: validate, prepare, then SSE or one JSON body. Everything a
        request can be refused for is found before the response starts (a stream too gets a 400, not an event)."""
        require_engine()
        request, (request_id, generation) = await parsed(raw_request, request_cls, lambda r: prepare(serving, r))
        if request.stream:
            events = stream(serving, request, request_id, generation)
            return StreamingResponse(stream_events(events), media_type="text/event-stream", headers=SSE_HEADERS)
        response = await unless_disconnected(raw_request, respond(serving, request, request_id, generation))
        return Response(response.model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(raw_request: Request):
        return await generate(raw_request, CompletionRequest, prepare_completion, completion_stream,
                              completion_response)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request):
        return await generate(raw_request, ChatCompletionRequest, prepare_chat, chat_stream, chat_response)

    @app.post("/v1/embeddings")
    async def embeddings(raw_request: Request):
        require_engine()
        request, (request_id, jobs) = await parsed(raw_request, EmbeddingRequest,
                                                   lambda r: prepare_embeddings(serving, r))
        response = await unless_disconnected(raw_request, embeddings_response(serving, request, request_id, jobs))
        return Response(response.model_dump_json(), media_type="application/json")

    card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "quantkit",
            "root": (model_info or {}).get("source", served_model_name), "parent": None,
            "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):  # what the openai client's models.retrieve asks
        check_model(serving, model_id)
        return card

    @app.get("/health")
    async def health():
        require_engine()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(engine.stats()), media_type=PROMETHEUS_CONTENT_TYPE)

    def tokenized(request: TokenizeRequest) -> list[int]:
        check_model(serving, request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "Send exactly one of prompt or messages.", "prompt")
        if request.messages is not None:
            chat = ChatCompletionRequest(messages=request.messages,
                                         add_generation_prompt=request.add_generation_prompt)
            return chat_prompt(serving, chat)[0]
        return tokenize_text(serving, request.prompt, "prompt", request.add_special_tokens)

    def detokenized(request: DetokenizeRequest) -> str:
        check_model(serving, request.model)
        check_token_ids(request.tokens, serving.vocab_size, "tokens")
        return tokenizer.decode(request.tokens)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request):
        _, token_ids = await parsed(raw_request, TokenizeRequest, tokenized)
        return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(raw_request: Request):
        _, text = await parsed(raw_request, DetokenizeRequest, detokenized)
        return {"prompt": text}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    app.state.serving = serving
    app.state.admission = admission
    return app
