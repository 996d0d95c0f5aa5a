"""`dflash-ops parity RUN`: teacher-forced per-position accuracy of a finished run's checkpoint,
computed the training way (batched anchor mask) and the eval way (per anchor) on the run's own
completions, on the host that ran it (``python -m remote.parity``); for a drafter SpecForge trains,
SpecForge's own training-side numbers on the same anchors and the gaps between them and ours."""
from __future__ import annotations

import json

from ..errors import OperationFailed
from .pipeline import default_device
from ..config.inventory import Inventory
from ..runs.record import RunRecord
from .ship import ship
from ..transport import runner_for


class ParityError(OperationFailed):
    """Parity could not be computed, or the two paths disagree."""


def run_parity(record: RunRecord, inventory: Inventory, max_anchors: int = 2000) -> dict:
    """remote/parity.py's report (also written to ``<run>/parity.json``)."""
    shard = record.shards[0]
    host = inventory.get(shard.host)
    runner = runner_for(host, inventory)
    with runner:
        host = host.on_host(runner.expand_home)
        code_dir = ship(runner, host.python, host.workdir)
        remote_in, remote_out = f"{shard.run_dir}/parity-input.jsonl", f"{shard.run_dir}/parity.json"
        runner.put_file(record.folder / "results.jsonl", remote_in)
        device = default_device(host, record.request)
        argv = [host.python, "-m", "remote.parity", "--target", shard.target_path, "--drafter", shard.drafter_path,
                "--results", remote_in, "--out", remote_out, "--max-anchors", str(max_anchors)]
        argv += ["--device", device] if device else []
        res = runner.run(argv, timeout=3600, env={"PYTHONPATH": code_dir}, cwd=code_dir)
        if not res.ok:
            raise ParityError(f"parity failed on {host.name}: {res.stderr.strip()[-1500:]}")
        runner.get_file(remote_out, record.folder / "parity.json")
    return json.loads((record.folder / "parity.json").read_text())


def three_way(record: RunRecord, report: dict) -> list[tuple[str, str, str]]:
    """τ of the same checkpoint on the run's prompts, each as (what, τ, how it is counted):
    teacher-forced the training way and the eval way (``report``'s estimates: 1 + Σ cumulative
    accuracy), our online decoding, SpecForge's training-side τs where ``report`` has them
    (remote/parity.py ``SpecForgeTally``), and for an `eval --engine` run the serving engine's own
    count, with the causes of its difference from ours that the worker's checks showed
    (reports/engine.py). Pooled τ throughout (Σ over anchors or cycles)."""
    from ..reports.engine import causes_text, engine_name
    from ..runs.folders import load_run
    from ..reports.render import fnum

    run = load_run(record.folder)
    m = run.metrics
    rows = [("teacher-forced, training way (batched mask)", fnum(report["tau_estimate"]["training"], 3),
             "1 + Σ cumulative per-position accuracy over the run's completions"),
            ("teacher-forced, eval way (per anchor)", fnum(report["tau_estimate"]["eval"], 3), "the same, per anchor")]
    if run.mode == "online":
        rows.append(("ours, online (speculative decoding)", fnum(m.get("tau_pooled"), 3),
                     "Σ committed tokens / Σ cycles"))
    sf = report.get("specforge") or {}
    if sf:
        rows.append(("SpecForge, accuracy-derived (training metric)", fnum(sf["accuracy_tau"], 3),
                     "the same, teacher-forced, SpecForge's positions"))
    if "accept_len" in sf:
        rows.append(("SpecForge accept_len (Domino)", fnum(sf["accept_len"], 3),
                     "1 + each block's teacher-forced accepted prefix, mean"))
    if "expected_tau" in sf:
        rows.append(("SpecForge expected τ (DSpark)", fnum(sf["expected_tau"], 3),
                     "1 + Σ cumulative accept probability, mean over blocks"))
    if "confidence_tau" in sf:
        rows.append(("DSpark confidence head's τ", fnum(sf["confidence_tau"], 3), "the same with σ(head)"))
    e = m.get("engine")
    if e:
        causes = e.get("causes") or {}
        rows.append((f"{engine_name(run)}, its own count", fnum(e.get("tau_pooled"), 3),
                     "why it differs from ours: " + (causes_text(causes, e.get("prompts") or 0) if causes
                                                     else "it does not")))
    return rows


def specforge_rows(report: dict) -> list[list[str]]:
    """SpecForge's per-position accuracy of ``report["specforge"]``, one row per block position:
    (token ``p+1+i``, the slot that drafts it, accuracy, positions counted), then the pooled total
    (Σ correct / Σ positions, as SpecForge's evaluator pools it); [] without it."""
    sf = report.get("specforge")
    if not sf:
        return []
    rows = [[f"p+{i + 1}", str(sf["first_slot"] + i), f"{a:.3f}", str(n)]
            for i, (a, n) in enumerate(zip(sf["per_position"], sf["per_position_count"]))]
    rows.append(["all", "", f"{sf['accuracy']:.3f}", str(sf["denominator"])])
    return rows
