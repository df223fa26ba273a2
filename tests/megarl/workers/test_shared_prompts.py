"""Shared-prompt micro-batches (megarl/workers/batch.py, parallel/modules/shared_prefix.py) laid out as
documented: one row per distinct prompt, every sample's response tokens predicted from positions
that hold exactly the sequence it would have alone, and the attention per branch equal to dense
attention under the tree mask (each token sees exactly its own sequence's earlier tokens), values
and gradients. (That log-probs, entropies and updates then equal HF transformers' and the padded
layout's is tests/megarl/workers/test_megatron_worker.py.)"""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megarl.workers.batch import make_shared_prompt_micro_batch, prompt_groups, response_mask, shared_prompt_row_length
from parallel.modules.shared_prefix import PADDING, PREFIX, branch_attention
from tests.megarl.workers.test_megatron_worker import rollout_batch


def tree_visibility(segments: torch.Tensor) -> torch.Tensor:
    """The oracle: [rows, q, k] True where query q sees key k: k comes first and is in the prefix
    or in q's own branch (what each token would see in its own sequence)."""
    s = segments.shape[1]
    earlier = torch.ones(s, s, dtype=torch.bool).tril()
    keys, queries = segments[:, None, :], segments[:, :, None]
    return earlier & ((keys == PREFIX) | (keys == queries)) & (keys != PADDING)


def _own_sequences(batch, rows):
    return [batch["input_ids"][r, : int(batch["prompt_lengths"][r] + batch["response_lengths"][r])].tolist()
            for r in rows]


def test_each_sample_sees_exactly_its_own_sequence():
    batch = rollout_batch(200)
    rows = [0, 1, 2, 3, 4]  # prompts A A B B C: three rows
    length = max(shared_prompt_row_length(batch, g) for g in ([0, 1], [2, 3], [4])) + 3  # with padding
    mb = make_shared_prompt_micro_batch(batch, prompt_groups(batch, rows), length, num_groups=4)  # a filler row
    assert mb["tokens"].shape == (4, length) and mb["segments"].shape == (4, length)
    assert shared_prompt_row_length(batch, [0, 1]) < sum(len(s) for s in _own_sequences(batch, [0, 1]))

    tokens, positions = mb["tokens"].reshape(-1), mb["position_ids"].reshape(-1)
    visible = tree_visibility(mb["segments"])  # [rows, q, k]
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


def _dense_tree_attention(q, k, v, segments, scale):
    """Attention of every real token under ``tree_visibility``, one row at a time: [s, rows, np*hn]
    (padding tokens 0)."""
    repeat = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(repeat, 2), v.repeat_interleave(repeat, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    visible = tree_visibility(segments)[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return (out * (segments != PADDING).t()[:, :, None, None]).flatten(2)


@pytest.mark.parametrize("kernel", [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_branch_attention_equals_dense_tree_attention(heads, groups, kernel):
    """Rows of different prefix and branch lengths (a one-token prefix: none), padding inside a
    row and an all-padding row: context and the gradients of q, k, v equal the dense oracle's,
    on either of torch's CPU kernels (its fused one, which takes the mask, and math)."""
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3, 3, -1, -1],
                             [1, 1, 1, 1, 2, 2, 2, 2, 2, 2, -1],
                             [0, 1, 2, 2, 3, -1, -1, -1, -1, -1, -1],
                             [-1] * 11])
    s, rows, dim = segments.shape[1], segments.shape[0], 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, rows, h, dim, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (heads, groups, groups))
    with sdpa_kernel([kernel]):
        out = branch_attention(q, k, v, segments, softmax_scale=0.3)
    expected = _dense_tree_attention(q, k, v, segments, scale=0.3)
    real = (segments != PADDING).t()
    assert out.shape == (s, rows, heads * dim)
    torch.testing.assert_close(out[real], expected[real], rtol=1e-10, atol=1e-10)
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64) * real[:, :, None]
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_branch_attention_of_rows_without_branches():
    """A micro-batch of filler rows only (a replica with no samples): zero context, no error."""
    q = torch.randn(5, 2, 2, 4, requires_grad=True)
    out = branch_attention(q, q, q, torch.full((2, 5), PADDING), softmax_scale=0.5)
    assert out.shape == (5, 2, 8) and not out.any()


class SDPACalls(torch.overrides.TorchFunctionMode):
    """Records what every ``scaled_dot_product_attention`` call is given, and makes the call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            self.calls.append({"heads": (q.shape[1], k.shape[1], v.shape[1]), "gqa": kwargs.get("enable_gqa", False),
                               "masked": kwargs.get("attn_mask") is not None})
        return func(*args, **kwargs)


def test_masked_attention_gets_the_query_heads():
    """torch's CUDA memory-efficient kernel, the fused kernel that takes a mask (flash takes none),
    refuses K/V with fewer heads than the query (torch 2.13: no GQA in it); SDPA would then run
    the math kernel and keep a [branches, heads, L, P + L] fp32 score matrix per layer. So every
    SDPA call of branch_attention on a GQA model (4 query heads, 2 KV heads) gets K and V with
    the query's heads, and the values still equal the dense oracle's (the test above)."""
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3, 3, -1, -1]])
    q = torch.randn(11, 1, 4, 8)
    k, v = torch.randn(2, 11, 1, 2, 8)
    with SDPACalls() as seen:
        branch_attention(q, k, v, segments, softmax_scale=0.3)
    assert len(seen.calls) == 2  # the prefix, then all branches at once
    assert all(call == {"heads": (4, 4, 4), "gqa": False, "masked": True} for call in seen.calls), seen.calls
