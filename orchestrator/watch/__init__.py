"""`dflash-ops watch`: evaluate a training run as it trains.

- state.py: the watch state (runs/watch-RUN/state.json, atomic) and the run's lock
- loop.py: poll → select → sync → eval → record, one eval at a time per eval host
- trainlog.py: the training run's own logged metrics (JSONL or TensorBoard), read-only
- trajectory.py: trajectory.md / trajectory.html
"""
from .loop import PassResult, Watcher, WatchOptions, select
from .state import RunLock, WatchBusy, WatchState

__all__ = ["PassResult", "RunLock", "WatchBusy", "WatchOptions", "WatchState", "Watcher", "select"]
