"""A real HTTP server speaking SGLang's native protocol, answering with a tiny transformers model.

``with serve_sglang(model, tokenizer) as url:`` serves on 127.0.0.1 (a free port) until the block ends:

- ``GET /health`` -> 200;
- ``GET /get_model_info`` (or ``model_info_path``) -> ``{"model_path", "tokenizer_path", "is_generation"}``;
- ``POST /generate`` ``{"input_ids" | "text", "sampling_params": {"temperature", "max_new_tokens",
  "stop_token_ids"}}`` -> ``{"text", "output_ids", "meta_info": {"prompt_tokens", "completion_tokens",
  "finish_reason": {"type": "length"|"stop", "matched"?}}}`` (a list in, a list out), by greedy decoding.

- ``GET /get_server_info`` -> the server's settings (``model_path``, ``version``, ``dtype``, and with
  a drafter ``speculative_algorithm``, ``speculative_draft_model_path``,
  ``speculative_num_draft_tokens`` = the drafter's block, and the algorithm's own settings).

With ``drafter`` the server decodes speculatively (``remote.decode.online.speculative_generate``, z-lab's
rules) with the algorithm SGLang serves the drafter's family with: DSPARK for a DSpark drafter (its
``speculative_dspark_block_size`` γ = the drafts per block), DFLASH for DFlash and Domino (a Domino
drafter scored over the full vocabulary: ``speculative_domino_candidate_pool_size`` 0); ``algorithm``
makes it say another. It answers SGLang's counters in ``meta_info``, the same for every algorithm and
named as SGLang's newest release names them (``spec_decoding_meta.py``), with the aliases it keeps:
``spec_verify_ct`` (cycles), ``spec_num_correct_drafts`` = ``spec_accepted_drafts`` (drafts accepted),
``spec_num_proposed_drafts`` = ``spec_proposed_drafts`` (cycles × γ), ``spec_correct_drafts_histogram`` =
``spec_accept_histogram`` (cycles by drafts accepted, as long as the most accepted needs),
``spec_accept_rate`` (accepted / proposed) and ``spec_accept_length`` = ``completion_tokens /
spec_verify_ct``, SGLang's own formulas.

Greedy only (temperature 0); like SGLang, a matched stop token is the last id of ``output_ids``;
``ignore_eos`` leaves out the model's own EOS from the stop tokens.
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


def _stops(model, stop_token_ids: list[int] | None, ignore_eos: bool = False) -> set[int]:
    eos = None if ignore_eos else getattr(model.generation_config, "eos_token_id", None)
    return set(stop_token_ids or []) | set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def speculative(model, drafter, input_ids: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], dict]:
    from remote.decode.online import speculative_generate

    ids = torch.tensor([input_ids], dtype=torch.long, device=next(model.parameters()).device)
    res = speculative_generate(model, drafter, ids, max_new_tokens, sorted(stops))
    output, lengths = res.output_ids, res.acceptance_lengths
    finish = {"type": "stop", "matched": output[-1]} if output and output[-1] in stops else \
        {"type": "length", "length": len(output)}
    meta = {"finish_reason": finish}
    if lengths:
        accepted, proposed = sum(lengths) - len(lengths), len(lengths) * drafter.config.num_drafts
        hist = [0] * max(lengths)
        for n in lengths:
            hist[n - 1] += 1
        meta.update(spec_verify_ct=len(lengths), spec_num_correct_drafts=accepted, spec_num_proposed_drafts=proposed,
                    spec_accepted_drafts=accepted, spec_proposed_drafts=proposed, spec_correct_drafts_histogram=hist,
                    spec_accept_histogram=hist, spec_accept_rate=accepted / proposed,
                    spec_accept_length=len(output) / len(lengths))
    return output, meta


def greedy(model, input_ids: list[int], max_new_tokens: int, stop_token_ids: list[int] | None) -> tuple[list[int], dict]:
    stops = _stops(model, stop_token_ids)
    ids = torch.tensor([input_ids], dtype=torch.long, device=next(model.parameters()).device)
    kwargs = {"eos_token_id": sorted(stops)} if stops else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    output = out[0, len(input_ids):].tolist()
    if output and output[-1] in stops:
        return output, {"type": "stop", "matched": output[-1]}
    return output, {"type": "length", "length": len(output)}


def _answer(model, tokenizer, lock, req: dict, drafter=None) -> dict:
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
        if drafter is not None:
            output, meta = speculative(model, drafter, input_ids, int(params.get("max_new_tokens", 128)),
                                       _stops(model, params.get("stop_token_ids"), bool(params.get("ignore_eos"))))
        else:
            output, finish = greedy(model, input_ids, int(params.get("max_new_tokens", 128)),
                                    params.get("stop_token_ids"))
            meta = {"finish_reason": finish}
    text = tokenizer.decode(output, skip_special_tokens=True) if tokenizer is not None else ""
    return {"text": text, "output_ids": output,
            "meta_info": {"id": "0", "prompt_tokens": len(input_ids), "completion_tokens": len(output), **meta}}


def server_info(model, drafter=None, drafter_path: str | None = None, algorithm: str | None = None) -> dict:
    """What ``/get_server_info`` says (module docstring)."""
    model_path = getattr(model.config, "_name_or_path", "") or f"tiny-{model.config.model_type}"
    info = {"model_path": model_path, "version": "stand-in", "dtype": str(model.dtype).replace("torch.", ""),
            "speculative_algorithm": None}
    if drafter is not None:
        family, drafts = drafter.config.family, drafter.config.num_drafts
        info.update(speculative_algorithm=algorithm or ("DSPARK" if family == "dspark" else "DFLASH"),
                    speculative_draft_model_path=drafter_path, speculative_num_draft_tokens=drafts + 1)
        if info["speculative_algorithm"] == "DSPARK":
            info["speculative_dspark_block_size"] = drafts
        if family == "domino":
            info["speculative_domino_candidate_pool_size"] = 0
    return info


def make_handler(model, tokenizer, model_info_path: str, auth: str | None = None, hits: list | None = None,
                 drafter=None, drafter_path: str | None = None, algorithm: str | None = None):
    lock = threading.Lock()
    want = "Basic " + base64.b64encode(auth.encode()).decode() if auth else None
    info = server_info(model, drafter, drafter_path, algorithm)
    model_path = info["model_path"]

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
            elif self.path == "/get_server_info":
                self._send(200, info)
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
                    return self._send(200, [_answer(model, tokenizer, lock, r, drafter) for r in req])
                if isinstance(req, dict) and req.get("input_ids") and isinstance(req["input_ids"][0], list):
                    return self._send(200, [_answer(model, tokenizer, lock, {**req, "input_ids": ids}, drafter)
                                            for ids in req["input_ids"]])
                if not isinstance(req, dict):
                    raise BadRequest("the request body must be a JSON object")
                self._send(200, _answer(model, tokenizer, lock, req, drafter))
            except BadRequest as e:
                self._send(400, {"error": {"message": str(e)}})
            except Exception as e:  # the model failed: like a server-side crash
                self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

    return Handler


@contextmanager
def serve_sglang(model, tokenizer=None, model_info_path: str = "/get_model_info", host: str = "127.0.0.1",
                 auth: str | None = None, hits: list | None = None, drafter=None, drafter_path: str | None = None,
                 algorithm: str | None = None):
    """Serve ``model`` over SGLang's protocol on ``host``; yields the base URL. ``auth``
    (``user:password``): HTTP basic auth required (401 otherwise); ``hits`` collects
    (method, path, authorized) per request; ``drafter`` (loaded from ``drafter_path``): decode
    speculatively with it and report SGLang's counters; ``algorithm``: the speculative algorithm it
    says it serves (default: SGLang's for the drafter's family)."""
    server = ThreadingHTTPServer((host, 0), make_handler(model, tokenizer, model_info_path, auth, hits, drafter,
                                                         drafter_path, algorithm))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
