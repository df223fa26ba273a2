"""The batched torch-native attention (megarl/rollout/sglang/cpu/batched_attention.py) against SGLang's own
per-sequence loops, the oracle: same outputs for prefill with cached prefixes and for decode, with
grouped-query attention, in one SDPA call or cut into many groups. (That engines using it still
generate HF's tokens and log-probs is tests/megarl/rollout/test_engine.py.)"""

import pytest
import torch

import megarl.rollout.sglang.cpu.batched_attention as batched


@pytest.fixture(scope="module")
def backend():
    from megarl.rollout.sglang.cpu.stubs import install

    install()  # SGLang imports CUDA-only modules (triton, ...): the CPU stubs stand in
    from sglang.srt.layers.attention import torch_native_backend

    cls = torch_native_backend.TorchNativeAttnBackend
    loops = {name: getattr(cls, "_megarl_loop" + name[len("_run"):], getattr(cls, name))
             for name in ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode")}

    class Loops:  # stands in for the backend instance: the fallbacks are SGLang's loops
        pass

    self = Loops()
    self._megarl_loop_sdpa_forward_extend = lambda *a, **k: loops["_run_sdpa_forward_extend"](self, *a, **k)
    self._megarl_loop_sdpa_forward_decode = lambda *a, **k: loops["_run_sdpa_forward_decode"](self, *a, **k)
    return self


def _cache(seed, seqs=37, heads=8, kv_heads=4, head_dim=16, max_len=60):
    g = torch.Generator().manual_seed(seed)
    slots = 8192
    k_cache, v_cache = torch.randn(slots, kv_heads, head_dim, generator=g), torch.randn(slots, kv_heads, head_dim, generator=g)
    req_to_token = torch.randperm(slots, generator=g)[: 100 * max_len].view(100, max_len).clone()
    req_pool = torch.randperm(100, generator=g)[:seqs]
    seq_lens = torch.randint(1, max_len, (seqs,), generator=g)
    prefix = (torch.rand(seqs, generator=g) * seq_lens).long().clamp(max=seq_lens - 1)
    return g, dict(k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, req_pool_indices=req_pool,
                   seq_lens=seq_lens), prefix, heads, head_dim


@pytest.mark.parametrize("budget", [batched.SCORE_BUDGET, 3000], ids=["one_call", "many_groups"])
def test_prefill_and_decode_equal_sglangs_loops(backend, budget, monkeypatch):
    monkeypatch.setattr(batched, "SCORE_BUDGET", budget)
    g, cache, prefix, heads, head_dim = _cache(seed=budget)
    extend = cache["seq_lens"] - prefix
    args = (cache["k_cache"], cache["v_cache"], cache["req_to_token"], cache["req_pool_indices"], cache["seq_lens"])
    query = torch.randn(int(extend.sum()), heads, head_dim, generator=g)
    want, got = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    kwargs = dict(scaling=0.25, enable_gqa=True, causal=True)
    backend._megarl_loop_sdpa_forward_extend(query, want, *args, prefix, extend, **kwargs)
    batched.batched_sdpa_forward_extend(backend, query, got, *args, prefix, extend, **kwargs)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)

    query = torch.randn(len(prefix), heads, head_dim, generator=g)
    want, got = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
    backend._megarl_loop_sdpa_forward_decode(query, want, *args, scaling=0.25, enable_gqa=True)
    batched.batched_sdpa_forward_decode(backend, query, got, *args, scaling=0.25, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_index_reused_across_layers_is_rebuilt_when_the_cache_map_changes(backend):
    """Layers of one step reuse the groups' index tensors (same tensors passed again); once the
    engine writes new slots into ``req_to_token`` in place (the next step), the same tensor
    objects must give the new attention, not the cached one."""
    g, cache, prefix, heads, head_dim = _cache(seed=5)
    args = lambda: (cache["k_cache"], cache["v_cache"], cache["req_to_token"], cache["req_pool_indices"],  # noqa: E731
                    cache["seq_lens"])
    query = torch.randn(len(prefix), heads, head_dim, generator=g)
    outputs = []
    for step in range(3):
        if step == 2:  # the next step: slots remapped in place
            cache["req_to_token"].copy_(cache["req_to_token"].roll(1, dims=1))
        want, got = torch.full_like(query, float("nan")), torch.full_like(query, float("nan"))
        backend._megarl_loop_sdpa_forward_decode(query, want, *args(), scaling=0.25, enable_gqa=True)
        batched.batched_sdpa_forward_decode(backend, query, got, *args(), scaling=0.25, enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
        outputs.append(got)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)  # a second layer: the same
    assert (outputs[2] - outputs[0]).abs().max() > 1e-3  # remapped: a different attention
