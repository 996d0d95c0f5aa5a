"""How to reach one host over SSH, described once.

An :class:`SSHEndpoint` is resolved by OpenSSH itself (``ssh -G``, orchestrator/sshconfig.py),
with the inventory's fields as overrides, and then produces both ways dflash-ops talks to a host:

- the control connection (:meth:`SSHEndpoint.connection`: a Fabric ``Connection`` with a
  ``gateway`` per jump hop, used by transport/ssh.py for commands, put and get), and
- the data path (:meth:`SSHEndpoint.argv`: an OpenSSH client argv, used by sync for checkpoint
  bytes; ``-F /dev/null`` plus every resolved value explicitly, so OpenSSH uses exactly what the
  control connection uses).

Both check host keys the same way: against the same known_hosts files, refusing an unknown key
unless the inventory says ``trust_host_key: true`` (then an unknown key is accepted and written
nowhere), and always refusing a *changed* key (OpenSSH: ``StrictHostKeyChecking=accept-new``
with ``/dev/null`` as the first known_hosts file, which is where a new key would be written).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .. import sshconfig
from .errors import HostKeyError, TransportError
from .runner import command_line

if TYPE_CHECKING:  # pragma: no cover
    from ..inventory import Host, Inventory

CONNECT_TIMEOUT = 10.0
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


def _files(paths) -> str:
    """A list value (files) for an ssh option, each quoted where needed."""
    return " ".join(sshconfig.quote_value(p) for p in paths)


@dataclass(frozen=True)
class SSHEndpoint:
    name: str                                 # the inventory's name (in messages)
    address: str                              # the resolved HostName
    port: int
    user: str | None
    identities: tuple[str, ...] = ()          # IdentityFile list, in order
    identities_only: bool = False             # False: the agent's keys are offered too
    known_hosts: tuple[str, ...] = ()         # user known_hosts files
    global_known_hosts: tuple[str, ...] = ()
    trust_unknown: bool = False               # inventory `trust_host_key: true`
    jump: "SSHEndpoint | None" = None         # reached through this host (ProxyJump)
    proxy_command: str | None = None          # or through this command (ProxyCommand)

    @property
    def where(self) -> str:
        return f"host {self.name} ({self.address}:{self.port})"

    @property
    def known_hosts_file(self) -> str:
        """Where a user would add this host's key."""
        return self.known_hosts[0] if self.known_hosts else os.path.expanduser(DEFAULT_KNOWN_HOSTS)

    # --- the data path: OpenSSH ------------------------------------------------------------

    def options(self, extra: tuple[str, ...] = (), on_host: bool = False) -> list[str]:
        """ssh options (without the destination). ``extra``: more ``Key=Value`` options, also
        given to jump hops. ``on_host``: for an ssh run *on another host* (``sync-ckpt
        --direct``), whose own key and known_hosts files are used (ours are paths here)."""
        opts = [] if on_host else ["-F", "/dev/null"]
        opts += ["-T", "-x", "-a", "-p", str(self.port), "-o", "BatchMode=yes", "-o", "ControlMaster=no",
                 "-o", "ControlPath=none"]
        if self.user:
            opts += ["-l", self.user]
        if not on_host:
            for key in self.identities:
                if os.path.exists(key):
                    opts += ["-o", f"IdentityFile={sshconfig.quote_value(key)}"]
            opts += ["-o", f"IdentitiesOnly={'yes' if self.identities_only else 'no'}",
                     "-o", f"GlobalKnownHostsFile={_files(self.global_known_hosts) or '/dev/null'}"]
        user_files = (DEFAULT_KNOWN_HOSTS, DEFAULT_KNOWN_HOSTS + "2") if on_host else self.known_hosts
        if self.trust_unknown:
            opts += ["-o", "StrictHostKeyChecking=accept-new",
                     "-o", f"UserKnownHostsFile={_files(('/dev/null', *user_files))}"]
        else:
            opts += ["-o", "StrictHostKeyChecking=yes"]
            if not on_host:
                opts += ["-o", f"UserKnownHostsFile={_files(user_files) or '/dev/null'}"]
        for option in extra:
            opts += ["-o", option]
        if self.jump is not None:
            # the hop's own ssh, with every '%' doubled so that only %h:%p are expanded here
            hop = [a.replace("%", "%%") for a in ["ssh", *self.jump.options(extra, on_host)]]
            opts += ["-o", "ProxyCommand=" + command_line([*hop, "-W", "%h:%p", "--", self.jump.address])]
        elif self.proxy_command:
            opts += ["-o", f"ProxyCommand={self.proxy_command}"]
        return opts

    def argv(self, remote: list[str], extra: tuple[str, ...] = (), on_host: bool = False) -> list[str]:
        """An OpenSSH client argv running ``remote`` (quoted by :func:`command_line`) here."""
        return ["ssh", *self.options(extra, on_host), "--", self.address, command_line(remote)]

    # --- the control connection: Fabric ----------------------------------------------------

    def connection(self, timeout: float = CONNECT_TIMEOUT, gateway=None):
        """An unopened Fabric ``Connection`` to this endpoint (``gateway``: the open Connection
        of :attr:`jump`). Fabric's defaults are replaced where they differ from OpenSSH's:
        its AutoAddPolicy by :class:`HostKeyPolicy` and these known_hosts files; its own
        ssh_config reading (a subset) and ~/.fabric.yml by nothing (everything came from
        ``ssh -G``); its integer ``connect_timeout`` by paramiko's float timeouts."""
        from fabric import Config, Connection
        from paramiko import SSHConfig

        kwargs = {"look_for_keys": False, "allow_agent": not self.identities_only, "timeout": timeout,
                  "banner_timeout": timeout, "auth_timeout": timeout, "channel_timeout": timeout}
        keys = [k for k in self.identities if os.path.exists(k)]
        if keys:
            kwargs["key_filename"] = keys
        if gateway is None:
            gateway = self.proxy_command or False
        conn = Connection(self.address, user=self.user, port=self.port, gateway=gateway,
                          config=Config(ssh_config=SSHConfig(), lazy=True), connect_kwargs=kwargs)
        client = conn.client
        for path in (*self.known_hosts, *self.global_known_hosts):
            if os.path.exists(path):
                try:
                    client.load_system_host_keys(path)  # read-only: never written back
                except Exception as e:
                    raise TransportError(f"{self.where}: cannot read known_hosts {path}: {e}") from None
        client.set_missing_host_key_policy(HostKeyPolicy(self))
        return conn


class HostKeyPolicy:
    """paramiko's policy for a key *not* in known_hosts: refuse, or (``trust_host_key``) accept
    for this connection only. A key that differs from known_hosts never gets here: paramiko
    raises BadHostKeyException first."""

    def __init__(self, endpoint: SSHEndpoint):
        self.endpoint = endpoint

    def missing_host_key(self, client, hostname, key) -> None:
        ep = self.endpoint
        if ep.trust_unknown:
            client.get_host_keys().add(hostname, key.get_name(), key)
            return
        port = f"-p {ep.port} " if ep.port != 22 else ""
        raise HostKeyError(
            f"{ep.where}: unknown host key ({key.get_name()} {key.fingerprint}) not in "
            f"{ep.known_hosts_file}; to trust it run `ssh-keyscan {port}{ep.address} >> {ep.known_hosts_file}` "
            f"(check the fingerprint first) or set `trust_host_key: true` for host {ep.name} in the inventory")


# --- resolution ------------------------------------------------------------------------------


def parse_jump_spec(spec: str, default_user: str | None, default_port: int | None = 22,
                    owner: str | None = None) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` (``[v6addr]:port`` too) -> (user, host, port); a bad hop (from
    ssh_config: the inventory refuses its own when it is loaded) is a :class:`TransportError`."""
    try:
        return sshconfig.parse_jump(spec, default_user, default_port)
    except ValueError as e:
        raise TransportError(f"{f'host {owner}: ' if owner else ''}jump host {spec!r}: {e}") from None


def _overrides(host: "Host", base: sshconfig.ResolvedConfig) -> dict[str, str]:
    """``-o`` overrides for the inventory's fields: those the inventory file set, and any other
    value that differs both from its default and from what ssh_config gives (a copied and
    changed Host). Values taken from ssh_config produce none."""
    out: dict[str, str] = {}

    def want(field: str, value, default, same: bool) -> bool:
        return value is not None and (field in host.ssh_set or (value != default and not same))

    if host.ssh_config and want("address", host.address, None, host.address == base.first("hostname")):
        out["HostName"] = host.address
    if want("port", host.port, 22, str(host.port) == base.first("port")):
        out["Port"] = str(host.port)
    if want("user", host.user, None, host.user == base.first("user")):
        out["User"] = host.user
    if host.identity:
        identity = sshconfig.expand(host.identity)
        if want("identity", identity, None, identity in map(sshconfig.expand, base.get("identityfile", []))):
            out["IdentityFile"] = sshconfig.quote_value(identity)
            out["IdentitiesOnly"] = "yes"
    return out


def endpoint_for(host: "Host", inventory: "Inventory | None" = None, _chain: tuple[str, ...] = ()) -> SSHEndpoint:
    """Resolve ``host`` (an inventory entry) to its endpoint, jump hops included. A ``jump`` is
    an inventory host name or ``[user@]addr[:port]``; several hops are comma-separated (as
    ProxyJump, which is also taken from ssh_config when the inventory names no jump). A hop
    that is not an inventory host inherits the host's identity, known_hosts and trust policy."""
    if host.is_local:
        raise TransportError(f"host {host.name} is the local machine, not an SSH host")
    if host.name in _chain:
        raise TransportError(f"jump hosts form a loop: {' → '.join((*_chain, host.name))}")
    destination = host.ssh_config or host.address
    if not destination:
        raise TransportError(f"host {host.name}: no address")
    try:
        base = sshconfig.resolve(destination, config_file=host.ssh_config_file)
        ov = _overrides(host, base)
        cfg = sshconfig.resolve(destination, ov, config_file=host.ssh_config_file) if ov else base
    except sshconfig.SSHConfigError as e:
        raise TransportError(f"host {host.name}: {e}") from None
    user_files = ((sshconfig.expand(host.known_hosts),) if host.known_hosts
                  else tuple(cfg.words("userknownhostsfile")))
    jump = None
    for hop in (host.jump or cfg.proxy("proxyjump") or "").split(","):
        if hop.strip():
            jump = _hop(hop.strip(), host, inventory, jump, (*_chain, host.name))
    return SSHEndpoint(
        name=host.name, address=cfg.first("hostname") or destination, port=int(cfg.first("port") or 22),
        user=cfg.first("user"), identities=tuple(sshconfig.expand(p) for p in cfg.get("identityfile", [])),
        identities_only=cfg.enabled("identitiesonly"), known_hosts=user_files,
        global_known_hosts=tuple(cfg.words("globalknownhostsfile")), trust_unknown=host.trust_host_key,
        jump=jump, proxy_command=None if jump else cfg.proxy("proxycommand"))


def _hop(spec: str, host: "Host", inventory: "Inventory | None", previous: SSHEndpoint | None,
         chain: tuple[str, ...]) -> SSHEndpoint:
    if inventory is not None and spec in inventory.hosts:
        jhost = inventory.get(spec)
        if jhost.is_local:
            raise TransportError(f"host {host.name}: jump host {spec!r} is not an SSH host")
        ep = endpoint_for(jhost, inventory, chain)
    else:
        user, addr, port = parse_jump_spec(spec, host.user, default_port=None, owner=host.name)
        inherited = {"identity", "known_hosts"} & host.ssh_set
        jhost = replace(host, name=spec, address=addr, port=port or 22, user=user, jump=None, ssh_config=None,
                        ssh_set=frozenset(inherited | ({"port"} if port else set())))
        ep = endpoint_for(jhost, inventory, chain)
    return replace(ep, jump=previous) if previous is not None else ep
