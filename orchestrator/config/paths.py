"""Where dflash-ops keeps and finds its files on this machine (XDG Base Directory layout).

- cache: ``$XDG_CACHE_HOME/dflash-ops`` (default ``~/.cache/dflash-ops``); the built-in ``local``
  host's workdir is its ``local/`` folder unless ``$DFLASH_OPS_HOME`` names another.
- user config: ``$XDG_CONFIG_HOME/dflash-ops/`` (default ``~/.config/dflash-ops/``), holding
  ``inventory.yaml`` and ``drafters.yaml``.
- a config file (inventory, catalog) is found as: the explicit flag, its environment variable,
  the current directory, the user config folder (:func:`locate`); else there is none: the
  examples shipped with the package are templates for ``dflash-ops init``, never read silently.
- files shipped with the package (``orchestrator/config/``): the example inventory, catalog and
  prompt suite (:data:`TEMPLATES`, what ``dflash-ops init`` writes into a project folder) and the
  published numbers, found in a wheel install as in a checkout. The repository's own top level
  (``inventory.yaml``, ``configs/``) is what ``init`` writes there (tests/test_names.py holds it so).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

APP = "dflash-ops"
HOME_ENV_VAR = "DFLASH_OPS_HOME"
SHIPPED = Path(__file__).resolve().parent


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


@dataclass(frozen=True)
class ConfigKind:
    """A kind of config file and where it is looked for, in order."""
    what: str          # "inventory" | "catalog"
    flag: str          # the command-line option
    env_var: str
    here: str          # relative to the current directory
    user_name: str     # in the user config folder

    def places(self) -> list[str]:
        return [self.flag, f"${self.env_var}", f"./{self.here}", str(config_dir() / self.user_name)]


INVENTORY = ConfigKind("inventory", "--inventory", "DFLASH_OPS_INVENTORY", "inventory.yaml", "inventory.yaml")
CATALOG = ConfigKind("catalog", "--catalog", "DFLASH_OPS_CATALOG", "configs/drafters.yaml", "drafters.yaml")


@dataclass(frozen=True)
class ConfigFile:
    """Where a config file was found (``path`` None: nowhere), and by which rule."""
    kind: ConfigKind
    path: Path | None
    source: str | None   # the flag, the environment variable, the current directory or the user folder

    def __str__(self) -> str:
        if self.path is None:
            return (f"no {self.kind.what} file found (looked for {', '.join(self.kind.places()[1:])}; "
                    f"`dflash-ops init` writes one)")
        via = self.source if self.source.startswith(("-", "$")) else f"the {self.source}"
        return f"{self.kind.what}: {self.path} (from {via})"


def locate(kind: ConfigKind, explicit: str | os.PathLike | None = None) -> ConfigFile:
    """The one discovery rule: ``explicit`` (the flag), else ``$ENV_VAR``, else ``./HERE`` if it
    exists, else ``USER_CONFIG/USER_NAME`` if it exists, else nothing (never a shipped example).
    An explicit or environment path is returned even if missing (the loader says so)."""
    if explicit:
        return ConfigFile(kind, Path(explicit).expanduser(), kind.flag)
    env = os.environ.get(kind.env_var)
    if env:
        return ConfigFile(kind, Path(env).expanduser(), f"${kind.env_var}")
    if Path(kind.here).exists():
        return ConfigFile(kind, Path(kind.here), "current directory")
    user = config_dir() / kind.user_name
    if user.exists():
        return ConfigFile(kind, user, "user config folder")
    return ConfigFile(kind, None, None)


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


MAX_NESTING = 32     # levels of mappings and lists a config file may nest: far beyond any real one


def check_nesting(text: str, path: Path, error: type[Exception], what: str) -> None:
    """``error`` naming the line where ``text`` nests deeper than :data:`MAX_NESTING` (PyYAML's
    composer recurses per level: a deep enough document would end in a RecursionError). Read from
    the parser's events, which are not recursive; a document that does not parse is left to the
    loader, whose message says where."""
    import yaml

    depth = 0
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_NESTING:
                    raise error(f"{path}: line {event.start_mark.line + 1}, column {event.start_mark.column + 1}: "
                                f"{what} nests more than {MAX_NESTING} levels deep")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        return


def shipped(name: str) -> Path:
    """A default file shipped in the package (``orchestrator/config/NAME``)."""
    return SHIPPED / name


class TemplateExists(InputError):
    """``init`` would overwrite a file the user may have edited."""


# What `dflash-ops init` writes into a project folder: its path there -> the example shipped in the
# package. The first two are where the discovery rule finds them (INVENTORY.here, CATALOG.here).
TEMPLATES = {INVENTORY.here: "inventory.yaml", CATALOG.here: "drafters.yaml",
             "configs/suites/my-prompts.jsonl": "suites/my-prompts.jsonl"}


def write_templates(project_dir: str | os.PathLike = ".", force: bool = False) -> list[Path]:
    """``dflash-ops init``: the commented example inventory and catalog and an example prompt
    suite, copied into ``project_dir`` for the user to edit, where running dflash-ops there finds
    them (``./inventory.yaml``, ``./configs/drafters.yaml``). Existing files are kept unless
    ``force`` (TemplateExists names them)."""
    dest = {Path(project_dir) / here: shipped(name) for here, name in TEMPLATES.items()}
    there = [p for p in dest if p.exists()]
    if there and not force:
        raise TemplateExists(f"{', '.join(map(str, there))} already exist{'s' * (len(there) == 1)}: edit "
                             f"{'it' if len(there) == 1 else 'them'}, or pass --force to replace "
                             f"{'it' if len(there) == 1 else 'them'} with the commented examples")
    for path, source in dest.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(source.read_bytes())
    return list(dest)
