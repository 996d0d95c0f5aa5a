"""Serving engines run beside our own decoding: one module per engine (``vllm``, ``sglang``), the
part they share (``server``), the worker's engine phase (``phase``), the reconciliation of their
counts with ours (``accounting``) and known engine quirks reproduced on our drafter (``quirks``)."""
