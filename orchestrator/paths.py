"""Where dflash-ops keeps and finds its files on this machine (XDG Base Directory layout).

- cache: ``$XDG_CACHE_HOME/dflash-ops`` (default ``~/.cache/dflash-ops``); the built-in ``local``
  host's workdir is its ``local/`` folder unless ``$DFLASH_OPS_HOME`` names another.
- user config: ``$XDG_CONFIG_HOME/dflash-ops/`` (default ``~/.config/dflash-ops/``), holding
  ``inventory.yaml`` and ``drafters.yaml``.
- a config file is found as: the explicit flag, its environment variable, the current
  directory, the user config folder (:func:`find_config`); then the caller's default.
- defaults shipped with the package (``orchestrator/configs/``): the example catalog and the
  published numbers, found in a wheel install as in a checkout.
"""
from __future__ import annotations

import os
from pathlib import Path

APP = "dflash-ops"
HOME_ENV_VAR = "DFLASH_OPS_HOME"
SHIPPED = Path(__file__).resolve().parent / "configs"


def _xdg(var: str, default: str) -> Path:
    value = os.environ.get(var)
    # the spec: a relative path in an XDG variable is invalid and ignored
    return Path(value) if value and os.path.isabs(value) else Path(default).expanduser()


def cache_dir() -> Path:
    return _xdg("XDG_CACHE_HOME", "~/.cache") / APP


def config_dir() -> Path:
    return _xdg("XDG_CONFIG_HOME", "~/.config") / APP


def local_home() -> str:
    """The built-in ``local`` host's workdir."""
    return os.environ.get(HOME_ENV_VAR) or str(cache_dir() / "local")


def find_config(explicit: str | os.PathLike | None, env_var: str, here: str, user_name: str) -> Path | None:
    """``explicit``, else ``$ENV_VAR``, else ``./HERE`` if it exists, else ``USER_CONFIG/USER_NAME``
    if it exists, else None. An explicit or environment path is returned even if missing (the
    loader says so)."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get(env_var)
    if env:
        return Path(env).expanduser()
    for candidate in (Path(here), config_dir() / user_name):
        if candidate.exists():
            return candidate
    return None


def read_config_text(path: Path, error: type[Exception], what: str) -> str:
    """The text of a config file (UTF-8); ``error`` with one line naming the file otherwise: it
    cannot be read, or a byte is not UTF-8 (with its line and column)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise error(f"{path}: line {line}, column {column}: not UTF-8 text (byte 0x{data[e.start]:02x}); "
                    f"save {what} as UTF-8") from None


def shipped(name: str) -> Path:
    """A default file shipped in the package (``orchestrator/configs/NAME``)."""
    return SHIPPED / name
