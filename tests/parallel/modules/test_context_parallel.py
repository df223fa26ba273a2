"""The project's context-parallel attention equals megatron's own attention on the whole sequence.

Oracle: megatron's DotProductAttention on one rank over the full sequence (CP=1). The CP ranks
hold megatron's zig-zag split (get_batch_on_this_cp_rank) of the same random q/k/v; each rank's
outputs and q/k/v gradients must equal that rank's slice of the oracle's. Negative controls: the
same inputs with the mask on positions of a contiguous split (the zig-zag ignored), or with no
K/V gather (local positions only), give clearly different outputs, so the comparison can fail.
Training at CP layouts is checked end to end in test_megatron_cpu.py.
"""

import pytest

from parallel.layout import LayoutError, MegatronLayout
from parallel.spawn import run_on_ranks


def _zigzag(full, cp_rank_batch_split):
    """This rank's share of a [S, b, ...] tensor, split by megatron's get_batch_on_this_cp_rank."""
    return cp_rank_batch_split({"x": full.transpose(0, 1).contiguous()})["x"].transpose(0, 1).contiguous()


def attention_vs_megatron(cp: int, cases: list[tuple[int, int]], seed: int = 0) -> list[dict]:
    """On each of ``cp`` ranks: max abs differences of ContextParallelAttention vs megatron's
    DotProductAttention (full sequence, same tensors) for each (heads, query_groups) case."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.utils import get_batch_on_this_cp_rank

    from parallel.modules.context_parallel import ContextParallelAttention, context_parallel_attention, token_positions
    from parallel.process_groups import initialize_megatron

    initialize_megatron(MegatronLayout(cp=cp))
    cp_group = parallel_state.get_context_parallel_group()
    cp_rank = parallel_state.get_context_parallel_rank()
    seq, batch, head_dim = 8 * cp, 2, 8
    results = []
    for heads, groups in cases:
        generator = torch.Generator().manual_seed(seed + 31 * heads + groups)
        q, dout = (torch.randn(seq, batch, heads, head_dim, generator=generator) for _ in range(2))
        k, v = (torch.randn(seq, batch, groups, head_dim, generator=generator) for _ in range(2))
        dout = dout.view(seq, batch, heads * head_dim)
        kwargs = dict(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                      num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                      masked_softmax_fusion=False, use_cpu_initialization=True)
        reference = DotProductAttention(TransformerConfig(**kwargs), 1, AttnMaskType.causal, "self")
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out = reference(*full, None)
        ref_out.backward(dout)

        local = [_zigzag(t, get_batch_on_this_cp_rank).requires_grad_() for t in (q, k, v)]
        module = ContextParallelAttention(TransformerConfig(**kwargs, context_parallel_size=cp), 1,
                                          AttnMaskType.causal, "self")
        out = module(*local, None)
        out.backward(_zigzag(dout, get_batch_on_this_cp_rank))
        expected = _zigzag(ref_out.detach(), get_batch_on_this_cp_rank)
        with torch.no_grad():
            contiguous = context_parallel_attention(*local, module.softmax_scale, cp_group, split="contiguous")
            no_gather = context_parallel_attention(*local, module.softmax_scale, None)
        positions = _zigzag(torch.arange(seq).view(seq, 1), get_batch_on_this_cp_rank).view(-1)
        results.append({
            "case": (heads, groups),
            "out": float((out.detach() - expected).abs().max()),
            "grads": [float((t.grad - _zigzag(r.grad, get_batch_on_this_cp_rank)).abs().max())
                      for t, r in zip(local, full)],
            "contiguous_control": float((contiguous - expected).abs().max()),
            "no_gather_control": float((no_gather - expected).abs().max()),
            "positions_match_megatron": torch.equal(positions, token_positions(seq // cp, cp, cp_rank)),
        })
    parallel_state.destroy_model_parallel()
    return results


@pytest.mark.parametrize("cp,cases", [(2, [(4, 4), (4, 2)]), (4, [(4, 1)])], ids=["cp2_mha_gqa", "cp4_gqa"])
def test_cp_attention_equals_megatron_attention(cp, cases):
    for rank, results in enumerate(run_on_ranks(attention_vs_megatron, cp, cp, cases, timeout_s=120)):
        for r in results:
            where = f"cp={cp} rank={rank} heads,groups={r['case']}"
            assert r["positions_match_megatron"], where
            # fp32 rounding of SDPA against DotProductAttention's explicit softmax (measured up to
            # 2e-6 on gradients; tests/parallel/modules/test_sdpa_attention.py uses the same bound)
            assert r["out"] < 5e-6, (where, r)
            assert max(r["grads"]) < 5e-6, (where, r)
            # The controls must be far off, or the comparison above proves nothing.
            assert r["contiguous_control"] > 1e-2, (where, r)
            assert r["no_gather_control"] > 1e-2, (where, r)


def test_sequence_length_must_fit_the_cp_split():
    MegatronLayout(cp=2).validate_sequence_length(32)
    with pytest.raises(LayoutError, match=r"seq_length=30 .* multiple of 4 .*2\*cp=4"):
        MegatronLayout(cp=2).validate_sequence_length(30)
    with pytest.raises(LayoutError, match=r"multiple of 8 .*cp\*tp=8"):
        MegatronLayout(cp=2, tp=4, sequence_parallel=True).validate_sequence_length(20)
    MegatronLayout(tp=2, sequence_parallel=True).validate_sequence_length(6)


def test_cp_training_with_uneven_loss_mask_matches_cp1():
    # A loss-free prefix gives the CP ranks different token counts (cp=2, seq 32: rank 0 holds
    # positions 0-7 and 24-31, i.e. 3 + 8 loss tokens, rank 1 holds 16): only a loss normalised by
    # the GLOBAL count, and a reported loss summed over DP x CP, match the single-rank run.
    from megarl.pretrain_demo import DemoRun, train_on_rank

    def run(layout):
        return DemoRun(layout=layout, steps=2, loss_mask_prefix=5)

    reference = run_on_ranks(train_on_rank, 1, run(MegatronLayout()), timeout_s=120)[0]
    for history in run_on_ranks(train_on_rank, 2, run(MegatronLayout(cp=2)), timeout_s=120):
        assert [s["loss"] for s in history] == pytest.approx([s["loss"] for s in reference], rel=1e-6)
        assert [s["grad_norm"] for s in history] == pytest.approx([s["grad_norm"] for s in reference], rel=1e-5)
