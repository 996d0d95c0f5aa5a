"""dflash-ops control plane: runs on the user's machine; never imports torch."""
