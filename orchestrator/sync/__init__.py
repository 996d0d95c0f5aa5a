"""`sync-ckpt` / `ckpts`: move a training checkpoint to the eval host through this machine,
streamed, resumable, sha256-verified, atomic; list a training run's checkpoints.

- plan.py: which run and checkpoint a name means; per file send / resume / skip
- relay.py: the data path (two OpenSSH clients joined by a pipe per file), its progress events
- lock.py: the destination lock and finalization (``sync_host.py hold``)
- listing.py: checkpoints on the training host and whether the eval host has them
- transfer.py: one sync from start to end
- tool.py: ``remote/sync_host.py`` shipped as an argument and its answers
"""
from .listing import CkptRow, list_checkpoints
from .plan import FilePlan, SyncPlan, SyncResult, newest_run
from .relay import SyncProgress
from .tool import SyncError
from .transfer import LOCK_WAIT, sync_checkpoint

__all__ = ["CkptRow", "FilePlan", "LOCK_WAIT", "SyncError", "SyncPlan", "SyncProgress", "SyncResult",
           "list_checkpoints", "newest_run", "sync_checkpoint"]
