"""The worker's engine phase (``--engine``) as a real subprocess, against an engine speaking SGLang's
protocol (tests/sglang_server.py: the embedded target decoding speculatively with the embedded
drafter, answering SGLang's own counters). The real vLLM engine: tests/test_engine_eval.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from remote.contract.metrics import summarize

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 32


def worker(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "remote.worker", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def stand_in(embedded_pair):
    """``(url of a stand-in serving the target with the drafter, url of one without)``."""
    from sglang_server import serve_sglang
    from transformers import AutoTokenizer

    from remote.drafters.checkpoint import load_drafter
    from remote.target.model import load_target

    target = load_target(embedded_pair["target"], "cpu")
    drafter, _ = load_drafter(embedded_pair["drafter"], "cpu")
    tokenizer = AutoTokenizer.from_pretrained(embedded_pair["target"])
    with serve_sglang(target, tokenizer, drafter=drafter, drafter_path=embedded_pair["drafter"]) as spec, \
            serve_sglang(target, tokenizer) as plain:
        yield spec, plain


@pytest.fixture(scope="module")
def engine_run(embedded_pair, stand_in, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "out"
    proc = worker("--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--prompts", 2,
                  "--out", out, "--device", "cpu", "--max-new-tokens", MAX_NEW, "--engine",
                  "--engine-kind", "sglang", "--engine-url", stand_in[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.mark.worker
def test_engine_counts_beside_ours(engine_run):
    out, proc = engine_run
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        e = r["engine"]
        assert r["mode"] == "online" if "mode" in r else True
        # the stand-in decodes as we do: the same output, the same cycles, the same accepted drafts
        assert e["output_ids"] == r["output_ids"] and e["checks"]["same_output"]
        assert e["cycles"] == len(r["acceptance_lengths"])
        assert e["accepted"] == sum(r["acceptance_lengths"]) - len(r["acceptance_lengths"])
        # SGLang's τ = completion tokens / verify steps: the prefill's token is counted, ours is not
        assert e["tokens"] == len(r["output_ids"]) and e["tau"] == pytest.approx(e["tokens"] / e["cycles"])
        assert e["checks"]["counts_prefill_token"] and e["causes"] == ["prefill_token"]
        assert sum(e["histogram"]) == e["cycles"] and e["per_step_accepted"] is None
        assert "plain" not in e                    # a url: server: no server without the drafter, no speedup
    summary = json.loads((out / "summary.json").read_text())
    assert summary == summarize(rows, 8, "online")
    s = summary["engine"]
    assert s["prompts"] == 2 and s["same_output"] == 2 and s["causes"] == {"prefill_token": 2}
    assert s["tau_pooled"] == pytest.approx(sum(len(r["output_ids"]) for r in rows)
                                            / sum(len(r["acceptance_lengths"]) for r in rows))
    assert s["tau_pooled"] > summary["tau_pooled"]
    env = json.loads((out / "env.json").read_text())
    assert env["settings"]["engine"] is True and env["engine"]["kind"] == "sglang"
    assert env["engine"]["served"]["drafter"]["num_speculative_tokens"] == 7
    assert "engine tau" in proc.stderr


@pytest.mark.worker
def test_report_shows_engine_tau_and_why(engine_run, tmp_path):
    from orchestrator.reports.engine import verdict_clause
    from orchestrator.runs.folders import load_run

    out, _ = engine_run
    run = load_run(out)
    clause = verdict_clause(run)
    assert clause.startswith("SGLang stand-in counts τ") and "prefill token (2 of 2 prompts)" in clause, clause


@pytest.mark.worker
@pytest.mark.parametrize("case", ["other-model", "no-drafter", "not-installed"])
def test_engine_refusals_are_one_line(case, embedded_pair, stand_in, tmp_path):
    args = ["--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--prompts", 1,
            "--out", tmp_path / "o", "--device", "cpu", "--max-new-tokens", 8, "--engine", "--engine-kind", "sglang"]
    if case == "other-model":           # a url: server that serves another target
        other = tmp_path / "other"
        shutil.copytree(embedded_pair["target"], other)
        args[1] = str(other)
        args += ["--engine-url", stand_in[0]]
        want = "does not serve what this run needs: it serves"
    elif case == "no-drafter":
        args += ["--engine-url", stand_in[1]]
        want = "it runs without speculative decoding"
    else:
        args += ["--engine-python", str(tmp_path / "nope" / "python")]
        want = "SGLang is not installed"
    proc = worker(*args, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [json.loads(line) for line in proc.stdout.splitlines() if '"error"' in line]
    assert errors and want in errors[-1]["message"] and "\n" not in errors[-1]["message"], (errors, proc.stderr[-2000:])
    assert not (tmp_path / "o" / "results.jsonl").exists() or not (tmp_path / "o" / "results.jsonl").read_text()


def test_servers_an_earlier_worker_left_are_ended(tmp_path):
    """A worker killed with SIGKILL cannot stop its engine servers (their own process groups): the next
    worker of the run ends the recorded ones, and only those (a pid is checked with its start time)."""
    from remote.engines.server import ServerProcess, kill_recorded
    from remote.host.proc import start_time as process_start

    left = ServerProcess([sys.executable, "-c", "import time; time.sleep(300)"], tmp_path / "left.log", name="left")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        record = tmp_path / "engine.pids"
        left.record(record)
        with open(record, "a") as f:                    # the same pid number, another process: left alone
            f.write(f"{other.pid} {process_start(other.pid) + 1}\n")
        assert kill_recorded(record) == [left.pid]
        assert left.proc.wait(timeout=10) == -9 and other.poll() is None and not record.exists()
        assert kill_recorded(record) == []
    finally:
        left.stop(grace=1)
        other.kill()
        other.wait()


def test_hosts_check_reads_what_a_running_server_serves(stand_in, embedded_pair):
    """`hosts check` on a host whose engine is a `url:` server: the probe asks the server what it serves."""
    from orchestrator.config.inventory import EngineSpec, Host
    from orchestrator.eval.hostcheck import HostReport, _fill_engine
    from remote.host.probe import engine

    for url, want in ((stand_in[0], "speculative, 7 drafts per step"), (stand_in[1], "no speculative decoding")):
        found = engine("sglang", None, url, 10.0)
        assert found["served"]["model"] == embedded_pair["target"], found
        report = HostReport(name="ev", endpoint="x")
        _fill_engine(report, Host(name="ev", address="x", engine=EngineSpec("sglang", url=url)), found)
        assert report.engine == f"sglang stand-in at {url}: {embedded_pair['target']}, {want}", report.engine
    down = engine("sglang", None, "http://127.0.0.1:9", 5.0)
    report = HostReport(name="ev", endpoint="x")
    _fill_engine(report, Host(name="ev", address="x", engine=EngineSpec("sglang", url="http://127.0.0.1:9")), down)
    assert report.engine == "sglang (not usable)" and report.warnings[0].startswith("engine: sglang server at "), report


def test_servers_on_a_gpu_get_a_share_of_its_memory(tmp_path):
    """On a GPU the servers share the worker's GPU with its models: each is given a share of its memory,
    which the inventory's args (after it on the command line) can override; on a CPU nothing is added."""
    from remote.engines import sglang as sglang_engine
    from remote.engines import vllm as vllm_engine
    from remote.engines.phase import EnginePhase

    vllm = EnginePhase("vllm", "T", "D", tmp_path, 7, python="/p", extra_args=["--gpu-memory-utilization", "0.2"],
                       device="cuda:1")
    argv = vllm_engine.server_argv("/p", "T", "D", 7, extra_args=vllm.extra_args)
    assert argv[-4:] == ["--gpu-memory-utilization", "0.3", "--gpu-memory-utilization", "0.2"]
    sglang = EnginePhase("sglang", "T", "D", tmp_path, 7, python="/p", device="cuda")
    assert sglang_engine.server_argv("/p", "T", "D", 8, extra_args=sglang.extra_args)[-2:] == \
        ["--mem-fraction-static", "0.3"]
    assert EnginePhase("vllm", "T", "D", tmp_path, 7, python="/p", device="cpu").extra_args == []


def test_every_engine_kind_has_a_module_with_the_engine_parts():
    """The registry: each kind the inventory accepts (remote.contract.engines) is one module of
    remote/engines with the parts the engine phase uses, and nothing else branches on the kind."""
    from remote.contract.engines import ENGINES, KINDS
    from remote.engines import engine

    for kind in KINDS:
        m = engine(kind)
        assert m.KIND == kind and m.INSTALL == ENGINES[kind].install and m.PYTHON_ENV == ENGINES[kind].python_env
        assert m.START_TIMEOUT > 0 and m.GPU_SHARE_FLAG.startswith("--")
        assert m.QUIRK is None or callable(getattr(__import__("remote.engines.quirks").engines.quirks, m.QUIRK))
        assert callable(m.engine_versions) and callable(m.launch)
        assert isinstance(m.Client.renders_chat, bool) and m.Client.kind == kind
        for method in ("check_serves", "complete", "served", "healthy") + (("chat",) if m.Client.renders_chat else ()):
            assert callable(getattr(m.Client, method)), (kind, method)
    with pytest.raises(ValueError, match="unknown engine kind 'tgi'"):
        engine("tgi")
    # (the probe is piped to a host as one file: it reads a running server of either kind by itself)
    branching = [f"{p.relative_to(REPO)}:{i}" for p in (REPO / "remote").rglob("*.py")
                 if (p.parent.name != "engines" or p.name in ("phase.py", "server.py", "__init__.py"))
                 and p.name != "probe.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if '== "vllm"' in line or '== "sglang"' in line or "== 'vllm'" in line]
    assert not branching, branching
