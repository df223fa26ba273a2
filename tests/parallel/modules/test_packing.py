"""Sequence packing: one packed row gives every sequence exactly what it gets alone.

Oracle: each sequence run alone, unpadded, through megatron's own local attention
(DotProductAttention) at TP=1. The per-token next-token log-probs of each sequence taken from ONE
packed row (the project's attention with megatron's thd PackedSeqParams and per-sequence RoPE)
must equal it at TP=1, TP=2, PP=2, CP=2 and TP=2 with sequence parallelism. Negative control: the
same row without packed_seq_params (sequences see their predecessors, positions run on) gives
clearly different log-probs for the 2nd and 3rd sequences. Gradients: a loss on the packed row
has the gradient of the sum of the same losses on the separate sequences.
"""

import pytest
import torch

from parallel.modules.context_parallel import packed_boundaries, packed_token_positions
from parallel.modules.packing import pack_sequences, unpack
from parallel.spawn import run_on_ranks
from tests.parallel.modules.rank_fns import packed_logprobs, packed_oracle_tp1

LENGTHS = [5, 9, 3]
ATOL = 1e-5


def test_pack_layout_and_round_trip():
    sequences = [[11, 12, 13, 14, 15], torch.arange(21, 30), [31, 32, 33]]
    batch = pack_sequences(sequences, pad_to_multiple=4, pad_id=-1)
    assert batch.tokens.shape == (1, 24) and batch.tokens.dtype == torch.long
    assert batch.cu_seqlens.tolist() == [0, 5, 14, 17] and batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens_padded.tolist() == [0, 8, 20, 24] and batch.cu_seqlens_padded.dtype == torch.int32
    assert batch.lengths == [5, 9, 3]
    assert batch.tokens[0, 5:8].tolist() == [-1] * 3 and batch.tokens[0, 17:20].tolist() == [-1] * 3
    assert batch.position_ids[0].tolist() == list(range(8)) + list(range(12)) + list(range(4))
    assert [t.tolist() for t in unpack(batch.tokens, batch)] == [list(map(int, s)) for s in sequences]
    per_token = torch.arange(24 * 2).view(24, 2)  # [T, ...] works as well as [1, T, ...]
    assert [p.tolist() for p in unpack(per_token, batch)] == [per_token[s: s + n].tolist()
                                                              for s, n in [(0, 5), (8, 9), (20, 3)]]
    labels, mask = batch.next_token_targets()
    assert labels[0, :4].tolist() == [12, 13, 14, 15] and labels[0, 8:16].tolist() == list(range(22, 30))
    assert mask[0].nonzero().view(-1).tolist() == [0, 1, 2, 3, *range(8, 16), 20, 21]

    params = batch.packed_seq_params()
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 12
    assert torch.equal(params.cu_seqlens_q, batch.cu_seqlens)
    assert torch.equal(packed_boundaries(params), batch.cu_seqlens_padded)
    unpadded = pack_sequences(sequences)
    assert unpadded.tokens.shape == (1, 17) and torch.equal(unpadded.cu_seqlens, unpadded.cu_seqlens_padded)


def test_context_parallel_split_is_per_sequence():
    batch = pack_sequences([[1] * 5, [2] * 9, [3] * 3], pad_to_multiple=4)  # slots 8, 12, 4
    ranks = [batch.local_positions(cp_size=2, cp_rank=r).tolist() for r in range(2)]
    assert ranks[0] == [0, 1, 6, 7, 8, 9, 10, 17, 18, 19, 20, 23]
    assert sorted(ranks[0] + ranks[1]) == list(range(24))
    assert batch.local_positions(cp_size=1, cp_rank=0).tolist() == list(range(24))
    with pytest.raises(ValueError, match=r"sequence 1 occupies 10 tokens, not a multiple of 2\*cp=4"):
        packed_token_positions(pack_sequences([[1] * 4, [2] * 9], pad_to_multiple=2).cu_seqlens_padded, 2, 0)


def test_pack_refuses_bad_input():
    with pytest.raises(ValueError, match="sequence 1 has shape \\[0\\]"):
        pack_sequences([[1, 2], []])
    with pytest.raises(ValueError, match="pad_to_multiple=0"):
        pack_sequences([[1]], pad_to_multiple=0)
    with pytest.raises(ValueError, match="no sequences"):
        pack_sequences([])
    batch = pack_sequences([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"shape \[1, 4\] do not cover the packed row of 3 tokens"):
        unpack(torch.zeros(1, 4), batch)
    from megatron.core.packed_seq_params import PackedSeqParams

    with pytest.raises(NotImplementedError, match="qkv_format='sbhd'"):
        packed_boundaries(PackedSeqParams(qkv_format="sbhd"))


@pytest.fixture(scope="module")
def tp1_run():
    """The single-rank run: log-probs (packed, control, and the oracle: each sequence alone through
    megatron's attention) and the gradient comparison."""
    return run_on_ranks(packed_oracle_tp1, 1, LENGTHS, 0, timeout_s=240)[0]


@pytest.fixture(scope="module")
def tp1(tp1_run):
    return tp1_run["logprobs"]


def _max_diffs(got, expected):
    return [float((a - b).abs().max()) for a, b in zip(got, expected)]


def test_packed_logprobs_equal_each_sequence_alone(tp1):
    assert [len(lp) for lp in tp1["alone"]] == [n - 1 for n in LENGTHS]
    assert max(_max_diffs(tp1["packed"], tp1["alone"])) < ATOL
    control = _max_diffs(tp1["control"], tp1["alone"])
    assert control[0] < ATOL  # the first sequence sees nothing before it either way
    assert min(control[1:]) > 1e-2, control  # the comparison above can fail


LAYOUTS = [dict(tp=2), dict(pp=2), dict(cp=2), dict(tp=2, sequence_parallel=True)]


def test_packed_logprobs_at_parallel_layouts(tp1):
    oracle = tp1["alone"]
    seen = set()
    for per_rank in run_on_ranks(packed_logprobs, 2, LAYOUTS, LENGTHS, 0, timeout_s=300):
        for result in per_rank:
            if result["packed"] is None:  # not the last pipeline stage
                continue
            name = str(result["layout"])
            seen.add(name)
            assert max(_max_diffs(result["packed"], oracle)) < ATOL, name
            if "control" in result:  # CP=1 layouts
                assert min(_max_diffs(result["control"], oracle)[1:]) > 1e-2, name
    assert seen == {str(layout) for layout in LAYOUTS}


def test_packed_loss_gradient_equals_sum_of_separate_losses(tp1_run):
    (packed_loss, packed), (separate_loss, separate) = tp1_run["grads"]["packed"], tp1_run["grads"]["separate"]
    assert packed_loss == pytest.approx(separate_loss, rel=1e-6)
    for name, grad in separate.items():
        assert grad.abs().max() > 1e-3, name  # a real gradient, not zeros
        assert torch.allclose(packed[name], grad, atol=ATOL, rtol=0), name
