"""`watch` under faults (issue 41), on the built-in `local` host with the sync and the eval stood
in for (the listing, the completeness rule, the host probes, the state and the trajectory are
the real ones): an eval host that does not answer is waited for (no attempt counted, its share
left to hosts that answer), a polling watch survives a failed listing of the training host, a
checkpoint the trainer rotated away is skipped as such, a given-up point is named each pass with
how to retry it, an earlier run stands for a checkpoint only with the weights it measured, and a
checkpoint saved again after its point is evaluated again (the old point kept as superseded).
On the SSH lab with the real sync: a copy watch synced is replaced when its checkpoint changes,
one made otherwise is refused."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
import threading
import types
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import DflashOpsError
from remote.contract.settings import EvalSettings

RUN = "v9"
SETTINGS = EvalSettings(suite="gsm8k", mode="offline", prompts=1)
_EVALS = itertools.count(1)


def fake_eval(runs: Path, run: str, p, weights: Path, on_id) -> dict:
    """An eval of point ``p`` stood in for: a run folder whose env.json records the sha256 of the
    weights in ``weights`` (as the worker records the copy it loaded), and its headline numbers."""
    from fakeruns import make_run

    rid = f"20260202-{next(_EVALS):04d}-{run}-step{p.step}-local"
    sha = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in weights.glob("*.safetensors")}
    make_run(runs, rid, run, p.name, prompts=1, host="local", env={"drafter": {"sha256": sha}})
    on_id(rid)
    return {"prompts": 1, "tau_macro": 2.0 + p.step / 1000, "tau_pooled": 2.0, "mode": "offline"}


def closed_port() -> int:
    """A local TCP port nothing listens on (a connection to it is refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A training run on `local` (its checkpoints in a folder of the test) and, where asked, a
    host `down` (an SSH host whose port refuses connections) as eval or training host."""

    def __init__(self, tmp: Path, monkeypatch, steps=(100, 200, 300), down: str | None = None):
        from orchestrator.names import Resolver

        import functools

        from orchestrator import transport

        monkeypatch.setenv("DFLASH_OPS_HOME", str(tmp / "home"))
        monkeypatch.setattr(transport, "runner_for", functools.partial(transport.runner_for, retries=0))
        self.ckpts = tmp / "ckpts"
        self.run_dir = self.ckpts / RUN
        for step in steps:
            self.save(step)
        hosts = {"local": {"checkpoints": str(self.ckpts)}}
        if down:
            hosts["down"] = {"address": "127.0.0.1", "port": closed_port(), "roles": [down], "python": "python3",
                             "checkpoints": "/nonexistent", "workdir": "/nonexistent", "trust_host_key": True}
        (tmp / "inventory.yaml").write_text(yaml.safe_dump({"hosts": hosts}))
        (tmp / "drafters.yaml").write_text(yaml.safe_dump({
            "runs": {RUN: {"dir": RUN, "pattern": "step_{step}", "settle": 0}},
            "drafters": {RUN: {"run": RUN, "format": "zlab", "target": "t"}},
            "targets": {"t": {"path": "/nonexistent"}}}))
        self.names = Resolver(str(tmp / "inventory.yaml"), str(tmp / "drafters.yaml"), tmp / "runs")
        self.said: list[tuple[str, str]] = []
        self.synced: list[tuple[str, str]] = []     # (checkpoint, eval host)
        self.fail: dict[str, str] = {}              # checkpoint -> the sync's error
        self.on_eval = lambda name: None
        monkeypatch.setattr("orchestrator.sync.sync_checkpoint", self.sync)
        monkeypatch.setattr("orchestrator.watch.loop.Watcher._evaluate", lambda w, p, drafter, host, on_id:
                            self.evaluate(p, on_id))

    def save(self, step: int) -> None:
        d = self.run_dir / f"step_{step}"
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}\n")
        (d / "model.safetensors").write_bytes(b"w" * 64)

    def sync(self, inv, catalog, name, *, run, src_name, dst_name, **kw):
        """What the sync does before a byte moves: both hosts reached, the checkpoint resolved in
        a listing of the training host."""
        from orchestrator.sync.listing import host_checkpoints
        from orchestrator.sync.plan import resolve_name
        from orchestrator.transport import runner_for

        src, dst = inv.pick("train", src_name), inv.pick("eval", dst_name)
        with runner_for(dst, inv) as drun, runner_for(src, inv) as srun:
            drun.connect()
            r = catalog.run(run)
            info = host_checkpoints(srun, src, [r], lambda x: x.source_dir(src.checkpoints))[run]
            resolve_name(name, r, info, src)
        if name in self.fail:
            from orchestrator.sync import SyncError

            raise SyncError(self.fail[name])
        self.synced.append((name, dst.name))
        return types.SimpleNamespace(copy_digest=None)

    def evaluate(self, p, on_id) -> dict:
        self.on_eval(p.name)
        return fake_eval(self.names.runs_root, RUN, p, self.run_dir / p.name, on_id)

    def watcher(self, hosts=("local",), **opts):
        from orchestrator.watch.loop import Watcher, WatchOptions

        return Watcher(self.names, WatchOptions(run=RUN, hosts=list(hosts), settings=SETTINGS, **opts),
                       lambda level, msg: self.said.append((level, msg)))

    def points(self, w) -> dict[str, tuple[str, int]]:
        return {n: (p.status, p.attempts) for n, p in sorted(w.state.points.items())}

    def lines(self, text: str) -> list[str]:
        return [m for _, m in self.said if text in m]


def test_an_eval_host_that_does_not_answer_is_waited_for_and_leaves_its_share_to_the_others(tmp_path, monkeypatch):
    lab = Lab(tmp_path, monkeypatch, down="eval")
    w = lab.watcher(hosts=("down",))
    for _ in range(3):                                  # three passes with the one eval host down
        result = w.watch(once=True, every_s=0)
        assert not result.failed and not result.evaluated
    assert w.state.points == {} or all(a == 0 for _, a in lab.points(w).values()), lab.points(w)
    waiting = lab.lines("waiting for down")
    assert len(waiting) == 3 and "connection refused" in waiting[0], lab.said
    with pytest.raises(DflashOpsError, match="waiting for down"):
        result.raise_for_outcome(w.folder / "trajectory.html")
    # with a host that answers beside it, that host takes the whole queue
    lab.on_eval = lambda name: __import__("time").sleep(0.2)
    w = lab.watcher(hosts=("down", "local"))
    result = w.watch(once=True, every_s=0)
    assert sorted(result.evaluated) == ["step_100", "step_200", "step_300"] and not result.failed
    assert lab.points(w) == {f"step_{s}": ("done", 0) for s in (100, 200, 300)}
    assert sorted(h for _, h in lab.synced) == ["local"] * 3
    result.raise_for_outcome(w.folder / "trajectory.html")       # nothing left undone: exit 0


def test_a_host_that_stops_answering_mid_checkpoint_costs_no_attempt(tmp_path, monkeypatch):
    from orchestrator.transport import TransportError

    lab = Lab(tmp_path, monkeypatch, steps=(100,))
    w = lab.watcher()
    dropped = []
    monkeypatch.setattr(type(w), "_unreachable", lambda self, host: dropped.pop() if dropped else None)

    def dies(name):                 # the host goes away while the eval runs, and is back for the next pass
        dropped.append("host local: connection refused")
        raise TransportError("host local: the connection dropped")
    lab.on_eval = dies
    for _ in range(3):
        w.watch(once=True, every_s=0)
    assert lab.points(w) == {"step_100": ("waiting", 0)}
    assert w.state.points["step_100"].reason == "waiting for local: host local: connection refused"
    assert len(lab.lines("not counted as an attempt")) == 3 and len(lab.synced) == 3


def test_a_polling_watch_survives_a_failed_listing_of_the_training_host(tmp_path, monkeypatch):
    lab = Lab(tmp_path, monkeypatch, down="train")
    w = lab.watcher()
    stop = threading.Event()
    said = lab.said.append

    def say(level, msg):
        said((level, msg))
        if len(lab.lines("cannot list")) >= 2:
            stop.set()
    w.say = say
    result = w.watch(once=False, every_s=0.01, stop=stop)          # before: the first refusal ended the watch
    listing = lab.lines("cannot list")
    assert len(listing) == 2 and "down" in listing[0] and "connection refused" in listing[0], lab.said
    assert "next pass" in listing[0]
    with pytest.raises(DflashOpsError, match="cannot list"):        # --once: one line, exit 1
        result.raise_for_outcome(w.folder / "trajectory.html")


def test_a_checkpoint_the_trainer_rotated_away_is_skipped_not_failed(tmp_path, monkeypatch):
    import shutil

    lab = Lab(tmp_path, monkeypatch, steps=(100, 200))
    lab.fail["step_100"] = "boom"
    w = lab.watcher()
    w.watch(once=True, every_s=0)
    assert lab.points(w) == {"step_100": ("failed", 1), "step_200": ("done", 0)}
    # the trainer keeps the newest checkpoints only: step_100 is deleted before the next pass, and
    # step_300 (listed by that pass) while step_400 is evaluated, before step_300's sync
    lab.save(300)
    lab.save(400)
    shutil.rmtree(lab.run_dir / "step_100")
    lab.on_eval = lambda name: shutil.rmtree(lab.run_dir / "step_300") if name == "step_400" else None
    lab.fail.clear()
    w2 = lab.watcher()
    result = w2.watch(once=True, every_s=0)
    assert result.evaluated == ["step_400"] and not result.failed, (result, lab.said)
    result.raise_for_outcome(w2.folder / "trajectory.html")        # exit 0
    points = lab.points(w2)
    assert points["step_300"] == ("gone", 0) and points["step_100"] == ("gone", 1), points
    assert w2.state.points["step_300"].reason.startswith("gone from the training host")
    assert lab.lines("step_300: gone from the training host") and lab.lines("step_100: gone from the training host")
    md = (w2.folder / "trajectory.md").read_text()
    assert "| 300 | step_300 | gone |" in md and "| failed |" not in md, md
    # saved again under the same name: evaluated like a new checkpoint
    lab.save(300)
    assert lab.watcher().watch(once=True, every_s=0).evaluated == ["step_300"]


def test_a_given_up_point_is_named_each_pass_and_more_attempts_retry_it(tmp_path, monkeypatch):
    lab = Lab(tmp_path, monkeypatch, steps=(100,))
    lab.fail["step_100"] = "boom"
    w = lab.watcher(max_attempts=1)
    w.watch(once=True, every_s=0)
    assert lab.points(w) == {"step_100": ("gave_up", 1)}
    lab.said.clear()
    for _ in range(2):
        assert not w.watch(once=True, every_s=0).failed
    named = lab.lines("step_100: given up")
    assert len(named) == 2 and "boom" in named[0] and "--max-attempts 2" in named[0], lab.said
    lab.fail.clear()
    w = lab.watcher(max_attempts=2)
    assert w.watch(once=True, every_s=0).evaluated == ["step_100"]
    assert lab.points(w) == {"step_100": ("done", 1)}


def test_an_invalid_run_is_not_retried_until_max_attempts_is_raised(tmp_path, monkeypatch):
    from orchestrator.eval.pipeline import InvalidRun

    lab = Lab(tmp_path, monkeypatch, steps=(100,))

    def invalid(name):
        raise InvalidRun("the run is invalid: τ out of range")
    lab.on_eval = invalid
    w = lab.watcher()
    w.watch(once=True, every_s=0)
    w.watch(once=True, every_s=0)
    assert lab.points(w) == {"step_100": ("gave_up", 1)}
    assert "--max-attempts 4" in lab.lines("step_100: given up")[0]
    lab.on_eval = lambda name: None
    assert lab.watcher(max_attempts=4).watch(once=True, every_s=0).evaluated == ["step_100"]


def test_an_earlier_run_stands_for_a_checkpoint_only_with_the_weights_it_measured(tmp_path, monkeypatch):
    import hashlib

    from fakeruns import make_run

    lab = Lab(tmp_path, monkeypatch, steps=(100, 200))
    weights = hashlib.sha256(b"w" * 64).hexdigest()
    # step_200 saved again since its run measured it; step_100's newest run measured other weights too
    for rid, step, sha in (("0001", 100, weights), ("0002", 200, "0" * 64), ("0003", 100, "1" * 64)):
        make_run(tmp_path / "runs", f"20260101-{rid}-{RUN}-step{step}-local", RUN, f"step_{step}",
                 prompts=1, host="local", env={"drafter": {"sha256": {"model.safetensors": sha}}})
    w = lab.watcher()
    result = w.watch(once=True, every_s=0)
    assert sorted(result.evaluated) == ["step_100", "step_200"]
    assert [n for n, _ in lab.synced] == ["step_200"], lab.said       # step_100 reused, step_200 evaluated anew
    assert w.state.points["step_100"].eval_run == f"20260101-0001-{RUN}-step100-local"
    assert lab.lines(f"step_200: run 20260101-0002-{RUN}-step200-local not reused: the weights it measured "
                     "(model.safetensors) are not the checkpoint's on local now")


def test_a_checkpoint_saved_again_is_evaluated_again_and_its_old_point_kept_as_superseded(tmp_path, monkeypatch):
    lab = Lab(tmp_path, monkeypatch, steps=(100, 200))
    w = lab.watcher()
    w.watch(once=True, every_s=0)
    old_run = w.state.points["step_200"].eval_run
    state = json.loads((w.folder / "state.json").read_text())     # as a watch before superseded points wrote it
    for key in ("superseded", "copies"):
        state.pop(key, None)
    for point in state["points"].values():
        point.pop("ident", None)
    (w.folder / "state.json").write_text(json.dumps(state))
    # step_200 saved again with other weights; step_100 only touched (the same bytes)
    (lab.run_dir / "step_200" / "model.safetensors").write_bytes(b"v" * 64)
    os.utime(lab.run_dir / "step_100" / "model.safetensors")
    lab.synced.clear()
    w = lab.watcher()
    result = w.watch(once=True, every_s=0)
    assert result.evaluated == ["step_200"] and [n for n, _ in lab.synced] == ["step_200"], lab.said
    assert lab.lines("step_200: saved again on local since it was evaluated (model.safetensors changed); "
                     "evaluated again, its old point kept as superseded")
    (old,) = w.state.superseded
    assert (old.name, old.status, old.eval_run) == ("step_200", "superseded", old_run)
    assert lab.points(w) == {"step_100": ("done", 0), "step_200": ("done", 0)}
    assert w.state.points["step_200"].eval_run != old_run
    md = (w.folder / "trajectory.md").read_text()
    assert "the newest of 2 checkpoints evaluated" in md, md          # the superseded point is no step's value
    assert "Superseded" in md and f"| 200 | step_200 | 2.200 | {old_run} | saved again on local" in md, md
    assert "superseded (saved again since)" in (w.folder / "plots" / "tau.svg").read_text()    # a grey mark
    # the next pass lists the same files: nothing hashed or evaluated again
    assert not lab.watcher().watch(once=True, every_s=0).evaluated


def test_a_copy_watch_synced_is_replaced_when_its_checkpoint_changes_and_one_it_did_not_is_refused(
        ssh_lab, tmp_path, monkeypatch):
    """step_100 saved again after its point: the eval host's copy is watch's own (its digest in
    state.json), so it is synced again over it (before: "already exists, a copy of other files" for
    ever). A copy of which watch has no record (synced by hand) is refused as before, left as it was."""
    from orchestrator.names import Resolver
    from orchestrator.sync import SyncError
    from orchestrator.watch.loop import Watcher, WatchOptions
    from synclab import FAST, Env, identical

    env = Env(ssh_lab, tmp_path)
    env.cat_path.write_text(json.dumps({"runs": {env.run: {"dir": env.run, "pattern": "step_{step}", "settle": 0}},
                                        "drafters": {env.run: {"run": env.run, "format": "zlab", "target": "t"}},
                                        "targets": {"t": {"path": "/nonexistent"}}}))
    env.ckpt(100, {"config.json": b"{}\n", "model.safetensors": b"a" * 1000})
    runs, copy = tmp_path / "runs", env.dst_run / "step_100"
    monkeypatch.setattr(Watcher, "_evaluate", lambda w, p, drafter, host, on_id:       # measures the eval host's copy
                        fake_eval(runs, env.run, p, copy, on_id))
    said = []

    def watch():
        w = Watcher(Resolver(str(env.inv_path), str(env.cat_path), runs),
                    WatchOptions(run=env.run, hosts=["eval"], settings=SETTINGS, redo=True),
                    lambda level, msg: said.append(msg),
                    sync_kw=FAST)
        return w, w.watch(once=True, every_s=0)
    w, result = watch()
    assert result.evaluated == ["step_100"] and list(w.state.copies["eval"]) == ["step_100"]
    env.ckpt(100, {"model.safetensors": b"b" * 1000})
    w, result = watch()
    assert result.evaluated == ["step_100"] and not result.failed, said
    identical(env.src_run / "step_100", copy)
    assert not (env.dst_run / ".old-step_100").exists()
    measured = json.loads((runs / w.state.points["step_100"].eval_run / "env.json").read_text())["drafter"]["sha256"]
    assert measured == {"model.safetensors": hashlib.sha256(b"b" * 1000).hexdigest()}
    env.ckpt(100, {"model.safetensors": b"c" * 1000})
    with pytest.raises(SyncError, match="already exists, a copy of other files"):     # a digest not the copy's
        env.sync("100", replace_own_copy=hashlib.sha256(b"not that copy").hexdigest())
    assert (copy / "model.safetensors").read_bytes() == b"b" * 1000


def test_an_eval_whose_worker_hangs_is_recorded_as_stalled_and_the_watch_moves_on(tmp_path, monkeypatch):
    """Before: a hung worker (alive, its follower's heartbeats coming, no progress) was followed for
    ever: the watch stalled with it and evaluated nothing more."""
    from fakeruns import hung_job, local_run
    from orchestrator.eval.pipeline import jobs_of
    from orchestrator.names import Resolver
    from orchestrator.runs.record import RunRecord

    lab = Lab(tmp_path, monkeypatch, steps=(100, 200))
    inventory = yaml.safe_load((tmp_path / "inventory.yaml").read_text())
    inventory["hosts"]["local"]["stall_minutes"] = 0.05
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump(inventory))
    lab.names = Resolver(str(tmp_path / "inventory.yaml"), str(tmp_path / "drafters.yaml"), tmp_path / "runs")
    rid = f"20260101-000000-{RUN}-step200-local"
    folder = local_run(tmp_path / "home", tmp_path / "runs", rid, status="running", drafter=RUN, checkpoint="step_200")
    pid = hung_job(tmp_path / "home" / "runs" / rid, done=2)
    w = lab.watcher()

    def evaluate(name):         # step_200's eval: a worker that hangs after 2 of its 3 prompts
        if name == "step_200":
            record = RunRecord.load(folder)
            w._follow(record, jobs_of(record, w.inv))
    lab.on_eval = evaluate
    passes = []
    watching = threading.Thread(target=lambda: passes.append(w.watch(once=True, every_s=0)), daemon=True)
    try:
        watching.start()
        watching.join(60)
        assert passes, "the watch is still following the hung worker"
    finally:
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass
    assert passes[0].evaluated == ["step_100"] and passes[0].failed == ["step_200"], passes[0]
    p = w.state.points["step_200"]
    assert (p.status, p.attempts) == ("failed", 1)
    assert p.reason.startswith(f"run {rid} stalled: local: no progress from its worker for 0.05 min (2 of 3 prompts "
                               f"done)") and f"dflash-ops cancel {rid}" in p.reason, p.reason
    assert lab.lines(f"step_200: failed (attempt 1 of 3): run {rid} stalled")
