"""HTTP to a server (an engine we started, or a user's SGLang), stdlib only: one way to open
connections (no proxies; a connect timeout apart from the read timeout) and one way to read a
failure (the server's own words for an HTTP error, a connection's reason in words)."""
from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request


def opener(connect_timeout: float | None = None) -> urllib.request.OpenerDirector:
    """An opener that ignores proxy variables (the server is on this host or behind an SSH tunnel)
    and, with ``connect_timeout``, connects within it and then lets reads wait for the request's own
    timeout (urllib alone has one timeout for both)."""
    if connect_timeout is None:
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def create(address, timeout=None, source_address=None):
        sock = socket.create_connection(address, min(connect_timeout, timeout or connect_timeout), source_address)
        sock.settimeout(timeout)
        return sock

    class HTTP(http.client.HTTPConnection):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._create_connection = create

    class HTTPS(http.client.HTTPSConnection):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._create_connection = create

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(HTTP, req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(HTTPS, req, context=self._context)

    return urllib.request.build_opener(urllib.request.ProxyHandler({}), HTTPHandler(), HTTPSHandler())


def describe(e) -> str:
    """A failed connection's reason in words."""
    if isinstance(e, (TimeoutError, socket.timeout)):
        return "timed out connecting"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (is the server running and the port right?)"
    if isinstance(e, socket.gaierror):
        return f"cannot resolve the host name ({e.strerror or e})"
    return str(e) or type(e).__name__


def http_error_message(e: urllib.error.HTTPError, one_line: bool = False) -> str:
    """A server's own words for an HTTP error: its JSON ``error``/``message``/``detail``, else the body
    (``one_line``: its whitespace collapsed), at most 500 characters."""
    try:
        raw = e.read()
    except Exception:
        raw = b""
    text = raw.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("message", obj.get("detail")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            text = str(err)
    if one_line:
        text = " ".join(text.split())
    return text[:500] or str(e.reason) or "no message"
