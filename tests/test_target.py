"""Hook capture of the drafter's target layers equals HF ``hidden_states[i + 1]``."""
import pytest
import torch

from remote.target.model import capture, decoder_layers, features, gdn_kernel_path
from models import random_target

pytestmark = pytest.mark.models


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@torch.no_grad()
def test_hook_capture_equals_hidden_states_plus_one(kind):
    model = random_target(kind)
    ids = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(0))
    layer_ids = [2, 0, 1]  # any order: the feature follows target_layer_ids order
    with capture(model, layer_ids) as store:
        out = model(input_ids=ids, output_hidden_states=True)
    got = features(store, layer_ids)
    want = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    # and the off-by-one (hidden_states[i]) is really different
    wrong = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
    assert (got - wrong).abs().max() > 1e-3
    # the last hidden_states entry is after the final norm, not the last layer's output
    with capture(model, [len(decoder_layers(model)) - 1]) as store:
        model(input_ids=ids)
    assert (store[len(decoder_layers(model)) - 1] - out.hidden_states[-1]).abs().max() > 1e-3


def test_hooks_are_removed_and_only_needed_layers_kept():
    model = random_target("qwen3")
    before = [len(layer._forward_hooks) for layer in decoder_layers(model)]
    with capture(model, [1]) as store:
        assert [len(layer._forward_hooks) for layer in decoder_layers(model)][1] == before[1] + 1
        model(input_ids=torch.tensor([[1, 2, 3]]))
        assert set(store) == {1}
    assert [len(layer._forward_hooks) for layer in decoder_layers(model)] == before


def test_kernel_path_recorded():
    assert gdn_kernel_path(random_target("qwen3")) == "n/a"
    assert gdn_kernel_path(random_target("qwen3_5")) == "torch"   # fla is kept out on CPU
