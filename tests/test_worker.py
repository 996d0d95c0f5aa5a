"""The worker as a real subprocess on the embedded pair (tiny hybrid target + trained drafter)."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from remote.contract.metrics import summarize

REPO = Path(__file__).resolve().parents[1]


def worker(*args, check=True, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "remote.worker", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"worker exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def events(proc):
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def rows(out):
    return [json.loads(line) for line in (Path(out) / "results.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def offline_run(embedded_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("w") / "offline"
    proc = worker("--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--prompts", 3,
                  "--out", out, "--device", "cpu", "--max-new-tokens", 96, "--all-anchors")
    return out, proc


ONE_RUN = pytest.mark.xdist_group("worker-offline-run")     # the tests of offline_run share one worker


@pytest.mark.worker
@ONE_RUN
def test_offline_run_files_are_complete_and_consistent(offline_run, embedded_pair):
    out, proc = offline_run
    ev = events(proc)
    assert ev[0] == {"event": "phase", "phase": "loading target", "device": "cpu", "dtype": "float32"}
    assert ev[1]["event"] == "start" and ev[-1]["event"] == "end"
    assert [e["done"] for e in ev if e["event"] == "prompt"] == [1, 2, 3]
    results = rows(out)
    assert len(results) == 3 and len({r["id"] for r in results}) == 3
    for r in results:
        assert {"id", "prompt_ids", "output_ids", "acceptance_lengths", "ddtree", "all_anchors"} <= set(r)
        assert sum(r["acceptance_lengths"]) == len(r["output_ids"]) - 1     # every token after the first
        assert all(1 <= n <= 8 for n in r["acceptance_lengths"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary == summarize(results, 8, "offline")                       # recomputation from results
    assert summary["tau_pooled"] > 1.5, summary
    assert summary["ddtree"]["64"]["tau_macro"] >= summary["ddtree"]["8"]["tau_macro"] - 1e-9
    env = json.loads((out / "env.json").read_text())
    weights = Path(embedded_pair["drafter"]) / "model.safetensors"
    assert env["drafter"]["sha256"] == {"model.safetensors": hashlib.sha256(weights.read_bytes()).hexdigest()}
    assert env["kernel_path"] == "torch" and env["dtype"] == "float32" and env["device"] == "cpu"
    assert env["versions"]["torch"] and env["suite"]["name"] == "default" and len(env["suite"]["sha256"]) == 64
    assert env["settings"]["reference"] == "local" and env["finished_at"]
    assert "--all-anchors" in env["command"]


@pytest.mark.worker
@pytest.mark.exactness
@ONE_RUN
def test_online_equals_offline_per_cycle_and_is_lossless(offline_run, embedded_pair, tmp_path):
    out, _ = offline_run
    proc = worker("--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--prompts", 3,
                  "--out", tmp_path, "--device", "cpu", "--max-new-tokens", 96, "--mode", "online")
    online, offline = rows(tmp_path), rows(out)
    for a, b in zip(online, offline):
        assert a["output_ids"] == b["output_ids"], a["id"]                 # == target greedy (lossless)
        assert a["acceptance_lengths"] == b["acceptance_lengths"], a["id"]
        assert a["lossless"] is True and a["wall_s"] > 0 and a["target_wall_s"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["online"]["lossless"] and summary["online"]["speedup"] > 0
    assert events(proc)[-1]["event"] == "end"


@pytest.mark.worker
def test_resume_skips_finished_prompts_and_drops_a_torn_line(embedded_pair, tmp_path):
    common = ["--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--out", tmp_path,
              "--device", "cpu", "--max-new-tokens", 48, "--ddtree", ""]
    worker(*common, "--prompts", 2)
    first = rows(tmp_path)
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"id": "half-written", "accep')                              # killed mid-write
    refused = worker(*common, "--prompts", 4, check=False)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    proc = worker(*common, "--prompts", 4, "--resume")
    assert events(proc)[1] == {"event": "start", "prompts": 4, "done": 2, "mode": "offline"}
    assert len([e for e in events(proc) if e["event"] == "prompt"]) == 2
    after = rows(tmp_path)
    assert [r["id"] for r in after[:2]] == [r["id"] for r in first] and len({r["id"] for r in after}) == 4
    assert json.loads((tmp_path / "summary.json").read_text())["prompts"] == 4


@pytest.mark.worker
def test_shards_partition_the_prompts(embedded_pair, tmp_path):
    ids = []
    for k in range(2):
        worker("--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--out", tmp_path / str(k),
               "--device", "cpu", "--max-new-tokens", 16, "--prompts", 5, "--shard", f"{k}/2", "--ddtree", "")
        ids.append([r["id"] for r in rows(tmp_path / str(k))])
    assert len(ids[0]) == 3 and len(ids[1]) == 2 and not set(ids[0]) & set(ids[1])


@pytest.mark.worker
def test_multi_turn_rows_are_answered_turn_by_turn(embedded_pair, tmp_path):
    suite = tmp_path / "two.jsonl"
    suite.write_text(json.dumps({"question_id": 7, "category": "writing", "turns": ["Say hello.", "Now again."]}) + "\n"
                     + json.dumps({"id": "ids", "input_ids": [1, 2, 3, 4, 5]}) + "\n")
    # (thinking: the template's default; with thinking off a Qwen3-style template drops the earlier
    # turns' empty think blocks from the history, so a turn's prompt is not a prefix of the next)
    worker("--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--suite", suite,
           "--out", tmp_path / "o", "--device", "cpu", "--max-new-tokens", 24, "--ddtree", "8",
           "--thinking", "default")
    multi, raw = rows(tmp_path / "o")
    assert multi["id"] == "7" and multi["category"] == "writing" and len(multi["turns"]) == 2
    t1, t2 = multi["turns"]
    assert t2["prompt_ids"][:len(t1["prompt_ids"])] == t1["prompt_ids"]     # the chat so far ...
    assert len(t2["prompt_ids"]) > len(t1["prompt_ids"]) + len(t1["output_ids"]) - 2   # ... with the answer
    assert multi["acceptance_lengths"] == t1["acceptance_lengths"] + t2["acceptance_lengths"]
    assert raw["prompt_ids"] == [1, 2, 3, 4, 5] and "turns" not in raw
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    per_turn = [sum(t["acceptance_lengths"]) / len(t["acceptance_lengths"]) for t in multi["turns"]]
    per_turn.append(raw["tau"])
    assert summary["responses"] == 3                                          # z-lab / DDTree: one per turn
    assert summary["tau_macro_turns"] == pytest.approx(sum(per_turn) / 3)


@pytest.mark.worker
def test_sglang_reference_path(embedded_pair, tmp_path):
    from remote.target.model import load_target
    from sglang_server import serve_sglang
    from transformers import AutoTokenizer

    target = load_target(embedded_pair["target"], "cpu")
    with serve_sglang(target, AutoTokenizer.from_pretrained(embedded_pair["target"])) as url:
        worker("--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--prompts", 2,
               "--out", tmp_path / "s", "--device", "cpu", "--max-new-tokens", 48, "--sglang", url,
               "--ddtree", "")
    worker("--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--prompts", 2,
           "--out", tmp_path / "l", "--device", "cpu", "--max-new-tokens", 48, "--ddtree", "")
    via_sglang, local = rows(tmp_path / "s"), rows(tmp_path / "l")
    assert [r["reference"] for r in via_sglang] == ["sglang", "sglang"]
    assert [r["output_ids"] for r in via_sglang] == [r["output_ids"] for r in local]
    assert [r["acceptance_lengths"] for r in via_sglang] == [r["acceptance_lengths"] for r in local]


@pytest.mark.worker
@pytest.mark.parametrize("case", ["missing-target", "mismatch", "bad-jsonl", "sglang-down", "bad-args"])
def test_clear_errors_before_heavy_work(case, embedded_pair, tmp_path):
    args = ["--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--out", tmp_path / "o",
            "--device", "cpu"]
    if case == "missing-target":
        args[1] = str(tmp_path / "nope")
        want, code = "--target", 2
    elif case == "mismatch":
        cfg = json.loads((Path(embedded_pair["drafter"]) / "config.json").read_text())
        cfg["dflash_config"]["mask_token_id"] = 999
        bad = tmp_path / "bad_drafter"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(cfg))
        (bad / "model.safetensors").symlink_to(Path(embedded_pair["drafter"]) / "model.safetensors")
        args[3] = str(bad)
        want, code = "mask_token_id 999 is outside the target's embedding rows", 1
    elif case == "bad-jsonl":
        f = tmp_path / "p.jsonl"
        f.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": \n')
        args += ["--suite", f]
        want, code = ":2", 1
    elif case == "sglang-down":
        args += ["--sglang", "http://127.0.0.1:9"]
        want, code = "not reachable", 1
    else:
        args += ["--shard", "3/2"]
        want, code = "--shard must be K/N", 2
    proc = worker(*args, check=False, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert want in proc.stderr
    assert not (tmp_path / "o" / "results.jsonl").exists()


@pytest.mark.worker
def test_one_token_completions_do_not_crash(embedded_pair, tmp_path):
    """A completion of one token (here --max-new-tokens 1; EOS first takes the same path) has no
    cycle: tau is None in the row, the progress event and the log line, in both modes."""
    for mode in ("offline", "online"):
        proc = worker("--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--prompts", 2,
                      "--out", tmp_path / mode, "--device", "cpu", "--max-new-tokens", 1, "--mode", mode)
        results = rows(tmp_path / mode)
        assert [len(r["output_ids"]) for r in results] == [1, 1]
        assert all(r["cycles"] == 0 and r["tau"] is None for r in results)
        prompt_events = [e for e in events(proc) if e["event"] == "prompt"]
        assert [e["tau"] for e in prompt_events] == [None, None] and prompt_events[-1]["tau_running"] is None
        assert "tau n/a" in proc.stderr
        summary = json.loads((tmp_path / mode / "summary.json").read_text())
        assert summary["tau_pooled"] is None and summary["tau_sglang"] is None


@pytest.mark.worker
def test_sampled_online_run_records_settings_and_is_reproducible(embedded_pair, tmp_path):
    common = ["--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--prompts", 2,
              "--device", "cpu", "--max-new-tokens", 24, "--mode", "online", "--temperature", "1",
              "--top-p", "0.95", "--top-k", "50", "--seed", "7"]
    worker(*common, "--out", tmp_path / "a")
    worker(*common, "--out", tmp_path / "b", "--shard", "1/2")          # prompt 2 alone: same numbers
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert (a[1]["output_ids"], a[1]["acceptance_lengths"]) == (b[0]["output_ids"], b[0]["acceptance_lengths"])
    assert all(r["lossless"] is None for r in a)                         # not checkable per prompt at T > 0
    env = json.loads((tmp_path / "a" / "env.json").read_text())
    s = env["settings"]
    assert (s["temperature"], s["top_p"], s["top_k"], s["seed"]) == (1.0, 0.95, 50, 7)
    assert s["enable_thinking"] is False and s["ddtree_budgets"] == [] and s["verify_block"] == 8
    assert s["stop_token_ids"] == [json.loads((Path(embedded_pair["target"]) / "generation_config.json")
                                              .read_text())["eos_token_id"]] and "z-lab" in s["stop_rule"]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["online"]["lossless"] is None
    tokens = sum(len(r["output_ids"]) for r in a)
    assert summary["tau_sglang"] == pytest.approx(tokens / summary["cycles"])   # completion_tokens / spec_verify_ct


@pytest.mark.worker
def test_sampled_offline_run_reports_the_expected_acceptance(embedded_pair, tmp_path):
    worker("--target", embedded_pair["target"], "--drafter", embedded_pair["drafter"], "--prompts", 2,
           "--device", "cpu", "--max-new-tokens", 32, "--temperature", "1", "--out", tmp_path)
    results = rows(tmp_path)
    for r in results:
        assert r["acceptance_lengths"] == [] and "ddtree" not in r
        e = r["expected"]
        assert e["anchors"] == len(r["output_ids"]) - 1 and e["count"][0] == e["anchors"]
        assert 1.0 <= e["expected_tau"] <= 8 and all(0 <= a <= c for a, c in zip(e["alpha_sum"], e["count"]))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == summarize(results, 8, "offline")
    assert summary["expected"]["label"].startswith("estimate") and 1.0 < summary["expected"]["tau_pooled"] <= 8
    assert summary["tau_macro"] is None


@pytest.mark.parametrize("args,message", [
    (["--ddtree", "8,2048"], "each budget must be 1..1024"),
    (["--temperature", "1", "--ddtree", "8"], "--ddtree at --temperature > 0 offline"),
    (["--top-p", "0"], "0 < --top-p <= 1"),
    (["--temperature", "-1"], "--temperature >= 0"),
])
def test_sampling_and_budget_usage_errors(args, message, tmp_path, capsys):
    from remote.worker import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--target", str(tmp_path), "--drafter", str(tmp_path), "--out", str(tmp_path), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
