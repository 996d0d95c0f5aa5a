"""Fuzzing the loaders of what users write by hand: the inventory, the drafter catalog,
a prompt suite (JSONL) and a drafter checkpoint's config.json. Each input is a valid document with
one thing broken (a field's value replaced by any JSON/YAML value, an unknown field added, a key
renamed), or any bytes at all. No input may end in anything but success or the loader's own error
(no traceback); that error names the file and the field that was broken.

hypothesis drives it with a bounded example count and no deadline (two shared cores), derandomized
so a CI run is repeatable."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(max_examples=int(os.environ.get("DFLASH_OPS_FUZZ_EXAMPLES", "100")), deadline=None,
                derandomize=True, suppress_health_check=list(HealthCheck), database=None)

def _yaml_keeps(key: str) -> bool:
    """YAML reads the key back as written (it folds some characters, e.g. U+0085 NEL, to a space:
    the loader then rightly names the key it read, not the one generated)."""

    return yaml.safe_load(yaml.safe_dump({key: 1}, allow_unicode=True)) == {key: 1}


KEYS = st.text(min_size=1, max_size=8).filter(_yaml_keeps)
# Any value YAML and JSON can both hold (keys: strings); text includes control and non-BMP characters.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False),
                    st.text(max_size=12), st.sampled_from(["~", "~root/x", "..", "/", "a:b", "{step}", "x@y:z",
                                                           "http://u:p@h:1", "http://h:abc", "", " "]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def mutate(doc: dict, paths: list[tuple], data) -> tuple[dict, set[str]]:
    """``doc`` with one of ``paths`` broken; returns (document, the names an error may show for it:
    the field, a renamed field's new name, or, for a broken section or entry, one of its keys (an
    emptied ``runs`` section shows as the drafter's reference to the run that is gone))."""
    path = data.draw(st.sampled_from(paths), label="field")
    how = data.draw(st.sampled_from(["value", "unknown field", "rename key"]), label="how")
    doc = json.loads(json.dumps(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    name = path[-1]
    old = parent[name]
    names = {name, *(old if isinstance(old, dict) else ())}
    if how == "value":
        parent[name] = data.draw(values, label="value")
        names |= set(parent[name]) if isinstance(parent[name], dict) else set()   # e.g. a host named ''"
    elif how == "unknown field":
        name = data.draw(KEYS.filter(lambda k: k not in parent), label="unknown")
        parent[name] = data.draw(values, label="value")
    else:
        new = data.draw(KEYS.filter(lambda k: k not in parent), label="new key")
        parent[new] = parent.pop(name)
        name = new
    return doc, names | {name}


def names_a_field(message: str, names: set[str]) -> bool:
    return any(form in message for name in names for form in (name, repr(name), json.dumps(name)))


def check_error(message: str, path: Path, fields: set[str] | None) -> None:
    assert "Traceback" not in message, message
    assert str(path) in message, f"the error does not name the file: {message}"
    if fields is not None:
        assert names_a_field(message, fields), f"the error does not name the field ({sorted(fields)}): {message}"


# ----------------------------------------------------------------------------- inventory

INVENTORY = {"hosts": {"gpu1": {"address": "10.0.0.5", "port": 2222, "user": "me", "roles": ["eval"],
                                "python": "/usr/bin/python3", "workdir": "~/dflash", "checkpoints": "/ckpts",
                                "sglang": "http://10.0.0.5:30000", "gpus": 8, "trust_host_key": True,
                                "jump": "bastion"},
                       "bastion": {"address": "bastion.example", "user": "me"}}}
INVENTORY_FIELDS = [("hosts",), ("hosts", "gpu1"), *(("hosts", "gpu1", k) for k in INVENTORY["hosts"]["gpu1"])]


def load_inventory_file(path: Path):
    from orchestrator.config.inventory import load_inventory

    return load_inventory(path, ssh_config_path=path.parent / "no-ssh-config")


def fuzz_yaml(tmp_path_factory, data, doc: dict, paths: list[tuple], name: str, load) -> None:
    """Load ``doc`` with one field broken, written as YAML to ``name``; only an InputError naming the
    file and the field may come out."""
    from orchestrator.errors import InputError

    doc, fields_ = mutate(doc, paths, data)
    path = tmp_path_factory.mktemp("yaml") / name
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    try:
        load(path)
    except InputError as e:
        check_error(str(e), path, fields_)


@FUZZ
@given(data=st.data())
def test_inventory_fuzz(tmp_path_factory, data):
    fuzz_yaml(tmp_path_factory, data, INVENTORY, INVENTORY_FIELDS, "inventory.yaml", load_inventory_file)


# ----------------------------------------------------------------------------- catalog

CATALOG = {"runs": {"v5": {"dir": "runs/v5", "pattern": "step_{step:08d}", "direct": False}},
           "targets": {"qwen": {"path": "/models/Qwen3-8B"}},
           "drafters": {"v5": {"run": "v5", "format": "state_dict", "target": "qwen"},
                        "zlab": {"path": "/models/drafter", "format": "zlab", "target": "qwen"}}}
CATALOG_FIELDS = [("runs",), ("targets",), ("drafters",), ("runs", "v5"), ("targets", "qwen"), ("drafters", "v5"),
                  *(("runs", "v5", k) for k in CATALOG["runs"]["v5"]), ("targets", "qwen", "path"),
                  *(("drafters", "v5", k) for k in CATALOG["drafters"]["v5"]),
                  *(("drafters", "zlab", k) for k in CATALOG["drafters"]["zlab"])]


@FUZZ
@given(data=st.data())
def test_catalog_fuzz(tmp_path_factory, data):
    from orchestrator.config.catalog import load_catalog

    fuzz_yaml(tmp_path_factory, data, CATALOG, CATALOG_FIELDS, "drafters.yaml", load_catalog)


# ----------------------------------------------------------------------------- prompt suite

ROWS = [{"id": "a", "category": "math", "turns": ["What is 2+2?", "And 3+3?"]},
        {"question_id": 7, "prompt": "Write a poem."},
        {"task_id": "HumanEval/0", "question": "def f():"},
        {"id": "ids", "input_ids": [1, 2, 3]}]
ROW_FIELDS = [(i, k) for i, row in enumerate(ROWS) for k in row]


@FUZZ
@given(data=st.data())
def test_prompt_suite_fuzz(tmp_path_factory, data):
    from remote.suites.prompts import PromptError, load_suite

    rows, field = mutate({str(i): r for i, r in enumerate(ROWS)}, [(str(i), k) for i, k in ROW_FIELDS], data)
    path = tmp_path_factory.mktemp("suite") / "suite.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows.values()))
    try:
        load_suite(str(path))
    except PromptError as e:
        # a broken id may show as the duplicate of another row's id; the row's line is named either way
        check_error(str(e), path, None if "duplicate id" in str(e) else field)


# ----------------------------------------------------------------------------- drafter config.json

DRAFTER_CONFIG = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64,
                  "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                  "rope_theta": 1000000.0, "max_position_embeddings": 32768, "vocab_size": 256, "block_size": 8,
                  "num_target_layers": 4,
                  "dflash_config": {"mask_token_id": 255, "target_layer_ids": [0, 1, 2]}}
CONFIG_FIELDS = [(k,) for k in DRAFTER_CONFIG] + [("dflash_config", k) for k in DRAFTER_CONFIG["dflash_config"]]


def open_drafter(folder: Path, config: bytes):
    from remote.drafters.checkpoint import open_checkpoint

    (folder / "config.json").write_bytes(config)
    (folder / "model.safetensors").write_bytes(b"")      # only listed, never read, by open_checkpoint
    return open_checkpoint(folder)


@FUZZ
@given(data=st.data())
def test_drafter_config_fuzz(tmp_path_factory, data):
    from remote.drafters.checkpoint import CheckpointError

    doc, field = mutate(DRAFTER_CONFIG, CONFIG_FIELDS, data)
    folder = tmp_path_factory.mktemp("drafter")
    try:
        open_drafter(folder, json.dumps(doc).encode())
    except CheckpointError as e:
        check_error(str(e), folder, field)


@pytest.mark.parametrize("bad", [[[]], [1], [None, "DFlashDraftModel"]])
def test_architectures_that_are_not_names_are_refused_naming_the_field(tmp_path, bad):
    """Found by the fuzz test above: a list in `architectures` reached a dict lookup (TypeError)."""
    from remote.drafters.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="field 'architectures' must be a list of strings"):
        open_drafter(tmp_path, json.dumps({**DRAFTER_CONFIG, "architectures": bad}).encode())


# ----------------------------------------------------------------------------- any bytes

@settings(FUZZ, max_examples=max(20, FUZZ.max_examples // 3))
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
def test_any_bytes_is_loaded_or_refused_with_the_file_named(tmp_path_factory, raw):
    from orchestrator.config.catalog import load_catalog
    from orchestrator.errors import InputError
    from remote.drafters.checkpoint import CheckpointError
    from remote.suites.prompts import PromptError, load_suite

    base = tmp_path_factory.mktemp("raw")
    for name, load, error in (("inventory.yaml", load_inventory_file, InputError),
                              ("drafters.yaml", load_catalog, InputError),
                              ("suite.jsonl", lambda p: load_suite(str(p)), PromptError)):
        path = base / name
        path.write_bytes(raw)
        try:
            load(path)
        except error as e:
            check_error(str(e), path, None)
    folder = base / "drafter"
    folder.mkdir()
    try:
        open_drafter(folder, raw)
    except CheckpointError as e:
        check_error(str(e), folder, None)


# ----------------------------------------------------------------------------- numbers and nesting

NUMBER_FIELDS = [(k,) for k, v in DRAFTER_CONFIG.items() if isinstance(v, (int, float)) and not isinstance(v, bool)] + \
    [("dflash_config", k) for k in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")]


@FUZZ
@given(data=st.data())
def test_drafter_config_numbers_no_model_computes_with_are_refused_by_name(tmp_path_factory, data):
    """NaN or an infinity in any field (an unknown one too), an epsilon or a RoPE base that is not
    positive: refused naming the field (NaN, -1 and Infinity passed, and eval reported τ 1.00)."""
    from remote.drafters.checkpoint import CheckpointError

    path = data.draw(st.sampled_from(NUMBER_FIELDS + [("rope_parameters", "rope_theta"), ("dflash_config", "x"),
                                                      ("x",)]), label="field")
    positive = path[-1] in ("rms_norm_eps", "rope_theta")
    value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf] + ([0.0, -1.0, -1e-9] if positive else [])),
                      label="value")
    doc = json.loads(json.dumps(DRAFTER_CONFIG))
    doc.pop("rope_theta")
    doc["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    parent = doc.setdefault(path[0], {}) if len(path) == 2 else doc
    parent[path[-1]] = value
    folder = tmp_path_factory.mktemp("drafter")
    with pytest.raises(CheckpointError) as refused:
        open_drafter(folder, json.dumps(doc).encode())
    check_error(str(refused.value), folder, {path[-1]})


@pytest.mark.parametrize("depth", [33, 900, 100_000])
def test_a_deeply_nested_drafter_config_is_refused_in_one_line(tmp_path, depth):
    from remote.drafters.checkpoint import CheckpointError

    text = json.dumps(DRAFTER_CONFIG)[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
    with pytest.raises(CheckpointError, match="nested deeper than 32 levels") as refused:
        open_drafter(tmp_path, text.encode())
    check_error(str(refused.value), tmp_path, None)
