"""Run folders on this machine: the run record (run.json), reading runs, their metrics."""
