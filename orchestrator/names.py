"""Every name a user types, resolved one way for every command.

The names: a host (the inventory), a training run, a drafter label, ``LABEL:CKPT`` with the
checkpoint in any spelling (``step20k``, ``20000``, ``step_20000``, a folder name), an eval run
(an id, a unique id prefix, a drafter label, ``LABEL:CKPT``), and ``latest``. One
:class:`Resolver` per command knows the config files it read (paths.locate) and the runs folder;
a name that means nothing is an :class:`UnknownName` (exit 2) whose message has one form per kind
of name, wherever it was typed: ``unknown KIND 'x' (did you mean 'y'?); known KINDs: ...; FILE``.

Everything here is decided before any host is contacted, except where a checkpoint lives
(:meth:`Resolver.locate_checkpoint`: the eval host's synced folders, then the training host's).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from .config.catalog import (EMBEDDED, Catalog, CatalogError, Drafter, TrainingRun, check_name, load_catalog, parse_step,
                      resolve_checkpoint, split_label)
from .errors import InputError, did_you_mean
from .config.inventory import Host, Inventory, InventoryError, load_inventory
from .config.paths import CATALOG, INVENTORY, ConfigFile, locate
from .runs.record import RunRecord
from .runs.folders import LATEST, EvalRun, RunError, find_runs, label_matches, load_runs, no_run, resolve


class UnknownName(InputError):
    """A name that resolves to nothing, or to the wrong kind of thing (exit 2)."""


class StaleCheckpoint(InputError):
    """The eval host's copy of a checkpoint is not the training host's any more (saved again)."""


class NotSynced(InputError):
    """The checkpoint is on the training host but not on the eval host (``eval --sync`` copies it)."""


@dataclass
class DrafterChoice:
    """What ``eval --drafter`` (or its default) means: a catalog label, a folder on the host, or
    the embedded demo; for a training-run drafter, the checkpoint once located on the host."""
    typed: str | None                      # as given; None = the default
    label: str                             # catalog label, `embedded`, or the folder
    why: str = ""                          # how a default was chosen
    entry: Drafter | None = None
    run: TrainingRun | None = None
    checkpoint: str | None = None          # as typed, then the folder on the host
    step: int | None = None
    path: str | None = None                # a folder drafter
    target: str | None = None              # target label, `embedded`, or a folder
    target_path: str | None = None
    candidates: list[str] = field(default_factory=list)   # run drafters to choose from on the host
    synced: bool = True                    # False: on `source` (the training host), not on the eval host
    source: Host | None = None

    @property
    def resolved(self) -> str:
        """As a user would type it: ``v5:step_20000``, ``zlab``, ``embedded`` or the folder."""
        return f"{self.label}:{self.checkpoint}" if self.run and self.checkpoint else self.label

    def statement(self, host: str) -> str:
        """``v5 → v5:step_20000 on ct129, target qwen3.6-27b`` (and why, for a default)."""
        shown = self.typed or self.label
        where = f" ({self.path})" if self.entry and self.entry.path else ""
        why = f" ({self.why})" if self.why else ""
        return f"{shown} → {self.resolved}{where} on {host}, target {self.target}{why}"


class Resolver:
    """The names of one command: hosts (inventory), drafters, training runs and targets (catalog),
    eval runs (runs folder). Files are read on first use."""

    def __init__(self, inventory: ConfigFile | str | None = None, catalog: ConfigFile | str | None = None,
                 runs_root: Path | str | None = None):
        from .runs.folders import runs_dir

        self.inventory_file = inventory if isinstance(inventory, ConfigFile) else locate(INVENTORY, inventory)
        self.catalog_file = catalog if isinstance(catalog, ConfigFile) else locate(CATALOG, catalog)
        self.runs_root = runs_dir(str(runs_root) if runs_root else None)
        self._inventory: Inventory | None = None
        self._catalog: Catalog | None = None
        self._runs: list[EvalRun] | None = None

    # --- the files ------------------------------------------------------------------------------

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = load_inventory(self.inventory_file.path)
        return self._inventory

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = load_catalog(self.catalog_file)
        return self._catalog

    @property
    def runs(self) -> list[EvalRun]:
        if self._runs is None:
            self._runs = load_runs(self.runs_root)
        return self._runs

    @staticmethod
    def unknown(kind: str, word: str, known, source) -> UnknownName:
        """The one message for a name of ``kind`` that means nothing."""
        known = list(known)
        return UnknownName(f"unknown {kind} '{word}'{did_you_mean(word, known)}; known {kind}s: "
                           f"{', '.join(known) or 'none'}; {source}")

    # --- hosts ----------------------------------------------------------------------------------

    def host(self, name: str, role: str | None = None) -> Host:
        """The inventory host ``name``; with ``role``, one that has it."""
        inv = self.inventory
        if name not in inv.hosts:
            raise self.unknown("host", name, inv.names(), self.inventory_file)
        host = inv.hosts[name]
        if role and role not in host.roles:
            others = ", ".join(h.name for h in inv.with_role(role)) or "none"
            raise UnknownName(f"host {name} is not a{'n' if role[0] in 'aeiou' else ''} {role} host (roles: "
                              f"{', '.join(host.roles) or 'none'}); {role} hosts: {others}; {self.inventory_file}")
        return host

    def role_host(self, role: str, name: str | None = None) -> Host:
        """``name`` (checked for ``role``), else the one host with ``role``; a training host is never
        the built-in ``local`` unless named (or written into the inventory with role train)."""
        if name:
            return self.host(name, role)
        host = self.inventory.pick(role)
        if role == "train" and host.is_local and host.defined_in is None:
            raise InputError(f"no training host in the inventory ({self.inventory_file}): add a host with "
                             f"`roles: [train]` and its `checkpoints:` folder, or name one with --from HOST "
                             f"(--from local: this machine's {host.checkpoints})")
        return host

    # --- the catalog ----------------------------------------------------------------------------

    def training_run(self, name: str) -> TrainingRun:
        """A training run by its name, or by the label of a drafter that is one."""
        cat = self.catalog
        if name in cat.runs:
            return cat.runs[name]
        entry = cat.drafters.get(name)
        if entry is not None and entry.run:
            return cat.runs[entry.run]
        raise self.unknown("training run", name, cat.runs, self.catalog_file)

    def checkpoint_name(self, spec: str, run: str | None = None) -> tuple[TrainingRun | None, str]:
        """``sync-ckpt``'s argument: ``CKPT`` or ``LABEL:CKPT`` -> (training run or None, CKPT)."""
        label, _, ckpt = spec.rpartition(":")
        if not label:
            if not run and not self.catalog.runs:
                raise self.catalog.no_runs()
            return (self.training_run(run) if run else None), spec
        r = self.training_run(label)
        if run and self.training_run(run).name != r.name:
            raise InputError(f"{spec} names training run {r.name} but --run says {run}")
        return r, check_name(ckpt)

    def _target(self, target: str | None, entry: Drafter | None, label: str) -> tuple[str, str | None]:
        """(target label or folder, its folder; None for the embedded demo's)."""
        name = target or (entry.target if entry else None)
        if name == EMBEDDED or (name is None and label == EMBEDDED):
            return EMBEDDED, None
        if name is None:
            raise InputError(f"no target for drafter {label}: pass --target LABEL|FOLDER or set `target:` for it "
                             f"in the catalog; {self.catalog_file}")
        if "/" in name:
            return name, name
        if name not in self.catalog.targets:
            raise self.unknown("target", name, self.catalog.targets, self.catalog_file)
        return name, self.catalog.targets[name].path

    def default_drafter(self, host: Host) -> tuple[str | None, list[str], str]:
        """eval's drafter when none is named: (label or None, run drafters to choose from on the
        host, why). The catalog's ``default:``, else the embedded demo on ``local``, else the
        catalog's training run (of several: the one with the newest synced checkpoint)."""
        cat = self.catalog
        if cat.default:
            return cat.default, [], "the catalog's default"
        if host.is_local:
            return EMBEDDED, [], "the default on local"
        runs = {d.run: d.label for d in cat.drafters.values() if d.run}
        if len(runs) == 1:
            run = next(iter(runs))
            return runs[run], [], f"no --drafter: the newest synced checkpoint of training run {run}"
        if runs:
            return None, list(runs.values()), "no --drafter: the newest synced checkpoint of the catalog's training runs"
        raise InputError(f"name a drafter: --drafter LABEL[:CKPT], a folder on the host, or embedded; "
                         f"known drafters: {', '.join(cat.drafters) or 'none'}; {self.catalog_file}")

    def drafter(self, spec: str | None, host: Host, target: str | None = None, *,
                need_target: bool = True) -> DrafterChoice:
        """What ``--drafter spec`` means on ``host`` (spec None: the default), from the catalog
        alone; a training run's checkpoint is then found by :meth:`locate_checkpoint`. Without
        ``need_target`` a drafter the catalog gives no target keeps ``target`` None (``export``)."""
        why, candidates = "", []
        label = spec
        if spec is None:
            label, candidates, why = self.default_drafter(host)
        if label is None:       # several training runs: chosen on the host
            first = self.catalog.drafters[candidates[0]]
            choice = DrafterChoice(typed=None, label=candidates[0], why=why, entry=first,
                                   run=self.catalog.runs[first.run], candidates=candidates)
        elif label == EMBEDDED:
            choice = DrafterChoice(typed=spec, label=EMBEDDED, why=why)
        elif "/" in label:
            choice = DrafterChoice(typed=spec, label=label, why=why, path=label)
        else:
            base, ckpt = split_label(label)
            entry = self.catalog.drafters.get(base)
            if entry is None:
                raise self.unknown("drafter", base, [*self.catalog.drafters, EMBEDDED], self.catalog_file)
            if entry.path and ckpt:
                raise InputError(f"drafter {base} is a folder ({entry.path}), not a training run: it has no "
                                 f"checkpoint {ckpt!r}; use --drafter {base}")
            choice = DrafterChoice(typed=spec, label=base, why=why, entry=entry, path=entry.path,
                                   run=self.catalog.runs[entry.run] if entry.run else None, checkpoint=ckpt)
        if need_target or target or (choice.entry and choice.entry.target) or choice.label == EMBEDDED:
            choice.target, choice.target_path = self._target(target, choice.entry, choice.label)
        return choice

    def locate_checkpoint(self, choice: DrafterChoice, host: Host, *, from_source: bool = False) -> DrafterChoice:
        """The checkpoint folder a training-run drafter means on eval host ``host``: the named one,
        else the newest synced there. One that is only on the training host comes back with
        ``synced`` False and its ``source``; ``from_source``: an unnamed checkpoint is the
        training host's newest (``eval --sync``)."""
        if choice.run is None:
            return choice
        from .sync.plan import dest_rundir
        from .transport import TransportError

        runs = [self.catalog.runs[self.catalog.drafters[c].run] for c in choice.candidates] or [choice.run]
        named = choice.checkpoint if choice.checkpoint not in (None, *LATEST) else None
        there = self._listing(host, runs, lambda r: dest_rundir(host, r))
        found, error = self._pick_checkpoint(choice, runs, there, named)
        if found is not None and not (from_source and named is None):
            self._check_copy(found, host, there)
            return found
        try:
            source = self.inventory.pick("train")
        except InventoryError:
            source = None
        if source is None or source.name == host.name:
            if found is not None:
                return found
            raise error or InputError(f"training run {choice.run.name} has no checkpoints on {host.name}")
        try:
            listing = self._listing(source, runs, lambda r: r.source_dir(source.checkpoints))
        except TransportError:     # the training host cannot be asked: what the eval host has
            if found is not None:
                return found
            raise error or InputError(f"training run {choice.run.name} has no checkpoints on {host.name}") from None
        on_source, error = self._pick_checkpoint(choice, runs, listing, named, complete_only=True)
        if on_source is None:
            raise error or InputError(f"training run {choice.run.name} has no checkpoints on {host.name} "
                                      f"or {source.name}")
        synced = any(c["name"] == on_source.checkpoint for c in there[on_source.run.name]["checkpoints"])
        if synced:
            self._check_copy(on_source, host, there)
        return replace(on_source, synced=synced, source=None if synced else source)

    def _check_copy(self, choice: DrafterChoice, host: Host, there: dict) -> None:
        """A checkpoint about to be evaluated from its copy on ``host`` is refused when the
        training host saved it again since it was synced (sync/fresh.py: sizes and mtimes, hashes
        where they changed); when the training host cannot be asked, one warning says so."""
        import warnings

        from .errors import DflashOpsWarning
        from .sync.fresh import changed_files, describe, differs
        from .sync.listing import host_checkpoints
        from .sync.plan import dest_rundir
        from .sync.tool import SyncError
        from .transport import TransportError, runner_for

        copy = next((c for c in there[choice.run.name]["checkpoints"] if c["name"] == choice.checkpoint), None)
        try:
            source = self.inventory.pick("train")
        except InventoryError:
            return
        if copy is None or not copy.get("complete") or source.name == host.name:
            return
        what = f"{choice.label}:{choice.checkpoint}"
        try:
            with runner_for(source, self.inventory) as srun, runner_for(host, self.inventory) as drun:
                src = source.on_host(srun.expand_home)
                info = host_checkpoints(srun, src, [choice.run], lambda r: r.source_dir(src.checkpoints))[choice.run.name]
                now = next((c for c in info["checkpoints"] if c["name"] == choice.checkpoint), None)
                if now is None or not differs(now, copy):
                    return          # gone from the training host (the copy is all there is), or the same files
                dst = host.on_host(drun.expand_home)
                changed = changed_files(srun, src, f"{info['dir']}/{choice.checkpoint}", drun, dst,
                                        dest_rundir(dst, choice.run), choice.checkpoint)
        except (TransportError, SyncError) as e:
            warnings.warn(DflashOpsWarning(f"could not check {what} on {host.name} against {source.name} ({e}); "
                                           f"its copy on {host.name} is used as it is"))
            return
        if changed:
            folder = f"{dest_rundir(dst, choice.run)}/{choice.checkpoint}"
            raise StaleCheckpoint(f"{what} on {host.name} is not the one on {source.name} any more: {source.name} "
                                  f"saved it again after it was synced (changed: {describe(changed)}); move "
                                  f"{host.name}:{folder} away and sync it again: dflash-ops sync-ckpt {what} "
                                  f"--to {host.name}")

    def _listing(self, host: Host, runs: list[TrainingRun], root_for) -> dict:
        from .sync.listing import host_checkpoints
        from .transport import runner_for

        with runner_for(host, self.inventory) as runner:
            return host_checkpoints(runner, host, runs, root_for)

    def _pick_checkpoint(self, choice: DrafterChoice, runs: list[TrainingRun], listing: dict,
                         named: str | None, complete_only: bool = False) -> tuple[DrafterChoice | None, CatalogError | None]:
        """The named checkpoint in a host's listing (or why not), else its newest (by step; across
        several training runs, by time); ``complete_only`` (the training host's listing): the
        newest one training has finished writing (sync/complete.py), saying why a newer one was passed."""
        if named is not None:
            folders = [c["name"] for c in listing[choice.run.name]["checkpoints"]]
            try:
                folder = resolve_checkpoint(named, choice.run, folders)
            except CatalogError as e:
                return None, e
            return replace(choice, checkpoint=folder, step=choice.run.step_of(folder) or parse_step(folder)), None
        from .sync.complete import judge_listed

        best, passed = None, None
        for r in runs:
            for c in listing[r.name]["checkpoints"]:
                if c["step"] is None:
                    continue
                rank = (c["mtime"], c["step"]) if len(runs) > 1 else (c["step"], c["mtime"])
                if complete_only:
                    verdict = judge_listed(c, listing[r.name]["now"], r)
                    if not verdict.complete:
                        if passed is None or rank > passed[0]:
                            passed = (rank, c["name"], verdict.reason)
                        continue
                if best is None or rank > best[0]:
                    best = (rank, r, c)
        if best is None:
            if passed is not None:
                return None, CatalogError(f"training run {choice.run.name}: no complete checkpoint yet ({passed[1]} "
                                          f"is still being written: {passed[2]})")
            return None, None
        _, run, c = best
        label = next(d.label for d in self.catalog.drafters.values() if d.run == run.name) \
            if choice.candidates else choice.label
        why = choice.why
        if passed is not None and passed[0] > best[0]:
            why = "; ".join(w for w in (why, f"{passed[1]} is still being written ({passed[2]}): the newest complete "
                                              f"checkpoint is {c['name']}") if w)
        return replace(choice, label=label, entry=self.catalog.drafters[label], run=run, checkpoint=c["name"],
                       step=c["step"], why=why), None

    # --- eval runs ------------------------------------------------------------------------------

    def eval_runs(self, name: str) -> list[EvalRun]:
        """Every eval run ``name`` may mean (runs.find_runs)."""
        return find_runs(name, self.runs, self.runs_root)

    def eval_run(self, name: str, prefer: tuple[str, ...] = ("done",)) -> EvalRun:
        """The one eval run ``name`` means (of several: the newest with a status in ``prefer``)."""
        return resolve(name, self.runs_root, self.runs, prefer)

    def run_record(self, name: str, prefer: tuple[str, ...] = ("running",), need: str = "run.json") -> RunRecord:
        """The record of the run ``name`` means, for commands that act on it (attach, cancel,
        resume, parity); ``need``: a file the run must have. A run named by its exact id is read
        from its folder even when its files are too damaged to be listed (the error names run.json)."""
        folder = self.runs_root / name
        if name and "/" not in name and name not in (".", "..") and (folder / "run.json").is_file():
            if not (folder / need).exists():
                raise RunError(f"run {name} has no results yet (no {need} in {folder})")
            return RunRecord.load(folder)
        run = self.eval_run(name, prefer)
        for f in dict.fromkeys(("run.json", need)):
            if not (run.path / f).exists():
                what = "was not started by `dflash-ops eval`" if f == "run.json" else "has no results yet"
                raise RunError(f"run {run.id} {what} (no {f} in {run.path})")
        try:
            return RunRecord.load(run.path)
        except (TypeError, ValueError, KeyError) as e:
            raise RunError(f"run {run.id}: {run.path / 'run.json'} is not a record `dflash-ops eval` wrote ({e})") \
                from None

    def runs_of(self, drafter: str | None = None, host: str | None = None) -> list[EvalRun]:
        """The runs of drafter ``LABEL[:CKPT]`` and on ``host`` (either may be None); a name that
        matches no run (and is no inventory host) fails as it fails everywhere."""
        runs = self.runs
        if drafter:
            base, sep, ckpt = drafter.partition(":")
            runs = [r for r in runs if label_matches(r, base, ckpt if sep else None)]
            if not runs:
                raise no_run(drafter, self.runs, self.runs_root)
        if host:
            seen = {h for r in self.runs for h in r.hosts}
            if host not in seen:
                self.host(host)      # a host no run was on must at least be an inventory host
            runs = [r for r in runs if host in r.hosts]
        return runs
