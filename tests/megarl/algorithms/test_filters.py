import pytest
import torch

from megarl.algorithms.filters import dynamic_sampling_mask, overlong_reward_penalty, response_lengths


def test_dynamic_sampling_keeps_only_mixed_groups():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.3, 0.3])
    index = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3, 4, 4])
    # group 0 mixed, group 1 all correct, group 2 mixed, group 3 singleton, group 4 all equal
    keep = dynamic_sampling_mask(scores, index)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, True, False, False, True, True, True, False, False, False]
    keep_str = dynamic_sampling_mask(scores, ["a", "a", "b", "b", "c", "c", "c", "d", "e", "e"])
    assert torch.equal(keep, keep_str)


def test_response_lengths():
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert response_lengths(m).tolist() == [2, 0, 2]


def test_overlong_penalty_by_hand():
    # max_len 20, cache 4: 0 up to 16, then -1/4 per token, -1 at 20 and beyond.
    lengths = torch.tensor([0, 10, 16, 17, 18, 19, 20, 21, 500])
    out = overlong_reward_penalty(lengths, max_len=20, cache_len=4)
    assert out.tolist() == pytest.approx([0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    out = overlong_reward_penalty(lengths, max_len=20, cache_len=4, penalty_factor=0.5)
    assert out.tolist() == pytest.approx([0, 0, 0, -0.125, -0.25, -0.375, -0.5, -0.5, -0.5])
    # No cache window: a hard step at max_len.
    assert overlong_reward_penalty(lengths, max_len=20, cache_len=0).tolist() == [0, 0, 0, 0, 0, 0, 0, -1, -1]
    # Whole range is the window.
    out = overlong_reward_penalty(torch.tensor([0, 5, 10]), max_len=10, cache_len=10)
    assert out.tolist() == pytest.approx([0, -0.5, -1])


def test_overlong_penalty_validation():
    with pytest.raises(ValueError, match="cache_len"):
        overlong_reward_penalty(torch.tensor([1]), max_len=10, cache_len=11)
    with pytest.raises(ValueError, match="max_len"):
        overlong_reward_penalty(torch.tensor([1]), max_len=0, cache_len=0)
