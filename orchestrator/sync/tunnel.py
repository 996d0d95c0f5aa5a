"""``sync-ckpt --tunnel``: the eval host pulls the checkpoint from the training host through a
tunnel this machine forwards, so every byte is encrypted once end to end (training host to eval
host) and this machine only forwards the encrypted stream (inside its own connection to the eval
host), where the relay decrypts and re-encrypts both legs here.

How, in order (each step undone in reverse, on success, failure or Ctrl-C):

1. the eval host's session (``serve``, tool.py) makes a private folder with a one-time key pair
   (``TUNNEL``: the private key never leaves that host); no OpenSSH client there: one line;
2. the training host's session adds the public key to its authorized_keys (``GRANT``), restricted:
   ``restrict`` (no forwarding, no pty), ``from`` this machine's address as that host sees it,
   an ``expiry-time`` minutes away, and a forced command that only sends files of this checkpoint
   folder, the tool's code pinned by its sha256 (tool.py ``forced_sender``);
3. this machine's master connection to the eval host forwards a Unix socket in that folder to the
   training host's sshd (``ssh -O forward -R``); the eval host's sshd may refuse: one line;
4. the eval host opens an OpenSSH master connection to the training host through that socket
   (``PULL``), pinned to the host key the training host's control connection accepted (the only
   line of a known_hosts file in that folder, under an alias), logging in with the one-time key
   and nothing else (transport/endpoint.py ``tunnel_client_argv``); the training host may refuse
   the key: one line. Once it is in, the key is deleted there and its line removed here
   (``REVOKE``): the credential existed for those seconds only;
5. each file's receiver starts its sender over that connection (``recv --pull``).

A ``serve`` session undoes its part when it ends however it ends (its connection dropping, this
process killed), and sshd itself refuses the key after its expiry time: nothing is left behind.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from ..transport import SSHRunner, authorized_keys_command
from ..transport.endpoint import tunnel_client_argv
from .plan import FilePlan, SyncPlan
from .relay import ALIVE_COUNT, ALIVE_INTERVAL, AES_FIRST, MACS
from .tool import Session, SessionError, SyncError, fdpass_argv, forced_sender, sender_request

ALIAS = "dflash-ops-training-host"  # the training host's name in the eval host's temporary known_hosts
DEFAULT_AUTHORIZED_KEYS = "~/.ssh/authorized_keys"
CONNECT_WAIT = 30.0


class TunnelUnavailable(SyncError):
    """``--tunnel`` cannot be set up between these hosts (one line why); with ``--tunnel-auto`` the
    sync moves the bytes through this machine instead."""


def _inner_options(alive: tuple[int, int]) -> tuple[str, ...]:
    """The eval host's connection to the training host: both ends are hosts, so AES-GCM first
    (servers have AES instructions; OpenSSH's own default puts ChaCha20 first)."""
    return (f"ConnectTimeout={int(CONNECT_WAIT)}", f"ServerAliveInterval={alive[0]}",
            f"ServerAliveCountMax={alive[1]}", "Compression=no", f"Ciphers={AES_FIRST}", f"MACs={MACS}")


@contextmanager
def pull_through_tunnel(srun, ssess: Session, dsess: Session, dmaster, plan: SyncPlan, token: str,
           alive: tuple[int, int] = (ALIVE_INTERVAL, ALIVE_COUNT)
           ) -> Iterator[tuple[Callable[[FilePlan, int], list[str]], Callable[[str], list[str]]]]:
    """Set up the tunnel for ``plan`` (module docstring) and yield the commands the eval host runs
    to start the sender of a file (file, offset -> argv) and of a batch (SPEC -> argv); a
    :class:`TunnelUnavailable` when it cannot be set up, with nothing left behind."""
    src, dst = plan.src, plan.dst
    if not isinstance(srun, SSHRunner) or dmaster is None:
        raise TunnelUnavailable(f"--tunnel needs SSH hosts on both ends ({src.name} → {dst.name})")
    ep = srun.endpoint
    if ep.jump is not None or ep.proxy_command:
        raise TunnelUnavailable(f"--tunnel: {ep.where} is reached through a jump host or ProxyCommand; the tunnel "
                                f"forwards to its address directly")
    key = srun.host_key
    try:
        end = dsess.call_json("TUNNEL", {"token": token}, timeout=60)
    except SessionError as e:
        raise TunnelUnavailable(f"--tunnel: host {dst.name} cannot pull: "
                                f"{e.reason.removeprefix('NOSSH ') or e}") from None
    try:  # a failure on the way may be a host's session gone (killed): then that is the cause (_undo)
        try:
            command = authorized_keys_command(forced_sender(src, plan.src_dir))
        except ValueError as e:
            raise TunnelUnavailable(f"--tunnel: {plan.src_dir}: {e}") from None
        try:
            granted = ssess.call_json("GRANT", {"file": src.authorized_keys or DEFAULT_AUTHORIZED_KEYS,
                                                "key": end["key"], "command": command, "token": token}, timeout=60)
        except SessionError as e:
            raise TunnelUnavailable(f"--tunnel: host {src.name} did not take the one-time key: {e.reason}") from None
        try:
            try:
                dmaster.forward(f"{end['socket']}:{ep.address}:{ep.port}")
            except Exception as e:  # noqa: BLE001 - TransportError or a timeout: one line either way
                raise TunnelUnavailable(f"--tunnel: {e}") from None

            def client(remote: list[str] | None) -> list[str]:
                return tunnel_client_argv(user=granted["user"], alias=ALIAS, port=ep.port,
                                          identity=end["identity"], known_hosts=end["known_hosts"],
                                          control=end["control"], proxy=fdpass_argv(dst, end["socket"]),
                                          remote=remote, extra=_inner_options(alive))
            try:
                dsess.call("PULL", {"argv": client(None), "known_hosts": f"{ALIAS} {key.get_name()} {key.get_base64()}",
                                    "timeout": CONNECT_WAIT}, timeout=CONNECT_WAIT + 30)
            except SessionError as e:
                why = e.reason.removeprefix("PULLFAIL ").rstrip(".")
                if "host key verification failed" in why.lower():
                    raise SyncError(f"--tunnel: host {dst.name} reached a training host with another host key than "
                                    f"{ep.where} showed this machine: host key verification failed") from None
                raise TunnelUnavailable(f"--tunnel: host {src.name} refused the eval host's login through the "
                                        f"tunnel: {why}") from None
        except SyncError:
            _undo(ssess, "REVOKE", cause=True)
            raise
        except BaseException:
            _undo(ssess, "REVOKE", cause=False)
            raise
        _undo(ssess, "REVOKE", cause=True)  # logged in: the key has done its work
        yield (lambda f, offset: client(sender_request(f.path, f.size, f.mtime_ns, offset,
                                                       *(["--hash"] if f.sha256 is None else []))),
               lambda spec: client(sender_request(spec, verb="send-batch")))
    except SyncError:
        _undo(dsess, "UNTUNNEL", cause=True)
        raise
    except BaseException:
        _undo(dsess, "UNTUNNEL", cause=False)
        raise
    else:
        _undo(dsess, "UNTUNNEL", cause=False)


def _undo(session: Session, verb: str, cause: bool) -> None:
    """Have ``session`` undo its part of the tunnel (``verb``). A session that is gone undid it as
    it ended (its guardian on the host, if its process was killed); with ``cause`` its end is
    raised, as what failed the sync (a host refusing the login, or a forward failing, because a
    session was killed, is only the consequence)."""
    try:
        session.call(verb, timeout=60)
    except SessionError:
        pass  # the session answered: it is there, and undid what it could
    except SyncError:
        if cause:
            raise
