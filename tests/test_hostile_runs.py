"""Run folders are untrusted input (they travel between machines): a damaged or hostile folder is
one line in `show` (exit 2) and is left out, named, of `runs` and `compare`; nothing is written
outside the folder the user named; report.md and compare.md carry what a folder holds as text,
never as HTML (docs/reliability.md, "Run folders")."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clirun import invoke
from fakeruns import add_confidences, make_run

GOOD = "20261201-1000-zlab-ct129"
BAD = "20261201-1100-v5-step_100-ct129"


def cli(*args):
    """``(exit code, stdout, stderr)`` of the CLI in this process; an uncaught exception fails."""
    res = invoke(*args)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res.exit_code, res.stdout, res.stderr


def rewrite_rows(run_dir: Path, change, every: bool = False) -> None:
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    for row in rows if every else rows[:1]:
        change(row)
    (run_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def rewrite_json(name: str, change):
    def apply(run_dir: Path) -> None:
        path = run_dir / name
        value = change(json.loads(path.read_text()))
        path.write_text(json.dumps(value))
    return apply


def first_row_text(text: str):
    def apply(run_dir: Path) -> None:
        lines = (run_dir / "results.jsonl").read_text().splitlines()
        (run_dir / "results.jsonl").write_text("\n".join([text, *lines[1:]]) + "\n")
    return apply


def env_settings(change):
    return rewrite_json("env.json", lambda env: {**env, "settings": change(env["settings"])})


def not_utf8(run_dir: Path) -> None:
    lines = (run_dir / "results.jsonl").read_bytes().split(b"\n")
    (run_dir / "results.jsonl").write_bytes(b"\n".join([b'{"id": "\xff"}', *lines[1:]]))


# each: how a folder is damaged, and what its one line names
DAMAGE = {
    "env.json not UTF-8": (lambda d: (d / "env.json").write_bytes(b'{"host": "\xff"}'), "env.json: not UTF-8"),
    "env.json nested deep": (lambda d: (d / "env.json").write_text("[" * 100_000 + "]" * 100_000),
                             "env.json: nested more than"),
    "env.json settings a string": (env_settings(lambda _: "x"), 'settings: "x" is not an object'),
    "env.json temperature NaN": (lambda d: (d / "env.json").write_text(
        (d / "env.json").read_text().replace('"mode"', '"temperature": NaN, "mode"', 1)), "settings.temperature: nan"),
    "run.json nested deep": (lambda d: (d / "run.json").write_text('{"id": ' + "[" * 50_000 + "]" * 50_000 + "}"),
                             "run.json: not a valid run record"),
    "run.json id leads out": (rewrite_json("run.json", lambda r: {**r, "id": "../../escaped"}),
                              "is not its folder's name"),
    "summary.json a list": (lambda d: (d / "summary.json").write_text("[1]"), "summary.json: a list is not an object"),
    "summary.json tau Infinity": (lambda d: (d / "summary.json").write_text('{"tau_macro": Infinity}'),
                                  "tau_macro: inf is not a finite number"),
    "a row that is a list": (first_row_text("[1, 2]"), "results.jsonl:1: a list is not an object"),
    "a row not UTF-8": (not_utf8, "results.jsonl:1: not UTF-8 (byte 0xff"),
    "a 5,000-digit integer": (first_row_text('{"id": "a", "cycles": ' + "9" * 5000 + "}"), "results.jsonl:1: not JSON"),
    "lengths as strings": (lambda d: rewrite_rows(d, lambda r: r.update(acceptance_lengths=["3", "4"])),
                           'acceptance_lengths[0]: "3" is not an acceptance length (1..16)'),
    "a length Infinity": (first_row_text('{"id": "a", "acceptance_lengths": [Infinity]}'),
                          "acceptance_lengths[0]: inf is not an acceptance length"),
    "lengths of -5": (lambda d: rewrite_rows(d, lambda r: r.update(acceptance_lengths=[-5, -5]), every=True),
                      "acceptance_lengths[0]: -5 is not an acceptance length (1..16)"),
    "a length of 1e18": (lambda d: rewrite_rows(d, lambda r: r.update(acceptance_lengths=[10 ** 18]), every=True),
                         "1000000000000000000 is not an acceptance length (1..16)"),
    "a DDTree key abc": (lambda d: rewrite_rows(d, lambda r: r.update(ddtree={"abc": {"acceptance_lengths": [1]}})),
                         'ddtree: key "abc" is not a DDTree node budget'),
    "turns x": (lambda d: rewrite_rows(d, lambda r: r.update(turns="x")), 'turns: "x" is not a list'),
    "a DDTree budget's time a string": (
        lambda d: rewrite_rows(d, lambda r: r.update(ddtree={"8": {"acceptance_lengths": [1], "wall_s": "1s"}})),
        'ddtree.8.wall_s: "1s" is not'),
    "a DDTree budget's speedup NaN": (lambda d: (d / "summary.json").write_text('{"ddtree": {"8": {"speedup": NaN}}}'),
                                      "speedup: nan is not a finite number"),
    "a block size of 2,000,000": (env_settings(lambda s: {**s, "block_size": 2_000_000}),
                                  "block_size 2000000 is not a block size (1..1024)"),
}


@pytest.fixture
def runs(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, GOOD, "zlab", prompts=6)
    return runs


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_run_folder_is_one_line_in_show_and_named_in_runs(runs, case):
    damage, named = DAMAGE[case]
    bad = make_run(runs, BAD, "v5", "step_100", prompts=6)
    damage(bad)
    code, out, err = cli("show", BAD, "--runs-dir", runs)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:") and named in err, err
    assert not (bad / "report.md").exists() and not (bad / "report.html").exists()

    code, out, err = cli("show", GOOD, "--runs-dir", runs)          # the other runs are untouched by it
    assert code == 0 and "zlab: τ" in out, (out, err)
    code, out, err = cli("runs", "--json", "--runs-dir", runs)
    assert code == 0 and [r["id"] for r in json.loads(out)] == [GOOD], (out, err)
    assert "skipped a run folder" in err and BAD in err and named in err, err


def test_compare_writes_nothing_outside_the_runs_folder(tmp_path):
    """A run id `../../../escaped` in run.json made compare write compare.md/.html and plots
    three folders up; such a folder is refused (its id is not its folder's name), named, and
    nothing is written anywhere."""
    runs = tmp_path / "project" / "runs"
    make_run(runs, GOOD, "zlab", prompts=6)
    bad = make_run(runs, BAD, "v5", "step_100", prompts=6)
    rewrite_json("run.json", lambda r: {**r, "id": "../../../escaped"})(bad)
    before = sorted(tmp_path.rglob("*"))
    for labels in (("zlab", "v5"), (GOOD, BAD), (GOOD, "../../../escaped")):
        code, out, err = cli("compare", *labels, "--runs-dir", runs, "--resamples", "200")
        assert code == 2 and len(err.strip().splitlines()) == 1, (labels, out, err)
        assert "is not its folder's name" in err, err
    assert sorted(tmp_path.rglob("*")) == before


def test_compare_leaves_out_a_damaged_run_of_a_label_and_names_it(runs):
    """The newest v5 run has acceptance lengths of -5: compare picks the older one and says which
    it left out and why."""
    make_run(runs, "20261201-1100-v5-step_100-ct129", "v5", "step_100", prompts=6)
    newest = make_run(runs, "20261201-1200-v5-step_100-ct129", "v5", "step_100", prompts=6)
    rewrite_rows(newest, lambda r: r.update(acceptance_lengths=[-5]), every=True)
    code, out, err = cli("compare", "zlab", "v5", "--runs-dir", runs, "--resamples", "200", "--json")
    assert code == 0, (out, err)
    result = json.loads(out)
    assert [p["id"] for p in result["picked"]] == [GOOD, "20261201-1100-v5-step_100-ct129"]
    assert newest.name in err and "-5 is not an acceptance length" in err
    assert any(newest.name in why for why in result["skipped"])
    code, out, err = cli("compare", "zlab", newest.name, "--runs-dir", runs, "--resamples", "200")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "can be read" in err, err


HOSTILE_IDS = ["<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "[x](javascript:alert(1))",
               "![t](https://tracker.example/pixel.png)", "a & b"]


def test_markdown_reports_carry_run_folder_text_as_text(runs):
    """Prompt ids, categories and run names went into report.md and compare.md as raw HTML (only
    `|` and newlines were escaped); they are text there now, as in the HTML reports."""
    kw = dict(prompt_ids=HOSTILE_IDS, categories=["<b>math</b>"] * len(HOSTILE_IDS))
    make_run(runs, "20261202-1000-x-ct129", "<img src=x onerror=alert(2)>", **kw)
    make_run(runs, "20261202-1100-y-ct129", "<script>y</script>", **kw)
    code, out, err = cli("show", "20261202-1000-x-ct129", "--runs-dir", runs)
    assert code == 0, (out, err)
    code, out, err = cli("compare", "20261202-1000-x-ct129", "20261202-1100-y-ct129", "--runs-dir", runs,
                         "--resamples", "200", "--out", runs / "cmp")
    assert code == 0, (out, err)
    for md in (runs / "20261202-1000-x-ct129" / "report.md", runs / "cmp" / "compare.md"):
        text = md.read_text()
        for raw in ("<script", "<img", "<b>"):
            assert raw not in text, (md.name, raw)
        assert not re.search(r"(?<!\\)\]\(", text.replace("](plots/", "")), md.name   # links: only the plots
        assert "&lt;img src=x onerror=alert(2)>" in text and "&lt;b>math&lt;/b>" in text     # run name, category
    report = (runs / "20261202-1000-x-ct129" / "report.md").read_text()
    assert all(shown in report for shown in ("&lt;script>alert(1)&lt;/script>", "[x\\](javascript:alert(1))",
                                             "a & b"))                                    # prompt ids
    html = (runs / "cmp" / "compare.html").read_text()
    assert "<script>y" not in html and "&lt;script&gt;y&lt;/script&gt;" in html          # as it was


def test_a_report_is_never_written_through_a_link(runs, tmp_path):
    """report.md a link to a file elsewhere, plots/ a link to a folder elsewhere: `show` replaces
    the links in the run folder and leaves what they pointed to as it was."""
    victim, elsewhere = tmp_path / "victim.txt", tmp_path / "elsewhere"
    victim.write_text("keep")
    elsewhere.mkdir()
    run_dir = runs / GOOD
    (run_dir / "report.md").symlink_to(victim)
    (run_dir / "plots").symlink_to(elsewhere, target_is_directory=True)
    code, out, err = cli("show", GOOD, "--rewrite", "--runs-dir", runs)
    assert code == 0, (out, err)
    assert victim.read_text() == "keep" and not any(elsewhere.iterdir())
    assert not (run_dir / "report.md").is_symlink() and "zlab" in (run_dir / "report.md").read_text()
    assert not (run_dir / "plots").is_symlink() and any((run_dir / "plots").iterdir())


def test_watch_reads_run_folders_through_the_same_checks(runs, tmp_path):
    """The trajectory's CI and calibration of a damaged eval run are absent, not a traceback; an
    eval run id that would lead out of the runs folder is refused; tracking names folders only."""
    from orchestrator.reports.tracking import folder_name
    from orchestrator.runs.folders import RunError, run_folder
    from orchestrator.watch.loop import headline
    from orchestrator.watch.state import Point, WatchState
    from orchestrator.watch.trajectory import calibration, tau_cis, write_trajectory

    bad = make_run(runs, BAD, "v5", "step_100", prompts=6)
    add_confidences(bad)
    assert tau_cis(bad) is not None and calibration({}, bad) is not None
    summary = headline(json.loads((bad / "summary.json").read_text()))
    rewrite_rows(bad, lambda r: r.update(acceptance_lengths=["x"]))
    (bad / "summary.json").write_text('{"confidence": "x"}')
    assert tau_cis(bad) is None and calibration({}, bad) is None
    state = WatchState(run="v5", settings={}, baseline={"label": "zlab", "status": "done", "eval_run": GOOD,
                                                         "summary": headline(json.loads((runs / GOOD / "summary.json")
                                                                                        .read_text()))},
                       points={"step_100": Point("step_100", 100, "done", eval_run=BAD, summary=summary)})
    md, _ = write_trajectory(runs / "watch-v5", state, runs, {}, None, [])
    assert md.parent == runs / "watch-v5" and not list(runs.glob(f"{GOOD}/trajectory*"))
    with pytest.raises(RunError, match="is not a run id"):
        run_folder(runs, "../../x")
    assert run_folder(runs, BAD) == bad
    assert folder_name("../../x") == "x" and folder_name("..") == "eval" and folder_name("v5") == "v5"


def test_what_the_worker_writes_passes_the_checks(tmp_path):
    """The checks refuse nothing a worker writes: offline and online rows, DDTree, all-anchors,
    confidences, sample_from_anchor lengths to B + 1, and a row's engine object as the worker's
    engine phase builds it (remote/engines/phase.py, with a stand-in for the servers)."""
    from orchestrator.runs.folders import load_run
    from remote.contract import runfiles
    from remote.engines import phase

    for i, (mode, extra) in enumerate((("offline", {}), ("online", {}), ("offline", {"settings": {"verify_block": 9}}))):
        d = make_run(tmp_path, f"2026120{i}-1000-r-ct129", mode=mode, prompts=8, env=extra,
                     block_size=8 if extra else 16, acceptance=[[9, 1, 3], [2, 9]] if extra else None)
        if mode == "offline" and not extra:
            add_confidences(d)
        run = load_run(d).check()
        assert run.metrics["prompts"] == len(run.results)

    turn = {"output_ids": [5, 6, 7, 8, 9], "finish_reason": "length", "cycles": 2, "tokens": 5, "drafts": 6,
            "draft_tokens": 6, "accepted": 2, "accepted_per_pos": [1, 1, 0], "histogram": [0, 1, 1, 0],
            "per_step_accepted": [1, 1], "tau": 2.5, "wall_s": 0.2, "metrics_delta": {"x": 1},
            "num_speculative_tokens": 3, "prompt_ids": [1, 2, 3]}

    class StandIn:
        kind, num_drafts, quirk, dtype, clients = "vllm", 3, None, "bfloat16", {"drafter": None, "plain": None}

        def request(self, name, t):
            return dict(turn, wall_s=0.1 if name == "plain" else 0.2)

        def served_dtype_differs(self):
            return "float16"

    request = phase.TurnRequest(prompt_ids=[1, 2, 3], messages=None, enable_thinking=None, max_new_tokens=5,
                                stop_token_ids=[])
    ours = phase.OurTurn(prompt_ids=[1, 2, 3], output_ids=[5, 6, 7, 8, 9], acceptance_lengths=[2, 3])
    engine = phase.serve_row(StandIn(), [request, request], [ours, ours], 4)
    runfiles.check_row({"id": "p", "acceptance_lengths": [2, 3, 2, 3], "engine": engine}, 4)


def test_json_is_decoded_strictly_and_bounded():
    from remote.contract.runfiles import MAX_DEPTH, RunFileError, check_row, parse

    assert parse(b'{"id": "[[[[", "x": "\\"]]"}') == {"id": "[[[[", "x": '"]]'}   # brackets in strings
    assert parse(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None
    for data, why in ((b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested more than"),
                      (b'{"a": "\xc3"}', "not UTF-8"), (b"{", "not JSON")):
        with pytest.raises(RunFileError, match=why):
            parse(data)
    row = parse(b'{"id": "a", "tau": NaN}')           # Python's json takes NaN; a row's τ must be finite
    with pytest.raises(RunFileError, match="tau: nan is not a finite number"):
        check_row(row, 16)
    with pytest.raises(RunFileError, match=r"cycle 0: acceptance length 4 with 2 confidences"):
        check_row({"id": "a", "acceptance_lengths": [4], "confidences": [[0.5, 0.5]]}, 16)
