"""One way to touch a host: a runner (local subprocess or SSH) behind one interface, and the
SSH endpoint both the control connection and the OpenSSH data path are built from.

- runner.py: the Runner interface and :func:`command_line`, the one place argv becomes shell text
- local.py: the built-in ``local`` host
- endpoint.py: :class:`SSHEndpoint`, resolved by ``ssh -G``; Fabric connection and OpenSSH argv
- master.py: :class:`~.master.Master`, an OpenSSH master connection the data path rides
- ssh.py: :class:`SSHRunner`, commands and files over the control connection
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .endpoint import CONNECT_TIMEOUT, SSHEndpoint, endpoint_for, parse_jump_spec
from .errors import CommandFailed, CommandTimeout, HostKeyError, TransportError
from .local import LocalRunner
from .runner import ExecHandle, Result, Runner, authorized_keys_command, command_line
from .ssh import CONNECT_RETRIES, SSHRunner

if TYPE_CHECKING:  # pragma: no cover
    from ..config.inventory import Host, Inventory

__all__ = ["CONNECT_TIMEOUT", "CONNECT_RETRIES", "CommandFailed", "CommandTimeout", "ExecHandle", "HostKeyError",
           "LocalRunner", "Result", "Runner", "SSHEndpoint", "SSHRunner", "TransportError", "authorized_keys_command",
           "command_line", "endpoint_for", "parse_jump_spec", "runner_for"]


def runner_for(host: "Host", inventory: "Inventory | None" = None, *,
               connect_timeout: float = CONNECT_TIMEOUT, retries: int = CONNECT_RETRIES) -> Runner:
    """The runner for a host (its jump hosts are looked up in ``inventory``)."""
    if host.is_local:
        return LocalRunner(host.name)
    if host.is_ray:
        raise TransportError(f"host {host.name} is a Ray cluster (kind: ray): it runs eval shards only, it has no "
                             f"SSH commands or files")
    if host.is_slurm:                   # its commands and files: those of its login host
        if inventory is None:
            raise TransportError(f"host {host.name} is a Slurm cluster: its login host needs the inventory")
        return runner_for(inventory.get(host.slurm.login), inventory, connect_timeout=connect_timeout, retries=retries)
    return SSHRunner(endpoint_for(host, inventory), connect_timeout=connect_timeout, retries=retries)
