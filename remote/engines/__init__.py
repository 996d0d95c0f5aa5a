"""Serving engines run beside our own decoding: one module per engine (``vllm``, ``sglang``), each
with the same parts — ``KIND``, ``START_TIMEOUT``, ``GPU_SHARE_FLAG``, ``QUIRK`` (a known way it
computes the drafter differently, or None), ``engine_versions(python)``, ``Client(url)`` (with
``renders_chat``, ``check_serves``, ``complete`` and, where it renders chat, ``chat``) and
``launch(...)`` (a server of our own) — found by kind through :func:`engine`. Beside them: what they
share (``server``: processes, logs, HTTP), one request's answer (``counts``), the worker's engine
phase (``phase``), the reconciliation of their counts with ours (``accounting``), known engine quirks
reproduced on our drafter (``quirks``), and SGLang's native API as a source of reference completions
(``sglang_client``). The kinds, names and install lines are :mod:`remote.contract.engines`."""
from __future__ import annotations

import importlib

from remote.contract.engines import ENGINES


def engine(kind: str):
    """The module of engine ``kind`` (:data:`remote.contract.engines.KINDS`)."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine kind {kind!r} ({', '.join(ENGINES)})")
    return importlib.import_module(f"{__name__}.{kind}")
