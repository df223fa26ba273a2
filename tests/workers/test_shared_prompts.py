"""Shared-prompt micro-batches (megarl/workers/batch.py, parallel/shared_prefix.py) laid out as
documented: one row per distinct prompt, every sample's response tokens predicted from positions
that hold exactly the sequence it would have alone, and the tree mask letting each token see
exactly its own sequence's earlier tokens. (That log-probs, entropies and updates then equal HF
transformers' and the padded layout's is tests/workers/test_megatron_worker.py.)"""

import torch

from megarl.workers.batch import make_shared_prompt_micro_batch, prompt_groups, response_mask, shared_prompt_row_length
from tests.workers.test_megatron_worker import rollout_batch


def _own_sequences(batch, rows):
    return [batch["input_ids"][r, : int(batch["prompt_lengths"][r] + batch["response_lengths"][r])].tolist()
            for r in rows]


def test_each_sample_sees_exactly_its_own_sequence():
    batch = rollout_batch(200)
    rows = [0, 1, 2, 3, 4]  # prompts A A B B C: three rows
    length = max(shared_prompt_row_length(batch, g) for g in ([0, 1], [2, 3], [4])) + 3  # with padding
    mb = make_shared_prompt_micro_batch(batch, prompt_groups(batch, rows), length, num_groups=4)  # a filler row
    assert mb["tokens"].shape == (4, length) and mb["tree_mask"].shape == (4, 1, length, length)
    assert shared_prompt_row_length(batch, [0, 1]) < sum(len(s) for s in _own_sequences(batch, [0, 1]))

    tokens, positions = mb["tokens"].reshape(-1), mb["position_ids"].reshape(-1)
    visible = ~mb["tree_mask"][:, 0]  # [rows, q, k]
    mask = response_mask(batch)[rows].bool()
    for slot, (row, sequence) in enumerate(zip(rows, _own_sequences(batch, rows))):
        prompt = int(batch["prompt_lengths"][row])
        for j in range(int(batch["response_lengths"][row])):
            flat = int(mb["gather_index"][slot, j])
            group, query = divmod(flat, length)
            # The predicting position holds the token before response token j, at its own position ...
            assert tokens[flat] == sequence[prompt + j - 1] and positions[flat] == prompt + j - 1
            assert mb["targets"].reshape(-1)[flat] == sequence[prompt + j]
            # ... and sees exactly the earlier tokens of its own sequence, each at its own position.
            seen = visible[group, query].nonzero().view(-1)
            assert [int(tokens[group * length + k]) for k in seen] == sequence[: prompt + j]
            assert [int(positions[group * length + k]) for k in seen] == list(range(prompt + j))
        assert mb["response_mask"][slot].bool().tolist() == mask[slot].tolist()
    assert mb["rows"].tolist() == rows
    assert visible.any(-1).all()  # no query (padding included) has an empty row


def test_rows_with_one_token_prompts_and_empty_responses():
    batch = {"input_ids": torch.tensor([[7, 8, 9], [7, 0, 0], [7, 5, 0]]),
             "prompt_lengths": torch.tensor([1, 1, 1]), "response_lengths": torch.tensor([2, 0, 1])}
    mb = make_shared_prompt_micro_batch(batch, [[0, 1, 2]], shared_prompt_row_length(batch, [0, 1, 2]), 1)
    assert mb["tokens"].tolist() == [[7, 8, 9, 7, 7, 5]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert mb["gather_index"].tolist() == [[0, 1], [0, 0], [4, 0]]
    assert mb["response_mask"].tolist() == [[1, 1], [0, 0], [1, 0]]
    assert mb["targets"][0, :2].tolist() == [8, 9] and mb["targets"][0, 4] == 5


def test_a_prompt_drawn_twice_is_cut_into_groups_of_the_usual_size():
    """Four samples of A (drawn twice in the step), two of B and C: groups of two, so no row is
    twice as long as the others (all rows are padded to the longest)."""
    prompts = [[1, 2], [1, 2], [3], [3], [1, 2], [1, 2], [4, 5, 6], [4, 5, 6]]
    ids = torch.tensor([p + [9] * (4 - len(p)) for p in prompts])
    batch = {"input_ids": ids, "prompt_lengths": torch.tensor([len(p) for p in prompts]),
             "response_lengths": torch.tensor([4 - len(p) for p in prompts])}
    assert prompt_groups(batch, list(range(8))) == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert prompt_groups(batch, [0, 1, 4, 2]) == [[0], [1], [4], [2]]  # most common size 1
