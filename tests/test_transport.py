"""The runner interface, against a local subprocess and a real sshd (lab host `train`)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.config.inventory import load_inventory
from orchestrator.transport import (
    CommandFailed, CommandTimeout, HostKeyError, LocalRunner, SSHRunner, TransportError,
    command_line, runner_for,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def lab_hosts(ssh_lab, tmp_path_factory):
    path = ssh_lab.write_inventory(tmp_path_factory.mktemp("inv") / "inventory.yaml")
    return load_inventory(path)


@pytest.fixture(scope="module")
def ssh_runner(lab_hosts):
    with runner_for(lab_hosts.get("train")) as r:
        yield r


@pytest.fixture(params=["local", "ssh"])
def runner_and_dir(request, tmp_path, ssh_lab):
    """(runner, a scratch directory that runner's host sees)."""
    if request.param == "local":
        yield LocalRunner(), tmp_path
    else:
        d = ssh_lab.train.root / "scratch" / tmp_path.name
        d.mkdir(parents=True, exist_ok=True)
        yield request.getfixturevalue("ssh_runner"), d


def test_run_stdout_stderr_returncode(runner_and_dir):
    r, _ = runner_and_dir
    res = r.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (res.returncode, res.stdout, res.stderr, res.ok) == (3, "out\n", "err\n", False)
    assert r.run(["true"]).ok
    with pytest.raises(CommandFailed, match="exited 3"):
        r.run([sys.executable, "-c", "import sys; sys.exit(3)"], check=True)


def test_input_env_cwd(runner_and_dir):
    r, d = runner_and_dir
    assert r.run(["cat"], input="piped\n").stdout == "piped\n"
    res = r.run([sys.executable, "-c", "import os; print(os.getcwd()); print(os.environ['DFL_X'])"],
                env={"DFL_X": "a b;$HOME"}, cwd=str(d))
    assert res.stdout.split("\n")[:2] == [str(d), "a b;$HOME"]


def test_run_script_is_fed_not_interpolated(runner_and_dir):
    r, d = runner_and_dir
    res = r.run_script('set -e\nx="$(echo hi)"\necho "$x" > out.txt\ncat out.txt\n', cwd=str(d))
    assert res.ok and res.stdout == "hi\n"


def test_timeout_kills_the_command(runner_and_dir):
    r, d = runner_and_dir
    pidfile = d / "sleeper.pid"
    script = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    t = time.monotonic()
    with pytest.raises(CommandTimeout, match="timed out after 1s"):
        r.run([sys.executable, "-c", script], timeout=1)
    assert time.monotonic() - t < 10
    pid = int(pidfile.read_text())  # the lab shares the pid namespace: we can see remote pids
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the timed-out command is still running"


def test_files_roundtrip(runner_and_dir, tmp_path):
    r, d = runner_and_dir
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    r.put_file(src, str(d / "sub" / "dst.bin"))
    assert (d / "sub" / "dst.bin").read_bytes() == src.read_bytes()
    r.get_file(str(d / "sub" / "dst.bin"), tmp_path / "back" / "x.bin")
    assert (tmp_path / "back" / "x.bin").read_bytes() == src.read_bytes()
    r.put_text("héllo\n", str(d / "deep" / "t.txt"))
    assert r.read_text(str(d / "deep" / "t.txt")) == "héllo\n"
    with pytest.raises(TransportError, match="no such file"):
        r.read_text(str(d / "missing.txt"))


def test_hostile_name_is_passed_literally(runner_and_dir):
    r, d = runner_and_dir
    name = "a b'c\";touch PWNED"
    res = r.run(["touch", name], cwd=str(d))
    assert res.ok, res.stderr
    assert (d / name).is_file()
    r.put_text("x", str(d / (name + "2")))
    assert (d / (name + "2")).read_text() == "x"
    assert r.run(["ls", "-1", str(d)]).stdout.count("\n") == 2
    assert not (d / "PWNED").exists()
    assert not (Path.home() / "PWNED").exists()


def test_big_stdout_and_stderr_do_not_deadlock_and_arrive_whole(runner_and_dir):
    """Neither stream blocks the other, and all of both arrive: over SSH the exit status can come
    before the last of the output (a reader that stops at the exit status loses the last 64 KiB about
    once in 25 runs), so the command runs a dozen times."""
    r, _ = runner_and_dir
    n = 4 * 1024 * 1024
    for _ in range(12):
        res = r.run([sys.executable, "-c",
                     f"import sys; sys.stderr.write('e' * {n}); sys.stdout.write('o' * {n})"], timeout=60)
        assert res.ok and len(res.stdout) == n and len(res.stderr) == n


def test_open_exec_streams(runner_and_dir):
    r, _ = runner_and_dir
    payload = os.urandom(1 << 20)
    with r.open_exec([sys.executable, "-c",
                      "import sys, hashlib; d = sys.stdin.buffer.read(); "
                      "sys.stdout.write(hashlib.sha256(d).hexdigest())"]) as h:
        h.stdin.write(payload)
        h.stdin.close()
        out = h.stdout.read().decode()
        assert h.wait(30) == 0
    import hashlib
    assert out == hashlib.sha256(payload).hexdigest()


def test_command_line_is_the_one_quoting_place():
    assert command_line(["echo", "a b", "$x;y"]) == "echo 'a b' '$x;y'"
    assert command_line(["ls"], cwd="/t m p") == "cd -- '/t m p' && exec ls"
    with pytest.raises(TypeError):
        command_line("echo hi")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        command_line(["true"], env={"A;B": "1"})
    with pytest.raises(TypeError):
        LocalRunner().run("echo hi")  # type: ignore[arg-type]


def test_runner_for_local(lab_hosts):
    from orchestrator.transport import parse_jump_spec
    assert parse_jump_spec("ops@[::1]:2200", None) == ("ops", "::1", 2200)
    assert parse_jump_spec("bastion", "root") == ("root", "bastion", 22)
    assert isinstance(runner_for(lab_hosts.get("local")), LocalRunner)
    assert isinstance(runner_for(lab_hosts.get("eval")), SSHRunner)


# --- SSH specifics ------------------------------------------------------------------------


def test_unknown_host_key_is_refused_with_how_to_trust(lab_hosts, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    host = replace(lab_hosts.get("eval"), known_hosts=str(empty))
    with pytest.raises(HostKeyError) as e:
        SSHRunner(host).connect()
    msg = str(e.value)
    assert f"ssh-keyscan -p {host.port} {host.address} >> {empty}" in msg
    assert "trust_host_key: true" in msg and "host eval" in msg
    assert empty.read_text() == ""


def test_trust_host_key_accepts_without_writing(lab_hosts, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    host = replace(lab_hosts.get("train"), known_hosts=str(empty), trust_host_key=True)
    with SSHRunner(host) as r:
        assert r.run(["echo", "ok"]).stdout == "ok\n"
    assert empty.read_text() == ""


def test_changed_host_key_is_refused(ssh_lab, lab_hosts, tmp_path):
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{ssh_lab.eval.known_hosts_name} {ssh_lab.train.host_key_pub}\n")
    host = replace(lab_hosts.get("eval"), known_hosts=str(wrong), trust_host_key=True)
    with pytest.raises(HostKeyError, match="HOST KEY MISMATCH"):
        SSHRunner(host).connect()


def _closed_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def test_closed_port_is_a_clear_error_in_bounded_time(lab_hosts):
    host = replace(lab_hosts.get("train"), name="ct129", port=_closed_port("127.0.0.1"), address="127.0.0.1")
    t = time.monotonic()
    with pytest.raises(TransportError) as e:
        SSHRunner(host).connect()
    assert time.monotonic() - t < 15
    assert str(e.value).startswith(f"host ct129 (127.0.0.1:{host.port}): connection refused")


def test_silent_server_times_out_in_bounded_time(lab_hosts):
    with socket.socket() as srv:  # accepts TCP, never speaks SSH
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        host = replace(lab_hosts.get("train"), name="ct129", address="127.0.0.1", port=srv.getsockname()[1])
        t = time.monotonic()
        with pytest.raises(TransportError, match=r"^host ct129 \(127\.0\.0\.1:\d+\): .*timed out .*after 2s"):
            SSHRunner(host, connect_timeout=2).connect()
        assert time.monotonic() - t < 15


def test_address_without_host_is_a_clear_error(ssh_lab, lab_hosts):
    if not ssh_lab.isolated:
        pytest.skip(f"needs network namespaces ({ssh_lab.fallback_reason})")
    empty_addr = ssh_lab.train.address.rsplit(".", 1)[0] + ".99"  # in the lab subnet, nobody there
    host = replace(lab_hosts.get("train"), address=empty_addr)
    t = time.monotonic()
    with pytest.raises(TransportError, match=rf"host train \({empty_addr}:22\): (no route to host|connection timed out)"):
        SSHRunner(host, connect_timeout=5).connect()
    assert time.monotonic() - t < 15


def test_jump_host(ssh_lab, lab_hosts):
    train = lab_hosts.get("train")
    via = replace(train, name="train-via-jump", jump="train")
    with runner_for(via, lab_hosts) as r:
        assert r.jump is not None and r.run(["echo", "through"]).stdout == "through\n"
    if ssh_lab.isolated:  # train cannot reach eval, so eval via train fails clearly
        ev = replace(lab_hosts.get("eval"), jump="train")
        with pytest.raises(TransportError, match="jump host train could not open a connection"):
            runner_for(ev, lab_hosts).connect()


# --- one endpoint, two paths: the Fabric control connection and the OpenSSH data path ----------


def _data_path(host, inventory=None, endpoint=None):
    from orchestrator.transport import endpoint_for

    ep = endpoint or endpoint_for(host, inventory)
    argv = ep.argv(["echo", "data-ok"], ("ConnectTimeout=10",))
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def _control_path(host, inventory=None, pin=None):
    """The control connection's answer, and (with ``pin``: a file to write) its endpoint pinned
    to the keys it accepted, as sync builds the data path."""
    try:
        with runner_for(host, inventory) as r:
            answer = r.run(["echo", "control-ok"]).stdout.strip()
            if pin is None:
                return answer, None
            pin.write_text(r.pin_lines())
            return answer, r.endpoint.pinned_to(str(pin))
    except HostKeyError as e:
        return f"HostKeyError: {e}", None


@pytest.mark.parametrize("case", ["unknown", "unknown-trusted", "changed-trusted", "known"])
def test_both_paths_check_host_keys_the_same_way(ssh_lab, lab_hosts, tmp_path, case):
    kh = tmp_path / "known_hosts"
    ev = ssh_lab.eval
    kh.write_text({"unknown": "", "unknown-trusted": "",
                   "changed-trusted": f"{ev.known_hosts_name} {ssh_lab.train.host_key_pub}\n",
                   "known": f"{ev.known_hosts_name} {ev.host_key_pub}\n"}[case])
    before = kh.read_text()
    host = replace(lab_hosts.get("eval"), known_hosts=str(kh), trust_host_key=case.endswith("trusted"))
    control, pinned = _control_path(host, pin=tmp_path / "pinned")
    data = _data_path(host, endpoint=pinned)
    if case in ("unknown-trusted", "known"):
        assert (data.returncode, data.stdout.strip(), control) == (0, "data-ok", "control-ok"), data.stderr
    else:
        assert data.returncode == 255 and "Host key verification failed" in data.stderr
        assert control.startswith("HostKeyError") and ("MISMATCH" in control) == (case == "changed-trusted")
    assert kh.read_text() == before          # nothing is ever written to known_hosts
    if case == "unknown-trusted":            # the data path takes the key the control connection took, no other
        assert "StrictHostKeyChecking=yes" in pinned.argv(["true"]) and _data_path(host).returncode == 255
        (tmp_path / "pinned").write_text(f"{ev.known_hosts_name} {ssh_lab.train.host_key_pub}\n")
        other = _data_path(host, endpoint=pinned)
        assert other.returncode == 255 and "Host key verification failed" in other.stderr, other.stderr


def test_jump_chain_serves_both_paths(ssh_lab, lab_hosts):
    via = replace(lab_hosts.get("train"), name="train-via-jump", jump="train")
    inv = type(lab_hosts)(hosts={**lab_hosts.hosts, via.name: via}, path=lab_hosts.path)
    from orchestrator.transport import endpoint_for

    ep = endpoint_for(via, inv)
    assert ep.jump is not None and ep.jump.name == "train" and ep.jump.known_hosts == ep.known_hosts
    assert _control_path(via, inv)[0] == "control-ok"
    res = _data_path(via, inv)
    assert res.returncode == 0 and res.stdout.strip() == "data-ok", res.stderr
    assert "ProxyCommand=ssh -F /dev/null" in " ".join(endpoint_for(via, inv).argv(["true"]))


def test_ssh_config_is_resolved_by_openssh(tmp_path):
    """Include and Match (which a hand-written parser would get wrong) come from `ssh -G`."""
    from orchestrator.config.inventory import parse_inventory
    from orchestrator.transport import endpoint_for

    inc = tmp_path / "included.conf"
    inc.write_text("Host box\n    HostName 192.0.2.9\n    ProxyJump hopper:2022\n")
    cfg = tmp_path / "config"
    cfg.write_text(f"Include {inc}\nMatch host 192.0.2.9\n    Port 2299\n    User matched\n"
                   "Host hopper\n    HostName 192.0.2.10\n")
    inv = parse_inventory({"hosts": {"box": {"ssh_config": "box", "known_hosts": str(tmp_path / "kh")}}},
                          tmp_path / "inv.yaml", ssh_config_path=cfg)
    ep = endpoint_for(inv.get("box"), inv)
    assert (ep.address, ep.port, ep.user) == ("192.0.2.9", 2299, "matched")
    assert ep.jump is not None and (ep.jump.address, ep.jump.port) == ("192.0.2.10", 2022)
    assert ep.known_hosts == (str(tmp_path / "kh"),) == ep.jump.known_hosts   # the hop inherits it


def test_a_relative_path_is_read_from_where_the_user_typed_it_or_the_login_home(ssh_runner, tmp_path, monkeypatch):
    """`--drafter mine/step2` (and export's folders): on `local` from the folder the command runs
    in, on an SSH host from the login home, never from the worker's code folder."""
    monkeypatch.chdir(tmp_path)
    assert LocalRunner().absolute("mine/step2") == str(tmp_path / "mine" / "step2")
    assert LocalRunner().absolute("/abs/x") == "/abs/x"
    home = ssh_runner.home().rstrip("/")
    assert ssh_runner.absolute("mine/step2") == f"{home}/mine/step2"
    assert ssh_runner.absolute("~/mine") == f"{home}/mine" and ssh_runner.absolute("/abs/x") == "/abs/x"


def test_files_fetched_from_many_threads_over_one_connection_all_arrive(runner_and_dir, tmp_path):
    """The shards of a run on one host are fetched side by side over its one connection: SFTP
    transfers from several threads at once hung there (paramiko's SFTP client is one per
    connection); each arrives whole, in bounded time."""
    import threading

    runner, d = runner_and_dir
    for i in range(4):
        runner.put_text(f"file {i}\n" * 20000, f"{d}/f{i}.txt")
    errors, done = [], []

    def fetch(i):
        try:
            for round_ in range(15):
                runner.get_file(f"{d}/f{i}.txt", tmp_path / f"{i}-{round_}.txt")
                runner.get_tail(f"{d}/f{i}.txt", tmp_path / f"{i}-{round_}.tail", 1000)
            done.append(i)
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)
    threads = [threading.Thread(target=fetch, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sorted(done) == [0, 1, 2, 3], (errors, done)
    assert all((tmp_path / f"{i}-14.txt").read_text() == f"file {i}\n" * 20000 for i in range(4))
