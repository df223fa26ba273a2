"""Every micro-batch layout (padded rows, one packed row, shared-prompt rows) predicts each
response token from a position holding the token before it, with that response token as the
target, whether the model reads whole samples or all but their last token
(``without_last_tokens``, what the actor, reference and critic read); the latter reads exactly one
token fewer per sample. Oracle: each sample's own token sequence."""

import pytest
import torch

from megarl.workers.batch import (
    input_lengths,
    make_micro_batch,
    make_packed_micro_batch,
    make_shared_prompt_micro_batch,
    packed_row_length,
    prompt_groups,
    shared_prompt_row_length,
    without_last_tokens,
)
from tests.megarl.workers.test_megatron_worker import rollout_batch

ROWS = list(range(8))


def padded(batch):  # (micro-batch, tokens the model reads)
    lengths = input_lengths(batch)[ROWS]
    return make_micro_batch(batch, ROWS, int(lengths.max()), len(ROWS)), int(lengths.sum())


def packed(batch):
    length = packed_row_length(batch, ROWS, 1)
    return make_packed_micro_batch(batch, ROWS, length, 1), length


def shared(batch):
    groups = prompt_groups(batch, ROWS)
    length = max(shared_prompt_row_length(batch, g) for g in groups)
    return make_shared_prompt_micro_batch(batch, groups, length, len(groups)), sum(
        shared_prompt_row_length(batch, g) for g in groups)


@pytest.mark.parametrize("layout", [padded, packed, shared], ids=["padded", "packed", "shared"])
def test_each_response_token_is_predicted_from_the_token_before_it(layout):
    whole = rollout_batch(200)
    trimmed = without_last_tokens(whole)
    _, whole_tokens = layout(whole)
    mb, tokens = layout(trimmed)
    assert tokens == whole_tokens - len(ROWS)
    flat_tokens, flat_targets = mb["tokens"].reshape(-1), mb["targets"].reshape(-1)
    for slot, row in enumerate(mb["rows"].tolist()):
        prompt, response = int(whole["prompt_lengths"][row]), int(whole["response_lengths"][row])
        sequence = whole["input_ids"][row, : prompt + response].tolist()
        index = mb["gather_index"].reshape(len(mb["gather_index"]), -1)[slot]
        if layout is padded:
            index = index + slot * mb["tokens"].shape[1]
        for j in range(response):
            assert flat_tokens[index[j]] == sequence[prompt + j - 1]
            assert flat_targets[index[j]] == sequence[prompt + j]


def test_a_one_token_sample_is_still_read():
    batch = {"input_ids": torch.tensor([[7, 0], [7, 8]]), "prompt_lengths": torch.tensor([1, 1]),
             "response_lengths": torch.tensor([0, 1])}
    assert input_lengths(without_last_tokens(batch)).tolist() == [1, 1]
