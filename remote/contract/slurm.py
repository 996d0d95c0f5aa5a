"""Slurm's job states and reasons as dflash-ops reads them: one vocabulary for the login node's run
control (:mod:`remote.host.slurm`) and the user's machine (``hosts check``'s job). Stdlib only."""
from __future__ import annotations

# Slurm's job states (squeue %T, sacct State, scontrol's JobState), each as run control reads it. A
# job's base state (PENDING, RUNNING, SUSPENDED, an end) with Slurm's flags shown in its place
# (REQUEUED, COMPLETING, ...). Run control's ``queued`` is "waiting on the scheduler": not started
# yet, requeued, held, or suspended/stopped by Slurm (it ran, its processes are stopped, and it
# makes no progress until Slurm lets it go on): each is told as itself in ``why``.
WAITING = {                          # run control: queued; the words that open its `why`
    "PENDING": "queued",
    "REQUEUED": "requeued (queued again)",
    "REQUEUE_HOLD": "requeued and held",
    "REQUEUE_FED": "requeued (by its federation)",
    "RESV_DEL_HOLD": "held (its reservation was deleted)",
    "SPECIAL_EXIT": "requeued and held in SPECIAL_EXIT (by its exit value, an epilog's rule)",
    "CONFIGURING": "allocated, its nodes being made ready (CONFIGURING)",
    "SUSPENDED": "SUSPENDED by Slurm: it was running, its processes are stopped until Slurm resumes it",
    "STOPPED": "STOPPED (SIGSTOP): it was running, its processes are stopped, its allocation kept",
}
QUEUED = set(WAITING)
HELD = {"REQUEUE_HOLD", "RESV_DEL_HOLD", "SPECIAL_EXIT"}     # and any reason that says held
# running: RUNNING, COMPLETING, SIGNALING, STAGE_OUT, RESIZING, and any state Slurm adds that is neither
# waiting nor an end
# those after which nothing more happens to the task (PREEMPTED: PreemptMode=CANCEL; a job Slurm
# requeues after a preemption shows PENDING/REQUEUED instead)
WHY_ENDED = {
    "COMPLETED": "it completed",
    "TIMEOUT": "it ran into its time limit",
    "OUT_OF_MEMORY": "it ran out of memory",
    "NODE_FAIL": "its node failed",
    "CANCELLED": "it was cancelled in Slurm (scancel)",
    "BOOT_FAIL": "its node failed to boot",
    "DEADLINE": "it reached its deadline",
    "FAILED": "the task failed",
    "PREEMPTED": "it was preempted (cancelled) for a higher-priority job",
    "REVOKED": "it was revoked (it ran on another cluster of its federation)",
}
ENDED = set(WHY_ENDED)
NO_REASON = ("", "None", "(null)", "none")
REASONS = {                          # an ended task's reason, explained where Slurm's word alone is not
    "JobLaunchFailure": "its node could not launch it (its output file in the run folder could not be opened "
                        "there? workdir must be storage the login host and the compute nodes both see)",
}
SAID_BY_STATE = {"NonZeroExitCode", "TimeLimit", "OutOfMemory"}   # an end's reason its state or exit code says
