"""`dflash-ops hosts` and `hosts check` against the built-in local host and the SSH lab."""
from __future__ import annotations

import platform
import socket
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from clirun import invoke

pytestmark = pytest.mark.timeout(180)
TORCH = metadata.version("torch")

# A stand-in for SGLang's /health and /get_model_info, run on the eval host itself.
FAKE_SGLANG = """\
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = {"/health": b"", "/get_model_info": json.dumps({"model_path": "Qwen/Qwen3-8B"}).encode()}
        if self.path not in body:
            self.send_error(404); return
        self.send_response(200); self.end_headers(); self.wfile.write(body[self.path])
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("ready", flush=True)
s.serve_forever()
"""


def test_hosts_lists(lab_inventory, ssh_lab):
    res = invoke("--inventory", str(lab_inventory), "hosts")
    assert res.exit_code == 0, res.output
    for name in ("local", "train", "eval"):
        assert name in res.output
    assert f"root@{ssh_lab.eval.address}:{ssh_lab.eval.port}" in res.output
    assert "(local subprocess)" in res.output


def test_hosts_check_local():
    res = invoke("hosts", "check", "local")
    assert res.exit_code == 0, res.output
    assert platform.python_version() in res.output and TORCH in res.output


def test_the_probe_answers_a_cpu_build_of_torch_as_its_import_would():
    from remote.host.probe import torch_cuda

    assert torch_cuda(60, TORCH) == torch_cuda(60)      # this machine's torch, with and without the import
    assert torch_cuda(1e-6, "2.13.0+cpu") == {"available": False, "cuda": None, "device_count": 0}   # no import
    assert "timed out" in torch_cuda(1e-6, "2.13.0")["error"]                                        # the import


@pytest.fixture
def fake_sglang(ssh_lab):
    """An HTTP server bound to 127.0.0.1 *inside the eval host* (unreachable from here when isolated)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefix = ["ip", "netns", "exec", ssh_lab.eval.netns] if ssh_lab.eval.netns else []
    proc = subprocess.Popen([*prefix, sys.executable, "-c", FAKE_SGLANG, str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_hosts_check_all_lab_hosts(ssh_lab, tmp_path, fake_sglang):
    inv = ssh_lab.write_inventory(tmp_path / "inv.yaml", eval={"sglang": fake_sglang})
    t = time.monotonic()
    res = invoke("--inventory", str(inv), "hosts", "check", env={"COLUMNS": "200"})   # a table, whatever the values' widths
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): line for line in res.output.splitlines() if line.count("│") > 5}
    assert set(rows) >= {"local", "train", "eval"}
    for name in ("local", "train", "eval"):
        assert "passed" in rows[name] and platform.python_version() in rows[name] and TORCH in rows[name]
    assert "healthy" in rows["eval"] and "Qwen/Qwen3-8B" in rows["eval"]
    assert time.monotonic() - t < 60


def test_failing_hosts_make_check_fail(ssh_lab, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    inv = ssh_lab.write_inventory(
        tmp_path / "inv.yaml", train={"python": "/nonexistent/bin/python"},
        extra={"gone": {"address": "127.0.0.1", "port": closed, "user": "root",
                        "identity": str(ssh_lab.client_key), "known_hosts": str(ssh_lab.known_hosts)}})
    res = invoke("--inventory", str(inv), "hosts", "check", "train", "gone")
    assert res.exit_code == 1, res.output
    assert "python not found or not executable: /nonexistent/bin/python" in res.output
    assert f"gone (127.0.0.1:{closed}): connection refused" in res.output
    assert "2 of 2 host(s) failed" in res.output


def test_sglang_down_is_reported(ssh_lab, tmp_path):
    inv = ssh_lab.write_inventory(tmp_path / "inv.yaml", eval={"sglang": "http://127.0.0.1:9"})
    res = invoke("--inventory", str(inv), "hosts", "check", "eval")
    assert "down" in res.output and "SGLang at http://127.0.0.1:9" in res.output


def test_cli_import_does_not_load_torch_or_ssh():
    code = ("import sys, orchestrator.cli\n"
            "heavy = [m for m in ('torch', 'paramiko', 'fabric', 'transformers') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_help_starts_fast():
    exe = Path(sys.executable).with_name("dflash-ops")   # this environment's console script, not PATH's first
    argv = [str(exe), "--help"] if exe.exists() else [sys.executable, "-m", "orchestrator.cli", "--help"]
    times = []
    for _ in range(3):
        t = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        times.append(time.monotonic() - t)
        assert proc.returncode == 0 and "hosts" in proc.stdout
    assert statistics.median(times) < 2.5, times
