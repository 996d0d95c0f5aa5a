"""The worker's engine phase (``--engine``) as a real subprocess, against an engine speaking SGLang's
protocol (tests/sglang_server.py: the embedded target decoding speculatively with the embedded
drafter, or a DSpark drafter on its backbone, answering SGLang's own counters); the command line of
the SGLang servers the worker starts, for each drafter family. The real vLLM engine:
tests/test_engine_eval.py; the real SGLang: tests/test_gpu.py."""
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
        assert sum(e["histogram"]) == e["cycles"] and len(e["histogram"]) == 8 and e["per_step_accepted"] is None
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


def test_the_engine_speedup_at_t_above_0_divides_each_side_by_its_own_tokens():
    """At T > 0 the run without the drafter is its own sample and stops at its own length: the
    speedup is tokens/s over tokens/s, not time over time (which here would say 1.0)."""
    from remote.contract.metrics import engine_summary
    from remote.engines.phase import combine

    def turn(n_out, wall):
        return {"cycles": 4, "tokens": n_out, "wall_s": wall, "output_ids": list(range(n_out)), "drafts": 28,
                "draft_tokens": 28, "accepted": 8, "accepted_per_pos": [4] * 7, "histogram": [0] * 8,
                "per_step_accepted": None, "num_speculative_tokens": 7, "finish_reason": "length"}

    rows = []
    for temperature, plain_out in ((1.0, 20), (0.0, 40)):
        e = combine("vllm", [turn(40, 2.0)], [turn(plain_out, 2.0)])
        assert e["plain"]["tokens"] == plain_out and e["tokens_per_s"] == 20.0
        assert e["speedup"] == pytest.approx(20.0 / (plain_out / 2.0))     # 2.0 at T = 1, 1.0 at T = 0
        e["checks"] = {"temperature": temperature, "same_output": temperature == 0}
        rows.append({"engine": e})
    s = engine_summary(rows)
    assert s["plain_tokens_per_s"] == pytest.approx(60 / 4.0) and s["speedup"] == pytest.approx(20.0 / 15.0)
    # rows written before the plain run's tokens were kept: greedy with the same output counts its own,
    # a sample has no plain rate (None, never the time ratio)
    for r in rows:
        del r["engine"]["plain"]["tokens"]
    s = engine_summary(rows)
    assert s["plain_tokens_per_s"] is None and s["speedup"] is None
    assert engine_summary(rows[1:])["speedup"] == pytest.approx(1.0)


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


@pytest.fixture(scope="module")
def family_drafters(embedded_pair, tmp_path_factory):
    """The embedded drafter's backbone with SpecForge's DSpark and Domino heads, in SpecForge's format
    (tests/enginelab.py)."""
    from enginelab import family_drafter

    out = tmp_path_factory.mktemp("families")
    return {family: family_drafter(embedded_pair["drafter"], family, out / family, fmt="specforge")
            for family in ("dspark", "domino")}


@pytest.fixture(scope="module")
def served_target(embedded_pair):
    """``(target, tokenizer)`` as the stand-ins serve them."""
    from transformers import AutoTokenizer

    from remote.target.model import load_target

    return load_target(embedded_pair["target"], "cpu"), AutoTokenizer.from_pretrained(embedded_pair["target"])


@pytest.fixture(scope="module")
def dspark_stand_in(served_target, family_drafters):
    """The URL of a stand-in serving the target with the DSpark drafter (SGLang's DSPARK)."""
    from sglang_server import serve_sglang

    from remote.drafters.checkpoint import load_drafter

    drafter, _ = load_drafter(family_drafters["dspark"], "cpu")
    with serve_sglang(*served_target, drafter=drafter, drafter_path=str(family_drafters["dspark"])) as url:
        yield url


@pytest.fixture(scope="module")
def dspark_run(embedded_pair, family_drafters, dspark_stand_in, tmp_path_factory):
    """The worker's engine phase with the DSpark drafter against its stand-in, counted by z-lab's rules
    (the stand-in's decoding), so that our counts and the engine's differ only as SGLang counts."""
    out = tmp_path_factory.mktemp("dspark") / "out"
    proc = worker("--target", embedded_pair["target"], "--drafter", family_drafters["dspark"], "--prompts", 2,
                  "--out", out, "--device", "cpu", "--max-new-tokens", MAX_NEW, "--semantics", "zlab", "--engine",
                  "--engine-kind", "sglang", "--engine-url", dspark_stand_in)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.worker
def test_a_dspark_drafter_is_counted_as_the_engine_served_it(dspark_run, dspark_stand_in, served_target):
    """Each row's engine numbers are what the server answered for that prompt (asked again here,
    through the reference client): its verify steps, accepted and proposed drafts, histogram (0..γ,
    SGLang's ends at the most a step accepted) and τ; the stand-in decodes as we do, so the counts
    are ours and the τ differs by the prefill's token only."""
    from remote.engines.sglang import result
    from remote.engines.sglang_client import SGLangClient
    from remote.worker import stop_ids

    env = json.loads((dspark_run / "env.json").read_text())
    served = env["engine"]["served"]["drafter"]
    assert served["algorithm"] == "DSPARK" and served["num_speculative_tokens"] == 7, served
    stops = stop_ids(served_target[1], served_target[0])
    rows = [json.loads(line) for line in (dspark_run / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r.get("confidences") for r in rows)
    for r in rows:
        e = r["engine"]
        raw = SGLangClient(dspark_stand_in).generate_raw(r["prompt_ids"], MAX_NEW, stops)
        meta = raw["meta_info"]
        again = result(raw, e["wall_s"])
        counts = ("output_ids", "finish_reason", "cycles", "tokens", "drafts", "draft_tokens", "accepted",
                  "accepted_per_pos", "histogram", "per_step_accepted", "tau", "num_speculative_tokens")
        assert {k: e[k] for k in counts} == {k: again[k] for k in counts}
        assert e["output_ids"] == raw["output_ids"] == r["output_ids"]
        assert (e["cycles"], e["accepted"], e["draft_tokens"], e["tau"]) == \
            (meta["spec_verify_ct"], meta["spec_num_correct_drafts"], meta["spec_num_proposed_drafts"],
             meta["spec_accept_length"])
        hist = meta["spec_correct_drafts_histogram"]
        assert e["histogram"] == hist + [0] * (8 - len(hist)) and e["draft_tokens"] == 7 * e["cycles"]
        assert e["accepted_per_pos"] == [sum(e["histogram"][k + 1:]) for k in range(7)]
        assert e["cycles"] == len(r["acceptance_lengths"])
        assert e["accepted"] == sum(r["acceptance_lengths"]) - len(r["acceptance_lengths"])
        assert e["causes"] == ["prefill_token"], e["checks"]


def test_sglangs_counters_are_read_under_each_releases_names(dspark_stand_in):
    """SGLang has named its per-request counters three ways (remote/engines/sglang.py): one answer of
    the stand-in (the newest names) renamed to each earlier release's reads the same."""
    from remote.engines.sglang import COUNTERS, result
    from remote.engines.sglang_client import SGLangClient

    raw = SGLangClient(dspark_stand_in).generate_raw(list(range(3, 40)), 24)
    meta = raw["meta_info"]
    newest = result(raw, 1.0)
    assert newest["cycles"] and newest["num_speculative_tokens"] == 7 and len(newest["histogram"]) == 8
    for release in (1, 2):
        older = {k: v for k, v in meta.items() if not any(k in names for names in COUNTERS.values())}
        for names in COUNTERS.values():
            name = names[min(release, len(names) - 1)]
            older[name] = meta[names[0]]
        assert result({**raw, "meta_info": older}, 1.0) == newest, release
    without_histogram = {k: v for k, v in meta.items() if k not in COUNTERS["histogram"]}
    got = result({**raw, "meta_info": without_histogram}, 1.0)
    assert got["histogram"] is None and got["accepted_per_pos"] is None
    assert (got["accepted"], got["draft_tokens"], got["tau"]) == (newest["accepted"], newest["draft_tokens"],
                                                                  newest["tau"])


def test_the_algorithm_a_server_serves_is_checked(embedded_pair, served_target, family_drafters):
    """A `url:` server must serve the drafter with its family's algorithm: a DSpark drafter as DSPARK
    (refused, naming both, when the server says DFLASH), a Domino drafter as DFLASH."""
    from sglang_server import serve_sglang

    from remote.drafters.checkpoint import load_drafter
    from remote.engines.server import EngineError
    from remote.engines.sglang import SGLangEngineClient

    target = embedded_pair["target"]
    dspark, _ = load_drafter(family_drafters["dspark"], "cpu")
    with serve_sglang(*served_target, drafter=dspark, drafter_path=str(family_drafters["dspark"]),
                      algorithm="DFLASH") as url:
        with pytest.raises(EngineError, match="its speculative algorithm is DFLASH, not DSPARK") as e:
            SGLangEngineClient(url).check_serves(target, 7, True, drafter=family_drafters["dspark"])
        assert e.value.kind == "mismatch" and "\n" not in str(e.value)
    domino, _ = load_drafter(family_drafters["domino"], "cpu")
    with serve_sglang(*served_target, drafter=domino, drafter_path=str(family_drafters["domino"])) as url:
        got = SGLangEngineClient(url).check_serves(target, 7, True, drafter=family_drafters["domino"])
        assert got["algorithm"] == "DFLASH" and got["num_speculative_tokens"] == 7


@pytest.mark.parametrize("family", ["dflash", "dspark", "domino"])
def test_the_server_is_started_with_the_drafters_algorithm(family, embedded_pair, family_drafters, tmp_path):
    """The SGLang server the worker starts (here an environment without SGLang: it fails to start,
    saying why): DSPARK with γ = the drafts per block for a DSpark drafter, DFLASH for DFlash and
    Domino (the Domino one scoring the full vocabulary, as ours does), B = γ + 1 draft tokens per verify."""
    from remote.engines import sglang as sglang_engine
    from remote.engines.server import EngineError

    drafter = embedded_pair["drafter"] if family == "dflash" else str(family_drafters[family])
    server = sglang_engine.launch(embedded_pair["target"], drafter, tmp_path / "engine-drafter.log",
                                  python=sys.executable, num_drafts=7, dtype="float32", seed=0,
                                  extra_args=["--log-level", "warning"])
    try:
        argv = server.argv
        spec = argv[argv.index("--speculative-algorithm"):argv.index("--log-level")]
        want = {"dflash": ["DFLASH"], "dspark": ["DSPARK", "--speculative-dspark-block-size", "7"],
                "domino": ["DFLASH", "--speculative-domino-candidate-pool-size", "0"]}[family]
        assert spec == ["--speculative-algorithm", want[0], "--speculative-draft-model-path", drafter,
                        "--speculative-num-draft-tokens", "8", *want[1:]], argv
        assert server.settings["algorithm"] == want[0] and server.settings["num_speculative_tokens"] == 7
        with pytest.raises(EngineError, match=r"failed to start .*No module named 'sglang'"):
            server.wait_ready(60)
    finally:
        server.stop(grace=1)


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
    assert sglang_engine.server_argv("/p", "T", "D", 8, extra_args=sglang.extra_args, family="dflash")[-2:] == \
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
