"""The host inventory: which machines exist, what they are for, and how to reach them.

The file is found as: explicit path, ``$DFLASH_OPS_INVENTORY``, ``./inventory.yaml``,
``$XDG_CONFIG_HOME/dflash-ops/inventory.yaml``, else only the built-in ``local`` host.
"""
from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable

import yaml

from remote.contract.engines import KINDS as ENGINE_KINDS

from ..errors import InputError
from .paths import INVENTORY, check_nesting, local_home, locate, read_config_text

ROLES = ("train", "eval")
ENV_VAR = "DFLASH_OPS_INVENTORY"


class InventoryError(InputError):
    """A bad inventory or an unknown host; the message is meant for the user as-is."""


class ExampleHost(InventoryError):
    """A connection to a host the inventory marks ``example: true`` (a placeholder to edit)."""


ENGINE_FIELDS = ("kind", "python", "url", "args")


class _Spec:
    """A mapping of an inventory entry held as a dataclass; ``to_dict``: the fields it sets."""

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v not in (None, ())}


@dataclass(frozen=True)
class EngineSpec(_Spec):
    """A host's serving engine (``engine:`` in the inventory): ``kind`` vllm or sglang, and either
    ``python`` (the engine's own environment there: `eval --engine` starts its servers) or ``url``
    (a server already running, as the host sees it); ``args``: more arguments for servers we start."""
    kind: str
    python: str | None = None
    url: str | None = None
    args: tuple[str, ...] = ()

    def worker_args(self) -> list[str]:
        """How the worker on the host is told where the engine is (never part of the run's settings)."""
        argv = ["--engine-kind", self.kind]
        argv += ["--engine-python", self.python] if self.python else ["--engine-url", self.url]
        return argv + [f"--engine-arg={a}" for a in self.args]

    def describe(self) -> str:
        return f"{self.kind} " + (self.python if self.python else f"at {self.url}")



SLURM_FIELDS = ("login", "partition", "account", "qos", "time", "gres", "constraint", "sbatch_args", "setup",
                "gpu_memory")
# sbatch options dflash-ops sets itself (or a field sets), with the negations sbatch has: not in sbatch_args,
# nor any abbreviation of them (sbatch reads long options with getopt_long: `--outp=` is --output=)
SBATCH_OWN = ("array", "job-name", "output", "error", "parsable", "wrap", "chdir", "gres", "gpus", "partition",
              "account", "qos", "time", "constraint", "signal", "export", "input", "wait", "test-only", "requeue",
              "no-requeue")


def sbatch_own(name: str) -> tuple[str, ...]:
    """The options of SBATCH_OWN that ``--name`` may stand for in sbatch's argv: itself, or those it
    abbreviates (getopt_long takes any unambiguous prefix; an ambiguous one is refused here too)."""
    return (name,) if name in SBATCH_OWN else tuple(o for o in SBATCH_OWN if o.startswith(name))


_SBATCH_ARG = re.compile(r"--([a-z][a-z0-9-]*)(=[^\n\r\0]*)?")
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")


@dataclass(frozen=True)
class SlurmSpec(_Spec):
    """A Slurm cluster's job settings (``kind: slurm`` in the inventory): ``login`` is the inventory
    host (an SSH host, or ``local``) where ``sbatch``, ``squeue``, ``scontrol`` and ``scancel`` run;
    the rest become sbatch options of every job (``gres``: ``gpu`` or ``gpu:TYPE``, the count is a
    worker's GPUs; ``gres_count``: the count a user wrote, ``gpu:N``, which must be that);
    ``setup``: a script on the cluster each job sources first (its ``module load`` lines);
    ``gpu_memory``: GiB per GPU, where the nodes' GRES do not say."""
    login: str
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    gres: str = "gpu"
    gres_count: int | None = None
    constraint: str | None = None
    sbatch_args: tuple[str, ...] = ()
    setup: str | None = None
    gpu_memory: float | None = None

    def gres_problem(self, gpus_per_task: int) -> str | None:
        """Why a task holding ``gpus_per_task`` GPUs (0: a CPU job) cannot run with the count the
        entry's ``gres`` names, or None."""
        if self.gres_count is None or self.gres_count == gpus_per_task:
            return None
        holds = (f"each worker of this run holds {gpus_per_task} (--target-devices N sets it)" if gpus_per_task
                 else "its jobs are CPU jobs (`gpus: 0`), which ask for no GPU")
        return (f"field 'gres' asks {self.gres_count} GPU(s) per task ({self.gres}:{self.gres_count}), but {holds}: "
                f"write `gres: {self.gres}` and dflash-ops asks each task's count itself")

    def sbatch_options(self, gpus_per_task: int) -> list[str]:
        """The options of every job of this cluster (argv items, never a shell line)."""
        opts = [f"--{name}={value}" for name, value in (("partition", self.partition), ("account", self.account),
                                                         ("qos", self.qos), ("time", self.time),
                                                         ("constraint", self.constraint)) if value]
        if gpus_per_task:
            opts.append(f"--gres={self.gres}:{gpus_per_task}")
        return opts + list(self.sbatch_args)



@dataclass(frozen=True)
class Host:
    name: str
    address: str | None = None
    port: int = 22
    user: str | None = None
    identity: str | None = None
    known_hosts: str | None = None
    trust_host_key: bool = False
    ssh_config: str | None = None
    jump: str | None = None
    roles: tuple[str, ...] = ()
    python: str = "python3"
    workdir: str | None = None
    checkpoints: str | None = None
    sglang: str | None = None       # the URL without credentials (what is shown and recorded)
    gpus: int | None = None
    kind: str = "ssh"               # ssh | ray (address: ray://HOST:PORT, a Ray cluster's client server) | slurm
    via: str | None = None          # ray: reach the address through an SSH tunnel from this inventory host
    example: bool = False           # a placeholder (the shipped examples): listed, never connected to
    tunnel: bool | str | None = None   # eval host: sync-ckpt pulls through a tunnel (true, false, auto)
    authorized_keys: str | None = None  # training host: where sync-ckpt --tunnel adds its one-time key
    engine: EngineSpec | None = None  # its serving engine (`eval --engine`)
    stall_minutes: float = 30.0     # eval host: no event from a worker this long ends following it (0: never)
    slurm: SlurmSpec | None = None  # kind slurm: the cluster's login host and job settings
    is_local: bool = False
    # the SSH fields the inventory file itself set (they override ~/.ssh/config; transport/endpoint.py)
    ssh_set: frozenset[str] = field(default=frozenset(), compare=False, repr=False)
    ssh_config_file: str | None = field(default=None, compare=False, repr=False)  # `-F` (tests)
    # `user:password` from the inventory's sglang URL: sent to the host on stdin, never shown or recorded
    sglang_auth: str | None = field(default=None, compare=False, repr=False)
    defined_in: str | None = field(default=None, compare=False, repr=False)   # the inventory file, as shown

    def refuse_example(self) -> None:
        """Raise :class:`ExampleHost` (one line saying what to edit) for an ``example: true``
        host: every connection (control, data path, tunnel, Ray) asks this first."""
        if self.example:
            raise ExampleHost(f"{self.name} is an example host in {self.defined_in or 'the inventory'}: set its "
                              f"address and remove `example: true`")

    @property
    def endpoint(self) -> str:
        if self.is_ray:
            return self.address + (f" via {self.via}" if self.via else "")
        if self.is_slurm:
            return f"slurm via {self.slurm.login}"
        return "local" if self.is_local else f"{self.address}:{self.port}"

    @property
    def is_ray(self) -> bool:
        return self.kind == "ray"

    @property
    def is_slurm(self) -> bool:
        return self.kind == "slurm"

    def on_host(self, expand_home: Callable[[str | None], str | None]) -> "Host":
        """This host with ``~`` in its paths (workdir, checkpoints, python) expanded on the host
        (``expand_home``: its runner's :meth:`~orchestrator.transport.Runner.expand_home`)."""
        values = {k: expand_home(getattr(self, k)) for k in HOME_PATHS}
        if self.engine and self.engine.python:
            values["engine"] = replace(self.engine, python=expand_home(self.engine.python))
        return self if all(values[k] == getattr(self, k) for k in values) else replace(self, **values)

    def to_dict(self) -> dict:
        """The inventory's view of the host (what `hosts --json` prints)."""
        return {f.name: (list(v) if isinstance(v, tuple) else v.to_dict() if isinstance(v, _Spec)
                         else v)
                for f in fields(self) if f.repr for v in [getattr(self, f.name)]}


# Field name -> (accepted python types, human type name).
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "address": ((str,), "a string"),
    "port": ((int,), "an integer"),
    "user": ((str,), "a string"),
    "identity": ((str,), "a string (path)"),
    "known_hosts": ((str,), "a string (path)"),
    "trust_host_key": ((bool,), "true or false"),
    "ssh_config": ((str,), "a string (ssh config Host alias)"),
    "jump": ((str,), "a string (host name or [user@]addr[:port])"),
    "roles": ((list,), "a list of roles (train, eval)"),
    "python": ((str,), "a string (interpreter path)"),
    "workdir": ((str,), "a string (path)"),
    "checkpoints": ((str,), "a string (path)"),
    "sglang": ((str,), "a string (URL)"),
    "gpus": ((int,), "an integer"),
    "kind": ((str,), "ssh, ray or slurm"),
    "via": ((str,), "a string (an SSH host of the inventory)"),
    "example": ((bool,), "true or false"),
    "tunnel": ((bool, str), "true, false or auto"),
    "authorized_keys": ((str,), "a string (path on the host)"),
    "engine": ((dict,), "a mapping {kind: vllm|sglang, python: PATH} or {kind: ..., url: URL}"),
    "stall_minutes": ((int, float), "a number of minutes (0: never)"),
    "login": ((str,), "a string (an SSH host of the inventory, or local)"),
    "partition": ((str,), "a string (a Slurm partition)"),
    "account": ((str,), "a string (a Slurm account)"),
    "qos": ((str,), "a string (a Slurm QOS)"),
    "time": ((str, int), "a Slurm time limit (minutes, or [D-]HH:MM:SS)"),
    "gres": ((str,), "gpu, gpu:TYPE, gpu:N or gpu:TYPE:N (N, if given, must be each worker's GPUs)"),
    "constraint": ((str,), "a string (a Slurm node constraint)"),
    "sbatch_args": ((list,), "a list of --option=value strings"),
    "setup": ((str,), "a string (a script path on the cluster)"),
    "gpu_memory": ((int, float), "a number of GiB per GPU"),
}
KINDS = ("ssh", "ray", "slurm")
RAY_ONLY = {"via"}
NOT_RAY = {"engine"}                # Ray clusters: fields refused (the engine's servers would outlive the actor)
SSH_ONLY = {"port", "user", "identity", "known_hosts", "trust_host_key", "ssh_config", "jump", "sglang", "tunnel",
            "authorized_keys"}
_LOCAL_ONLY_IGNORED = {"is_local"}
HOME_PATHS = ("workdir", "checkpoints", "python")   # paths on the host: a leading ~ is expanded there


def builtin_local() -> Host:
    home = local_home()
    return Host(
        name="local",
        roles=("train", "eval"),
        python=sys.executable,
        workdir=home,
        checkpoints=str(Path(home) / "checkpoints"),
        is_local=True,
    )


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


@dataclass
class Inventory:
    hosts: dict[str, Host] = field(default_factory=dict)
    path: Path | None = None

    def names(self) -> list[str]:
        return list(self.hosts)

    def get(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            where = f" in {self.path}" if self.path else ""
            known = ", ".join(self.hosts) or "none"
            raise InventoryError(
                f"unknown host '{name}'{where}{did_you_mean(name, self.names())}; known hosts: {known}"
            ) from None

    def with_role(self, role: str) -> list[Host]:
        return [h for h in self.hosts.values() if role in h.roles]

    def pick(self, role: str, name: str | None = None) -> Host:
        """``name``, else the one host with ``role`` (an SSH host before the built-in ``local``)."""
        if name:
            return self.get(name)
        hosts = [h for h in self.with_role(role) if not h.is_local] or self.with_role(role)
        if len(hosts) != 1:
            flag = "--from" if role == "train" else "--to"
            raise InventoryError(f"{len(hosts)} hosts have role {role} ({', '.join(h.name for h in hosts) or 'none'});"
                                 f" pick one with {flag} HOST")
        return hosts[0]

    def __iter__(self):
        return iter(self.hosts.values())


# --- YAML loading with duplicate-key detection -------------------------------------------
# PyYAML silently keeps the last of two equal keys; walk the composed node tree first.


def _duplicates(node: yaml.Node, path: Path, owner: str | None) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
        line = key_node.start_mark.line + 1
        if key in seen:
            if owner is None:
                what = f"duplicate top-level key '{key}'"
            elif owner == "hosts":
                what = f"duplicate host '{key}' (host names must be unique)"
            else:
                what = f"host '{owner}': duplicate field '{key}'"
            raise InventoryError(f"{path}: line {line}: {what}; first defined on line {seen[key]}")
        seen[key] = line
        if owner is None and key == "hosts":
            _duplicates(value_node, path, "hosts")
        elif owner == "hosts":
            _duplicates(value_node, path, key)


def _read_yaml(path: Path) -> Any:
    text = read_config_text(path, InventoryError, "the inventory")
    check_nesting(text, path, InventoryError, "the inventory")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            _duplicates(root, path, None)
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise InventoryError(f"{path}: {where}invalid YAML: {problem}") from None


# --- ssh_config ----------------------------------------------------------------------------


SSH_FIELDS = frozenset({"address", "port", "user", "identity", "known_hosts", "jump"})


def _resolve_ssh_alias(where: str, alias: str, ssh_config_path: Path | None) -> dict[str, Any]:
    """A ``Host`` alias as OpenSSH resolves it (``ssh -G``: Include, Match and defaults honoured)."""
    from . import sshconfig

    try:
        cfg = sshconfig.resolve(alias, config_file=ssh_config_path)
    except sshconfig.SSHConfigError as e:
        raise InventoryError(f"{where}: ssh_config {alias!r}: {e}") from None
    out: dict[str, Any] = {"address": cfg.first("hostname") or alias, "port": int(cfg.first("port") or 22),
                           "user": cfg.first("user")}
    identities = cfg.get("identityfile", [])
    if identities and tuple(identities) != sshconfig.default_identities():
        out["identity"] = sshconfig.expand(identities[0])
    if cfg.proxy("proxyjump"):
        out["jump"] = cfg.proxy("proxyjump")
    return out


# --- validation ----------------------------------------------------------------------------


def _host_from_entry(
    path: Path, name: str, entry: Any, base: Host | None, ssh_config_path: Path | None
) -> Host:
    where = f"{path}: host '{name}'"
    if entry is None:
        entry = {}
    if not isinstance(entry, dict):
        raise InventoryError(f"{where}: expected a mapping of fields, got {type(entry).__name__}")
    for key in entry:
        if not isinstance(key, str) or key not in _FIELDS:
            raise InventoryError(
                f"{where}: unknown field '{key}'{did_you_mean(str(key), list(_FIELDS))}"
            )
    for key, value in entry.items():
        types, human = _FIELDS[key]
        if value is None:
            continue
        ok = isinstance(value, types) and not (bool not in types and isinstance(value, bool))
        if not ok:
            raise InventoryError(f"{where}: field '{key}' must be {human}, got {value!r}")
    for key in HOME_PATHS:
        value = entry.get(key)
        if isinstance(value, str) and value.startswith("~") and value != "~" and not value.startswith("~/"):
            raise InventoryError(f"{where}: field '{key}': {value!r}: only '~' and '~/...' (the login user's home "
                                 f"on the host) are expanded; write the path out")
    if isinstance(entry.get("tunnel"), str) and entry["tunnel"] != "auto":
        raise InventoryError(f"{where}: field 'tunnel' must be true, false or auto, got {entry['tunnel']!r}")
    if "port" in entry and entry["port"] is not None and not 0 < entry["port"] < 65536:
        raise InventoryError(f"{where}: field 'port' must be between 1 and 65535, got {entry['port']}")
    if "gpus" in entry and entry["gpus"] is not None and entry["gpus"] < 0:
        raise InventoryError(f"{where}: field 'gpus' must be >= 0, got {entry['gpus']}")
    stall = entry.get("stall_minutes")
    if stall is not None and not 0 <= stall < float("inf"):
        raise InventoryError(f"{where}: field 'stall_minutes' must be a number of minutes >= 0 (0: never), got {stall}")
    roles = entry.get("roles")
    if roles is not None:
        for r in roles:
            if r not in ROLES:
                raise InventoryError(
                    f"{where}: field 'roles': unknown role {r!r}{did_you_mean(str(r), ROLES)}; "
                    f"roles are {', '.join(ROLES)}"
                )
    values: dict[str, Any] = {k: v for k, v in entry.items() if v is not None}
    if "roles" in values:
        values["roles"] = tuple(values["roles"])
    if "engine" in values:
        values["engine"] = _engine(where, values["engine"])
    if "sglang" in values:
        from remote.contract.credentials import split_credentials
        try:
            values["sglang"], values["sglang_auth"] = split_credentials(values["sglang"])
        except ValueError as e:
            raise InventoryError(f"{where}: field 'sglang': not a valid URL ({e})") from None

    slurm_only = sorted(set(SLURM_FIELDS) & set(values))
    if slurm_only and values.get("kind") != "slurm":
        raise InventoryError(f"{where}: field '{slurm_only[0]}' is for `kind: slurm` entries")
    if base is not None:  # overriding the built-in local host
        if "kind" in values or "via" in values:
            raise InventoryError(f"{where}: the built-in local host takes no 'kind' or 'via'")
        return replace(base, **values)
    if values.get("kind", "ssh") not in KINDS:
        raise InventoryError(f"{where}: field 'kind' must be one of {', '.join(KINDS)}, got {values['kind']!r}")
    if values.get("kind") == "ray":
        return _ray_host(where, name, values)
    if values.get("kind") == "slurm":
        return _slurm_host(where, name, values)
    if RAY_ONLY & set(values):
        raise InventoryError(f"{where}: field 'via' is for `kind: ray` entries (an SSH host uses 'jump')")

    ssh_set = frozenset(values) & SSH_FIELDS
    if values.get("ssh_config"):
        resolved = _resolve_ssh_alias(where, values["ssh_config"], ssh_config_path)
        values = {**resolved, **values}  # explicit inventory fields win over ~/.ssh/config
    if not values.get("address"):
        raise InventoryError(f"{where}: missing field 'address' (or 'ssh_config: ALIAS')")
    return Host(name=name, ssh_set=ssh_set, ssh_config_file=str(ssh_config_path) if ssh_config_path else None,
                **values)


def _engine(where: str, entry: dict) -> EngineSpec:
    """The ``engine:`` mapping checked: a known kind, exactly one of python and url, an http(s) URL
    without credentials, args a list of strings."""
    where = f"{where}: field 'engine'"
    for key in entry:
        if key not in ENGINE_FIELDS:
            raise InventoryError(f"{where}: unknown key '{key}'{did_you_mean(str(key), ENGINE_FIELDS)}; the keys are "
                                 f"{', '.join(ENGINE_FIELDS)}")
    kind = entry.get("kind")
    if kind not in ENGINE_KINDS:
        raise InventoryError(f"{where}: 'kind' must be one of {', '.join(ENGINE_KINDS)}, got {kind!r}")
    python, url, args = entry.get("python"), entry.get("url"), entry.get("args") or []
    if (python is None) == (url is None):
        raise InventoryError(f"{where}: give exactly one of 'python' (the engine's environment on the host: dflash-ops "
                             f"starts its servers) and 'url' (a server already running there)")
    for key, value in (("python", python), ("url", url)):
        if value is not None and (not isinstance(value, str) or not value):
            raise InventoryError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    if isinstance(python, str) and python.startswith("~") and python != "~" and not python.startswith("~/"):
        raise InventoryError(f"{where}: 'python': {python!r}: only '~' and '~/...' are expanded; write the path out")
    if url is not None:
        import urllib.parse

        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 -- raises ValueError for a bad one
        except ValueError as e:
            raise InventoryError(f"{where}: 'url': not a valid URL ({e})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InventoryError(f"{where}: 'url' must be http(s)://HOST:PORT as the host sees the server, got {url!r}")
        if parts.username is not None:
            raise InventoryError(f"{where}: 'url' holds credentials; an engine URL is used without them")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise InventoryError(f"{where}: 'args' must be a list of strings (arguments for the servers), got {args!r}")
    if args and url is not None:
        raise InventoryError(f"{where}: 'args' are for servers dflash-ops starts ('python'), not a running one ('url')")
    return EngineSpec(kind, python, url.rstrip("/") if url else None, tuple(args))


def _ray_host(where: str, name: str, values: dict[str, Any]) -> Host:
    """A Ray cluster: ``address: ray://HOST:PORT`` (its Ray Client server), optionally reached
    through an SSH tunnel from inventory host ``via`` (the address then as that host sees it)."""
    if NOT_RAY & set(values):
        raise InventoryError(f"{where}: field 'engine': a Ray cluster's eval runs without a serving engine (give the "
                             f"engine to an SSH eval host)")
    wrong = sorted(SSH_ONLY & set(values))
    if wrong:
        raise InventoryError(f"{where}: field '{wrong[0]}' is for SSH hosts, not `kind: ray` (a cluster behind "
                             f"SSH is reached with `via: HOST`)")
    address = values.get("address") or ""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not address.startswith("ray://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InventoryError(f"{where}: field 'address' must be ray://HOST:PORT (the cluster's Ray Client "
                             f"server, port 10001 by default), got {address!r}")
    if "train" in values.get("roles", ()):
        raise InventoryError(f"{where}: field 'roles': a Ray cluster is an eval host (role eval), not a training host")
    return Host(name=name, **{"roles": ("eval",), **values})


def _slurm_host(where: str, name: str, values: dict[str, Any]) -> Host:
    """A Slurm cluster: ``login`` names the inventory host where its commands run; the job
    settings are checked here, so that a typo is one line before anything is submitted."""
    wrong = sorted((SSH_ONLY | RAY_ONLY | NOT_RAY | {"address"}) & set(values))
    if wrong:
        raise InventoryError(f"{where}: field '{wrong[0]}' is not for `kind: slurm` (the cluster is reached through "
                             f"its login host: `login: HOST`, an SSH host of the inventory or local)")
    if not values.get("login"):
        raise InventoryError(f"{where}: missing field 'login' (the inventory host where sbatch runs, or local)")
    if "train" in values.get("roles", ()):
        raise InventoryError(f"{where}: field 'roles': a Slurm cluster is an eval host (role eval), not a training host")
    if not values.get("workdir"):
        raise InventoryError(f"{where}: missing field 'workdir' (storage the login node and the compute nodes both see)")
    time_ = values.get("time")
    if time_ is not None:
        time_ = str(time_)
        if isinstance(values["time"], bool) or not _SLURM_TIME.fullmatch(time_):
            raise InventoryError(f"{where}: field 'time' must be a Slurm time limit (minutes, MM:SS, HH:MM:SS or "
                                 f"D-HH:MM:SS), got {values['time']!r}")
    gres = values.get("gres", "gpu")
    parts = gres.split(":")
    count = int(parts.pop()) if len(parts) > 1 and parts[-1].isdigit() else None
    if not (1 <= len(parts) <= 2 and all(re.fullmatch(r"[A-Za-z0-9_.-]+", p) for p in parts)) or parts[-1].isdigit() \
            or count == 0:
        raise InventoryError(f"{where}: field 'gres' must be gpu or gpu:TYPE, with :N at the end if you like (N: each "
                             f"worker's GPUs, --target-devices), got {gres!r}")
    args = values.get("sbatch_args") or []
    for a in args:
        m = _SBATCH_ARG.fullmatch(a) if isinstance(a, str) else None
        if m is None:
            raise InventoryError(f"{where}: field 'sbatch_args': {a!r} is not --option or --option=value (each item "
                                 f"one option, passed to sbatch as one argument)")
        own = sbatch_own(m.group(1))
        if own:
            said = f"--{m.group(1)}" + ("" if own == (m.group(1),) else
                                        f" (sbatch reads it as {' or '.join('--' + o for o in own)})")
            fields = [o for o in own if o in SLURM_FIELDS]
            raise InventoryError(f"{where}: field 'sbatch_args': {said} is set by dflash-ops"
                                 + (f" (use the field '{fields[0]}')" if len(own) == 1 and fields else ""))
    gpu_memory = values.get("gpu_memory")
    if gpu_memory is not None and (isinstance(gpu_memory, bool) or not gpu_memory > 0):
        raise InventoryError(f"{where}: field 'gpu_memory' must be a positive number of GiB, got {gpu_memory!r}")
    spec = SlurmSpec(login=values.pop("login"), partition=values.pop("partition", None),
                     account=values.pop("account", None), qos=values.pop("qos", None),
                     time=time_, gres=":".join(parts), gres_count=count, constraint=values.pop("constraint", None),
                     sbatch_args=tuple(values.pop("sbatch_args", ()) or ()), setup=values.pop("setup", None),
                     gpu_memory=float(gpu_memory) if gpu_memory is not None else None)
    values.pop("time", None)
    values.pop("gpu_memory", None)
    values.pop("gres", None)
    return Host(name=name, slurm=spec, **{"roles": ("eval",), **values})


def parse_inventory(data: Any, path: Path, ssh_config_path: Path | None = None) -> Inventory:
    inv = Inventory(hosts={"local": builtin_local()}, path=path)
    if data is None:
        return inv
    if not isinstance(data, dict):
        raise InventoryError(f"{path}: top level must be a mapping with a 'hosts' key")
    for key in data:
        if key != "hosts":
            raise InventoryError(f"{path}: unknown top-level key '{key}'{did_you_mean(str(key), ['hosts'])}")
    hosts = data.get("hosts") or {}
    if not isinstance(hosts, dict):
        raise InventoryError(f"{path}: 'hosts' must be a mapping of host name to fields")
    for name, entry in hosts.items():
        if not isinstance(name, str) or not name:
            raise InventoryError(f"{path}: host name {name!r} must be a non-empty string")
        base = inv.hosts["local"] if name == "local" else None
        shown = str(path) if Path(path).is_absolute() or str(path).startswith(".") else f"./{path}"
        inv.hosts[name] = replace(_host_from_entry(path, name, entry, base, ssh_config_path), defined_in=shown)
    for host in inv:
        _check_jump(path, host, inv)
        _check_via(path, host, inv)
        _check_login(path, host, inv)
    return inv


def _check_login(path: Path, host: Host, inv: Inventory) -> None:
    if host.slurm is None:
        return
    hop = inv.hosts.get(host.slurm.login)
    if hop is None or hop.is_ray or hop.is_slurm:
        choices = [h.name for h in inv if not h.is_ray and not h.is_slurm]
        raise InventoryError(f"{path}: host '{host.name}': field 'login': '{host.slurm.login}' is not an SSH host of "
                             f"the inventory or local{did_you_mean(host.slurm.login, choices)}")


def _check_via(path: Path, host: Host, inv: Inventory) -> None:
    if host.via is None:
        return
    hop = inv.hosts.get(host.via)
    if hop is None or hop.is_local or hop.is_ray:
        raise InventoryError(f"{path}: host '{host.name}': field 'via': '{host.via}' is not an SSH host of the "
                             f"inventory{did_you_mean(host.via, [h.name for h in inv if not h.is_local and not h.is_ray])}")


def _check_jump(path: Path, host: Host, inv: Inventory) -> None:
    """Every hop of ``jump`` is an SSH host of the inventory or ``[user@]addr[:port]``."""
    if not host.jump or host.is_local:
        return
    from .sshconfig import parse_jump

    field_ = "field 'jump'" if "jump" in host.ssh_set else "ProxyJump (from ssh_config)"
    for hop in host.jump.split(","):
        hop = hop.strip()
        if hop in inv.hosts:
            if inv.hosts[hop].is_local:
                raise InventoryError(f"{path}: host '{host.name}': {field_}: '{hop}' is the local machine, "
                                     f"not an SSH host")
            continue
        try:
            parse_jump(hop)
        except ValueError as e:
            raise InventoryError(f"{path}: host '{host.name}': {field_}: bad hop {hop!r}: {e} "
                                 f"(a hop is an inventory host or [user@]address[:port])") from None


def resolve_inventory_path(path: str | os.PathLike | None = None) -> Path | None:
    return locate(INVENTORY, path).path


def load_inventory(
    path: str | os.PathLike | None = None, *, ssh_config_path: str | os.PathLike | None = None
) -> Inventory:
    resolved = resolve_inventory_path(path)
    if resolved is None:
        return Inventory(hosts={"local": builtin_local()}, path=None)
    if not resolved.exists():
        raise InventoryError(f"{resolved}: inventory file not found")
    data = _read_yaml(resolved)
    return parse_inventory(data, resolved, Path(ssh_config_path).expanduser() if ssh_config_path else None)
