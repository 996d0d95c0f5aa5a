"""Acceptance metrics: the one implementation, used by the worker (summary.json) and by every
report, listing and comparison of the orchestrator. Stdlib only.

Definitions (docs/run-format.md, REFERENCE §2): an acceptance length is the number of tokens one
draft–verify cycle commits, **bonus token included** (1..B). ``tau_macro`` = mean over prompts of
each prompt's tokens / cycles (z-lab); ``tau_pooled`` = Σ tokens / Σ cycles (Spec-Bench, SGLang,
vLLM); ``per_position_acceptance[k-1]`` = share of cycles whose length is ≥ k+1, k = 1..B-1, so
``tau_pooled = 1 + Σ per_position_acceptance``. A length outside 1..B (a damaged results file)
falls in no histogram bin and is counted by :func:`out_of_range`.
"""
from __future__ import annotations

# the stages of an online cycle, named and bounded as ddtree_generate's and dflash_generate's
# stage_times: draft (the drafter's forward and its drafts), verify (the target's forward), commit
# (the target's choices, the accepted tokens, the caches); a tree cycle also builds the tree from
# the draft's top-k (tree_build) and the verify's inputs and mask (tree_compile). The references
# leave the first cycle's draft out of their stage times (they count it as the drafter's prefill);
# here every cycle counts, so the stages sum to the cycles' time (remote/decode/online.py StageClock).
LINEAR_STAGES = ("draft", "verify", "commit")
TREE_STAGES = ("draft", "tree_build", "tree_compile", "verify", "commit")


def row_stats(acceptance_lengths: list[int]) -> dict:
    cycles, tokens = len(acceptance_lengths), sum(acceptance_lengths)
    return {"cycles": cycles, "tokens": tokens, "tau": tokens / cycles if cycles else None}


def tau_summary(per_prompt: list[list[int]]) -> dict:
    """``tau_macro`` (mean of per-prompt means, z-lab) and ``tau_pooled`` (Σ tokens / Σ cycles)
    over the prompts that have at least one cycle (``prompts`` counts them)."""
    rows = [row_stats(a) for a in per_prompt if a]
    cycles = sum(r["cycles"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    return {"tau_macro": sum(r["tau"] for r in rows) / len(rows) if rows else None,
            "tau_pooled": tokens / cycles if cycles else None, "cycles": cycles, "tokens": tokens,
            "prompts": len(rows)}


def histogram(per_prompt: list[list[int]], block_size: int) -> dict[str, int]:
    hist = {str(k): 0 for k in range(1, block_size + 1)}
    for lengths in per_prompt:
        for n in lengths:
            if 1 <= n <= block_size:
                hist[str(int(n))] += 1
    return hist


def out_of_range(per_prompt: list[list[int]], block_size: int) -> int:
    """How many acceptance lengths fall outside 1..B (none in a healthy run)."""
    return sum(not 1 <= n <= block_size for lengths in per_prompt for n in lengths)


def per_position_acceptance(per_prompt: list[list[int]], block_size: int) -> list[float]:
    """acc_k = (cycles with length >= k + 1) / cycles, k = 1..B-1; τ_pooled = 1 + Σ acc_k."""
    lengths = [n for a in per_prompt for n in a]
    if not lengths:
        return [0.0] * (block_size - 1)
    return [sum(n >= k + 1 for n in lengths) / len(lengths) for k in range(1, block_size)]


def responses(rows: list[dict]) -> list[dict]:
    """One entry per response: each turn of a multi-turn row, else the row itself."""
    return [t for r in rows for t in (r.get("turns") or [r])]


def tau_sglang(rows: list[dict]) -> float | None:
    """τ as SGLang reports it, ``Σ completion_tokens / Σ spec_verify_ct``: every response's first
    token (from the prefill) counts as a completion token, verify cycles are the cycles."""
    per_response = [t.get("acceptance_lengths") or [] for t in responses(rows)]
    cycles = sum(len(a) for a in per_response)
    return sum(1 + sum(a) for a in per_response) / cycles if cycles else None


EXPECTED_LABEL = ("estimate: per anchor of the reference completion, α_k = the chance that draft k is "
                  "accepted given the drafts before it were; expected acceptance @k = mean over anchors of "
                  "Π_{j≤k} α_j; expected τ = 1 + Σ_k Π_{j≤k} α_j per anchor, tau_pooled its mean over anchors "
                  "(= 1 + Σ_k expected acceptance @k), tau_macro the mean over prompts of each prompt's")


def expected_summary(rows: list[dict]) -> dict:
    """Offline at T > 0 (no walk: what a cycle accepts is random): the expected acceptance along the
    reference completions, an estimate, and the one definition every report, listing and comparison
    shows. Per anchor p and draft k, α_k(p) is the chance that draft k is accepted given that the
    drafts before it were (remote/decode/offline.py), its reach r_k(p) = Π_{j≤k} α_j(p) the chance
    that the cycle accepts at least k drafts, and E[τ](p) = 1 + Σ_k r_k(p). Then, as for a walk's
    cycles (module docstring): ``per_position_acceptance[k-1]`` = mean over anchors of r_k (an
    anchor whose cut last block has no draft k counts 0), ``tau_pooled`` = mean over anchors of E[τ]
    = 1 + Σ ``per_position_acceptance``, ``tau_macro`` = mean over prompts of each prompt's mean
    E[τ] (what the verdict leads with and compare pairs). ``alpha[k-1]`` = mean α_k over the anchors
    that have draft k. Rows written without ``reach_sum`` give no ``per_position_acceptance`` (None)."""
    parts = [r["expected"] for r in rows if r.get("expected")]
    alpha = [sum(v) for v in zip(*(p["alpha_sum"] for p in parts))]
    count = [sum(v) for v in zip(*(p["count"] for p in parts))]
    anchors = sum(p["anchors"] for p in parts)
    per_prompt = [p["tau_sum"] / p["anchors"] for p in parts if p["anchors"]]
    reach = [sum(v) for v in zip(*(p["reach_sum"] for p in parts))] \
        if parts and all(p.get("reach_sum") is not None for p in parts) else None
    return {"label": EXPECTED_LABEL,
            "tau_macro": sum(per_prompt) / len(per_prompt) if per_prompt else None,
            "tau_pooled": sum(p["tau_sum"] for p in parts) / anchors if anchors else None,
            "per_position_acceptance": [x / anchors for x in reach] if reach is not None and anchors else None,
            "alpha": [a / n if n else None for a, n in zip(alpha, count)],
            "anchors": anchors, "prompts": len(per_prompt)}


def category_summary(rows: list[dict]) -> dict[str, dict]:
    """:func:`tau_summary` per prompt category (rows without a category are left out), with
    :func:`expected_summary`'s ``expected`` where the category's rows have one (offline at T > 0)."""
    groups: dict[str, list] = {}
    for r in rows:
        if r.get("category") is not None:
            groups.setdefault(str(r["category"]), []).append(r)
    out = {}
    for c, group in sorted(groups.items()):
        out[c] = tau_summary([r.get("acceptance_lengths") or [] for r in group])
        if any(r.get("expected") for r in group):
            out[c]["expected"] = expected_summary(group)
    return out


def all_anchors_accuracy(rows: list[dict], slots: int) -> tuple[list[float], list[float]]:
    """Teacher-forced per-slot accuracy with every completion position an anchor (rows'
    ``all_anchors`` hit counts for the ``slots`` drafted slots: B-1, or B for a sample_from_anchor
    drafter; longer lists in a damaged file are cut), and its cumulative product."""
    correct, count = [0] * slots, [0] * slots
    for r in rows:
        hits = r.get("all_anchors") or {}
        for k, (c, n) in enumerate(zip(list(hits.get("correct") or [])[:slots], list(hits.get("count") or [])[:slots])):
            correct[k] += c
            count[k] += n
    acc = [c / n if n else 0.0 for c, n in zip(correct, count)]
    cum, running = [], 1.0
    for a in acc:
        running *= a
        cum.append(running)
    return acc, cum


def plain_tokens(row: dict) -> int | None:
    """The output tokens of an online row's plain decoding (every turn's): its ``target_tokens``. A
    row written without them counts its own outputs when greedy (lossless: the same tokens) and has
    None when sampled (``lossless`` null): a sample of plain decoding stops at its own length."""
    if row.get("target_tokens") is not None:
        return row["target_tokens"]
    if "lossless" in row and row["lossless"] is None:
        return None
    return sum(len(t.get("output_ids") or []) for t in responses([row]))


def engine_tokens(e: dict) -> int:
    """The output tokens of an engine row's run with the drafter (every turn's)."""
    return sum(len(t.get("output_ids") or []) for t in e["turns"]) if e.get("turns") else len(e.get("output_ids") or [])


def engine_plain_tokens(e: dict) -> int | None:
    """The output tokens of an engine row's run without the drafter (``plain.tokens``). A row written
    without them counts the drafter run's outputs when greedy with the same output, else None (a
    sample without the drafter stops at its own length)."""
    plain = e.get("plain") or {}
    if plain.get("tokens") is not None:
        return plain["tokens"]
    if (e.get("checks") or {}).get("temperature") == 0 and plain.get("same_output"):
        return engine_tokens(e)
    return None


def online_summary(rows: list[dict]) -> dict:
    """Speed of an online run: output tokens (every turn's completion) per second of speculative
    decoding (``tokens_per_s``) and plain decoding's own output tokens per second of plain decoding
    (``target_tokens_per_s``, :func:`plain_tokens`; None when a row does not say them), ``speedup``
    = the first rate / the second; and whether every row was lossless (``None`` when no row could
    be checked, e.g. sampled decoding)."""
    wall = sum(r["wall_s"] for r in rows)
    target_wall = sum(r.get("target_wall_s") or 0.0 for r in rows)
    tokens = sum(len(t.get("output_ids") or []) for t in responses(rows))
    online = {"wall_s": wall, "tokens_per_s": tokens / wall if wall else None}
    if target_wall:
        plain = [plain_tokens(r) for r in rows]
        target_tokens = sum(plain) if None not in plain else None
        rate = target_tokens / target_wall if target_tokens is not None else None
        online.update(target_wall_s=target_wall, target_tokens=target_tokens, target_tokens_per_s=rate,
                      speedup=online["tokens_per_s"] / rate if online["tokens_per_s"] is not None and rate else None)
    online.update(cycle_costs(rows))
    if any("lossless" in r for r in rows):   # a row that does not record it is not lossless;
        checked = [r.get("lossless") for r in rows if "lossless" not in r or r["lossless"] is not None]
        online["lossless"] = all(c is True for c in checked) if checked else None   # None: sampled
        near_ties = sum(bool((r.get("divergence") or {}).get("near_tie")) for r in rows)
        if near_ties:
            online["near_tie_divergences"] = near_ties
    return online


def engine_summary(rows: list[dict]) -> dict | None:
    """The serving engine's own counts over the rows that have them (``eval --engine``), beside ours
    on the same prompts: τ exactly as the engine counts it per prompt (``tokens / cycles`` of each
    row's ``engine``), macro (mean over prompts) and pooled (Σ / Σ, how the engine's own /metrics
    pool it); drafts and accepted drafts, per-position acceptance (steps that accepted more than k
    drafts / steps), the histogram of drafts accepted per step (0..K); its speed with the drafter and
    without (``speedup`` = Σ time without / Σ time with); prompts whose output equals ours; and per
    cause (remote/engines/phase.py ``CAUSES``) the prompts it explains. None without engine rows."""
    pairs = [(r, r["engine"]) for r in rows if r.get("engine")]
    if not pairs:
        return None
    counted = [(r, e) for r, e in pairs if e.get("cycles")]
    cycles = sum(e["cycles"] for _, e in counted)
    tokens = sum(e["tokens"] for _, e in counted)
    ours = tau_summary([r.get("acceptance_lengths") or [] for r, _ in counted])
    out = {"kind": pairs[0][1].get("kind"), "prompts": len(pairs),
           "tau_macro": sum(e["tokens"] / e["cycles"] for _, e in counted) / len(counted) if counted else None,
           "tau_pooled": tokens / cycles if cycles else None, "cycles": cycles, "tokens": tokens,
           "our_tau_macro": ours["tau_macro"], "our_tau_pooled": ours["tau_pooled"],
           "drafts": sum(e.get("drafts") or 0 for _, e in pairs),
           "accepted": sum(e.get("accepted") or 0 for _, e in pairs),
           "same_output": sum(bool((e.get("checks") or {}).get("same_output")) for _, e in pairs)}
    per_pos = [e.get("accepted_per_pos") for _, e in pairs]
    if out["drafts"] and all(p is not None for p in per_pos):
        width = max(len(p) for p in per_pos)
        out["per_position_acceptance"] = [sum((p + [0] * width)[k] for p in per_pos) / out["drafts"]
                                          for k in range(width)]
    hists = [e.get("histogram") for _, e in pairs]
    if all(h is not None for h in hists):
        width = max(len(h) for h in hists)
        out["histogram"] = [sum((h + [0] * width)[k] for h in hists) for k in range(width)]
    wall = sum(e.get("wall_s") or 0.0 for _, e in pairs)
    out_tokens = sum(engine_tokens(e) for _, e in pairs)
    out["wall_s"], out["tokens_per_s"] = wall, out_tokens / wall if wall else None
    plain = [e["plain"] for _, e in pairs if e.get("plain")]
    if len(plain) == len(pairs):
        plain_wall = sum(p["wall_s"] for p in plain)
        counts = [engine_plain_tokens(e) for _, e in pairs]
        rate = sum(counts) / plain_wall if plain_wall and None not in counts else None
        out["plain_tokens_per_s"] = rate
        out["speedup"] = out["tokens_per_s"] / rate if out["tokens_per_s"] is not None and rate else None
    causes: dict[str, int] = {}
    for _, e in pairs:
        for cause in e.get("causes") or []:
            causes[cause] = causes.get(cause, 0) + 1
    out["causes"] = causes
    return out


def cycle_costs(decodings: list[dict]) -> dict:
    """The time per cycle of online decodings that timed their stages (a row, or a row's
    ``ddtree[N]``: ``acceptance_lengths``, ``cycles_s``, ``stage_s``): ``s_per_cycle`` = Σ
    ``cycles_s`` / Σ cycles and ``stage_s_per_cycle`` = each stage's Σ / Σ cycles; ``{}`` when one
    of them did not time its stages or no cycle ran."""
    if not decodings or any(d.get("cycles_s") is None or d.get("stage_s") is None for d in decodings):
        return {}
    cycles = sum(len(d.get("acceptance_lengths") or []) for d in decodings)
    if not cycles:
        return {}
    stages = [k for k in TREE_STAGES if any(k in d["stage_s"] for d in decodings)]
    return {"s_per_cycle": sum(d["cycles_s"] for d in decodings) / cycles,
            "stage_s_per_cycle": {k: sum(d["stage_s"].get(k, 0.0) for d in decodings) / cycles for k in stages}}


def tree_tokens(row: dict, budget: str) -> int:
    """The output tokens of a row's online DDTree-``budget`` decoding: its last turn's tree output,
    and the row's own outputs of the turns before (:func:`ddtree_costs`)."""
    earlier = sum(len(t.get("output_ids") or []) for t in (row.get("turns") or [])[:-1])
    return len(row["ddtree"][budget].get("output_ids") or []) + earlier


def ddtree_costs(rows: list[dict], budget: str) -> dict:
    """What DDTree budget ``budget`` costs in an online run (``{}`` offline, where a row's budget has
    no ``wall_s``), over the rows that decoded it: its output tokens per second of tree decoding
    (``wall_s``), plain decoding's over the same rows (:func:`online_summary`'s, plain decoding's
    own tokens per ``target_wall_s``), ``speedup`` = the first / the second, ``lossless`` as
    :func:`online_summary` has it, and the time per cycle by stage (:func:`cycle_costs`). A
    multi-turn row keeps only its last turn's tree output: its earlier turns count the row's own
    outputs (the same tokens when greedy and lossless)."""
    trees = [(r, r["ddtree"][budget]) for r in rows if budget in (r.get("ddtree") or {})]
    if not trees or any(t.get("wall_s") is None for _, t in trees):
        return {}
    wall = sum(t["wall_s"] for _, t in trees)
    tokens = sum(tree_tokens(r, budget) for r, _ in trees)
    plain = online_summary([r for r, _ in trees]) if all(r.get("wall_s") is not None for r, _ in trees) else {}
    out = {"wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
           "target_tokens_per_s": plain.get("target_tokens_per_s")}
    out["speedup"] = (out["tokens_per_s"] / out["target_tokens_per_s"]
                      if out["tokens_per_s"] is not None and out["target_tokens_per_s"] else None)
    out.update(cycle_costs([t for _, t in trees]))
    if any("lossless" in t for _, t in trees):
        checked = [t.get("lossless") for _, t in trees if "lossless" not in t or t["lossless"] is not None]
        out["lossless"] = all(c is True for c in checked) if checked else None
    return out


def fastest_budget(ddtree: dict) -> str | None:
    """The budget of a summary's ``ddtree`` with the most tokens per second (None offline)."""
    timed = [(v["tokens_per_s"], b) for b, v in ddtree.items() if v.get("tokens_per_s") is not None]
    return max(timed, key=lambda t: (t[0], -int(t[1])))[1] if timed else None


def summarize(rows: list[dict], block_size: int, mode: str | None, max_length: int | None = None) -> dict:
    """``max_length``: the most tokens a cycle can commit (default ``block_size``; ``B + 1`` for a
    sample_from_anchor drafter)."""
    per_prompt = [r.get("acceptance_lengths") or [] for r in rows]
    longest = max_length or block_size
    t = tau_summary(per_prompt)
    summary = {"mode": mode, "block_size": block_size, "prompts": len(rows), "tau_macro": t["tau_macro"],
               "tau_pooled": t["tau_pooled"], "cycles": t["cycles"], "tokens": t["tokens"],
               "tau_macro_turns": tau_summary([r.get("acceptance_lengths") or [] for r in responses(rows)])["tau_macro"],
               "tau_sglang": tau_sglang(rows), "responses": len(responses(rows)),
               "acceptance_histogram": histogram(per_prompt, longest),
               "per_position_acceptance": per_position_acceptance(per_prompt, longest)}
    if any(r.get("expected") for r in rows):
        summary["expected"] = expected_summary(rows)
    budgets = sorted({str(b) for r in rows for b in (r.get("ddtree") or {})}, key=int)
    if budgets:
        summary["ddtree"] = {}
        for b in budgets:
            d = tau_summary([r["ddtree"][b].get("acceptance_lengths") or [] for r in rows
                             if b in (r.get("ddtree") or {})])
            summary["ddtree"][b] = {"tau_macro": d["tau_macro"], "tau_pooled": d["tau_pooled"],
                                    "prompts": d["prompts"], **ddtree_costs(rows, b)}
    if any("all_anchors" in r for r in rows):
        summary["all_anchors_accuracy"], summary["all_anchors_cumulative"] = all_anchors_accuracy(rows, longest - 1)
    if rows and all(r.get("wall_s") is not None for r in rows):
        summary["online"] = online_summary(rows)
    engine = engine_summary(rows)
    if engine:
        summary["engine"] = engine
    cycles = [(c, n) for r in rows for c, n in zip(r.get("confidences") or [], r.get("acceptance_lengths") or [])]
    if cycles:      # a confidence head (DSpark): judged against the cycles it predicted
        from remote.contract import confidence
        summary["confidence"] = confidence.summary(cycles)
    return summary
