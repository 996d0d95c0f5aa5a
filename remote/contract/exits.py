"""How a worker run ends: its exit statuses (stdlib only; the orchestrator reads them from the
``exit_code`` file :mod:`remote.host.launch` writes)."""
DONE = 0
CHECK_FAILED = 1        # drafter/target mismatch, bad prompts, a library the host must not use, SGLang down
USAGE = 2               # missing folders, results already there without --resume, ...
CRASHED = 3             # an unexpected error during the run (finished prompts kept)
INVALID = 4             # the results are wrong: greedy online output differs from the target's own

MEANING = {DONE: "done", CHECK_FAILED: "a check failed", USAGE: "bad usage", CRASHED: "crashed",
           INVALID: "invalid results"}
