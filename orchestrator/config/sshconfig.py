"""Ask OpenSSH how it would reach a host: ``ssh -G`` prints the effective client configuration
for a destination (``~/.ssh/config`` with its Include and Match blocks, /etc/ssh/ssh_config, the
built-in defaults and any ``-o`` given), without connecting. Both the inventory (``ssh_config:``
aliases) and every SSH endpoint (transport/endpoint.py) are resolved here, so dflash-ops never
re-implements ssh_config parsing.

``~`` follows ``$HOME`` like the rest of dflash-ops: when ``$HOME`` is not the passwd home
directory (which OpenSSH itself would use), ``$HOME/.ssh/config`` is passed to ssh with ``-F``.
"""
from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from ..errors import InputError

SSH = "ssh"


class SSHConfigError(InputError):
    """OpenSSH is missing or rejected the configuration (message is user-facing)."""


def quote_value(value: str) -> str:
    """An ``-o Key=VALUE`` value as ssh_config reads it (quoted when it holds blanks)."""
    return f'"{value}"' if any(c.isspace() for c in value) else value


def expand(path: str) -> str:
    return str(Path(path).expanduser())


def user_config_file(explicit: str | os.PathLike | None = None) -> str | None:
    """The ``-F`` file to give ssh: an explicit one, or ``$HOME/.ssh/config`` when ``$HOME`` is
    not the passwd home (else None: ssh reads its usual files)."""
    if explicit:
        return expand(str(explicit))
    home_cfg = Path("~/.ssh/config").expanduser()
    try:
        pw_cfg = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".ssh" / "config"
    except KeyError:
        pw_cfg = None
    return str(home_cfg) if home_cfg != pw_cfg and home_cfg.exists() else None


class ResolvedConfig(dict):
    """``ssh -G`` output: lower-case keyword -> list of values (one per line it appeared on)."""

    def first(self, key: str, default: str | None = None) -> str | None:
        values = self.get(key)
        return values[0] if values else default

    def words(self, key: str) -> list[str]:
        """A whitespace-separated list value (known-hosts files)."""
        return [w for v in self.get(key, []) for w in v.split()]

    def enabled(self, key: str) -> bool:
        return (self.first(key) or "no").lower() == "yes"

    def proxy(self, key: str) -> str | None:
        v = self.first(key)
        return None if v is None or v.lower() == "none" else v


@lru_cache(maxsize=256)
def _ssh_G(destination: str, options: tuple[tuple[str, str], ...], config_file: str | None,
           home: str) -> ResolvedConfig:
    if shutil.which(SSH) is None:
        raise SSHConfigError("the OpenSSH client `ssh` is not installed on this machine (apt-get install "
                             "openssh-client): dflash-ops resolves ~/.ssh/config and moves checkpoints with it")
    argv = [SSH, "-G", *(["-F", config_file] if config_file else [])]
    for key, value in options:
        argv += ["-o", f"{key}={value}"]
    proc = subprocess.run([*argv, "--", destination], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.strip().splitlines() if ln.strip()]
        # "FILE line 3: Bad port 'abc'." says what is wrong; "terminating, 1 bad ..." only that it is
        why = [ln for ln in lines if " line " in ln] or lines[-1:] or [f"exit {proc.returncode}"]
        raise SSHConfigError(f"ssh -G {destination}: {'; '.join(why)}")
    out = ResolvedConfig()
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key:
            out.setdefault(key.lower(), []).append(value.strip())
    return out


def resolve(destination: str, options: dict[str, str] | None = None,
            config_file: str | os.PathLike | None = None) -> ResolvedConfig:
    """What OpenSSH would use for ``destination`` (a Host alias or an address) with ``options``
    as ``-o`` overrides (values already quoted with :func:`quote_value` where needed)."""
    if destination.startswith("-"):
        raise SSHConfigError(f"bad SSH destination {destination!r}")
    return _ssh_G(destination, tuple(sorted((options or {}).items())), user_config_file(config_file),
                  os.environ.get("HOME", ""))


def parse_jump(spec: str, default_user: str | None = None,
               default_port: int | None = 22) -> tuple[str | None, str, int | None]:
    """One ProxyJump hop, ``[user@]host[:port]`` (``[v6addr]:port`` too) -> (user, host, port);
    ValueError (saying what is wrong) for anything else."""
    user = default_user
    if "@" in spec:
        user, spec = spec.rsplit("@", 1)
        if not user:
            raise ValueError("an empty user before '@'")
    port: int | str | None = default_port
    if spec.startswith("["):
        addr, _, rest = spec[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{rest!r} after ']' (expected ':PORT')")
        port = rest[1:] if rest else default_port
    elif spec.count(":") == 1:
        addr, port = spec.split(":")
    else:
        addr = spec
    if not addr or any(c.isspace() for c in addr) or addr.startswith("-"):
        raise ValueError("no host" if not addr else f"{addr!r} is not a host name or address")
    if isinstance(port, str):
        if not port.isdigit():
            raise ValueError(f"{port!r} is not a port")
        if not 0 < int(port) < 65536:
            raise ValueError(f"port {port} is out of range (1-65535)")
        port = int(port)
    return user, addr, port


@lru_cache(maxsize=1)
def default_identities() -> tuple[str, ...]:
    """The identity files OpenSSH tries when no IdentityFile is configured."""
    return tuple(_ssh_G("dflash-ops-defaults.invalid", (), "/dev/null", "").get("identityfile", []))
