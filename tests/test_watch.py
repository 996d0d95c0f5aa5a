"""`dflash-ops watch`: selection, state and lock, and on the SSH lab a fake training
process writing checkpoints of the embedded drafter while `watch` syncs and evaluates each one
exactly once, never a half-written one, surviving kills; the trajectory renders in Chromium."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from browser import assert_images_decode, chromium
from waiting import finished, patience, wait_for

from orchestrator.sync.complete import Verdict
from orchestrator.watch import RunLock, WatchState, select
from orchestrator.watch.state import WatchStateError
from orchestrator.watch.trainlog import read_jsonl, value_at

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
EVAL_ARGS = ["--prompts", "1", "--max-new-tokens", "16", "--ddtree", "8", "--device", "cpu", "--sglang", "off"]


# --------------------------------------------------------------------------- units

def _ck(step: int, complete: bool = True) -> dict:
    return {"name": f"step_{step}", "step": step, "verdict": Verdict(complete, "" if complete else "writing")}


def test_select_newest_first_skips_done_incomplete_and_thins_by_every(tmp_path):
    st = WatchState(run="r", settings={}, path=tmp_path / "state.json")
    listed = [_ck(500), _ck(1000), _ck(1500), _ck(2000), _ck(2500), _ck(4100), _ck(4500, complete=False)]
    assert [c["step"] for c in select(listed, st, None)] == [4100, 2500, 2000, 1500, 1000, 500]
    st.mark(st.point("step_2000", 2000), "done")
    st.failed(st.point("step_1000", 1000), "boom", max_attempts=1)  # gave up
    st.failed(st.point("step_500", 500), "boom", max_attempts=3)    # retried later
    assert [c["step"] for c in select(listed, st, None)] == [4100, 2500, 1500, 500]
    # --every 2000: the first checkpoint at or after each multiple (4000 -> 4100), one per bucket
    assert [c["step"] for c in select(listed, WatchState(run="r", settings={}), 2000)] == [4100, 2000, 500]


def test_state_survives_reopen_and_refuses_other_settings(tmp_path):
    st = WatchState.open(tmp_path, "r", {"prompts": 5})
    st.mark(st.point("step_1", 1), "evaluating", eval_run="x")
    again = WatchState.open(tmp_path, "r", {"prompts": 5})
    assert again.points["step_1"].status == "evaluating" and again.points["step_1"].eval_run == "x"
    with pytest.raises(WatchStateError, match="prompts: 5 then, 7 now"):
        WatchState.open(tmp_path, "r", {"prompts": 7})
    (tmp_path / "state.json").write_text("{torn")
    with pytest.raises(WatchStateError, match="unreadable watch state"):
        WatchState.open(tmp_path, "r", {"prompts": 5})
    assert not list(tmp_path.glob("state.json.tmp*"))


def test_training_jsonl_log_is_read_with_a_torn_last_line():
    data = (b'{"step": 100, "metrics": {"eval/acc_len": 3.5, "loss": 2.0}}\n'
            b'{"step": 200, "eval/acc_len": 3.6}\n{"step": 300, "metr')
    s = read_jsonl(data, ("eval/acc_len", "loss"))
    assert s == {"eval/acc_len": [(100, 3.5), (200, 3.6)], "loss": [(100, 2.0)]}
    assert value_at(s["eval/acc_len"], 250) == 3.6 and value_at(s["eval/acc_len"], 50) is None


def test_trajectory_answers_first_and_names_the_ddtree_budgets_that_ran(tmp_path):
    """trajectory.md opens with the newest checkpoint's τ and CI (and the best so far), then that
    checkpoint against the baseline paired prompt by prompt; the settings note names the DDTree
    budgets the points ran, even when the watch left the budgets to eval's default."""
    from orchestrator.watch.loop import headline
    from orchestrator.watch.state import Point
    from orchestrator.watch.trajectory import tau_cis, write_trajectory
    from fakeruns import make_run

    runs = tmp_path / "runs"
    base = make_run(runs, "20261202-0900-zlab-ct129", "zlab", prompts=20, mean=5.0)
    st = WatchState(run="v5", settings={"suite": "gsm8k", "prompts": 20, "mode": "offline", "max_new_tokens": 256,
                                        "thinking": "off", "ddtree_budgets": None})
    for i, (step, mean) in enumerate([(1000, 3.0), (2000, 4.6), (3000, 4.0)]):
        rid = f"20261203-10{i}0-v5-step{step}-ct129"
        d = make_run(runs, rid, "v5", f"step_{step}", prompts=20, mean=mean)
        st.points[f"step_{step}"] = Point(name=f"step_{step}", step=step, status="done", eval_run=rid,
                                          summary=headline(json.loads((d / "summary.json").read_text())))
    st.baseline = {"label": "zlab", "status": "done", "eval_run": base.name,
                   "summary": headline(json.loads((base / "summary.json").read_text()))}
    md = write_trajectory(tmp_path / "watch-v5", st, runs, {}, None, [])[0].read_text().split("\n")
    tau = {s: p.summary["tau_macro"] for s, p in st.points.items()}
    (lo, hi), _ = tau_cis(runs / st.points["step_3000"].eval_run)
    assert md[2] == (f"**v5 at step 3000 (the newest of 3 checkpoints evaluated): τ {tau['step_3000']:.2f} "
                     f"[{lo:.2f}, {hi:.2f}]; the best so far is step 2000, τ {tau['step_2000']:.2f}**  ")
    assert md[3].startswith("**v5 step 3000 vs zlab: τ −") and "v5 step 3000 worse on " in md[3]
    assert "DDTree budgets 8, 16, 32, 64." in "\n".join(md) and "`none`" not in "\n".join(md)
    for p in st.points.values():
        p.summary["ddtree"] = {}
    assert "no DDTree." in write_trajectory(tmp_path / "watch-v5", st, runs, {}, None, [])[0].read_text()


def test_live_view_shows_each_hosts_work_and_the_newest_points(tmp_path):
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from orchestrator.cli.watch import LiveView

    term = Console(file=io.StringIO(), force_terminal=True, width=100)
    view = LiveView(term)
    st = WatchState(run="r", settings={}, path=tmp_path / "state.json")
    st.mark(st.point("step_100", 100), "done", summary={"tau_macro": 2.5})
    view.watcher = SimpleNamespace(state=st)
    view.on_event("ct129", {"event": "sync", "checkpoint": "step_200"})
    view.on_event("ct130", {"event": "prompt", "done": 3, "prompts": 10, "tau_running": 3.14})
    out = Console(file=io.StringIO(), width=100)
    out.print(view.render())
    text = out.file.getvalue()
    assert "syncing step_200" in text and "eval: 3/10 prompts, τ 3.14" in text
    assert "step_100" in text and "2.500" in text


# --------------------------------------------------------------------------- on the SSH lab

@pytest.fixture(scope="module")
def lab(ssh_lab, embedded_pair, tmp_path_factory):
    base = tmp_path_factory.mktemp("watch")
    pair = Path(embedded_pair["target"]).parent
    shutil.copytree(pair, ssh_lab.eval.root / "workdir" / "embedded", dirs_exist_ok=True)
    return {"lab": ssh_lab, "base": base, "drafter": pair / "drafter",
            "inventory": ssh_lab.write_inventory(base / "inventory.yaml")}


class Run:
    """One training run of the lab: its catalog, runs folder and fake trainer."""

    def __init__(self, lab: dict, tmp: Path, settle: float = 2.0):
        self.lab, self.name = lab, f"w{uuid.uuid4().hex[:6]}"
        ev = lab["lab"].eval.root / "workdir" / "embedded"
        self.catalog = tmp / "drafters.yaml"
        self.catalog.write_text(yaml.safe_dump({
            "runs": {self.name: {"dir": self.name, "settle": settle, "log": "train.jsonl",
                                 "metrics": ["eval/acc_len", "loss"], "tau_metric": "eval/acc_len"}},
            "drafters": {self.name: {"run": self.name, "format": "zlab", "target": "tiny"},
                         "demo": {"path": str(ev / "drafter"), "format": "zlab", "target": "tiny"}},
            "targets": {"tiny": {"path": str(ev / "target")}}}))
        self.runs = tmp / "runs"
        self.src = lab["lab"].train.root / "checkpoints" / self.name
        self.dst = lab["lab"].eval.root / "checkpoints" / self.name
        self.folder = self.runs / f"watch-{self.name}"

    def env(self) -> dict:
        return {**os.environ, "DFLASH_OPS_CATALOG": str(self.catalog), "DFLASH_OPS_RUNS": str(self.runs), "COLUMNS": "160"}

    def watch(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "-i", str(self.lab["inventory"]), "watch",
                                 self.name, *EVAL_ARGS, *args], cwd=REPO, env=self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def train(self, steps: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(TESTS / "faketrain.py"), str(self.src), str(self.lab["drafter"]),
                                 "--steps", steps, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def state(self) -> dict:
        try:
            return json.loads((self.folder / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def eval_runs(self) -> list[str]:
        return sorted(p.name for p in self.runs.glob(f"*-{self.name}-step*") if (p / "run.json").exists())


def _rows(run: Run) -> list[tuple[str, str]]:
    """(step, checkpoint) of the trajectory's points, in the order trajectory.md lists them."""
    try:
        return re.findall(r"^\| (\d+) \| (step_\d+) \|", (run.folder / "trajectory.md").read_text(), re.M)
    except OSError:
        return []


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir() if p.is_file() and not p.name.startswith("."))
    assert names == sorted(p.name for p in b.iterdir() if p.is_file() and not p.name.startswith("."))
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.mark.worker
@pytest.mark.timeout(900)
@pytest.mark.timing
def test_watch_follows_training_each_checkpoint_once_never_half_written(lab, tmp_path):
    run = Run(lab, tmp_path)
    watch = run.watch("--interval", "1")
    trainer = None
    try:
        wait_for(lambda: run.state(), patience(10), "the watch state", watch)
        # the first checkpoint is written slowly (config first, then the weights piece by piece)
        trainer = run.train("100,200,300", "--slow", "100", "--gap", "2", "--pause", "0.5", "--metric", "100")
        wait_for(lambda: [p for p in run.state().get("points", {}).values() if p["status"] == "done"] and
                 len(run.state()["points"]) == 3 and
                 all(p["status"] == "done" for p in run.state()["points"].values()), 800, "3 evaluated points", watch)
        wait_for(lambda: len(_rows(run)) == 3, patience(10), "3 points in the trajectory", watch)
        assert trainer.wait(patience(10)) == 0
    finally:
        watch.send_signal(signal.SIGINT)
        out = finished(watch, patience(10)).stdout
        if trainer and trainer.poll() is None:
            trainer.kill()
    assert watch.returncode == 130, out
    # it saw step_100 half-written (first without weights, then still changing) and waited
    assert re.search(r"step_100: not complete yet \(expected files missing: weights", out), out
    assert re.search(r"step_100: not complete yet \(a file changed \d+s ago \(settle time 2s\)", out), out
    st = run.state()
    assert [(p["name"], p["status"], p["attempts"]) for p in st["points"].values()] == [
        ("step_100", "done", 0), ("step_200", "done", 0), ("step_300", "done", 0)]
    assert len(run.eval_runs()) == 3  # each checkpoint evaluated exactly once
    for step in (100, 200, 300):
        same_files(run.src / f"step_{step}", run.dst / f"step_{step}")
    assert _rows(run) == [("100", "step_100"), ("200", "step_200"), ("300", "step_300")]
    assert "Traceback" not in out


@pytest.mark.worker
@pytest.mark.timeout(900)
def test_killed_mid_sync_and_mid_eval_resumes_without_loss_or_duplicates(lab, tmp_path):
    run = Run(lab, tmp_path)
    assert run.train("100,200", "--gap", "0", "--metric", "100").wait(60) == 0
    time.sleep(2)                       # quiet for the settle time on the host's clock (ctime)
    args = ("--once", "--baseline", "demo", "--alarm-ratio", "3")
    # kill 1: while a checkpoint is syncing
    w = run.watch(*args)
    wait_for(lambda: any(p["status"] == "syncing" for p in run.state().get("points", {}).values()), 300,
             "a sync", w)
    os.killpg(w.pid, signal.SIGKILL)
    w.wait(30)
    # kill 2: while a checkpoint's eval worker runs (it keeps running on the host)
    w = run.watch(*args)

    def evaluating():
        for p in run.state().get("points", {}).values():
            if p["status"] == "evaluating" and p["eval_run"] and (run.runs / p["eval_run"] / "run.json").exists():
                return p
    killed = wait_for(evaluating, 400, "an eval", w)
    os.killpg(w.pid, signal.SIGKILL)
    w.wait(30)
    # a second watch of the run while one holds the lock refuses
    with RunLock(run.folder, run.name):
        busy = run.watch(*args)
        out = busy.communicate(timeout=120)[0]
        assert busy.returncode == 1 and "another `watch` of run" in out and "Traceback" not in out, out
    # the rerun finishes everything; the alarm (training claims τ 100) makes --once exit 6
    w = run.watch(*args)
    out = w.communicate(timeout=600)[0]
    assert w.returncode == 6, out
    assert "ALARM" in out and "Traceback" not in out
    st = run.state()
    assert [(p["name"], p["status"]) for p in st["points"].values()] == [("step_100", "done"), ("step_200", "done")]
    assert st["points"][killed["name"]]["eval_run"] == killed["eval_run"]  # re-attached, not started again
    assert len(run.eval_runs()) == 2, run.eval_runs()
    assert st["baseline"]["status"] == "done"
    for step in (100, 200):
        same_files(run.src / f"step_{step}", run.dst / f"step_{step}")
    md = (run.folder / "trajectory.md").read_text()
    assert "Alarm" in md and "training eval/acc_len" in md and "Baseline **demo**" in md
    # different settings on the same trajectory are refused (its points must stay comparable)
    w = run.watch("--once", "--baseline", "demo", "--prompts", "2")
    out = w.communicate(timeout=120)[0]
    assert w.returncode == 2 and "other settings" in out and "Traceback" not in out, out

    exe = chromium()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (CI is set)")
        pytest.skip("chromium is not installed")
    assert_images_decode(exe, tmp_path, run.folder / "trajectory.html", 3)  # τ, acceptance map, training


def test_trajectory_shows_the_engine_tau_of_each_point(tmp_path):
    """watch --engine: each point's summary carries the engine's own τ and speedup; the trajectory
    shows them beside ours (no engine columns for points without)."""
    from orchestrator.watch.loop import headline
    from orchestrator.watch.state import Point
    from orchestrator.watch.trajectory import write_trajectory
    from fakeruns import make_run

    runs = tmp_path / "runs"
    st = WatchState(run="v5", settings={"suite": "gsm8k", "prompts": 4, "mode": "online", "max_new_tokens": 64,
                                        "thinking": "off", "ddtree_budgets": None})
    for i, step in enumerate((1000, 2000)):
        rid = f"20261203-10{i}0-v5-step{step}-ct129"
        d = make_run(runs, rid, "v5", f"step_{step}", prompts=4, mode="online", ddtree=False, all_anchors=False)
        summary = json.loads((d / "summary.json").read_text())
        summary["engine"] = {"kind": "vllm", "tau_macro": 2.5 + i, "tau_pooled": 2.4 + i, "speedup": 1.25 + i,
                             "causes": {}}
        st.points[f"step_{step}"] = Point(name=f"step_{step}", step=step, status="done", eval_run=rid,
                                          summary=headline(summary))
    md = write_trajectory(tmp_path / "watch-v5", st, runs, {}, None, [])[0].read_text()
    assert "| engine τ macro | engine speedup |" in md
    assert "| 2.500 | 1.25 |" in md and "| 3.500 | 2.25 |" in md, md
    for p in st.points.values():
        p.summary.pop("engine")
    assert "engine τ" not in write_trajectory(tmp_path / "watch-v5", st, runs, {}, None, [])[0].read_text()
