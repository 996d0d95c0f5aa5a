"""A real HTTP server speaking SGLang's native protocol, answering with a tiny transformers model.

``with serve_sglang(model, tokenizer) as url:`` serves on 127.0.0.1 (a free port) until the block ends:

- ``GET /health`` -> 200;
- ``GET /get_model_info`` (or ``model_info_path``) -> ``{"model_path", "tokenizer_path", "is_generation"}``;
- ``POST /generate`` ``{"input_ids" | "text", "sampling_params": {"temperature", "max_new_tokens",
  "stop_token_ids"}}`` -> ``{"text", "output_ids", "meta_info": {"prompt_tokens", "completion_tokens",
  "finish_reason": {"type": "length"|"stop", "matched"?}}}`` (a list in, a list out), by greedy decoding.

Greedy only (temperature 0); like SGLang, a matched stop token is the last id of ``output_ids``.
With ``auth`` every request needs HTTP basic auth (as behind an authenticating proxy).
A model failure (e.g. an id outside the embedding) answers HTTP 500 with the error's message.
"""
from __future__ import annotations

import base64
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class BadRequest(Exception):
    pass


def greedy(model, input_ids: list[int], max_new_tokens: int, stop_token_ids: list[int] | None) -> tuple[list[int], dict]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    stops = set(stop_token_ids or []) | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    ids = torch.tensor([input_ids], dtype=torch.long, device=next(model.parameters()).device)
    kwargs = {"eos_token_id": sorted(stops)} if stops else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    output = out[0, len(input_ids):].tolist()
    if output and output[-1] in stops:
        return output, {"type": "stop", "matched": output[-1]}
    return output, {"type": "length", "length": len(output)}


def _answer(model, tokenizer, lock, req: dict) -> dict:
    params = req.get("sampling_params") or {}
    if float(params.get("temperature", 1.0)) != 0:
        raise BadRequest("this test server decodes greedily only: pass sampling_params.temperature = 0")
    if req.get("input_ids") is not None:
        input_ids = req["input_ids"]
    elif req.get("text") is not None and tokenizer is not None:
        input_ids = tokenizer(req["text"], add_special_tokens=False)["input_ids"]
    else:
        raise BadRequest("the request needs 'input_ids' (or 'text' when the server has a tokenizer)")
    if not isinstance(input_ids, list) or not input_ids or not all(isinstance(i, int) for i in input_ids):
        raise BadRequest("'input_ids' must be a non-empty list of integers")
    with lock:
        output, finish = greedy(model, input_ids, int(params.get("max_new_tokens", 128)), params.get("stop_token_ids"))
    text = tokenizer.decode(output, skip_special_tokens=True) if tokenizer is not None else ""
    return {"text": text, "output_ids": output,
            "meta_info": {"id": "0", "prompt_tokens": len(input_ids), "completion_tokens": len(output),
                          "finish_reason": finish}}


def make_handler(model, tokenizer, model_info_path: str, auth: str | None = None, hits: list | None = None):
    lock = threading.Lock()
    want = "Basic " + base64.b64encode(auth.encode()).decode() if auth else None
    model_path = getattr(model.config, "_name_or_path", "") or f"tiny-{model.config.model_type}"

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, body) -> None:
            raw = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _authorized(self) -> bool:
            ok = want is None or self.headers.get("Authorization") == want
            if hits is not None:
                hits.append((self.command, self.path, ok))
            if not ok:
                self._send(401, {"detail": "Unauthorized"})
            return ok

        def do_GET(self):
            if not self._authorized():
                return
            if self.path == "/health":
                self._send(200, None)
            elif self.path == model_info_path:
                self._send(200, {"model_path": model_path, "tokenizer_path": model_path, "is_generation": True})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            if not self._authorized():
                return
            try:
                req = json.loads(self.rfile.read(length) or b"null")
            except json.JSONDecodeError as e:
                return self._send(400, {"error": {"message": f"invalid JSON: {e}"}})
            if self.path != "/generate":
                return self._send(404, {"detail": "Not Found"})
            try:
                if isinstance(req, list):
                    return self._send(200, [_answer(model, tokenizer, lock, r) for r in req])
                if isinstance(req, dict) and req.get("input_ids") and isinstance(req["input_ids"][0], list):
                    return self._send(200, [_answer(model, tokenizer, lock, {**req, "input_ids": ids})
                                            for ids in req["input_ids"]])
                if not isinstance(req, dict):
                    raise BadRequest("the request body must be a JSON object")
                self._send(200, _answer(model, tokenizer, lock, req))
            except BadRequest as e:
                self._send(400, {"error": {"message": str(e)}})
            except Exception as e:  # the model failed: like a server-side crash
                self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

    return Handler


@contextmanager
def serve_sglang(model, tokenizer=None, model_info_path: str = "/get_model_info", host: str = "127.0.0.1",
                 auth: str | None = None, hits: list | None = None):
    """Serve ``model`` over SGLang's protocol on ``host``; yields the base URL. ``auth``
    (``user:password``): HTTP basic auth required (401 otherwise); ``hits`` collects
    (method, path, authorized) per request."""
    server = ThreadingHTTPServer((host, 0), make_handler(model, tokenizer, model_info_path, auth, hits))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
