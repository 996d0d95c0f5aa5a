"""`dflash-ops eval` end to end: real sshd eval hosts, the real CLI as a subprocess, a real
detached worker; dropped connections, killed workers, sharding and pre-flight errors."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import lab_cli
from runfolders import only_run, prompt_events, remote_run_dir, results
from waiting import finished, wait_for

REPO = Path(__file__).resolve().parents[1]
N_PROMPTS = 5


def test_eval_over_ssh_equals_the_worker_run_by_hand(eval_lab, tmp_path):
    runs = tmp_path / "runs"
    # the same worker by hand, here, on the same files, with the settings eval passes (checked below),
    # run side by side with the eval
    by_hand = tmp_path / "by_hand"
    drafter = eval_lab["lab"].eval.root / "checkpoints" / "v9" / "step_100"
    hand = subprocess.Popen([sys.executable, "-m", "remote.worker", "--target", str(eval_lab["pair"] / "target"),
                             "--drafter", str(drafter), "--prompts", "3", "--max-new-tokens", "64",
                             "--device", "cpu", "--out", str(by_hand), "--thinking", "off"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = lab_cli(eval_lab, "eval", "--host", "eval", "--drafter", "v9:100", "--prompts", 3, "--max-new-tokens", 64,
               "--device", "cpu", runs=runs)
    hand = finished(hand, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert hand.returncode == 0, hand.stderr[-3000:]
    assert "3/3" in proc.stdout and "tau_pooled" in proc.stdout
    run_dir = only_run(runs)
    assert "v9:100 → v9:step_100 on eval" in proc.stdout          # what the name resolved to
    assert "-v9-step100-eval" in run_dir.name
    for name in ("results.jsonl", "summary.json", "env.json", "report.md", "report.html", "worker.log", "run.json"):
        assert (run_dir / name).exists(), name
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "done" and (record["checkpoint"], record["step"]) == ("step_100", 100)
    assert record["shards"][0]["drafter_path"].endswith("/checkpoints/v9/step_100")
    assert Path(record["shards"][0]["drafter_path"]) == drafter                 # the files the worker by hand read
    env = json.loads((run_dir / "env.json").read_text())
    assert env["host"] == "eval"
    assert {None: "default", True: "on", False: "off"}[env["settings"]["enable_thinking"]] == "off"
    keys = ("id", "prompt_ids", "output_ids", "acceptance_lengths", "ddtree")
    assert [{k: r[k] for k in keys} for r in results(run_dir)] == [{k: r[k] for k in keys} for r in results(by_hand)]
    # the worker code is content-addressed: a second eval ships nothing new
    code = list((eval_lab["lab"].eval.root / "workdir" / "code").iterdir())
    assert len([c for c in code if (c / ".complete").exists()]) == 1


def start_long_eval(eval_lab, runs: Path):
    """`dflash-ops eval` of N_PROMPTS long prompts as a background process; returns (proc, run id)."""
    proc = lab_cli(eval_lab, "eval", "--host", "eval", "--drafter", "demo", "--prompts", N_PROMPTS, "--max-new-tokens", 160,
               "--device", "cpu", runs=runs, popen=True)
    wait_for(lambda: runs.exists() and any((d / "run.json").exists() for d in runs.iterdir()), what="run record", interval=0.3)
    return proc, only_run(runs).name


def test_dropped_connection_keeps_the_worker_and_attach_completes(eval_lab, tmp_path):
    runs = tmp_path / "runs"
    proc, run_id = start_long_eval(eval_lab, runs)
    events = remote_run_dir(eval_lab, "eval", run_id) / "events.jsonl"
    wait_for(lambda: prompt_events(events) >= 1, what="first prompt", interval=0.3)
    proc.kill()                                    # the client dies: its SSH connections drop
    proc.wait()
    pid = int((remote_run_dir(eval_lab, "eval", run_id) / "pid").read_text().split()[0])
    time.sleep(1.0)
    assert (remote_run_dir(eval_lab, "eval", run_id) / "exit_code").exists() or os.path.exists(f"/proc/{pid}"), \
        "the worker died with the SSH connection"
    attach = lab_cli(eval_lab, "attach", run_id, runs=runs)
    assert attach.returncode == 0, attach.stdout + attach.stderr
    rows = results(runs / run_id)
    assert len(rows) == N_PROMPTS and len({r["id"] for r in rows}) == N_PROMPTS
    assert json.loads((runs / run_id / "run.json").read_text())["status"] == "done"


def test_killed_worker_is_resumed_without_duplicates(eval_lab, tmp_path):
    runs = tmp_path / "runs"
    proc, run_id = start_long_eval(eval_lab, runs)
    rdir = remote_run_dir(eval_lab, "eval", run_id)
    wait_for(lambda: prompt_events(rdir / "events.jsonl") >= 2, what="two prompts", interval=0.3)
    os.kill(int((rdir / "pid").read_text().split()[0]), signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "failed" in out and "exit code -9" in out and f"--resume {run_id}" in out
    finished = len((rdir / "out" / "results.jsonl").read_text().splitlines())
    assert 2 <= finished < N_PROMPTS
    resumed = lab_cli(eval_lab, "eval", "--resume", run_id, runs=runs)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows = results(runs / run_id)
    suite_ids = json.loads((runs / run_id / "env.json").read_text())["suite"]["ids"]
    assert [r["id"] for r in rows] == suite_ids and len(set(suite_ids)) == N_PROMPTS
    worker_events = [json.loads(line) for line in (rdir / "events.jsonl").read_text().splitlines()]
    starts = [e for e in worker_events if e["event"] == "start"]
    assert starts[-1]["done"] == finished          # the resumed worker skipped the finished prompts


def test_two_eval_hosts_shard_one_run(eval_lab, tmp_path):
    runs = tmp_path / "runs"
    target = eval_lab["lab"].eval.root / "workdir" / "embedded" / "target"
    proc = lab_cli(eval_lab, "eval", "--host", "eval", "--host", "train", "--drafter", "embedded", "--prompts", N_PROMPTS,
               "--max-new-tokens", 48, "--device", "cpu", "--ddtree", "", runs=runs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = only_run(runs)
    rows = results(run_dir)
    env = json.loads((run_dir / "env.json").read_text())
    assert len(rows) == N_PROMPTS and len({r["id"] for r in rows}) == N_PROMPTS
    assert [r["id"] for r in rows] == env["suite"]["ids"]                 # suite order
    assert sorted(e["host"] for e in env["shards"]) == ["eval", "train"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["prompts"] == N_PROMPTS
    assert target.exists()


@pytest.mark.parametrize("case", ["unknown-label", "missing-checkpoint", "incomplete", "corrupt", "no-torch", "no-gpu"])
def test_preflight_errors_are_clear(eval_lab, tmp_path, case):
    args = ["eval", "--host", "eval", "--prompts", 1, "--device", "cpu"]
    inventory = None
    if case == "unknown-label":
        args += ["--drafter", "v8"]
        want = "did you mean 'v9'"
    elif case == "missing-checkpoint":
        args += ["--drafter", "v9:step999"]
        want = "no checkpoint 'step999' in run v9; nearest: step_100"
    elif case == "incomplete":
        broken = eval_lab["lab"].eval.root / "checkpoints" / "v9" / "step_200"
        shutil.copytree(eval_lab["pair"] / "drafter", broken, dirs_exist_ok=True)
        (broken / "model.safetensors").rename(broken / "model.safetensors.part")
        args += ["--drafter", "v9:200"]
        want = "incomplete"
    elif case == "corrupt":
        broken = eval_lab["lab"].eval.root / "checkpoints" / "v9" / "step_300"
        shutil.copytree(eval_lab["pair"] / "drafter", broken, dirs_exist_ok=True)
        weights = broken / "model.safetensors"
        import hashlib
        good = hashlib.sha256(weights.read_bytes()).hexdigest()
        (broken / ".dflash-manifest.json").write_text(json.dumps({"files": [
            {"path": "model.safetensors", "size": weights.stat().st_size, "sha256": good}]}))
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF                              # same size, one byte flipped
        weights.write_bytes(bytes(data))
        args += ["--drafter", "v9:300", "--verify-weights"]
        want = "does not match its sha256 in the sync manifest"
    elif case == "no-torch":
        args += ["--drafter", "demo"]
        inventory = eval_lab["no_torch"]
        want = "lacks torch"
    else:
        args = ["eval", "--host", "eval", "--prompts", 1, "--drafter", "demo"]   # GPU asked, none there
        want = "no CUDA GPU"
    proc = lab_cli(eval_lab, *args, inventory=inventory, runs=tmp_path / "runs", timeout=300)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert want in out, out
    assert "Traceback" not in out
    if case in ("incomplete", "corrupt"):
        shutil.rmtree(eval_lab["lab"].eval.root / "checkpoints" / "v9" / ("step_200" if case == "incomplete" else "step_300"))


@pytest.mark.worker
def test_local_host_runs_the_embedded_default(embedded_pair, tmp_path):
    """The README's first command, on the built-in `local` host (embedded pair pre-built)."""
    home = tmp_path / "home"
    shutil.copytree(Path(embedded_pair["target"]).parent, home / "embedded")
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(tmp_path / "runs"), "COLUMNS": "160"}
    env.pop("DFLASH_OPS_INVENTORY", None)
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "eval", "--host", "local", "--prompts", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = only_run(tmp_path / "runs")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["prompts"] == 2 and summary["tau_pooled"] > 1.5
    assert (run_dir / "report.html").exists()
    # parity on the same run: the training-style batched path and the per-anchor path agree
    par = subprocess.run([sys.executable, "-m", "orchestrator.cli", "parity", run_dir.name], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert par.returncode == 0, par.stdout + par.stderr
    report = json.loads((run_dir / "parity.json").read_text())
    assert report["agree"] and report["draft_disagreements"] == 0 and report["anchors"] > 0
    assert report["accuracy"]["training"] == report["accuracy"]["eval"]
    assert "agree draft for draft" in par.stdout
    # a z-lab DFlash drafter is one SpecForge trains: its training-side accuracy is our training way's
    assert report["specforge"]["accuracy_tau"] == pytest.approx(report["tau_estimate"]["training"])
    assert "SpecForge's teacher-forced accuracy (dflash)" in par.stdout and len(report["gaps"]) == 1


def on_a_terminal(argv: list[str], env: dict, cwd: Path, timeout: float = 600) -> tuple[int, str]:
    """``argv`` with a pseudo-terminal for stdin, stdout and stderr: (exit code, all it wrote)."""
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, cwd=cwd, env=env)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 1.0)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:         # the terminal's other side closed: the command ended
                    break
                if not chunk:
                    break
                chunks.append(chunk)
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
    return proc.wait(timeout=max(1.0, deadline - time.monotonic())), b"".join(chunks).decode(errors="replace")


@pytest.mark.worker
def test_the_embedded_pair_is_said_to_be_built_only_when_it_is(tmp_path):
    """First use on `local`, output redirected: a plain line when the build starts and one when it is
    done (no spinner shows them). A later eval, on a terminal, finds the pair built: its pre-flight
    spinner never says it is building."""
    import re

    home = tmp_path / "home"
    env = {**os.environ, "DFLASH_OPS_HOME": str(home), "DFLASH_OPS_RUNS": str(tmp_path / "runs"), "COLUMNS": "160"}
    env.pop("DFLASH_OPS_INVENTORY", None)
    argv = [sys.executable, "-m", "orchestrator.cli", "eval", "--host", "local", "--prompts", "1", "--max-new-tokens",
            "8", "--ddtree", ""]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [ln for ln in proc.stderr.splitlines() if "embedded demo pair" in ln]
    assert len(said) == 2 and said[0] == (f"local: building the embedded demo pair in {home / 'embedded'} (first use "
                                          f"on this host: about a minute on CPU)"), proc.stderr
    assert re.fullmatch(r"local: built the embedded demo pair in \d+s", said[1]), said
    code, shown = on_a_terminal(argv, {**env, "TERM": "xterm"}, tmp_path)
    assert code == 0, shown
    assert "local: pre-flight: shipping the worker, checking drafter and target ..." in shown, shown
    assert "building" not in shown and "first use" not in shown, shown


def svg_line_values(svg: str) -> list[float]:
    """The y values of a plot's one line, read back through its axis's "0" and "1" tick labels
    (orchestrator/reports/svg.py writes a label 4 px below its tick)."""
    import re

    (points,) = re.findall(r'<polyline points="([^"]+)"', svg)
    zero = float(re.search(r'y="([0-9.]+)" text-anchor="end">0</text>', svg).group(1))
    one = float(re.search(r'y="([0-9.]+)" text-anchor="end">1</text>', svg).group(1))
    return [(zero - 4 - float(p.split(",")[1])) / (zero - one) for p in points.split()]


@pytest.mark.worker
def test_offline_at_t_above_0_shows_the_expected_acceptance_everywhere(local_home, tmp_path):
    """`eval --host local --temperature 0.7` (offline): no walk, so every number shown is the
    expected acceptance, labelled, by one definition recomputed here from the rows: per anchor
    r_k = Π_{j≤k} α_j, expected acceptance @k = Σ r_k / anchors, tau_pooled = 1 + Σ of those = Σ
    E[τ] / anchors, tau_macro = the mean of the prompts' expected τ (the verdict's). The console,
    the progress line, report.md and its per-position plot, `runs`, `show` and `compare` show
    them, and none shows a cycle count, a zero acceptance or no τ."""
    env = {**os.environ, "DFLASH_OPS_HOME": str(local_home), "DFLASH_OPS_RUNS": str(tmp_path / "runs"),
           "COLUMNS": "200"}
    env.pop("DFLASH_OPS_INVENTORY", None)

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
        return proc.stdout

    evals = [cli("eval", "--host", "local", "--prompts", "2", "--temperature", "0.7", "--max-new-tokens", "64")
             for _ in range(2)]
    first, second = sorted((tmp_path / "runs").iterdir())
    rows = results(first)
    e = json.loads((first / "summary.json").read_text())["expected"]
    anchors = sum(r["expected"]["anchors"] for r in rows)
    reach = [sum(r["expected"]["reach_sum"][k] for r in rows) / anchors for k in range(7)]
    for r in rows:                                                  # reach_sum: Σ over anchors of Π α
        assert all(0 <= x <= c for x, c in zip(r["expected"]["reach_sum"], r["expected"]["count"]))
        assert sum(r["expected"]["reach_sum"]) + r["expected"]["anchors"] == pytest.approx(r["expected"]["tau_sum"])
    assert e["per_position_acceptance"] == pytest.approx(reach) and 0 < reach[-1] < reach[0] < 1
    assert e["tau_pooled"] == pytest.approx(1 + sum(reach))
    assert e["tau_pooled"] == pytest.approx(sum(r["expected"]["tau_sum"] for r in rows) / anchors)
    assert e["tau_macro"] == pytest.approx(sum(r["expected"]["expected_tau"] for r in rows) / 2)
    assert (e["anchors"], e["prompts"]) == (anchors, 2)

    out = " ".join(evals[0].split())
    assert f"embedded: expected τ {e['tau_macro']:.2f} [" in out
    assert f"expected tau_macro (offline, T > 0: an estimate) │ {e['tau_macro']:.3f}" in out
    assert f"expected tau_pooled (offline, T > 0: an estimate) │ {e['tau_pooled']:.3f}" in out
    assert f"anchors │ {anchors}" in out
    assert f"expected acceptance @1..4 │ {' '.join(f'{a:.2f}' for a in reach[:4])}" in out
    assert f"2/2 expected τ macro {e['tau_macro']:.2f}" in out                   # the progress line
    last = rows[-1]
    assert f"{last['id']}: {last['expected']['anchors']} anchors, expected τ {last['expected']['expected_tau']:.2f}" in out
    for wrong in ("cycles", "blocks", "0.00 0.00", "tau_pooled │ -"):
        assert wrong not in out, out

    md = (first / "report.md").read_text()
    assert f"| expected tau_macro (offline, T > 0: an estimate) | {e['tau_macro']:.4f} |" in md
    assert f"| expected tau_pooled (offline, T > 0: an estimate) | {e['tau_pooled']:.4f} |" in md
    for k, (r, a) in enumerate(zip(reach, e["alpha"]), 1):
        assert f"| {k} | {r:.4f} | {a:.4f} |" in md, md
    assert "| cycles |" not in md and "| tau_macro |" not in md and "Acceptance-length histogram" not in md
    assert "![Per-position acceptance (expected; offline, T > 0: an estimate)](plots/per-position.svg)" in md
    svg = (first / "plots" / "per-position.svg").read_text()
    assert "embedded (expected, an estimate)" in svg
    assert svg_line_values(svg) == pytest.approx(reach, abs=2e-3)

    listed = " ".join(cli("runs").split())
    assert f"│ {e['tau_macro']:.3f} expected │" in listed, listed
    row = next(r for r in json.loads(cli("runs", "--json")) if r["id"] == first.name)
    assert row["tau_macro"] is None and row["expected_tau_macro"] == pytest.approx(e["tau_macro"])
    shown = " ".join(cli("show", first.name).split())
    assert f"embedded: expected τ {e['tau_macro']:.2f} [" in shown
    assert f"expected tau_pooled (offline, T > 0: an estimate) │ {e['tau_pooled']:.4f}" in shown
    compared = " ".join(cli("compare", first.name, second.name, "--resamples", "200", "--no-published").split())
    assert f"expected tau_macro (offline, T > 0: an estimate) │ {e['tau_macro']:.4f} │ {e['tau_macro']:.4f}" in compared
    assert f"│ 1 │ {reach[0]:.4f} │ {reach[0]:.4f} │ +0.0000" in compared, compared

    # watch's trajectory (the two runs as two checkpoints) and experiment tracking: the same numbers, named
    from orchestrator.reports.tracking import run_facts
    from orchestrator.watch import WatchState
    from orchestrator.watch.loop import headline
    from orchestrator.watch.state import Point
    from orchestrator.watch.trajectory import write_trajectory

    st = WatchState(run="v5", settings={"suite": "embedded", "prompts": 2, "mode": "offline"})
    for step, run in ((1000, first), (2000, second)):
        st.points[f"step_{step}"] = Point(name=f"step_{step}", step=step, status="done", eval_run=run.name,
                                          summary=headline(json.loads((run / "summary.json").read_text())))
    head = st.points["step_1000"].summary
    assert (head["tau_macro"], head["tau_pooled"], head["measure"]) == (e["tau_macro"], e["tau_pooled"], "expected")
    assert head["per_position_acceptance"] == e["per_position_acceptance"]
    md = write_trajectory(tmp_path / "watch-v5", st, tmp_path / "runs", {}, None, [])[0].read_text()
    e2 = json.loads((second / "summary.json").read_text())["expected"]
    assert f"v5 at step 2000 (the newest of 2 checkpoints evaluated): expected τ {e2['tau_macro']:.2f} [" in md, md
    assert "| expected τ macro [95% CI] | expected τ pooled [95% CI] |" in md
    assert f"| 1000 | step_1000 | {e['tau_macro']:.3f} [" in md
    svg = (tmp_path / "watch-v5" / "plots" / "tau.svg").read_text()
    assert "eval expected τ (macro, 95% CI)" in svg
    _, metrics = run_facts(first)
    assert metrics["expected_tau_macro"] == e["tau_macro"] and metrics["expected_tau_pooled"] == e["tau_pooled"]
    assert [metrics[f"expected_acceptance_{k}"] for k in range(1, 8)] == e["per_position_acceptance"]
    assert not {"tau_macro", "cycles", "tokens", "acceptance_1"} & set(metrics), metrics


def test_detach_json_then_attach(eval_lab, tmp_path):
    runs = tmp_path / "runs"
    proc = lab_cli(eval_lab, "eval", "--host", "eval", "--drafter", "demo", "--prompts", 1, "--max-new-tokens", 24,
               "--device", "cpu", "--ddtree", "", "--detach", "--json", runs=runs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    started = json.loads(proc.stdout)
    assert started["status"] == "running" and started["hosts"] == ["eval"]
    assert started["attach"] == f"dflash-ops attach {started['id']}"
    assert json.loads((runs / started["id"] / "run.json").read_text())["status"] == "running"
    attach = lab_cli(eval_lab, "attach", started["id"], runs=runs)
    assert attach.returncode == 0, attach.stdout + attach.stderr
    assert json.loads((runs / started["id"] / "run.json").read_text())["status"] == "done"
    assert len(results(runs / started["id"])) == 1


def test_a_suite_file_on_this_machine_is_sent_to_the_host(eval_lab, tmp_path):
    """`--suite configs/suites/mine.jsonl` names this machine's file (the project's own suites): it is
    copied to the host once per content and the worker reads it there."""
    suite = tmp_path / "mine.jsonl"
    suite.write_text('{"id": "mine-a", "prompt": "Say hi."}\n{"id": "mine-b", "prompt": "Count to three."}\n')
    runs = tmp_path / "runs"
    proc = lab_cli(eval_lab, "eval", "--host", "eval", "--drafter", "demo", "--suite", suite, "--prompts", 2,
                   "--max-new-tokens", 16, "--device", "cpu", "--ddtree", "", runs=runs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"suite {suite}: this machine's file, sent to eval" in proc.stdout
    run_dir = only_run(runs)
    assert [r["id"] for r in results(run_dir)] == ["mine-a", "mine-b"]
    sha = hashlib.sha256(suite.read_bytes()).hexdigest()[:16]
    sent = eval_lab["lab"].eval.root / "workdir" / "suites" / sha / "mine.jsonl"
    assert sent.read_bytes() == suite.read_bytes()
    assert json.loads((run_dir / "env.json").read_text())["suite"]["name"] == str(sent)
