"""The naive server that issue 6 measures against: transformers' `generate`, one request at a time, behind the
same streaming /v1/chat/completions wire format (so the same benchmark client times it).

    python bench/naive_server.py MODEL_DIR --port 8400 [--dtype bfloat16]

No batching, no paged KV: a request waits for the one before it to finish (a lock), then runs generate with a
TextIteratorStreamer; the SSE stream carries role-first delta, content deltas, finish_reason, a usage chunk and
`data: [DONE]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer


def build_app(model_dir: str, dtype: torch.dtype) -> FastAPI:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    one_at_a_time = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        max_new = int(body.get("max_tokens") or 128)
        ignore_eos = bool(body.get("ignore_eos"))
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        counted: dict[str, int] = {}

        def work():
            with one_at_a_time, torch.inference_mode():
                out = model.generate(ids, max_new_tokens=max_new, do_sample=False, streamer=streamer,
                                     min_new_tokens=max_new if ignore_eos else 0,
                                     pad_token_id=tokenizer.eos_token_id)
                counted["completion"] = out.shape[1] - ids.shape[1]

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        rid, created = f"naive-{time.time_ns()}", int(time.time())

        def chunk(delta: dict, finish=None, usage=None) -> str:
            payload = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.get("model"),
                       "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if usage:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            yield chunk({"role": "assistant", "content": ""})
            iterator = iter(streamer)
            while True:
                piece = await asyncio.to_thread(next, iterator, None)
                if piece is None:
                    break
                if piece:
                    yield chunk({"content": piece})
            await asyncio.to_thread(thread.join)
            yield chunk({}, finish="length" if counted["completion"] >= max_new else "stop")
            yield chunk({}, usage={"prompt_tokens": ids.shape[1], "completion_tokens": counted["completion"],
                                   "total_tokens": ids.shape[1] + counted["completion"]})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--port", type=int, default=8400)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    uvicorn.run(build_app(args.model_dir, getattr(torch, args.dtype)), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
