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

import json
import os
import time
from pathlib import Path

from ..errors import InputError

TRACKERS = ("mlflow", "tensorboard", "wandb")
EXTRA = {"mlflow": "mlflow", "tensorboard": "tensorboard", "wandb": "wandb"}


class TrackingError(InputError):
    pass


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
    """(params, metrics) of a finished eval run folder."""
    rec = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    env = json.loads((run_dir / "env.json").read_text()) if (run_dir / "env.json").exists() else {}
    summary = json.loads((run_dir / "summary.json").read_text())
    req = rec.get("request") or {}
    params = {"run_id": run_dir.name, "drafter": rec.get("drafter"), "checkpoint": rec.get("checkpoint"),
              "step": step, "suite": rec.get("suite"), "host": rec.get("host"), "mode": rec.get("mode"),
              "prompts": summary.get("prompts")}
    params.update({f"setting.{k}": v for k, v in req.items() if k not in ("hosts", "drafter")})
    params.update({f"version.{k}": v for k, v in (env.get("versions") or {}).items() if isinstance(v, (str, int, float))})
    metrics = {k: summary[k] for k in ("tau_macro", "tau_pooled", "cycles", "tokens") if isinstance(summary.get(k), (int, float))}
    for b, t in (summary.get("ddtree") or {}).items():
        if isinstance((t or {}).get("tau_macro"), (int, float)):
            metrics[f"ddtree_{b}_tau_macro"] = t["tau_macro"]
    for k, a in enumerate(summary.get("per_position_acceptance") or [], start=1):
        metrics[f"acceptance_{k}"] = a
    return {k: v for k, v in params.items() if v is not None}, metrics


def log_run(trackers: list[str], run_dir: Path, runs_root: Path, *, step: int | None = None,
            group: str | None = None) -> list[str]:
    """Log one finished eval run to each tracker; returns where each went (for the user)."""
    params, metrics = run_facts(Path(run_dir), step)
    artifacts = [p for p in (Path(run_dir) / n for n in ("report.md", "report.html", "summary.json")) if p.exists()]
    return [_LOGGERS[t](params, metrics, artifacts, Path(runs_root), step, group) for t in trackers]


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
    return f"mlflow {uri} (experiment {name}, run {run.info.run_id})"


def _tensorboard(params, metrics, artifacts, runs_root: Path, step, group) -> str:
    from tensorboardX import SummaryWriter

    folder = runs_root / "tensorboard" / (group or params.get("drafter") or "eval")
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
