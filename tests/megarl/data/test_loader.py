import pytest

from megarl.data.dataset import PromptLoader, PromptSample


def _samples(n):
    return [PromptSample(i, [1] * (i % 5 + 1), f"p{i}", f"p{i}", str(i), "s") for i in range(n)]


def _indices(batch):
    return batch["index"]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    loader = PromptLoader(_samples(10), batch_size=3, seed=5)
    assert len(loader) == 3
    epoch0 = [i for batch in loader for i in _indices(batch)]
    assert loader.epoch == 1 and loader.index == 0
    epoch1 = [i for batch in loader for i in _indices(batch)]
    assert len(epoch0) == len(set(epoch0)) == 9 and len(epoch1) == 9  # drop_last: 10 % 3 left out
    assert epoch0 != epoch1
    again = PromptLoader(_samples(10), batch_size=3, seed=5)
    assert [i for batch in again for i in _indices(batch)] == epoch0  # a pure function of the seed
    other = PromptLoader(_samples(10), batch_size=3, seed=6)
    assert [i for batch in other for i in _indices(batch)] != epoch0


def test_no_shuffle_and_no_drop_last():
    loader = PromptLoader(_samples(7), batch_size=3, shuffle=False, drop_last=False)
    assert len(loader) == 3
    assert [_indices(b) for b in loader] == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 4, 7])
def test_resume_gives_the_uninterrupted_batches(stop_after):
    total = 9  # three epochs of 3 batches
    full = PromptLoader(_samples(11), batch_size=3, seed=1)
    expected = [_indices(full.next_batch()) for _ in range(total)]

    first = PromptLoader(_samples(11), batch_size=3, seed=1)
    got = [_indices(first.next_batch()) for _ in range(stop_after)]
    state = first.state_dict()
    assert set(state) >= {"epoch", "index"}
    resumed = PromptLoader(_samples(11), batch_size=3, seed=1)  # a new object, as after a restart
    resumed.load_state_dict(state)
    got += [_indices(resumed.next_batch()) for _ in range(total - stop_after)]
    assert got == expected


def test_resume_inside_a_for_loop_finishes_the_epoch():
    full = PromptLoader(_samples(8), batch_size=2, seed=3)
    expected = [_indices(b) for _ in range(2) for b in full]
    first = PromptLoader(_samples(8), batch_size=2, seed=3)
    it = iter(first)
    got = [_indices(next(it)), _indices(next(it))]
    resumed = PromptLoader(_samples(8), batch_size=2, seed=3)
    resumed.load_state_dict(first.state_dict())
    got += [_indices(b) for b in resumed]  # the rest of epoch 0
    assert resumed.epoch == 1
    got += [_indices(b) for b in resumed]  # epoch 1
    assert got == expected


def test_state_from_other_data_or_settings_is_refused():
    state = PromptLoader(_samples(10), batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_prompts=10 but this loader has num_prompts=9"):
        PromptLoader(_samples(9), batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=1"):
        PromptLoader(_samples(10), batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        PromptLoader(_samples(10), batch_size=2, seed=1).load_state_dict({"epoch": 0, "index": 10})


def test_too_small_dataset_fails_early():
    with pytest.raises(ValueError, match="fewer than batch_size=8"):
        PromptLoader(_samples(5), batch_size=8)
