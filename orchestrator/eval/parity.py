"""`dflash-ops parity RUN`: teacher-forced per-position accuracy of a finished run's checkpoint,
computed the training way (batched anchor mask) and the eval way (per anchor) on the run's own
completions, on the host that ran it (``python -m remote.parity``)."""
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
