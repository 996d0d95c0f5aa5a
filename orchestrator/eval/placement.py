"""Where a run's workers go: ``--gpus all|N|0,2,5`` on each eval host -> one shard per (host, GPU).

A shard that owns a GPU runs its worker with ``CUDA_VISIBLE_DEVICES=<id>``, so inside the worker
that GPU is ``cuda:0``. On a host without CUDA (or with ``--device cpu``) the ids are only labels:
each one becomes a CPU worker, which is how the sharding is exercised where no GPU exists.
"""
from __future__ import annotations

import re
from ..errors import InputError

ALL = "all"


def parse_gpus(spec: str | None) -> str | int | list[str] | None:
    """``all`` | a count ``N`` | ids ``0,2,5`` (one id: ``3,``); None when not given. Bad input ->
    InputError."""
    if spec is None:
        return None
    spec = spec.strip()
    if spec == ALL:
        return ALL
    if re.fullmatch(r"[1-9][0-9]*", spec):
        return int(spec)
    ids = [s.strip() for s in spec.split(",") if s.strip()]
    if "," in spec and ids and all(re.fullmatch(r"[0-9]+", i) for i in ids):
        if len(set(ids)) != len(ids):
            raise InputError(f"--gpus {spec}: a GPU id is listed twice")
        return ids
    raise InputError(f"--gpus must be 'all', a count N or ids like 0,2,5, not {spec!r}")


def host_gpu_ids(spec: str | int | list[str] | None, host: str, visible: int, inventory_gpus: int | None,
                 cpu: bool) -> list[str | None]:
    """The GPU ids of ``host`` the run uses. ``visible``: CUDA devices the host's torch sees;
    ``cpu``: the workers run on CPU (the ids then only name the shards; ``all`` means the
    inventory's ``gpus`` count)."""
    if spec is None:
        return [None]
    have = visible if not cpu else (inventory_gpus or 0)
    if isinstance(spec, list):
        if not cpu:
            missing = [i for i in spec if int(i) >= visible]
            if missing:
                raise InputError(f"host {host}: no GPU {', '.join(missing)} (it has {visible}: "
                                 f"{', '.join(map(str, range(visible))) or 'none'})")
        return list(spec)
    count = have if spec == ALL else spec
    if spec == ALL and not count:
        raise InputError(f"host {host}: --gpus all, but the host has no CUDA GPU"
                         + (" and no `gpus:` count in the inventory; name CPU workers with --gpus N" if cpu else
                            " (pass --device cpu with --gpus N for CPU workers)"))
    if not cpu and count > visible:
        raise InputError(f"host {host}: --gpus {count}, but it has {visible} GPU(s)")
    return [str(i) for i in range(count)]


def visible_gpus(raw_probe: dict | None) -> int:
    """CUDA devices torch sees on a probed host (remote/host/probe.py's report)."""
    tc = (raw_probe or {}).get("torch_cuda") or {}
    return int(tc.get("device_count") or 0) if tc.get("available") else 0


def group(ids: list[str | None], per_worker: int) -> list[str | None]:
    """GPU ids in groups of ``per_worker`` (``--target-devices N``): one worker per group, its
    CUDA_VISIBLE_DEVICES the group, e.g. ``0,1``."""
    if per_worker <= 1 or ids == [None]:
        return ids
    if len(ids) % per_worker:
        raise InputError(f"--gpus gives {len(ids)} GPU(s), not a multiple of --target-devices {per_worker}")
    return [",".join(ids[i:i + per_worker]) for i in range(0, len(ids), per_worker)]
