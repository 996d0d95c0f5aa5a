"""``--log-to mlflow|tensorboard|wandb`` (on `eval` and `watch`): every finished eval run's metrics,
params (drafter, checkpoint, step, suite, settings, versions) and report, into an experiment
tracker, with the library itself (each an optional extra, imported only when asked for).

* mlflow: the tracking URI ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<runs>/mlflow.db``;
  experiment ``dflash-ops`` (or ``dflash-ops/<training run>`` under `watch`); report and summary
  as artifacts.
* tensorboard: event files under ``<runs>/tensorboard/<drafter>/`` (tensorboardX writer), one
  scalar per metric at the training step.
* wandb: offline mode (``<runs>/wandb``) unless ``WANDB_MODE`` says otherwise.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from ..errors import InputError, OperationFailed

TRACKERS = ("mlflow", "tensorboard", "wandb")
EXTRA = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}
_USERINFO = re.compile(r"(?<=//)[^/@\s]*@")


class TrackingError(InputError):
    pass


class TrackingFailed(OperationFailed):
    """A tracker could not take a finished run (its results are on disk all the same)."""


def redact(text: str) -> str:
    """``text`` with the user and password of every URL in it replaced (a database or HTTP
    tracking URI often carries them): what is printed or logged never holds a credential."""
    return _USERINFO.sub("***@", text)


def folder_name(name: str) -> str:
    """``name`` (a drafter's, a training run's) as one folder under the runs folder, never a way out of it."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._") or "eval"


def check_trackers(names: list[str]) -> list[str]:
    """The ``--log-to`` values, each checked and its library importable (a clear line if not)."""
    import importlib.util

    out = []
    for n in names:
        for name in filter(None, (x.strip() for x in n.split(","))):
            if name not in TRACKERS:
                raise TrackingError(f"--log-to {name!r}: choose from {', '.join(TRACKERS)}")
            module = {"tensorboard": "tensorboardX"}.get(name, name)
            if importlib.util.find_spec(module) is None:
                raise TrackingError(f"--log-to {name}: the {module} package is not installed "
                                    f"(pip install 'dflash-ops[{EXTRA[name]}]')")
            out.append(name)
    return out


def run_facts(run_dir: Path, step: int | None = None) -> tuple[dict, dict]:
    """(params, metrics) of a finished eval run folder (its files read and checked by runs/folders.py)."""
    from ..runs.folders import RunError, load_run, read_json

    run = load_run(run_dir)
    env, summary = run.env, run.summary
    if summary is None:
        raise RunError(f"{Path(run_dir) / 'summary.json'}: not there: the run has not finished")
    rec = read_json(Path(run_dir) / "run.json", lambda raw: None) or {}     # checked by load_run
    req = rec.get("request") or {}
    params = {"run_id": run_dir.name, "drafter": rec.get("drafter"), "checkpoint": rec.get("checkpoint"),
              "step": step, "suite": rec.get("suite"), "host": rec.get("host"), "mode": rec.get("mode"),
              "prompts": summary.get("prompts")}
    params.update({f"setting.{k}": Path(v).name if k.endswith("_path") and isinstance(v, str) else v
                   for k, v in req.items() if k not in ("hosts", "drafter")})   # folder names, not a host's layout
    params.update({f"version.{k}": v for k, v in (env.get("versions") or {}).items() if isinstance(v, (str, int, float))})
    expected = summary.get("expected") or {}        # offline at T > 0: no walk ran, its expected acceptance
    walk = {} if expected else summary
    metrics = {k: walk[k] for k in ("tau_macro", "tau_pooled", "cycles", "tokens") if isinstance(walk.get(k), (int, float))}
    metrics.update({f"expected_{k}": expected[k] for k in ("tau_macro", "tau_pooled")
                    if isinstance(expected.get(k), (int, float))})
    for k, a in enumerate(expected.get("per_position_acceptance") or [], start=1):
        metrics[f"expected_acceptance_{k}"] = a
    for b, t in (summary.get("ddtree") or {}).items():
        if isinstance((t or {}).get("tau_macro"), (int, float)):
            metrics[f"ddtree_{b}_tau_macro"] = t["tau_macro"]
    for k, a in enumerate(walk.get("per_position_acceptance") or [], start=1):
        metrics[f"acceptance_{k}"] = a
    return {k: v for k, v in params.items() if v is not None}, metrics


def log_run(trackers: list[str], run_dir: Path, runs_root: Path, *, step: int | None = None,
            group: str | None = None) -> list[str]:
    """Log one finished eval run to each tracker; returns where each went (for the user)."""
    params, metrics = run_facts(Path(run_dir), step)
    artifacts = [p for p in (Path(run_dir) / n for n in ("report.md", "report.html", "summary.json")) if p.exists()]
    where = []
    for t in trackers:
        try:
            where.append(_LOGGERS[t](params, metrics, artifacts, Path(runs_root), step, group))
        except Exception as e:  # noqa: BLE001 — any failure of the tracker's library or service
            why = (str(e).strip().splitlines() or [""])[0][:300]
            raise TrackingFailed(f"--log-to {t}: could not log run {Path(run_dir).name} ({type(e).__name__}: "
                                 f"{redact(why)}); its results are in {run_dir} all the same") from None
    return where


def _mlflow(params, metrics, artifacts, runs_root: Path, step, group) -> str:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(runs_root / 'mlflow.db').resolve()}"
    runs_root.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    name = f"dflash-ops/{group}" if group else "dflash-ops"
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        name, artifact_location=(runs_root / "mlflow-artifacts").resolve().as_uri() if uri.startswith("sqlite") else None)
    run = client.create_run(exp_id, run_name=params["run_id"], tags={"dflash-ops.run_id": params["run_id"]})
    now = int(time.time() * 1000)
    client.log_batch(run.info.run_id, metrics=[Metric(k, float(v), now, step or 0) for k, v in metrics.items()],
                     params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    for a in artifacts:
        client.log_artifact(run.info.run_id, str(a))
    client.set_terminated(run.info.run_id)
    return f"mlflow {redact(uri)} (experiment {name}, run {run.info.run_id})"


def _tensorboard(params, metrics, artifacts, runs_root: Path, step, group) -> str:
    from tensorboardX import SummaryWriter

    folder = runs_root / "tensorboard" / folder_name(group or params.get("drafter") or "eval")
    w = SummaryWriter(logdir=str(folder), filename_suffix=f".{params['run_id']}.{step or 0}")  # one file each
    try:
        for k, v in metrics.items():
            w.add_scalar(f"eval/{k}", float(v), global_step=step or 0)
        w.add_text("eval/params", "\n".join(f"{k}: {v}" for k, v in params.items()), global_step=step or 0)
    finally:
        w.close()
    return f"tensorboard {folder}"


def _wandb(params, metrics, artifacts, runs_root: Path, step, group) -> str:
    import wandb

    mode = os.environ.get("WANDB_MODE", "offline")
    folder = runs_root / "wandb"
    folder.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=f"dflash-ops-{group}" if group else "dflash-ops", name=params["run_id"],
                     config=params, dir=str(folder), mode=mode,
                     reinit="create_new")
    try:
        run.log({f"eval/{k}": v for k, v in metrics.items()}, step=step or 0)
        for a in artifacts:
            run.save(str(a), base_path=str(a.parent), policy="now")
    finally:
        run.finish()
        wandb.teardown()    # wait for wandb's service to write the run out before this process moves on or exits
    return f"wandb ({mode}) {folder}"


_LOGGERS = {"mlflow": _mlflow, "tensorboard": _tensorboard, "wandb": _wandb}
