"""The reference training step produces a drafter that really predicts the target."""
import pytest
import torch

from remote.drafters.tiny import tiny_drafter
from models import HELD_OUT, held_out_drafter, walk_batches, walk_target
from remote.drafters.train import Batch, block_labels, position_weights, sample_anchors, teacher_forced_accuracy


def test_loss_weights_and_supervision():
    w = position_weights(8, 7.0)
    assert w[0] == 1.0 and torch.allclose(w[1], torch.exp(torch.tensor(-1 / 7.0)))
    mask = torch.tensor([[False, False, True, True, True, False]])
    anchors = sample_anchors(mask, 10, torch.Generator().manual_seed(0))
    assert anchors.tolist() == [1, 2, 3]          # p + 1 must be a supervised position


@pytest.mark.models
def test_training_lifts_teacher_forced_accuracy_far_above_chance():
    target = walk_target("qwen3")
    cfg, batches = walk_batches("qwen3")
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    held_out = batches[:HELD_OUT]
    before = teacher_forced_accuracy(tiny_drafter(cfg, seed=0), held_out, embed, lm_head)
    drafter, losses = held_out_drafter("qwen3", steps=400)     # remote.drafters.train.train from the same start
    after = teacher_forced_accuracy(drafter, held_out, embed, lm_head)
    chance = 1 / cfg.vocab_size
    assert max(before["per_position"]) < 0.05
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    assert after["per_position"][0] > 100 * chance and min(after["per_position"]) > 0.4, after
    assert after["tau_estimate"] > 3.0


def test_labels_are_the_next_tokens_of_slots_one_to_b_minus_one():
    ids = torch.arange(100, 110)[None]
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 8] = False
    labels, valid = block_labels(Batch(ids, torch.zeros(1, 10, 4), mask), torch.tensor([0, 6]), 4)
    assert labels[0].tolist() == [101, 102, 103]           # slot k of anchor p -> token p + k
    assert labels[1][:2].tolist() == [107, 108]
    assert valid.tolist() == [[True, True, True], [True, False, True]]  # 8 unsupervised; 9 is the last
    _, valid_end = block_labels(Batch(ids, torch.zeros(1, 10, 4), mask), torch.tensor([8]), 4)
    assert valid_end.tolist() == [[True, False, False]]    # past the end of the sequence
