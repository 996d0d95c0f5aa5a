"""dflash-ops worker: runs on GPU hosts. Never imports `orchestrator`; stdlib + torch/transformers only."""
