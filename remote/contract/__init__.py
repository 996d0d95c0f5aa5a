"""What the worker and the control plane agree on, stdlib only: the eval settings, run states and
exit codes, the metrics, the library versions, the worker's event names. The only part of the
worker that the control plane imports (besides the self-contained host tools it ships)."""
