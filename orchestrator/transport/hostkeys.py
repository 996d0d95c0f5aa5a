"""known_hosts as OpenSSH reads it, for the control connection (paramiko reads only plain lines,
and one ``@cert-authority`` or ``@revoked`` line makes it reject the whole file).

A line is ``[@marker] PATTERNS KEYTYPE BASE64 [comment]``: PATTERNS are comma-separated host
names, ``[host]:port``, ``*``/``?`` wildcards, ``!negations`` or one hashed name (``|1|salt|hmac``).
Plain lines give the keys a host may present; ``@revoked`` keys are refused for the hosts their
line matches, even where a plain line lists the same key. ``@cert-authority`` lines (host
certificates signed by a CA) are skipped with a warning: paramiko cannot check a host
certificate, so such a host needs its own key in known_hosts (``ssh-keyscan``) or
``trust_host_key``; the OpenSSH data path honours them itself.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import warnings
from dataclasses import dataclass, field
from functools import lru_cache

from ..errors import DflashOpsWarning


class KnownHostsWarning(DflashOpsWarning):
    """A known_hosts line dflash-ops' control connection cannot use (shown once per file)."""


@dataclass(frozen=True)
class Entry:
    marker: str | None        # None, "@revoked" or "@cert-authority"
    patterns: str
    key_type: str
    blob: bytes               # the key as the wire carries it (type + public numbers)
    where: str                # FILE:LINE


def host_name(address: str, port: int) -> str:
    """The name a host has in known_hosts: ``addr``, or ``[addr]:port`` off port 22."""
    return address if port == 22 else f"[{address}]:{port}"


def _glob(pattern: str) -> re.Pattern:
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern),
                      re.IGNORECASE | re.DOTALL)


def _hashed_match(pattern: str, name: str) -> bool:
    try:
        _, salt, digest = pattern[1:].split("|")[:3]
        want = base64.b64decode(digest)
        return hmac.compare_digest(hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest(), want)
    except (ValueError, binascii.Error):
        return False


def matches(patterns: str, name: str) -> bool:
    """OpenSSH's ``match_hostname``: any positive pattern matches and no negated one does."""
    if patterns.startswith("|1|"):
        return _hashed_match(patterns, name)
    hit = False
    for p in patterns.split(","):
        negated = p.startswith("!")
        if _glob(p[1:] if negated else p).fullmatch(name):
            if negated:
                return False
            hit = True
    return hit


def _parse(path: str) -> tuple[list[Entry], list[str]]:
    entries, skipped = [], []
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return [], []
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        marker = words.pop(0) if words[0].startswith("@") else None
        where = f"{path}:{number}"
        if len(words) < 3 or marker not in (None, "@revoked", "@cert-authority"):
            skipped.append(f"{where} (not a known_hosts line)")
            continue
        try:
            blob = base64.b64decode(words[2], validate=True)
        except (binascii.Error, ValueError):
            skipped.append(f"{where} (bad base64 key)")
            continue
        if marker == "@cert-authority":
            skipped.append(f"{where} (@cert-authority: host certificates are not checked by the control connection)")
        entries.append(Entry(marker, words[0], words[1], blob, where))
    return entries, skipped


@lru_cache(maxsize=64)
def _load(path: str, stamp: tuple[int, int]) -> tuple[Entry, ...]:
    entries, skipped = _parse(path)
    if skipped:
        warnings.warn(KnownHostsWarning(f"known_hosts: skipping {len(skipped)} line(s) the control connection cannot "
                                        f"use, keeping the others: {'; '.join(skipped[:3])}"
                                        + (" ..." if len(skipped) > 3 else "")), stacklevel=2)
    return tuple(entries)


@dataclass
class KnownHosts:
    """The entries of some known_hosts files (read once per file version)."""
    entries: list[Entry] = field(default_factory=list)

    @classmethod
    def load(cls, paths) -> "KnownHosts":
        out = cls()
        for path in paths:
            try:
                st = os.stat(path)
            except OSError:
                continue
            out.entries += _load(path, (st.st_mtime_ns, st.st_size))
        return out

    def for_host(self, name: str, marker: str | None = None) -> list[Entry]:
        return [e for e in self.entries if e.marker == marker and matches(e.patterns, name)]

    def key_types(self, name: str) -> set[str]:
        """Key types known_hosts lists for ``name`` (plain lines)."""
        return {e.key_type for e in self.for_host(name)}

    def verdict(self, name: str, key_type: str, blob: bytes) -> str:
        """``revoked``, ``known``, ``changed`` (other keys listed for the host) or ``unknown``."""
        if any(e.blob == blob for e in self.for_host(name, "@revoked")):
            return "revoked"
        listed = self.for_host(name)
        if any(e.blob == blob for e in listed):
            return "known"
        return "changed" if listed else "unknown"

    def has_cert_authority(self, name: str) -> bool:
        return bool(self.for_host(name, "@cert-authority"))
