"""`watch` under faults (issue 41), on the built-in `local` host with the sync and the eval stood
in for (the listing, the completeness rule, the host probes, the state and the trajectory are
the real ones): an eval host that does not answer is waited for (no attempt counted, its share
left to hosts that answer), a polling watch survives a failed listing of the training host, a
checkpoint the trainer rotated away is skipped as such, a given-up point is named each pass with
how to retry it, and an earlier run stands for a checkpoint only with the weights it measured."""
from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import DflashOpsError
from remote.contract.settings import EvalSettings

RUN = "v9"
SETTINGS = EvalSettings(suite="gsm8k", mode="offline", prompts=1)


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
                            self.evaluate(p))

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

    def evaluate(self, p) -> dict:
        self.on_eval(p.name)
        return {"prompts": 1, "tau_macro": 2.0 + p.step / 1000, "tau_pooled": 2.0, "mode": "offline"}

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
