"""`sync-ckpt` / `ckpts`: move a training checkpoint to the eval host through this machine,
streamed, resumable, sha256-verified, atomic; list a training run's checkpoints.

- plan.py: which run and checkpoint a name means; per file send / resume / skip
- relay.py: the data path (two OpenSSH clients joined by a pipe per file, riding one master
  connection per host), its progress events
- tunnel.py: ``--tunnel``: the eval host pulls through a tunnel this machine forwards
- lock.py: the destination lock and finalization (the eval host's ``sync_host.py serve`` session)
- listing.py: checkpoints on the training host and whether the eval host has them
- transfer.py: one sync from start to end
- tool.py: ``remote/sync_host.py`` shipped as an argument, its answers, one session per host
"""
from .listing import CkptRow, list_checkpoints
from .plan import FilePlan, SyncPlan, SyncResult, newest_run
from .relay import SyncProgress
from .tool import SyncError
from .transfer import LOCK_WAIT, TunnelFallback, data_mode, sync_checkpoint
from .tunnel import TunnelUnavailable

__all__ = ["CkptRow", "FilePlan", "LOCK_WAIT", "SyncError", "SyncPlan", "SyncProgress", "SyncResult",
           "TunnelFallback", "TunnelUnavailable", "data_mode", "list_checkpoints", "newest_run", "sync_checkpoint"]
