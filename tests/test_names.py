"""One resolver for every name: the same wrong name fails the same way in every command (one red
line, the same message, exit 2, before any host is contacted); config discovery is stated and
`init` writes the examples; tables fit 80 columns with every run id whole."""
from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.config.paths import TEMPLATES, shipped
from fakeruns import make_run

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[1]

# TEST-NET-1 addresses: nothing answers there, so a command that tried to connect would hang
# until its timeout and fail with exit 1 instead of the name error.
UNREACHABLE = {"ct200": "192.0.2.200", "ct129": "192.0.2.129"}
ZLAB, V5, V5_ONLINE = "20261202-0900-zlab-ct129", "20261202-1000-v5-step20k-ct129", "20261203-1100-v5-step20k-ct129"
V5_OLD = "20261201-0800-v5-step10k-ct129"


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder as a user has it: ./inventory.yaml (ct200 train, ct129 eval, `gpus: 0`),
    ./configs/drafters.yaml (v5 + zlab) and ./runs with three runs."""
    (tmp_path / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {
        "ct200": {"address": UNREACHABLE["ct200"], "roles": ["train"], "checkpoints": "/ckpt", "gpus": 0},
        "ct129": {"address": UNREACHABLE["ct129"], "roles": ["eval"], "checkpoints": "/ckpt", "gpus": 0,
                  "workdir": "/w"}}}, sort_keys=False))
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "drafters.yaml").write_text(yaml.safe_dump({
        "runs": {"v5": {"dir": "v5"}},
        "drafters": {"zlab": {"path": "/models/zlab", "target": "tiny"}, "v5": {"run": "v5", "target": "tiny"}},
        "targets": {"tiny": {"path": "/models/tiny"}}}, sort_keys=False))
    runs = tmp_path / "runs"
    make_run(runs, ZLAB, "zlab", prompts=6)
    make_run(runs, V5_OLD, "v5", "step_10000", prompts=6, meta={"step": 10000})
    make_run(runs, V5, "v5", "step_20000", prompts=6, meta={"step": 20000})
    make_run(runs, V5_ONLINE, "v5", "step_20000", prompts=6, mode="online", meta={"step": 20000})
    for var in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_CATALOG", "DFLASH_OPS_RUNS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(*args: str, columns: int = 200):
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    assert "Traceback" not in res.output, res.output
    return res


def error_line(*args: str) -> tuple[int, str]:
    started = time.monotonic()
    res = run(*args)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, res.output)
    assert time.monotonic() - started < 10, f"{args} took {time.monotonic() - started:.1f}s: it contacted a host"
    return res.exit_code, lines[0]


SAME_MISTAKE = {
    "host": [["eval", "--host", "ct12"], ["hosts", "check", "ct12"], ["sync-ckpt", "step20k", "--to", "ct12"],
             ["ckpts", "--to", "ct12"], ["sync-ckpt", "step20k", "--from", "ct12"], ["runs", "--host", "ct12"],
             ["clean", "--host", "ct12"]],
    "role": [["eval", "--host", "ct200"], ["sync-ckpt", "step20k", "--to", "ct200"], ["ckpts", "--to", "ct200"]],
    "training run": [["ckpts", "v6"], ["sync-ckpt", "v6:step20k"], ["sync-ckpt", "step20k", "--run", "v6"]],
    "run": [["show", "zlb"], ["parity", "zlb"], ["attach", "zlb"], ["cancel", "zlb"], ["compare", "zlb", "v5"],
            ["eval", "--resume", "zlb"], ["runs", "--drafter", "zlb"]],
    "run checkpoint": [["show", "v5:step30k"], ["attach", "v5:step30k"], ["compare", "zlab", "v5:step30k"],
                       ["parity", "v5:step30k"], ["runs", "--drafter", "v5:step30k"]],
}
WANT = {
    "host": "unknown host 'ct12' (did you mean 'ct129'?); known hosts: local, ct200, ct129; "
            "inventory: inventory.yaml (from the current directory)",
    "role": "host ct200 is not an eval host (roles: train); eval hosts: local, ct129; "
            "inventory: inventory.yaml (from the current directory)",
    "training run": "unknown training run 'v6' (did you mean 'v5'?); known training runs: v5; "
                    "catalog: configs/drafters.yaml (from the current directory)",
    "run": "no run matches 'zlb' in runs (did you mean 'zlab'?); `dflash-ops runs` lists them",
    "run checkpoint": "no run matches 'v5:step30k' in runs (did you mean 'v5:step_20000'?); "
                      "v5 has runs of step_10000, step_20000; `dflash-ops runs` lists them",
}


@pytest.mark.parametrize("kind", list(SAME_MISTAKE))
def test_the_same_wrong_name_fails_the_same_way_everywhere(project, kind):
    seen = {tuple(args): error_line(*args) for args in SAME_MISTAKE[kind]}
    assert set(seen.values()) == {(2, f"error: {WANT[kind]}")}, json.dumps(
        {" ".join(a): v for a, v in seen.items()}, indent=1)


def test_eval_resolves_before_any_host_is_contacted(project):
    assert error_line("eval", "--host", "ct129", "--drafter", "v6") == (
        2, "error: unknown drafter 'v6' (did you mean 'v5'?); known drafters: zlab, v5, embedded; "
           "catalog: configs/drafters.yaml (from the current directory)")
    code, line = error_line("eval", "--host", "ct129", "--drafter", "zlab:step20k")
    assert code == 2 and "drafter zlab is a folder (/models/zlab), not a training run" in line


def test_every_spelling_of_a_checkpoint_finds_the_recorded_run(project):
    for spellings, want in ((("v5:step20k", "v5:20000", "v5:step_20000", "v5:20k", "v5", "step20k"), V5_ONLINE),
                            (("v5:step10k", "v5:10000", "v5:step_10000", "v5:10k", "step_10000"), V5_OLD)):
        for spelling in spellings:
            res = run("show", spelling, "--json")
            assert res.exit_code == 0, res.output
            assert json.loads(res.stdout)["id"] == want, spelling     # the newest run of that checkpoint
    res = run("runs", "--drafter", "v5:step20k", "--json")
    assert {r["id"] for r in json.loads(res.stdout)} == {V5, V5_ONLINE}
    assert {r["step"] for r in json.loads(res.stdout)} == {20000}
    assert json.loads(run("show", "latest", "--json").stdout)["id"] == V5_ONLINE


def test_unknown_names_say_which_files_were_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # no ./inventory.yaml, no ./configs/drafters.yaml
    for var in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_CATALOG"):
        monkeypatch.delenv(var, raising=False)
    code, line = error_line("eval", "--host", "ct129")
    assert code == 2 and line.startswith("error: unknown host 'ct129'; known hosts: local; no inventory file")
    assert "./inventory.yaml" in line and "dflash-ops/inventory.yaml" in line and "dflash-ops init" in line
    # the catalog shipped in the package is an example for `init`, never read silently
    code, line = error_line("eval", "--host", "local", "--drafter", "zlab")
    assert code == 2 and "unknown drafter 'zlab'; known drafters: embedded; no catalog file" in line


def test_init_writes_the_commented_examples_into_the_project_and_config_states_the_discovery(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_CATALOG"):
        monkeypatch.delenv(var, raising=False)
    user = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(user))
    res = run("init")
    assert res.exit_code == 0, res.output
    for here, name in TEMPLATES.items():                    # into the project folder, not the user's config
        assert (tmp_path / here).read_bytes() == shipped(name).read_bytes()
    assert not user.exists()
    assert (tmp_path / "inventory.yaml").read_text().startswith("#")
    assert error_line("init") == (2, "error: inventory.yaml, configs/drafters.yaml, configs/suites/my-prompts.jsonl "
                                     "already exist: edit them, or pass --force to replace them with the commented "
                                     "examples")
    found = json.loads(run("config", "--json").stdout)
    assert (found["inventory"]["path"], found["inventory"]["source"]) == ("inventory.yaml", "current directory")
    assert (found["catalog"]["path"], found["catalog"]["source"]) == ("configs/drafters.yaml", "current directory")
    assert run("init", "--dir", "proj").exit_code == 0
    monkeypatch.chdir(tmp_path / "proj")           # the project layout is found from its folder
    found = json.loads(run("config", "--json").stdout)
    assert (found["inventory"]["path"], found["inventory"]["source"]) == ("inventory.yaml", "current directory")
    (user / "dflash-ops").mkdir(parents=True)      # the user config folder is still read, after ./
    (user / "dflash-ops" / "drafters.yaml").write_text("runs: {u: {}}\n")
    monkeypatch.chdir(tmp_path / "xdg")
    assert json.loads(run("config", "--json").stdout)["catalog"]["source"] == "user config folder"
    monkeypatch.setenv("DFLASH_OPS_CATALOG", str(tmp_path / "nowhere.yaml"))
    Path("x.yaml").write_text("runs: {x: {}}\n")
    assert json.loads(run("config", "--json", "--catalog", "x.yaml").stdout)["catalog"]["source"] == "--catalog"
    code, line = error_line("config")
    assert code == 2 and "nowhere.yaml: cannot read the catalog" in line


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return res.stdout if res.returncode == 0 else None


def test_the_repository_top_level_is_what_init_writes(tmp_path, monkeypatch):
    """The project folder a clone starts with (inventory.yaml, configs/) is `dflash-ops init`'s
    output: the examples live once, in the package (what a wheel's `init` copies). Once a user
    has made the top-level files their own (edited after the last change to the examples), the
    files as that change committed them are compared instead."""
    monkeypatch.chdir(tmp_path)
    assert run("init").exit_code == 0
    sources = [f"orchestrator/config/{name}" for name in TEMPLATES.values()]
    edited = _git("status", "--porcelain", "--", *sources)
    if edited is None:
        pytest.skip("not a git checkout")
    commit = _git("log", "-1", "--format=%H", "--", *sources).strip() if not edited.strip() else None
    for here in TEMPLATES:
        top = _git("show", f"{commit}:{here}") if commit else (REPO / here).read_text()
        assert top is not None, f"{here} is missing from the repository's top level (dflash-ops init --dir . writes it)"
        assert top == (tmp_path / here).read_text(), (
            f"{here} at the repository's top level is not what `dflash-ops init` writes: "
            f"regenerate it with `dflash-ops init --dir {REPO} --force`")


def test_a_fresh_clone_lists_the_story_hosts_and_never_connects_to_an_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_CATALOG"):
        monkeypatch.delenv(var, raising=False)
    for here in TEMPLATES:                          # the clone's own files
        (tmp_path / here).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / here).write_bytes((REPO / here).read_bytes())
    hosts = json.loads(run("hosts", "--json").stdout)["hosts"]
    assert [(h["name"], h["example"]) for h in hosts] == [("local", False), ("ct200", True), ("ct129", True)]
    shown = run("hosts", columns=80).stdout
    assert "ct200 (example)" in shown and "ct129 (example)" in shown
    assert "never connected to" in " ".join(shown.split())
    want = "is an example host in ./inventory.yaml: set its address and remove `example: true`"
    for args, host in ((["eval", "--host", "ct129", "--drafter", "zlab"], "ct129"),
                       (["sync-ckpt", "step20k"], "ct200"), (["ckpts"], "ct200")):
        assert error_line(*args) == (2, f"error: {host} {want}")
    res = run("hosts", "check", "ct200")
    assert res.exit_code == 1 and f"ct200: ct200 {want}" in " ".join(res.stdout.split())
    res = run("hosts", "check")                 # not named: the examples are listed, not checked nor failed
    assert res.exit_code == 0 and "│ local │ passed │" in res.stdout and "ct200" not in res.stdout, res.output
    assert " ".join(res.stderr.split()) == ("warning: not checked: ct200, ct129, example hosts (`example: true` in "
                                            "./inventory.yaml): set the address and delete that line to check them")
    from orchestrator.config.inventory import ExampleHost, load_inventory
    from orchestrator.transport import endpoint_for
    with pytest.raises(ExampleHost, match="ct200 is an example host"):   # the data path's endpoint too
        endpoint_for(load_inventory().get("ct200"))
    # a host made real (address set, the marker deleted) is connected to as any other
    text = (tmp_path / "inventory.yaml").read_text()
    (tmp_path / "inventory.yaml").write_text(text.replace("\n    example: true", "\n    example: false", 1))
    assert load_inventory().get("ct200").example is False and endpoint_for(load_inventory().get("ct200"))


def test_with_no_training_host_sync_and_ckpts_say_so_and_what_to_add(project, monkeypatch):
    """An inventory without a host of role train: sync-ckpt and ckpts do not take this machine's
    built-in `local` for it unasked, they say in one line what to add (or name with --from)."""
    monkeypatch.setenv("DFLASH_OPS_HOME", str(project / "home"))
    (project / "inventory.yaml").write_text(yaml.safe_dump({"hosts": {
        "ct129": {"address": UNREACHABLE["ct129"], "roles": ["eval"], "checkpoints": "/ckpt", "gpus": 0}}}))
    want = (f"error: no training host in the inventory (inventory: inventory.yaml (from the current directory)): add "
            f"a host with `roles: [train]` and its `checkpoints:` folder, or name one with --from HOST (--from local: "
            f"this machine's {project / 'home' / 'checkpoints'})")
    for args in (["sync-ckpt", "step20k"], ["sync-ckpt", "v5:step20k"], ["ckpts"], ["ckpts", "v5"]):
        assert error_line(*args) == (2, want), args


def test_with_no_catalog_sync_and_ckpts_say_where_they_looked_and_that_init_writes_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("DFLASH_OPS_INVENTORY", "DFLASH_OPS_CATALOG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DFLASH_OPS_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "checkpoints").mkdir(parents=True)
    from orchestrator.config.paths import CATALOG, locate

    want = f"error: no training runs in the catalog; {locate(CATALOG)}"
    assert "`dflash-ops init` writes one" in want
    for args in (["sync-ckpt", "step20k"], ["ckpts"], ["sync-ckpt", "step20k", "--from", "local"],
                 ["ckpts", "--from", "local"]):
        assert error_line(*args) == (2, want), args


IDS = [ZLAB, V5, V5_ONLINE, V5_OLD]


def fallback_wall(text: str) -> bool:
    """Whether ``text`` holds a key/value table that fell back to a list: five or more records
    (a line, then its indented ``column value`` lines) of one pair each."""
    singles, record = 0, None
    for line in text.splitlines() + [""]:
        if line.startswith("  "):
            record = (record or "") + " " + line.strip()
            continue
        if record and " · " not in record:
            singles += 1
        record = "" if line.strip() else None
    return singles >= 5


def test_fallback_wall_is_what_a_flipped_key_value_table_prints():
    flipped = "run x\n" + "".join(f"{k}\n  value {v}\n" for k, v in zip("abcdef", range(6)))
    assert fallback_wall(flipped)
    assert not fallback_wall("runs\nid1\n  drafter v5 · target t\nid2\n  drafter v5 · target t\n")


@pytest.fixture
def checkpoints(project, monkeypatch):
    """The built-in local host as a training host: v5's step_1000 with its files (complete once
    quiet: see :func:`settle`), step_2000 only a config.json so far (a checkpoint being written)."""
    home = project / "home"
    monkeypatch.setenv("DFLASH_OPS_HOME", str(home))
    done, writing = home / "checkpoints" / "v5" / "step_1000", home / "checkpoints" / "v5" / "step_2000"
    for d in (done, writing):
        d.mkdir(parents=True)
    (done / "config.json").write_text("{}\n")
    (done / "model.safetensors").write_bytes(b"\0" * 4096)
    (writing / "config.json").write_text(" " * 822)
    return home


def settle(project, seconds: float) -> None:
    """v5's settle time in the catalog. Quiet time is the host's (ctime): a test waits it out."""
    cat = project / "configs" / "drafters.yaml"
    data = yaml.safe_load(cat.read_text())
    data["runs"]["v5"]["settle"] = seconds
    cat.write_text(yaml.safe_dump(data, sort_keys=False))


COMMANDS = [["runs"], ["show", V5], ["compare", "zlab", "v5", "--resamples", "200"], ["hosts"], ["config"],
            ["hosts", "check", "local"], ["ckpts", "v5", "--from", "local", "--to", "local"], ["init", "--dir", "new"]]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_output_fits_80_columns_with_ids_whole_and_no_fallback_wall(project, checkpoints, args):
    res = run(*args, columns=80)
    assert res.exit_code == 0, res.output
    too_long = [ln for ln in res.stdout.splitlines() if len(ln.rstrip()) > 80]
    assert not too_long, "\n".join(too_long)
    assert not fallback_wall(res.stdout), res.stdout
    for rid in IDS:
        if args[0] == "runs" or rid in args or (args[0] == "compare" and rid in (ZLAB, V5)):
            assert re.search(rf"(^|[\s(]){re.escape(rid)}([\s)]|$)", res.stdout), (rid, res.stdout)
    if args[0] == "show":        # the key/value table stays a table; its long values wrap inside it
        assert "│ versions" in res.stdout and "│ tau_macro" in res.stdout
    if args[:2] == ["hosts", "check"]:
        assert "check passed" in " ".join(res.stdout.split())      # each word says what it is


def test_a_checkpoint_being_written_is_marked_with_the_reason(project, checkpoints):
    settle(project, 0.5)
    time.sleep(0.5)
    res = run("ckpts", "v5", "--from", "local", "--to", "local", columns=80)
    assert res.exit_code == 0, res.output
    rows = {ln.split("│")[1].strip(): ln for ln in res.stdout.splitlines() if ln.count("│") > 3}
    assert "complete" in rows["step_1000"] and "being written" not in rows["step_1000"]
    assert "being written" in rows["step_2000"] and "822 B" in rows["step_2000"]
    said = " ".join(res.stdout.split())
    assert "! v5:step_2000 is being written: expected files missing: weights (*.safetensors, *.pt, *.pth or *.bin)" \
        in said
    listed = json.loads(run("ckpts", "v5", "--from", "local", "--to", "local", "--json").stdout)["checkpoints"]
    assert [(c["name"], c["incomplete"]) for c in listed] == [
        ("step_1000", ""), ("step_2000", "expected files missing: weights (*.safetensors, *.pt, *.pth or *.bin)")]
    settle(project, 60)
    (checkpoints / "checkpoints" / "v5" / "step_2000" / "model.safetensors").write_bytes(b"\0" * 64)
    listed = json.loads(run("ckpts", "v5", "--from", "local", "--to", "local", "--json").stdout)["checkpoints"]
    assert re.match(r"a file changed \d+s ago \(settle time 60s\)", listed[1]["incomplete"]), listed


def _commands(command, path=()):
    yield list(path)
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from _commands(sub, (*path, name))


def test_help_of_every_command_at_80_columns():
    import typer.main

    paths = list(_commands(typer.main.get_command(app)))
    assert len(paths) >= 15
    for path in paths:
        res = run(*path, "--help", columns=80)
        assert res.exit_code == 0, (path, res.output)
        lines = res.stdout.splitlines()
        bad = [ln for ln in lines if len(ln) > 80 or "…" in ln or "<bool>" in ln]
        assert not bad, (path, bad)                         # nothing cut, no type placeholder on a flag
        assert not re.search(r"--[a-z-]+\s+<(str|int|float)>", res.stdout), (path, res.stdout)
        # in a list of commands, a description breaks where the next word does not fit, never mid-sentence
        panel = None
        for a, b in zip(lines, lines[1:]):
            panel = a[3:].split("─")[0].strip() if a.startswith("╭─") else panel
            if panel != "Commands" or not (a.startswith("│") and b.startswith("│")):
                continue
            j = len(b) - len(b[1:].lstrip()) if b[1:].strip() else 0
            if j > 2 and a[j - 1] == " " and a[j] != " ":
                room = len(a) - j - 2
                assert len(a[j:-1].rstrip()) + 1 + len(b[j:].split()[0]) > room, (path, a, b)


def test_eval_default_drafter_from_the_catalog(project):
    from orchestrator.names import Resolver

    names = Resolver()
    ct129 = names.host("ct129", role="eval")
    choice = names.drafter(None, ct129)          # no `default:`: the catalog's one training run, located later
    assert (choice.label, choice.run.name, choice.checkpoint) == ("v5", "v5", None)
    assert choice.why == "no --drafter: the newest synced checkpoint of training run v5"
    assert names.drafter(None, names.host("local")).label == "embedded"
    cat = project / "configs" / "drafters.yaml"
    cat.write_text(cat.read_text() + "default: zlab\n")
    choice = Resolver().drafter(None, ct129)
    assert (choice.label, choice.path, choice.target, choice.why) == ("zlab", "/models/zlab", "tiny",
                                                                      "the catalog's default")
    assert choice.statement("ct129") == "zlab → zlab (/models/zlab) on ct129, target tiny (the catalog's default)"
    cat.write_text(cat.read_text().replace("default: zlab", "default: v6"))
    code, line = error_line("eval", "--host", "ct129")
    assert code == 2 and "configs/drafters.yaml: default: unknown drafter 'v6'" in line, line
