"""Decoding settings on the orchestrator side: eval's sampling flags and their checks,
the settings as pairing keys of `compare`, published rows by temperature, and what reports and
comparisons show of tau_sglang, tau_macro_turns, the expected τ at T > 0 and sample_from_anchor
runs. Synthetic run folders (tests/fakeruns.py); the real runs are tests/test_variants_e2e.py."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.reports.compare import PUBLISHED_FILE, find_benchmark, load_published
from orchestrator.eval.pipeline import worker_args
from orchestrator.config.inventory import builtin_local
from orchestrator.runs.record import EvalRequest, Shard
from remote.contract.metrics import summarize
from remote.contract.settings import FIELDS, EvalSettings
from fakeruns import make_run, read_rows
from reportchecks import md_table_values
from clirun import invoke

pytestmark = pytest.mark.timeout(240)
A, B = "20261202-2041-zlab-ct129", "20261203-1100-v5-step20k-ct129"


def compare_json(runs: Path, *args: str) -> tuple[int, dict]:
    res = invoke("compare", *args, "--runs-dir", runs, "--json", "--resamples", "500")
    return res.exit_code, json.loads(res.stdout[res.stdout.index("{"):])


def sampled(t: float = 1.0, **more) -> dict:
    return {"settings": {"temperature": t, "top_p": 1.0, "top_k": 0, "seed": 0, "stop_token_ids": [2], **more}}


# --------------------------------------------------------------------------- eval's flags

def worker_settings(argv: list[str]) -> EvalSettings:
    """The settings the worker reads from ``argv`` (its own parser)."""
    from remote.worker import parse_args

    return parse_args(argv).settings


def test_the_worker_reads_back_the_settings_eval_sends():
    """One settings value across the process boundary: what the orchestrator puts in the worker's
    argv is parsed by the worker into the same value (defaults left out of the argv)."""
    host = builtin_local()
    shard = Shard(host="local", index=0, count=1, run_dir="/w/runs/x", target_path="/t", drafter_path="/d")
    args = worker_args(EvalRequest(hosts=["local"]), shard, host, resume=False)
    assert worker_settings(args) == EvalSettings(device="cpu")          # local: CPU, the rest the defaults
    assert "--temperature" not in args and "--ddtree" not in args and "--checked" in args
    settings = EvalSettings(suite="humaneval", prompts=7, mode="online", max_new_tokens=64, max_blocks=3,
                            dtype="bfloat16", thinking="on", ddtree="16,1024", temperature=0.7, top_p=0.9,
                            top_k=20, seed=5, all_anchors=True, target_devices="2", max_memory=12.5)
    args = worker_args(EvalRequest(hosts=["local"], settings=settings), shard, host, resume=False)
    assert worker_settings(args) == replace(settings, device="cpu")


def test_every_setting_is_a_flag_of_eval_watch_and_the_worker():
    """eval and watch offer every setting (made from one list), and the worker parses each."""
    for command in ("eval", "watch"):
        text = invoke(command, "--help").output
        for f in FIELDS:
            assert f.flag in text, (command, f.flag)


@pytest.mark.parametrize("args, message", [
    (["--temperature", "1", "--ddtree", "8"], "--ddtree at --temperature > 0 offline"),
    (["--ddtree", "8,2048"], "each budget must be 1..1024"),
    (["--ddtree", "8,x"], "not a comma-separated list of integers"),
    (["--temperature", "-0.5"], "--temperature >= 0"),
    (["--top-p", "0"], "0 < --top-p <= 1"),
    (["--thinking", "maybe"], "--thinking must be one of off, on, default"),
    (["--prompts", "-1"], "--prompts must be >= 1, or 0 for every prompt of the suite (got -1)"),
])
def test_eval_refuses_bad_settings_before_touching_a_host(tmp_path, args, message):
    res = invoke("eval", "--host", "local", "--runs-dir", tmp_path / "runs", *args)
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())
    assert not (tmp_path / "runs").exists()                # nothing was started


def test_prompts_help_refusal_and_behaviour_say_the_same():
    """`--prompts` left out is 2 prompts for eval (its help says so) and every prompt for the worker;
    0 is every prompt of the suite for both (what the help and the refusal of -1 say)."""
    import argparse

    from remote.contract.settings import add_arguments

    text = " ".join(invoke("eval", "--help", env={"COLUMNS": "200"}).output.split())
    assert "-n N The first N prompts of the suite (0 = all). [default: 2]" in text, text
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv in (["--prompts", "0"], []):
        assert EvalSettings.from_args(parser.parse_args(argv)).prompts is None
    assert EvalSettings(prompts=0) == EvalSettings() and EvalSettings(prompts=0).to_argv() == []


# --------------------------------------------------------------------------- pairing keys

@pytest.mark.parametrize("env_a, env_b, field, values", [
    (sampled(0.0), sampled(1.0), "decoding setting temperature differs", ("0.0", "1.0")),
    ({}, sampled(0.7), "decoding setting temperature differs", ("0.0", "0.7")),      # unrecorded = greedy
    (sampled(top_p=0.9), sampled(top_p=0.95), "decoding setting top_p differs", ("0.9", "0.95")),
    (sampled(top_k=20), sampled(), "decoding setting top_k differs", ("20", "0")),
    (sampled(seed=1), sampled(seed=2), "decoding setting seed differs", ("1", "2")),
    (sampled(stop_token_ids=[2]), sampled(stop_token_ids=[2, 7]), "decoding setting stop_token_ids differs",
     ("[2]", "[2, 7]")),
    ({"settings": {"enable_thinking": None}}, {}, "decoding setting enable_thinking differs", ("null", "false")),
])
def test_runs_with_different_decoding_settings_do_not_pair(tmp_path, env_a, env_b, field, values):
    runs = tmp_path / "runs"
    make_run(runs, A, "zlab", prompts=6, env=env_a)
    make_run(runs, B, "v5", "step20k", prompts=6, env=env_b)
    res = invoke("compare", "zlab", "v5:step20k", "--runs-dir", runs, "--resamples", "200")
    assert res.exit_code == 3, res.output
    text = " ".join(res.output.split())
    assert "refusing to compare" in text and field in text, text
    for v in values:
        assert v in text, (v, text)


@pytest.mark.parametrize("env_a, env_b", [
    (sampled(0.0, seed=1, top_p=0.5), sampled(0.0, seed=2, top_p=0.9)),   # greedy: seed and top_p change nothing
    (sampled(1.0, stop_token_ids=None), sampled(1.0)),                   # an older worker did not record stops
    ({}, sampled(0.0)),                                                  # nor the temperature (it was greedy)
    (sampled(ddtree_budgets=[8], sglang_url="http://a", all_anchors=True, verify_block=16),
     sampled(ddtree_budgets=[1024], sglang_url="http://b", all_anchors=False, verify_block=17)),
])
def test_settings_that_do_not_change_the_measurement_still_pair(tmp_path, env_a, env_b):
    runs = tmp_path / "runs"
    make_run(runs, A, "zlab", prompts=6, env=env_a)
    make_run(runs, B, "v5", "step20k", prompts=6, env=env_b)
    code, r = compare_json(runs, "zlab", "v5:step20k")
    assert code == 0 and not r["mismatches"], r["mismatches"]


def test_sampled_online_outputs_may_differ_without_a_warning(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, A, "zlab", prompts=6, mode="online", env=sampled(1.0))
    make_run(runs, B, "v5", prompts=6, mode="online", env=sampled(1.0),
             output_ids={f"gsm8k-{i}": [7] * 50 for i in range(6)})
    code, r = compare_json(runs, A, B)
    assert code == 0 and not r["mismatches"] and not any("output_ids" in w for w in r["warnings"])
    assert [x["temperature"] for x in r["runs"]] == [1.0, 1.0]


# --------------------------------------------------------------------------- published rows

def test_published_config_matches_the_source():
    """REFERENCE §2 quotes the T=0 τ (and MATH-500 / Alpaca speedups); the T=1 rows are the DDTree
    paper's table (github.com/liranringel/ddtree src/data/results.tex), Qwen3-8B columns."""
    pub = load_published()
    want = {  # benchmark: {T: (DFlash speedup, τ, DDTree speedup, DDTree τ)}
        "math500": {0.0: (5.56, 7.79, 7.52, 10.73), 1.0: (4.56, 6.46, 6.59, 9.54)},
        "gsm8k": {0.0: (4.78, 6.57, 6.75, 9.54), 1.0: (4.33, 5.93, 6.27, 8.95)},
        "aime2024": {0.0: (5.38, 7.46, 7.35, 10.42), 1.0: (3.46, 4.98, 5.36, 7.79)},
        "aime2025": {0.0: (5.32, 7.39, 6.99, 9.86), 1.0: (3.36, 4.79, 5.25, 7.71)},
        "humaneval": {0.0: (4.84, 6.61, 6.90, 9.67), 1.0: (4.00, 5.48, 6.09, 8.59)},
        "mbpp": {0.0: (4.33, 5.99, 6.39, 9.07), 1.0: (3.83, 5.30, 5.87, 8.34)},
        "livecodebench": {0.0: (5.02, 7.22, 7.10, 10.28), 1.0: (4.52, 6.61, 6.46, 9.53)},
        "swe-bench-lite": {0.0: (2.65, 3.60, 4.23, 5.91), 1.0: (2.10, 2.82, 3.47, 4.86)},
        "mt-bench": {0.0: (2.56, 4.28, 4.10, 6.58), 1.0: (2.30, 3.77, 3.75, 6.02)},
        "alpaca": {0.0: (2.07, 3.12, 3.36, 5.09), 1.0: (1.95, 2.94, 3.20, 4.89)},
    }
    got = {k: {r["temperature"]: (r["speedup"], r["tau"], r["ddtree_speedup"], r["ddtree_tau"]) for r in v["rows"]}
           for k, v in pub["benchmarks"].items()}
    assert got == want
    assert pub["setup"] == {**pub["setup"], "target": "Qwen3-8B", "block_size": 16}
    assert "2604.12989" in pub["source"]["arxiv"] and "results.tex" in pub["source"]["table"]
    assert PUBLISHED_FILE.name == "published.yaml"
    for name, key in (("gsm8k", "gsm8k"), ("GSM8K-200", "gsm8k"), ("hf:math500", "math500"), ("MATH-500", "math500"),
                      ("humaneval", "humaneval"), ("mbpp", "mbpp"), ("mt-bench", "mt-bench"), ("mt_bench", "mt-bench"),
                      ("aime-2024", "aime2024"), ("AIME 2025", "aime2025"), ("lcb", "livecodebench"),
                      ("SWE-bench Lite", "swe-bench-lite"), ("alpaca", "alpaca"), ("custom", None)):
        assert find_benchmark(name, pub) == key, name


def test_published_row_follows_the_runs_temperature(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, A, "zlab", prompts=6, env=sampled(1.0))
    make_run(runs, B, "v5", "step20k", prompts=6, env=sampled(1.0))
    code, r = compare_json(runs, A, B)
    p = r["published"]
    assert code == 0 and p["benchmark"] == "gsm8k" and p["temperature"] == 1.0
    assert (p["tau"], p["ddtree_tau"], p["speedup"]) == (5.93, 8.95, 4.33)
    res = invoke("compare", A, B, "--runs-dir", runs, "--resamples", "200")
    text = " ".join(res.output.split())
    assert "GSM8K at T=1: published, not measured here" in text and "5.93" in text and "6.57" not in text

    runs = tmp_path / "warm"
    make_run(runs, A, "zlab", prompts=6, env=sampled(0.7))
    make_run(runs, B, "v5", "step20k", prompts=6, env=sampled(0.7))
    code, r = compare_json(runs, A, B)
    assert code == 0 and r["published"] is None
    assert "exist at T=0, T=1; these runs use T=0.7: not shown" in r["published_note"]
    res = invoke("compare", A, B, "--runs-dir", runs, "--resamples", "200", "--published", "math500")
    assert res.exit_code == 2 and "published MATH-500 numbers exist at T=0, T=1" in " ".join(res.output.split())


# --------------------------------------------------------------------------- what reports show

def _rewrite_summary(run_dir: Path, block_size: int, max_length: int | None = None) -> dict:
    """summary.json as the worker writes it for this run (make_run's passes no max_length)."""
    s = summarize(read_rows(run_dir), block_size, "offline", max_length=max_length)
    (run_dir / "summary.json").write_text(json.dumps(s))
    return s


def test_sample_from_anchor_runs_count_lengths_to_b_plus_one(tmp_path):
    runs = tmp_path / "runs"
    lengths = [[9, 1, 3], [2, 9], [5, 4, 1]]
    for rid, drafter in ((A, "spec"), (B, "spec2")):
        d = make_run(runs, rid, drafter, acceptance=lengths, block_size=8, ddtree=False, all_anchors=False,
                     env={"settings": {"verify_block": 9}})
        summary = _rewrite_summary(d, 8, max_length=9)
    assert list(summary["acceptance_histogram"]) == [str(k) for k in range(1, 10)] and \
        len(summary["per_position_acceptance"]) == 8
    res = invoke("show", A, "--runs-dir", runs, "--json")
    shown = json.loads(res.stdout[res.stdout.index("{"):])
    m = shown["metrics"]
    assert m["max_length"] == 9 and m["acceptance_histogram"]["9"] == 2 and not m["out_of_range_lengths"]
    assert m["per_position_acceptance"] == summary["per_position_acceptance"]
    assert m["tau_pooled"] == pytest.approx(1 + sum(m["per_position_acceptance"]))
    assert not shown["warnings"], shown["warnings"]            # summary.json agrees with the recomputation
    md = Path(shown["report"]["md"]).read_text()
    assert md_table_values(md)["longest acceptance (sample_from_anchor: B drafts + bonus)"] == "9"
    assert "| 8 | " in md                                     # the per-position table runs to k = B
    code, r = compare_json(runs, A, B, "--no-published")
    assert code == 0 and len(r["metrics"][A]["per_position_acceptance"]) == 8


def test_report_shows_every_tau_convention_and_the_multi_turn_average(tmp_path):
    runs = tmp_path / "runs"
    turns = {"mt-0": {"turns": [{"acceptance_lengths": [4, 4], "output_ids": [1] * 8},
                                {"acceptance_lengths": [1, 1, 1, 1], "output_ids": [1] * 4}]}}
    d = make_run(runs, A, "zlab", acceptance=[[4, 4, 1, 1, 1, 1], [2, 2]], prompt_ids=["mt-0", "mt-1"],
                 suite="mt-bench", row_overrides=turns, ddtree=False)
    s = _rewrite_summary(d, 16)
    assert s["tau_macro"] == pytest.approx((12 / 6 + 2) / 2)
    assert s["tau_macro_turns"] == pytest.approx((4 + 1 + 2) / 3)              # three responses
    assert s["tau_sglang"] == pytest.approx((9 + 5 + 5) / 8)                   # + one prefill token each
    res = invoke("show", A, "--runs-dir", runs, "--json")
    shown = json.loads(res.stdout[res.stdout.index("{"):])
    md = Path(shown["report"]["md"]).read_text()
    vals = md_table_values(md)
    assert vals["tau_macro_turns"] == f"{s['tau_macro_turns']:.4f}" and vals["tau_sglang"] == f"{s['tau_sglang']:.4f}"
    assert "Multi-turn suite: 3 responses (turns) over 2 prompts" in md and "spec_verify_ct" in md
    assert vals["decoding"] == "greedy (T=0), thinking off"


def test_offline_runs_at_t1_report_and_compare_the_expected_tau(tmp_path):
    runs = tmp_path / "runs"

    def expected(tau_sum, anchors):
        return {"alpha_sum": [0.5 * anchors, 0.25 * anchors], "count": [anchors, anchors], "tau_sum": tau_sum,
                "anchors": anchors, "expected_tau": tau_sum / anchors}
    for rid, drafter, taus in ((A, "zlab", (30.0, 20.0)), (B, "v5", (36.0, 26.0))):
        d = make_run(runs, rid, drafter, acceptance=[[], []], prompt_ids=["p-0", "p-1"], ddtree=False,
                     all_anchors=False, env=sampled(1.0),
                     row_overrides={"p-0": {"expected": expected(taus[0], 10)},
                                    "p-1": {"expected": expected(taus[1], 10)}})
        s = _rewrite_summary(d, 16)
    assert s["expected"]["tau_pooled"] == pytest.approx(62 / 20) and s["expected"]["tau_macro"] == pytest.approx(3.1)
    assert s["expected"]["per_position_acceptance"] is None          # rows written without reach_sum
    res = invoke("show", A, "--runs-dir", runs, "--json")
    shown = json.loads(res.stdout[res.stdout.index("{"):])
    md = Path(shown["report"]["md"]).read_text()
    vals = md_table_values(md)
    assert vals["expected tau_macro (offline, T > 0: an estimate)"] == "2.5000" and "tau_macro" not in vals
    assert vals["decoding"].startswith("sampled: T=1, top_p=1, top_k=0, seed=0")
    assert "Expected per-position acceptance (offline, T > 0: an estimate; expected tau_pooled = 1 + Σ)" in md
    assert "| 2 | — | 0.2500 |" in md
    code, r = compare_json(runs, A, B, "--no-published")
    assert code == 0 and r["measure"] == "expected" and r["paired_prompts"] == 2
    c = r["comparisons"][0]
    assert c["macro"]["diff"] == pytest.approx((3.6 + 2.6) / 2 - (3.0 + 2.0) / 2) and c["wins"] == 2
    res = invoke("compare", A, B, "--runs-dir", runs, "--resamples", "200", "--no-published")
    text = " ".join(res.output.split())
    assert "expected tau_macro (offline, T > 0: an estimate)" in text and "Δ expected τ_macro" in text


def test_a_settings_value_with_a_problem_is_never_made():
    """Each rule is checked where a settings value is made: by hand, by `replace`, from run.json
    (untrusted, read back), from the worker's command line; the sampling rule is the same one the
    worker's Sampling checks, with the same words."""
    from remote.contract.settings import SettingsError
    from remote.drafters.sampling import Sampling

    with pytest.raises(SettingsError, match=r"0 < --top-p <= 1"):
        EvalSettings(top_p=0)
    with pytest.raises(SettingsError, match=r"--ddtree: each budget must be 1\.\.1024"):
        replace(EvalSettings(), ddtree="0")
    with pytest.raises(SettingsError, match=r"--temperature >= 0"):
        EvalSettings.from_dict({"temperature": -1.0})
    with pytest.raises(ValueError) as by_hand:
        Sampling(-1.0)
    with pytest.raises(SettingsError) as setting:
        EvalSettings(temperature=-1.0)
    assert str(by_hand.value) == str(setting.value)
    assert EvalSettings(engine=True).mode == "online"      # --engine decodes online
