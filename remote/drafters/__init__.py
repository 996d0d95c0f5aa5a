"""The drafters: one module per family (``dflash``: z-lab's DFlash and DFlash2 and the speculators
variants) beside their configuration (``config``, no torch), checkpoint formats (``checkpoint``),
drafter/target compatibility (``compat``), export (``export``), the sampling rule (``sampling``),
the reference training step (``train``) and the tiny builders (``tiny``)."""
