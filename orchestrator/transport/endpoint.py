"""How to reach one host over SSH, described once.

An :class:`SSHEndpoint` is resolved by OpenSSH itself (``ssh -G``, orchestrator/config/sshconfig.py),
with the inventory's fields as overrides, and then produces both ways dflash-ops talks to a host:

- the control connection (:meth:`SSHEndpoint.connection`: a Fabric ``Connection`` with a
  ``gateway`` per jump hop, used by transport/ssh.py for commands, put and get), and
- the data path (:meth:`SSHEndpoint.argv`: an OpenSSH client argv, used by sync for checkpoint
  bytes; ``-F /dev/null`` plus every resolved value explicitly, so OpenSSH uses exactly what the
  control connection uses).

Both check host keys against the same known_hosts files, refusing a changed or revoked key. An
unknown key is refused unless the inventory says ``trust_host_key: true``; then the control
connection accepts it for itself (written nowhere), and the data path is pinned to exactly the
key it accepted: OpenSSH runs with ``StrictHostKeyChecking=yes`` and a temporary known_hosts file
holding that key first (:meth:`SSHEndpoint.pinned_to`, written by :meth:`SSHRunner.pin_lines`),
so a host that shows the data path another key is refused.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..config import sshconfig
from .errors import HostKeyError, TransportError
from .hostkeys import KnownHosts, host_name
from .runner import command_line

if TYPE_CHECKING:  # pragma: no cover
    from ..config.inventory import Host, Inventory

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
    pinned: str | None = None                 # data path: known_hosts file of the accepted keys

    @property
    def where(self) -> str:
        return f"host {self.name} ({self.address}:{self.port})"

    @property
    def known_hosts_file(self) -> str:
        """Where a user would add this host's key."""
        return self.known_hosts[0] if self.known_hosts else os.path.expanduser(DEFAULT_KNOWN_HOSTS)

    # --- the data path: OpenSSH ------------------------------------------------------------

    def options(self, extra: tuple[str, ...] = (), on_host: bool = False, control: str | None = None,
                master: bool = False) -> list[str]:
        """ssh options (without the destination). ``extra``: more ``Key=Value`` options, also
        given to jump hops. ``on_host``: for an ssh run *on another host* (``sync-ckpt
        --direct``), whose own key and known_hosts files are used (ours are paths here).
        ``control``: the socket of a master connection (:class:`~orchestrator.transport.master.Master`)
        this client rides, or with ``master`` the one it opens; the options stay complete, so a
        client whose master is gone connects on its own, pinned all the same."""
        opts = [] if on_host else ["-F", "/dev/null"]
        opts += ["-T", "-x", "-a", "-p", str(self.port), "-o", "BatchMode=yes"]
        opts += control_options(control, master)
        if self.user:
            opts += ["-l", self.user]
        if not on_host:
            for key in self.identities:
                if os.path.exists(key):
                    opts += ["-o", f"IdentityFile={sshconfig.quote_value(key)}"]
            opts += ["-o", f"IdentitiesOnly={'yes' if self.identities_only else 'no'}",
                     "-o", f"GlobalKnownHostsFile={_files(self.global_known_hosts) or '/dev/null'}"]
        user_files = (DEFAULT_KNOWN_HOSTS, DEFAULT_KNOWN_HOSTS + "2") if on_host else self.known_hosts
        opts += ["-o", "StrictHostKeyChecking=yes"]          # never an unknown key, never a changed one
        if self.pinned or not on_host:
            files = ((self.pinned,) if self.pinned else ()) + tuple(user_files)
            opts += ["-o", f"UserKnownHostsFile={_files(files) or '/dev/null'}"]
        for option in extra:
            opts += ["-o", option]
        if self.jump is not None:
            # the hop's own ssh, with every '%' doubled so that only %h:%p are expanded here
            hop = [a.replace("%", "%%") for a in ["ssh", *self.jump.options(extra, on_host)]]
            opts += ["-o", "ProxyCommand=" + command_line([*hop, "-W", "%h:%p", "--", self.jump.address])]
        elif self.proxy_command:
            opts += ["-o", f"ProxyCommand={self.proxy_command}"]
        return opts

    def argv(self, remote: list[str], extra: tuple[str, ...] = (), on_host: bool = False,
             control: str | None = None) -> list[str]:
        """An OpenSSH client argv running ``remote`` (quoted by :func:`command_line`) here."""
        return ["ssh", *self.options(extra, on_host, control), "--", self.address, command_line(remote)]

    def master_argv(self, control: str, extra: tuple[str, ...] = ()) -> list[str]:
        """The OpenSSH master connection at socket ``control``; its own session runs ``cat`` on the
        host, fed by the master's stdin (transport/master.py: how long the master lives)."""
        return ["ssh", *self.options(extra, control=control, master=True), "--", self.address, "cat"]

    # --- the control connection: Fabric ----------------------------------------------------

    def connection(self, timeout: float = CONNECT_TIMEOUT, gateway=None):
        """An unopened Fabric ``Connection`` to this endpoint (``gateway``: the open Connection
        of :attr:`jump`). Fabric's defaults are replaced where they differ from OpenSSH's:
        its AutoAddPolicy by :class:`HostKeyPolicy` over these known_hosts files (read as
        OpenSSH reads them, transport/hostkeys.py: paramiko itself is given none, and is offered
        only the key types they list for the host, as OpenSSH prefers them); its own ssh_config
        reading (a subset) and ~/.fabric.yml by nothing (everything came from ``ssh -G``); its
        integer ``connect_timeout`` by paramiko's float timeouts."""
        from fabric import Config, Connection
        from paramiko import SSHConfig

        kwargs = {"look_for_keys": False, "allow_agent": not self.identities_only, "timeout": timeout,
                  "banner_timeout": timeout, "auth_timeout": timeout, "channel_timeout": timeout}
        keys = [k for k in self.identities if os.path.exists(k)]
        if keys:
            kwargs["key_filename"] = keys
        known = KnownHosts.load((*self.known_hosts, *self.global_known_hosts))
        listed = known.key_types(self.known_hosts_name)
        if listed:
            kwargs["disabled_algorithms"] = {"keys": _other_key_types(listed)}
        if gateway is None:
            gateway = self.proxy_command or False
        conn = Connection(self.address, user=self.user, port=self.port, gateway=gateway,
                          config=Config(ssh_config=SSHConfig(), lazy=True), connect_kwargs=kwargs)
        conn.client.set_missing_host_key_policy(HostKeyPolicy(self, known))
        return conn

    @property
    def known_hosts_name(self) -> str:
        """This host's name in known_hosts."""
        return host_name(self.address, self.port)

    def pinned_to(self, path: str) -> "SSHEndpoint":
        """This endpoint (and its jump hops) with ``path`` as the first known_hosts file of the
        data path: a known_hosts file holding the keys the control connections accepted."""
        return replace(self, pinned=path, jump=self.jump.pinned_to(path) if self.jump else None)


def control_options(control: str | None, master: bool = False) -> list[str]:
    """OpenSSH options for a client that opens (``master``) or rides the master connection at
    socket ``control`` (every ``%`` doubled: ssh expands tokens in ControlPath), or uses none."""
    if control is None:
        return ["-o", "ControlMaster=no", "-o", "ControlPath=none"]
    path = control.replace("%", "%%")
    if master:
        return ["-o", "ControlMaster=yes", "-o", "ControlPersist=no", "-o", f"ControlPath={path}"]
    return ["-o", "ControlMaster=no", "-o", f"ControlPath={path}"]


def tunnel_client_argv(*, user: str, alias: str, port: int, identity: str, known_hosts: str, control: str,
                       proxy: list[str], remote: list[str] | None, extra: tuple[str, ...] = ()) -> list[str]:
    """The OpenSSH client the eval host runs for ``sync-ckpt --tunnel``: to the training host as
    ``alias`` through ``proxy`` (a command that connects to the tunnel's socket and passes the
    connection to ssh: ProxyUseFdpass), with exactly one key (the one-time ``identity``; no
    agent, no other keys, no config files of that host) and exactly one known host key
    (``known_hosts``: the training host's, as its control connection accepted it, under
    ``alias``). ``remote`` None: the master connection at ``control`` (no session of its own; it
    lives as long as the ``serve`` process that started it); else a client riding it."""
    opts = ["-F", "/dev/null", "-T", "-x", "-a", "-p", str(port), "-l", user, "-o", "BatchMode=yes",
            "-o", f"IdentityFile={sshconfig.quote_value(identity)}", "-o", "IdentitiesOnly=yes",
            "-o", "IdentityAgent=none", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={sshconfig.quote_value(known_hosts)}",
            "-o", "GlobalKnownHostsFile=/dev/null", "-o", f"HostKeyAlias={alias}", "-o", "CheckHostIP=no",
            "-o", "UpdateHostKeys=no", "-o", "ProxyCommand=" + command_line(proxy).replace("%", "%%"),
            "-o", "ProxyUseFdpass=yes"]
    opts += control_options(control, master=remote is None)
    for option in extra:
        opts += ["-o", option]
    if remote is None:
        return ["ssh", *opts, "-N", "--", alias]
    return ["ssh", *opts, "--", alias, command_line(remote)]


def _other_key_types(listed: set[str]) -> list[str]:
    """paramiko's host key algorithms that are none of ``listed`` (``ssh-rsa`` covers rsa-sha2-*)."""
    from paramiko import Transport

    def base(alg: str) -> str:
        alg = alg.replace("-cert-v01@openssh.com", "")
        return "ssh-rsa" if alg.startswith("rsa-sha2-") else alg
    return [alg for alg in Transport._preferred_keys if base(alg) not in listed]


class HostKeyPolicy:
    """Every host key the control connection meets is judged here (paramiko holds no known_hosts
    of its own): a revoked key and a key that differs from known_hosts are refused; an unknown
    key is refused, or accepted for this connection only with ``trust_host_key``. The key
    accepted is kept (:attr:`accepted`) so that the data path can be pinned to it."""

    def __init__(self, endpoint: SSHEndpoint, known: KnownHosts):
        self.endpoint, self.known = endpoint, known
        self.accepted = None

    def missing_host_key(self, client, hostname, key) -> None:
        ep = self.endpoint
        verdict = self.known.verdict(hostname, key.get_name(), key.asbytes())
        kh = ep.known_hosts_file
        if verdict == "revoked":
            raise HostKeyError(f"{ep.where}: the server offered {key.get_name()} {key.fingerprint}, a key marked "
                               f"@revoked in known_hosts; refusing it")
        if verdict == "changed":
            name = ep.address if ep.port == 22 else f"[{ep.address}]:{ep.port}"
            raise HostKeyError(
                f"{ep.where}: HOST KEY MISMATCH: the server offered {key.get_name()} {key.fingerprint} but {kh} "
                f"has a different key; this may be an attack. If the host was reinstalled, remove its old line "
                f"(`ssh-keygen -R {shlex.quote(name)} -f {shlex.quote(str(kh))}`) and re-add it")
        if verdict == "unknown" and not ep.trust_unknown:
            port = f"-p {ep.port} " if ep.port != 22 else ""
            ca = (" (known_hosts names a @cert-authority for it, but the control connection cannot check host "
                  "certificates)") if self.known.has_cert_authority(hostname) else ""
            raise HostKeyError(
                f"{ep.where}: unknown host key ({key.get_name()} {key.fingerprint}) not in {kh}{ca}; to trust it run "
                f"`ssh-keyscan {port}{ep.address} >> {kh}` (check the fingerprint first) or set "
                f"`trust_host_key: true` for host {ep.name} in the inventory")
        self.accepted = key


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
    host.refuse_example()
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
