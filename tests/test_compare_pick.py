"""`compare A B` picks, for each label, the newest runs that pair, says which and why, and when
none pair lists the closest candidates with what differs; `runs` shows mode and settings."""
from __future__ import annotations

import json

import pytest

from clirun import invoke
from fakeruns import make_run

ZLAB = "20261202-0900-zlab-ct129"
V5 = "20261202-1000-v5-step20k-ct129"
V5_ONLINE = "20261203-1100-v5-step20k-ct129"
V5_ALL = "20261203-1200-v5-step20k-ct129"


@pytest.fixture
def runs(tmp_path):
    d = tmp_path / "runs"
    make_run(d, ZLAB, "zlab", prompts=6)
    make_run(d, V5, "v5", "step_20000", prompts=6, meta={"step": 20000})
    make_run(d, V5_ONLINE, "v5", "step_20000", prompts=6, mode="online", meta={"step": 20000})
    make_run(d, V5_ALL, "v5", "step_20000", prompts=12, meta={"step": 20000})
    return d


def cli(runs, *args):
    return invoke(*args, "--runs-dir", runs, env={"COLUMNS": "200"})


def flat(text: str) -> str:
    return " ".join(text.split())


def test_compare_picks_the_newest_runs_that_pair_and_says_why(runs):
    res = cli(runs, "compare", "zlab", "v5", "--resamples", "200")
    assert res.exit_code == 0, res.output
    out = flat(res.stdout)
    assert f"zlab → {ZLAB} (the newest zlab run)" in out
    assert (f"v5 → {V5} (the newest v5 run that pairs with {ZLAB}; skipped newer: {V5_ALL} (prompts 12 vs 6), "
            f"{V5_ONLINE} (mode online vs offline))") in out
    result = json.loads(cli(runs, "compare", "zlab", "v5", "--resamples", "200", "--json").stdout)
    assert [p["id"] for p in result["picked"]] == [ZLAB, V5] and not result["refused"]
    # named by id, a run is taken as named: these do not pair, and compare says so (exit 3)
    res = cli(runs, "compare", ZLAB, V5_ONLINE)
    assert res.exit_code == 3 and "mode differs" in flat(res.stderr)


def test_when_nothing_pairs_the_closest_candidates_are_listed(runs):
    for rid in (V5,):
        for f in (runs / rid).iterdir():
            f.unlink()
        (runs / rid).rmdir()
    res = cli(runs, "compare", "zlab", "v5")
    assert res.exit_code == 3, res.output
    err = flat(res.stderr)
    assert "no runs of these labels pair; the closest candidates" in err
    assert f"{ZLAB} + {V5_ONLINE}: mode online vs offline" in err
    assert f"{ZLAB} + {V5_ALL}: prompts 12 vs 6" in err
    assert f"dflash-ops compare {ZLAB} " in err and "--force" in err


def test_runs_shows_mode_and_settings(runs):
    rows = json.loads(cli(runs, "runs", "--json").stdout)
    assert {r["id"]: r["mode"] for r in rows} == {ZLAB: "offline", V5: "offline", V5_ONLINE: "online",
                                                  V5_ALL: "offline"}
    assert all(r["settings"] not in (None, "") for r in rows)
    table = cli(runs, "runs").stdout
    assert "mode" in table and "settings" in table and "online" in table
