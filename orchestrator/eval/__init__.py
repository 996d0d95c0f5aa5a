"""An eval from plan to results: the pipeline, host checks, placement, shipping the worker, the detached jobs on SSH hosts and Ray actors beside them, parity."""
