"""The OpenAI-compatible HTTP API (routes as vLLM's server has them); `build_app` is the whole surface.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics,
POST /tokenize, POST /detokenize, GET /version. Anything else is a 404 in the OpenAI error shape.
Every error body is {"error": {"message", "type", "param", "code"}}; a request validation.py refuses is a 400
naming the field. With an API key, /v1/* needs `Authorization: Bearer <key>` (401 otherwise).
"""

from __future__ import annotations

import hmac
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantkit import __version__
from quantkit.serve.api_generate import (
    Serving, chat_prompt, chat_response, chat_stream, check_model, completion_response, completion_stream,
    prepare_chat, prepare_completion, stream_events, unless_disconnected,
)
from quantkit.serve.metrics import ServerMetrics
from quantkit.serve.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_request,
)
from quantkit.serve.validation import InvalidRequest, check_token_ids

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class BearerAuth:
    """ASGI middleware: /v1/* needs `Authorization: Bearer <key>`. Pure ASGI, so disconnects still reach the
    handlers (a BaseHTTPMiddleware would hide them)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                denied = error_response(APIError(401, "Invalid or missing API key: send 'Authorization: Bearer "
                                                      "<key>' with the key the server was started with."))
                await denied(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _json_body(raw_request: Request):
    try:
        return json.loads(await raw_request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None


def build_app(engine, tokenizer, served_model_name: str, max_model_len: int, api_key: str | None = None,
              chat_template: str | None = None, model_info: dict[str, str] | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an AsyncLLMEngine) under the name `served_model_name`.

    chat_template: a Jinja template used instead of the tokenizer's. model_info: labels of the
    quantkit:model_info gauge (e.g. source, quantization).
    """
    metrics = ServerMetrics(served_model_name, model_info or {})
    serving = Serving(engine, tokenizer, served_model_name, max_model_len, chat_template, metrics)
    created = int(time.time())
    app = FastAPI(title="quantkit", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

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

    def require_engine() -> None:
        if not engine.is_running:
            raise APIError(503, "The engine is not running: see the server log for the error that stopped it.")

    async def generate(raw_request: Request, request_cls, prepare, stream, respond):
        """The shared shape of both generation routes: validate, prepare, then SSE or one JSON body."""
        require_engine()
        request = parse_request(request_cls, await _json_body(raw_request))
        request_id, generation = prepare(serving, request)
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

    @app.get("/v1/models")
    async def models():
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "quantkit",
                "root": (model_info or {}).get("source", served_model_name), "parent": None,
                "max_model_len": max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        require_engine()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(engine.stats()), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request):
        request = parse_request(TokenizeRequest, await _json_body(raw_request))
        check_model(serving, request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "Send exactly one of prompt or messages.", "prompt")
        if request.messages is not None:
            chat = ChatCompletionRequest(messages=request.messages,
                                         add_generation_prompt=request.add_generation_prompt)
            token_ids, _ = chat_prompt(serving, chat)
        else:
            token_ids = tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids
        return {"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(raw_request: Request):
        request = parse_request(DetokenizeRequest, await _json_body(raw_request))
        check_model(serving, request.model)
        check_token_ids(request.tokens, serving.vocab_size, "tokens")
        return {"prompt": tokenizer.decode(request.tokens)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    app.state.serving = serving
    return app
