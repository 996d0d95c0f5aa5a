"""A small client for SGLang's native HTTP API (stdlib urllib only): reference completions.

``SGLangClient(url).generate(input_ids, max_new_tokens, stop_token_ids, sampling)`` posts to
``/generate`` with ``temperature: 0`` (or the sampling settings) and returns the completion's token
ids. Credentials (``auth="user:pass"``, or ``user:pass@`` in the URL) are sent as HTTP basic auth
and an ``api_key`` as a bearer token; neither ever appears in a message. A worker started by the
orchestrator gets them in the environment (``DFLASH_OPS_SGLANG_AUTH``), never on its command line.
Proxies from the environment are not used: the server is on this host or behind an SSH tunnel.
"""
from __future__ import annotations

import base64
import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request

from remote.contract.credentials import redact
from remote.engines.http import describe, http_error_message, opener

CONNECT_TIMEOUT = 5.0  # seconds to open a TCP connection; reads then wait up to the client's timeout


class SGLangError(Exception):
    """SGLang is unreachable, answered with an HTTP error (``status``), or answered something unexpected."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class SGLangClient:
    def __init__(self, url: str, timeout: float = 600, api_key: str | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT, auth: str | None = None):
        parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SGLangError(f"not an http(s) URL for SGLang: {parts.scheme}://{parts.hostname or ''}...")
        try:
            self.base = redact(parts.geturl())  # credentials go in a header, never in the URL used or shown
        except ValueError as e:  # a bad port
            raise SGLangError(f"not a valid SGLang URL: {e}") from None
        self.display = self.base
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if parts.username is not None and auth is None:
            auth = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        if auth:
            self._headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._opener = opener(connect_timeout)

    def __repr__(self) -> str:
        return f"SGLangClient({self.display!r})"

    # ------------------------------------------------------------------ requests

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=self._headers)
        timeout = self.timeout if timeout is None else timeout
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise SGLangError(f"SGLang at {self.display} answered HTTP {e.code} to {method} {path}: "
                              f"{http_error_message(e)}", status=e.code) from None
        except urllib.error.URLError as e:
            raise SGLangError(f"SGLang at {self.display} is not reachable: {describe(e.reason)}") from None
        except (TimeoutError, socket.timeout):
            raise SGLangError(f"SGLang at {self.display} did not answer {method} {path} within {timeout:g}s") from None
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            raise SGLangError(f"SGLang at {self.display}: the connection failed during {method} {path}: "
                              f"{describe(e)}") from None
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise SGLangError(f"SGLang at {self.display} answered {method} {path} with something that is not "
                              f"JSON: {raw[:200]!r}") from None

    def health(self, timeout: float = 10) -> None:
        """Raise SGLangError unless ``GET /health`` answers 200 (quickly: a short connect timeout)."""
        self._request("GET", "/health", timeout=timeout)

    def model_info(self) -> dict:
        """``GET /get_model_info`` (``/model_info`` on servers that have only that), e.g. ``model_path``."""
        try:
            info = self._request("GET", "/get_model_info", timeout=min(self.timeout, 30))
        except SGLangError as e:
            if e.status != 404:
                raise
            info = self._request("GET", "/model_info", timeout=min(self.timeout, 30))
        if not isinstance(info, dict):
            raise SGLangError(f"SGLang at {self.display}: model info is not a JSON object: {info!r:.200}")
        return info

    def generate_raw(self, input_ids: list[int], max_new_tokens: int, stop_token_ids: list[int] | None = None,
                     sampling=None) -> dict:
        """The whole ``/generate`` answer for one completion (``output_ids``, ``meta_info``, ...):
        greedy (``temperature: 0``), or sampled with ``sampling``'s temperature / top_p / top_k."""
        params = {"temperature": 0, "max_new_tokens": int(max_new_tokens)}
        if sampling is not None and not sampling.greedy:
            params.update(temperature=sampling.temperature, top_p=sampling.top_p)
            if sampling.top_k > 0:
                params["top_k"] = sampling.top_k
        if stop_token_ids is not None:
            params["stop_token_ids"] = [int(i) for i in stop_token_ids]
        out = self._request("POST", "/generate", {"input_ids": [int(i) for i in input_ids],
                                                  "sampling_params": params})
        if isinstance(out, list) and len(out) == 1:  # a batch answer
            out = out[0]
        if not isinstance(out, dict) or not isinstance(out.get("output_ids"), list):
            keys = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise SGLangError(f"SGLang at {self.display}: /generate answered without 'output_ids' (got {keys}); "
                              f"this client needs an SGLang version that returns token ids")
        return out

    def generate(self, input_ids: list[int], max_new_tokens: int, stop_token_ids: list[int] | None = None,
                 sampling=None) -> list[int]:
        """The completion's token ids (greedy unless ``sampling`` says otherwise)."""
        return [int(i) for i in self.generate_raw(input_ids, max_new_tokens, stop_token_ids, sampling)["output_ids"]]
