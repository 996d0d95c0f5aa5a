"""Credentials in a server URL (an SGLang behind basic auth): split from the URL before it is shown
or stored, and handed to the worker in its environment, never on a command line. Stdlib only."""
from __future__ import annotations

import urllib.parse

AUTH_ENV = "DFLASH_OPS_SGLANG_AUTH"  # ``user:password`` for an SGLang behind basic auth


def redact(url: str) -> str:
    """``url`` without user info, query or fragment: safe for logs and error messages."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def split_credentials(url: str) -> tuple[str, str | None]:
    """``(url without credentials, "user:password" or None)``. A URL without ``user@`` comes back
    unchanged; one with it comes back as :func:`redact` writes it. ValueError: a bad port."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url, None
    parts.port  # noqa: B018 -- raises ValueError for a bad one
    user = urllib.parse.unquote(parts.username)
    return redact(url), f"{user}:{urllib.parse.unquote(parts.password or '')}"
