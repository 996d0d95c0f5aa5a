"""A target split over devices with a device_map (accelerate hooks) captures exactly the drafter's
layers, equal to the single-device run. Here the split is CPU + disk offload (layers streamed in
per forward through accelerate's hooks); the real split over two GPUs is gpu-marked."""
import pytest
import torch

from remote.target.model import decoder_layers, features_device, load_target, target_features
from models import random_target

pytestmark = pytest.mark.models
LAYERS = [0, 2, 3]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def target_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"target-{request.param}")
    random_target(request.param).save_pretrained(folder)
    return folder


def split_map(n_layers: int, first, second) -> dict:
    """The first half of the layers (and the tied embeddings / head) on ``first``, the rest on ``second``."""
    half = n_layers // 2
    return {"model.embed_tokens": first, "model.rotary_emb": first, "model.norm": first, "lm_head": first,
            **{f"model.layers.{i}": (first if i < half else second) for i in range(n_layers)}}


def captured(model, ids):
    out, feats = target_features(model, ids, LAYERS)
    return out.logits, feats


@torch.no_grad()
def test_device_map_split_captures_the_same_features(target_dir, tmp_path):
    ids = torch.randint(0, 250, (1, 23), generator=torch.Generator().manual_seed(0))
    whole = load_target(target_dir, "cpu")
    n = len(decoder_layers(whole))
    split = load_target(target_dir, "cpu", device_map=split_map(n, "cpu", "disk"), offload_folder=str(tmp_path / "off"))
    offloaded = decoder_layers(split)[n - 1]
    assert hasattr(offloaded, "_hf_hook")                                   # accelerate really dispatched it
    assert {p.device.type for p in offloaded.parameters()} == {"meta"}      # weights not resident
    logits_a, feats_a = captured(whole, ids)
    logits_b, feats_b = captured(split, ids)
    assert feats_b.shape == (1, 23, len(LAYERS) * whole.config.hidden_size)
    torch.testing.assert_close(feats_b, feats_a, atol=0, rtol=0)
    torch.testing.assert_close(logits_b, logits_a, atol=0, rtol=0)
    assert features_device(split, LAYERS) == torch.device("cpu")


@pytest.mark.gpu
@torch.no_grad()
def test_two_gpu_split_captures_the_same_features(target_dir):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    ids = torch.randint(0, 250, (1, 23), generator=torch.Generator().manual_seed(0))
    whole = load_target(target_dir, "cuda:0", "float32")
    n = len(decoder_layers(whole))
    split = load_target(target_dir, "cuda", "float32", device_map=split_map(n, 0, 1))
    _, feats_a = captured(whole, ids.cuda())
    _, feats_b = captured(split, ids.cuda())
    assert features_device(split, LAYERS) == torch.device("cuda:1") and feats_b.device == torch.device("cuda:1")
    torch.testing.assert_close(feats_b.cpu(), feats_a.cpu(), atol=1e-5, rtol=1e-5)


def decoded(target, drafter, prompt) -> tuple:
    """Online greedy output and acceptance, then the offline walk and a DDTree walk over it."""
    from remote.decode.offline import evaluate_offline
    from remote.decode.online import speculative_generate

    spec = speculative_generate(target, drafter, prompt, 24)
    off = evaluate_offline(drafter, target, prompt[0].tolist(), spec.output_ids, budgets=[4])
    return spec.output_ids, spec.acceptance_lengths, off["acceptance_lengths"], off["ddtree"]


@torch.no_grad()
def test_device_map_split_decodes_as_one_device(target_dir, tmp_path):
    from models import random_drafter

    whole = load_target(target_dir, "cpu")
    n = len(decoder_layers(whole))
    split = load_target(target_dir, "cpu", device_map=split_map(n, "cpu", "disk"), offload_folder=str(tmp_path / "off"))
    drafter = random_drafter(whole, target_layer_ids=LAYERS)
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    assert decoded(split, drafter, prompt) == decoded(whole, drafter, prompt)


@pytest.mark.gpu
@torch.no_grad()
def test_two_gpu_split_decodes_as_one_device(target_dir):
    """Embedding and head on cuda:0, the deeper layers on cuda:1, the drafter on the features'
    device (cuda:1): offline drafts/acceptance and online greedy outputs equal the one-GPU run."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from models import random_drafter

    whole = load_target(target_dir, "cuda:0", "float32")
    n = len(decoder_layers(whole))
    split = load_target(target_dir, "cuda", "float32", device_map=split_map(n, 0, 1))
    drafter = random_drafter(whole, target_layer_ids=LAYERS).float()
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    assert features_device(split, LAYERS) == torch.device("cuda:1")
    one_gpu = decoded(whole, drafter.to("cuda:0"), prompt)
    assert decoded(split, drafter.to("cuda:1"), prompt) == one_gpu


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_device_map_split_tree_decodes_as_one_device(kind, tmp_path):
    """Online DDTree on a target split with a device_map (CPU + disk: accelerate hooks on every
    module, the deeper layers' weights streamed in per forward) equals the one-device run token for
    token and cycle for cycle; on the hybrid target the Gated DeltaNet tree rule runs inside each
    mixer's hook (its weights loaded as for the mixer's own forward), the offloaded mixers' included,
    and each hook wraps the mixer's own forward again afterwards."""
    from golden import prompts
    from models import trained_drafter, walk_target
    from remote.decode.tree import tree_generate
    from remote.target.tree_state import linear_attention_modules

    whole, drafter = walk_target(kind), trained_drafter(kind)
    whole.save_pretrained(tmp_path / "target")
    n = len(decoder_layers(whole))
    split = load_target(tmp_path / "target", "cpu", device_map=split_map(n, "cpu", "disk"),
                        offload_folder=str(tmp_path / "off"))
    mixers = [m for _, m in linear_attention_modules(split)]
    assert all(hasattr(m, "_hf_hook") for m in mixers) and (kind == "qwen3") == (not mixers)
    assert any(p.device.type == "meta" for m in mixers for p in m.parameters()) or not mixers
    hooked = [vars(m)["_old_forward"] for m in mixers]
    lengths = []
    for prompt in prompts(whole, 2):
        for budget in (4, 16):
            want = tree_generate(whole, drafter, prompt, 32, budget)
            got = tree_generate(split, drafter, prompt, 32, budget)
            assert (got.output_ids, got.acceptance_lengths) == (want.output_ids, want.acceptance_lengths), budget
            lengths += want.acceptance_lengths
    assert max(lengths) >= 4, lengths                                       # real trees, deep accepts
    assert [vars(m)["_old_forward"] for m in mixers] == hooked              # each hook wraps its own forward again
