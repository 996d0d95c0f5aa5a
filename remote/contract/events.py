"""The events a run's folder carries in ``events.jsonl``, one JSON object a line with its name under
``"event"``: the worker's progress and the run control's own lines, as every reader matches them."""
from __future__ import annotations

KEY = "event"

# the worker (remote/worker.py), in the order a run writes them
PHASE = "phase"          # {"phase": what it is doing before the first prompt (loading target, ...)}
START = "start"          # {"prompts", "done", "mode"}: the prompts it will decode now
PROMPT = "prompt"        # one finished prompt: {"id", "index", "done", "prompts", "cycles", "tau", ...}
END = "end"              # {"summary"}: summary.json's content
ERROR = "error"          # {"message"}: why it stopped

# the run control (remote/host/launch.py follow)
HEARTBEAT = "heartbeat"  # the follower is alive while the worker is quiet
EXIT = "exit"            # the last line: the job's state and exit code
SCHEDULER = "scheduler"  # a Slurm task's state changed: {"state": queued|running|..., "slurm_state", "why", "node", "job"}

# watch's own, shown beside its workers' events
SYNC = "sync"            # {"checkpoint"}: a checkpoint being synced to the eval host

PROGRESS = (START, PROMPT)   # the events that count as a worker's progress
