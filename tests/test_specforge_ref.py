"""SpecForge 0.2.0's own decoding (``spec_generate`` of its DFlash, Domino and DSpark drafter classes),
run in its environment by tests/specforge_ref.py, against the target's own greedy decoding here.

SpecForge pins transformers 5.8.1 (its spec_generate fails on the project's 5.25), so it has an
environment of its own, ``.ci/specforge-env``, found through ``$DFLASH_OPS_SPECFORGE_PYTHON``
(.ci/run sets it); without it the module is skipped. The target is a tiny random Qwen3 (weights at
std 0.5: decisive logits, so greedy decoding is robust, and T=0.7 still samples off the argmax); the
drafters are random (SpecForge's init, the Domino/DSpark heads at std 0.5), and one DSpark drafter's
Markov head is rewritten to know the target's greedy continuations (an oracle: long acceptances whose
lengths are known here). What is built is kept in the build cache (tests/buildcache.py); the harness
runs in two processes at once, each a batch of commands (its imports take most of a command's time).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import buildcache
from specforge_env import MARKS, PROMPTS, env_stamp, harness_batch, ok
from specforge_env import target_dir as built_target

pytestmark = MARKS

FAMILIES = ("dflash", "domino", "dspark")
BLOCK = 8
N = 24              # max_new_tokens
ORACLE_N = 20       # not a multiple of the block: the last cycle still verifies a whole block
SEED = 7
MASK = 255          # the drafters' mask_token_id: the target's last id
ORACLE_BIAS = 100.0


def as_specforge(ids: list[int]) -> list[int]:
    """What spec_generate returns of a continuation: every mask-token id dropped, wherever it is
    (``output_ids = output_ids[:, output_ids[0] != self.mask_token_id]``, meant for the unused tail
    of its buffer); the target's first greedy continuation has one (test_mask_token_ids_are_dropped)."""
    return [t for t in ids if t != MASK]


def check_cycles(lengths: list[int], n: int):
    """SpecForge's loop runs ``while start < max_length``: cycles until at least n tokens, each
    1 (all drafts rejected) to BLOCK (all accepted, plus the bonus token)."""
    assert all(1 <= a <= BLOCK for a in lengths), lengths
    assert sum(lengths[:-1]) < n <= sum(lengths), (lengths, n)


def oracle_table(reference: list[list[int]]) -> dict[int, int]:
    """Each token of the greedy paths (a prompt's last token, then its continuation) to the token
    after it; a token met twice keeps its first successor."""
    table = {}
    for prompt, ref in zip(PROMPTS, reference):
        path = [prompt[-1], *ref]
        for a, b in zip(path, path[1:]):
            table.setdefault(a, b)
    return table


def oracle_cycles(ref: list[int], table: dict[int, int], n: int, stop: int | None = None) -> list[int]:
    """The acceptance lengths SpecForge's loop gives the oracle drafter on one greedy continuation:
    from each cycle's first token (accepted, on the path) the drafts follow the table, accepted while
    they stay on the path (SpecForge's cumprod); the cycle counts them plus the bonus token. With a
    stop token the loop ends after the cycle whose tokens include it (its whole cycle counted)."""
    lengths, i = [], 0                  # ref[i]: the cycle's first token (the prefill's sample first)
    while i < n:
        accepted, token = 0, ref[i]
        while accepted < BLOCK - 1 and table.get(token) == ref[i + accepted + 1]:
            accepted += 1
            token = ref[i + accepted]
        lengths.append(accepted + 1)
        i += accepted + 1
        if stop is not None and stop in ref[:i + 1]:
            break
    return lengths


@pytest.fixture(scope="module")
def target_dir() -> Path:
    return built_target()


@pytest.fixture(scope="module")
def reference(target_dir) -> list[list[int]]:
    """The target's own greedy continuations here (the project's transformers): N + BLOCK tokens,
    so that the oracle knows the path past the last cycle's first token."""
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(N + BLOCK):
                ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def drafters(target_dir, reference) -> dict:
    """``{name: (folder, the build command's JSON)}``: a drafter of each family and the oracle
    (a DSpark drafter, Markov head of rank = vocab, w1 the identity and w2[next, token] = 100 for each
    pair of oracle_table: the bias decides each draft), built by the harness in one process once."""
    table = oracle_table(reference)
    common = ["--target", str(target_dir), "--seed", "0", "--block-size", str(BLOCK)]
    oracle_sets = ["--set", "dflash_config.markov_rank=256", "--set", "dflash_config.enable_confidence_head=false"]
    names = [*FAMILIES, "oracle"]
    recipe = {"target": target_dir.parent.name, "harness": env_stamp(), "common": common[2:], "oracle": oracle_sets,
              "table": sorted(table.items()), "bias": ORACLE_BIAS}

    def build(out):
        import torch
        from safetensors.torch import load_file, save_file

        jobs = [["build", name, str(out / name), *common] for name in FAMILIES]
        jobs.append(["build", "dspark", str(out / "oracle"), *common, *oracle_sets])
        infos = dict(zip(names, map(ok, harness_batch(jobs, out, "builds"))))
        (f,) = (out / "oracle").glob("*.safetensors")
        state = load_file(f)
        w2 = torch.zeros(256, 256)
        for a, b in table.items():
            w2[b, a] = ORACLE_BIAS
        state["markov_head.markov_w1.weight"] = torch.eye(256)
        state["markov_head.markov_w2.weight"] = w2
        save_file(state, f, metadata={"format": "pt"})
        (out / "builds.json").write_text(json.dumps(infos))

    folder = buildcache.built("specforge-drafters", recipe, build)
    infos = json.loads((folder / "builds.json").read_text())
    return {name: (folder / name, infos[name]) for name in names}


@pytest.fixture(scope="module")
def stop(reference) -> int:
    return reference[0][5]


@pytest.fixture(scope="module")
def runs(target_dir, drafters, stop, tmp_path_factory) -> dict:
    """The harness's generate runs: ``{key: its JSON}``, in two processes at once."""
    folder = tmp_path_factory.mktemp("specforge")
    prompts, twice = folder / "prompts.json", folder / "twice.json"
    prompts.write_text(json.dumps(PROMPTS))
    twice.write_text(json.dumps([PROMPTS[0], PROMPTS[1], PROMPTS[0]]))   # the first again: same seed, same output

    def generate(name: str, prompt_file: Path, n: int, *extra: str) -> list[str]:
        return ["generate", str(drafters[name][0]), str(target_dir), "--prompts", str(prompt_file),
                "--max-new-tokens", str(n), "--seed", str(SEED), *extra]

    jobs = {}
    for family in FAMILIES:
        jobs[family, "greedy"] = generate(family, prompts, N)
        jobs[family, "sampled"] = generate(family, twice, N, "--temperature", "0.7")
    jobs["oracle"] = generate("oracle", prompts, ORACLE_N)
    jobs["stop"] = generate("oracle", prompts, N, "--stop", str(stop))
    keys = list(jobs)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = [pool.submit(harness_batch, [jobs[k] for k in half], folder, f"runs{i}") for i, half in enumerate(halves)]
        results = [r for job in done for r in job.result()]
    return dict(zip([k for half in halves for k in half], results))


@pytest.mark.parametrize("family", FAMILIES)
def test_build_with_specforge_class(family, drafters):
    """SpecForge's class and config conventions; the family's head tensors, at std 0.5."""
    from safetensors.torch import load_file

    folder, info = drafters[family]
    config = info["config"]
    classes = {"dflash": "DFlashDraftModel", "domino": "DominoDraftModel", "dspark": "DSparkDraftModel"}
    assert config["architectures"] == [classes[family]]
    assert (config["block_size"], config["num_target_layers"], config["num_hidden_layers"]) == (BLOCK, 4, 1)
    assert (config["hidden_size"], config["vocab_size"], config["num_attention_heads"]) == (64, 256, 4)
    method = config["dflash_config"]
    assert (method["mask_token_id"], method["target_layer_ids"]) == (MASK, [2])
    assert method.get("projector_type") == (None if family == "dflash" else family)
    heads = {"dflash": set(),
             "domino": {"prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight"},
             "dspark": {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                        "confidence_head.proj.bias"}}[family]
    backbone = ("fc.", "hidden_norm.", "norm.", "layers.0.")
    assert {t for t in info["tensors"] if not t.startswith(backbone)} == heads
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "norm.weight"} <= set(info["tensors"])
    (f,) = folder.glob("*.safetensors")
    state = load_file(f)
    for name in heads:
        if state[name].numel() > 1:         # not the confidence head's one bias
            assert 0.4 < state[name].std().item() < 0.6, name


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_the_target(family, runs, reference):
    """At T=0 SpecForge's loop is lossless: its output is the target's greedy continuation (less
    the mask-token ids it drops)."""
    result = ok(runs[family, "greedy"])
    assert result["outputs"] == [as_specforge(ref[:N]) for ref in reference]
    for lengths in result["acceptance_lengths"]:
        check_cycles(lengths, N)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_is_seeded(family, runs, reference):
    """At T=0.7 the seed decides the output (the first prompt twice: the same ids, the same cycles),
    and the target samples: not its greedy continuation."""
    result = ok(runs[family, "sampled"])
    outputs, lengths = result["outputs"], result["acceptance_lengths"]
    assert (outputs[0], lengths[0]) == (outputs[2], lengths[2])
    assert [len(o) for o in outputs] == [N] * 3
    for cycle in lengths:
        check_cycles(cycle, N)
    assert outputs[:2] != [as_specforge(ref[:N]) for ref in reference]


def test_oracle_acceptance_lengths(runs, reference):
    """Drafts that follow the greedy path: the acceptance lengths the harness reads back (from the
    target cache's crops; it checks them against spec_generate's own list) are the ones the loop must
    give, computed here, long ones included. The last cycle verifies a whole block even past
    max_new_tokens (z-lab's dflash_generate verifies only what is left): the output is cut to it."""
    result = ok(runs["oracle"])
    table = oracle_table(reference)
    assert result["outputs"] == [as_specforge(ref[:ORACLE_N]) for ref in reference]
    expected = [oracle_cycles(ref, table, ORACLE_N) for ref in reference]
    assert result["acceptance_lengths"] == expected
    assert BLOCK in expected[0] + expected[1]          # a whole block accepted
    for lengths in expected:
        check_cycles(lengths, ORACLE_N)


def test_stop_token(runs, reference, stop):
    """A stop token ends the output after its first occurrence (kept); SpecForge looks for it after
    each whole cycle, so that cycle's length counts the tokens it accepted past the stop."""
    result = ok(runs["stop"])
    table = oracle_table(reference)
    for output, ref, lengths in zip(result["outputs"], reference, result["acceptance_lengths"]):
        expected = ref[:ref.index(stop) + 1] if stop in ref[:N] else ref[:N]
        assert output == as_specforge(expected)
        assert lengths == oracle_cycles(ref, table, N, stop)
        assert sum(lengths) >= len(expected)
    assert len(result["outputs"][0]) < N


def test_mask_token_ids_are_dropped(runs, reference):
    """The target's greedy continuation of the first prompt has the mask token's id in the middle:
    spec_generate's output lacks it and is one token short (our decoding keeps it)."""
    assert reference[0][:N].count(MASK) == 1, \
        "the target's greedy continuation of PROMPTS[0] no longer has the mask id once: pick a prompt where it does"
    output = ok(runs["dflash", "greedy"])["outputs"][0]
    assert len(output) == N - 1
    i = reference[0].index(MASK)
    assert output[:i] == reference[0][:i] and output[i:] == reference[0][i + 1:N]


# ----------------------------------------------------------------------------- ours against SpecForge's

def ours(target_dir: Path, folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from remote.drafters.checkpoint import load_drafter

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter, ckpt = load_drafter(folder)
    return target, drafter, ckpt


@pytest.mark.parametrize("family", FAMILIES)
def test_our_reader_names_the_family_and_its_heads(family, drafters):
    """SpecForge's checkpoints as `inspect` reads them: the family, its heads, whether it has a
    confidence head; a plain DFlash from SpecForge is a z-lab checkpoint."""
    from remote.drafters.checkpoint import open_checkpoint

    ckpt = open_checkpoint(drafters[family][0])
    rules = ckpt.config.describe_rules()
    assert (ckpt.format, ckpt.config.family) == ("zlab" if family == "dflash" else "specforge", family)
    assert rules["confidence_head"] is (family == "dspark")
    heads = " ".join(rules["heads"])
    assert {"dflash": heads == "", "domino": "prefix GRU" in heads,
            "dspark": "markov (vanilla, rank 8)" in heads and "confidence" in heads}[family], heads


@pytest.mark.exactness
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_online_decoding_equals_spec_generate(family, temperature, target_dir, drafters, runs):
    """Our online decoding under SpecForge's rules gives spec_generate's tokens and acceptance lengths,
    cycle for cycle: greedy, and at T=0.7 seed for seed (the same draws: the prefill's sample, then one
    draw over each verified block)."""
    import torch

    from remote.decode.online import speculative_generate
    from remote.drafters.sampling import Sampling

    target, drafter, _ = ours(target_dir, drafters[family][0])
    want = ok(runs[family, "greedy" if temperature == 0 else "sampled"])
    prompts = PROMPTS if temperature == 0 else [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    for prompt, output, lengths in zip(prompts, want["outputs"], want["acceptance_lengths"]):
        torch.manual_seed(SEED)
        got = speculative_generate(target, drafter, torch.tensor([prompt]), N, None, Sampling(temperature),
                                   semantics="specforge")
        assert (as_specforge(got.output_ids), got.acceptance_lengths) == (output, lengths)


@pytest.mark.exactness
def test_oracle_and_stop_cycles_equal_spec_generate(target_dir, drafters, runs, stop):
    """Long acceptances (the oracle DSpark), the last cycle past max_new_tokens and a stop token
    counted as SpecForge counts them, online and in the offline walk (its reference the target's
    greedy decoding run a block past the output)."""
    import torch

    from remote.decode.offline import SpecForgeRules, evaluate_offline
    from remote.decode.online import speculative_generate, target_decode

    target, drafter, _ = ours(target_dir, drafters["oracle"][0])
    for key, n, stops in (("oracle", ORACLE_N, None), ("stop", N, [stop])):
        want = ok(runs[key])
        for prompt, output, lengths in zip(PROMPTS, want["outputs"], want["acceptance_lengths"]):
            ids = torch.tensor([prompt])
            got = speculative_generate(target, drafter, ids, n, stops, semantics="specforge")
            assert (as_specforge(got.output_ids), got.acceptance_lengths) == (output, lengths)
            ref = target_decode(target, ids, n, stops, overshoot=drafter.config.verify_block)
            walk = evaluate_offline(drafter, target, prompt, ref.output_ids, budgets=(),
                                    rules=SpecForgeRules(n, frozenset(stops or ())), continuation=ref.continuation)
            assert walk["acceptance_lengths"] == lengths


@pytest.mark.exactness
@pytest.mark.parametrize("family", FAMILIES)
def test_offline_walk_equals_online_under_both_rules(family, target_dir, drafters):
    """The batched offline walk (the Domino and DSpark heads drafting each block in order) gives the
    online decoding's cycles under z-lab's rules and under SpecForge's; a confidence head's
    per-cycle predictions are the same both ways."""
    import torch

    from remote.decode.offline import SpecForgeRules, evaluate_offline
    from remote.decode.online import speculative_generate, target_decode

    target, drafter, _ = ours(target_dir, drafters[family][0])
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        zlab = speculative_generate(target, drafter, ids, N)
        ref = target_decode(target, ids, N, overshoot=drafter.config.verify_block)
        assert zlab.output_ids == ref.output_ids
        walk = evaluate_offline(drafter, target, prompt, ref.output_ids, budgets=())
        assert walk["acceptance_lengths"] == zlab.acceptance_lengths
        spec = speculative_generate(target, drafter, ids, N, semantics="specforge")
        walk = evaluate_offline(drafter, target, prompt, ref.output_ids, budgets=(), rules=SpecForgeRules(N),
                                continuation=ref.continuation)
        assert walk["acceptance_lengths"] == spec.acceptance_lengths
        if family == "dspark":
            assert len(spec.confidences) == len(spec.acceptance_lengths)
            assert all(0 < c < 1 for cycle in spec.confidences for c in cycle)
            assert [len(c) for c in walk["confidences"]] == [len(c) for c in spec.confidences]
            flat = [c for cycle in walk["confidences"] for c in cycle]
            assert flat == pytest.approx([c for cycle in spec.confidences for c in cycle], abs=1e-5)
        else:
            assert spec.confidences is None and "confidences" not in walk


def test_ddtree_on_a_domino_drafter_is_refused_in_one_line(target_dir, drafters):
    """A tree over drafts that depend on the draft before is not scored as if they were independent."""
    import torch

    from remote.decode.offline import evaluate_offline
    from remote.decode.online import target_decode

    target, drafter, _ = ours(target_dir, drafters["domino"][0])
    ref = target_decode(target, torch.tensor([PROMPTS[0]]), 8)
    with pytest.raises(ValueError, match="DDTree on a domino drafter: its drafts depend on the token drafted before"):
        evaluate_offline(drafter, target, PROMPTS[0], ref.output_ids, budgets=(8,))


@pytest.mark.parametrize("edit, words", [
    ({"markov_head_type": "lstm"}, "markov_head_type 'lstm' is not a DSpark Markov head (vanilla, gated, rnn)"),
    ({"attention_mode": "mha"}, "attention_mode mha but num_key_value_heads"),
    ({"projector_type": "xpress"}, "projector_type 'xpress' is not a family this worker knows"),
    ({"emb_dim": 32}, "dflash_config sets emb_dim but the drafter is a dspark drafter"),
    ({"refiner_steps": 2}, "dflash_config keys this worker does not know: refiner_steps"),
])
def test_a_bad_specforge_config_is_one_line(edit, words, drafters, tmp_path):
    """A DSpark config that SpecForge's class would refuse, or that names what this worker does not
    know, is refused in one line naming it; nothing is dropped."""
    import shutil

    from remote.inspect import inspect

    folder = tmp_path / "dspark"
    shutil.copytree(drafters["dspark"][0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"].update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    report = inspect(str(folder))
    assert not report["ok"] and len(report["problems"]) == 1 and words in report["problems"][0], report["problems"]


def test_a_confidence_head_without_its_weights_is_refused(drafters, tmp_path):
    """The config says a confidence head, the weights lack it: the missing tensors are named; and the
    early checkpoints' `logit_head.` names are read as the heads' own."""
    import shutil

    from safetensors.torch import load_file, save_file

    from remote.drafters.checkpoint import CheckpointError, load_drafter

    for name, rename in (("missing", lambda k: None if k.startswith("confidence_head.") else k),
                         ("legacy", lambda k: "logit_head." + k if k.startswith(("markov_head.", "confidence_head."))
                          else k)):
        folder = tmp_path / name
        shutil.copytree(drafters["dspark"][0], folder)
        (f,) = folder.glob("*.safetensors")
        state = {rename(k): v for k, v in load_file(f).items() if rename(k)}
        save_file(state, f, metadata={"format": "pt"})
        if name == "missing":
            with pytest.raises(CheckpointError, match=r"missing tensors \(2\): confidence_head.proj.bias, "
                                                      r"confidence_head.proj.weight"):
                load_drafter(folder)
        else:
            drafter, _ = load_drafter(folder)
            assert drafter.confidence_head.proj.weight.shape == (1, 64)


def test_vllm_is_asked_to_serve_a_dspark_drafter(drafters):
    """vLLM (0.32, CPU) serves DFlash only: asked to serve a Domino or DSpark drafter, one line that
    says which engine does."""
    from remote.engines.server import EngineError
    from remote.engines.vllm import drafter_num_speculative_tokens

    assert drafter_num_speculative_tokens(drafters["dflash"][0]) == BLOCK - 1
    for family, algorithm in (("dspark", "DSPARK"), ("domino", "DFLASH")):
        with pytest.raises(EngineError, match=f"vLLM serves DFlash drafters only.*SpecForge's {family} drafter, which "
                                              f"SGLang serves \\(--speculative-algorithm {algorithm}\\)"):
            drafter_num_speculative_tokens(drafters[family][0])


def test_exports_load_in_specforge_and_zlab_classes(target_dir, drafters, runs, tmp_path):
    """SpecForge's DFlash drafter -> z-lab -> speculators -> SpecForge, and z-lab -> SpecForge: the
    z-lab export in z-lab's own class and the SpecForge exports in SpecForge's own class draft the
    source's logits, and SpecForge's spec_generate of an export is the source's, cycle for cycle.
    Domino and DSpark drafters go to SpecForge's format only (tensors bit for bit, same drafts) and
    are refused elsewhere, naming their heads."""
    import torch
    from transformers import AutoModelForCausalLM

    from remote.drafters.checkpoint import open_checkpoint, read_tensors
    from remote.drafters.export import ExportRefused, export
    from remote.target.model import target_features
    from references import zlab_class, zlab_logits

    def to(src: Path, fmt: str, name: str) -> Path:
        return Path(export(src, fmt, out=tmp_path / name, verifier=str(target_dir))["out"])

    zlab = to(drafters["dflash"][0], "zlab", "z")
    chain = to(to(zlab, "speculators", "zs"), "specforge", "zsf")
    direct = to(zlab, "specforge", "zf")
    heads = {family: to(drafters[family][0], "specforge", family) for family in ("domino", "dspark")}
    for family, folder in heads.items():
        source = read_tensors(open_checkpoint(drafters[family][0]))
        assert {k: v.tolist() for k, v in read_tensors(open_checkpoint(folder)).items()} == \
               {k: v.tolist() for k, v in source.items()}
        for fmt in ("zlab", "speculators"):
            with pytest.raises(ExportRefused, match=f"a {family} drafter's heads .*--to specforge"):
                export(drafters[family][0], fmt, out=tmp_path / f"{family}.{fmt}")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    folders = [drafters["dflash"][0], chain, direct]
    jobs = [["logits", str(f), str(target_dir), "--prompts", str(prompts)] for f in folders]
    jobs += [["generate", str(f), str(target_dir), "--prompts", str(prompts), "--max-new-tokens", str(N),
              "--seed", str(SEED)] for f in (chain, direct, *heads.values())]
    results = [ok(r) for r in harness_batch(jobs, tmp_path, "exports")]
    source, *exported = (torch.tensor(r["logits"]) for r in results[:3])
    for logits in exported:
        assert torch.equal(logits, source)
    for result, name in zip(results[3:], ("dflash", "dflash", "domino", "dspark")):
        want = runs[name, "greedy"]
        assert (result["outputs"], result["acceptance_lengths"]) == (want["outputs"], want["acceptance_lengths"])

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    model = zlab_class(zlab)
    with torch.no_grad():
        for prompt, want in zip(PROMPTS, source):
            ids = torch.tensor(prompt + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())])
            _, th = target_features(target, ids[None], model.target_layer_ids)
            got = zlab_logits(model, target, th, ids, len(prompt), BLOCK)[0, 1:]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
