"""Inverse-CDF sampling (megarl/rollout/sglang/cpu/inverse_cdf_sampling.py) against the distribution it samples:
empirical frequencies of many draws equal the (normalized) probabilities within 5 standard
errors, zero-probability tokens are never drawn, and a uniform number that rounds up to the row's
total still yields a token of positive probability. That a running engine samples with it is in
tests/megarl/rollout/test_engine_seed.py (frequencies against HF transformers' softmax)."""

import pytest
import torch

import megarl.rollout.sglang.cpu.inverse_cdf_sampling as sampling

DRAWS = 200_000


def _rows():
    g = torch.Generator().manual_seed(0)
    peaked = torch.softmax(torch.randn(64, generator=g) * 3, -1)
    holes = torch.rand(64, generator=g) * (torch.rand(64, generator=g) > 0.5)  # zeros, not normalized
    holes[-5:] = 0.0  # the last tokens impossible too
    one_hot = torch.zeros(64)
    one_hot[17] = 2.5
    return {"peaked": peaked, "holes_unnormalized": holes, "one_token": one_hot}


@pytest.mark.parametrize("name", ["peaked", "holes_unnormalized", "one_token"])
def test_frequencies_follow_the_probabilities(name):
    torch.manual_seed(1)
    row = _rows()[name]
    drawn = sampling.inverse_cdf_sample(row.expand(DRAWS, -1).contiguous())
    assert drawn.shape == (DRAWS, 1) and drawn.dtype == torch.int64
    frequencies = torch.bincount(drawn.view(-1), minlength=len(row)).double() / DRAWS
    p = (row / row.sum()).double()
    assert frequencies[p == 0].sum() == 0, "a zero-probability token was drawn"
    standard_error = (p * (1 - p) / DRAWS).sqrt()
    assert ((frequencies - p).abs() <= 5 * standard_error + 1e-12).all(), (frequencies - p).abs().max()


def test_a_uniform_number_at_the_total_takes_the_last_possible_token(monkeypatch):
    rows = torch.tensor([[0.2, 0.3, 0.5, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape, **{k: v for k, v in kw.items()
                                                                                   if k == "dtype"}))
    assert sampling.inverse_cdf_sample(rows).view(-1).tolist() == [2, 1, 4]


def test_patch_replaces_sglangs_plain_sampler_only(monkeypatch):
    from megarl.rollout.sglang.cpu.stubs import install

    install()  # SGLang imports CUDA-only modules (triton, ...): the CPU stubs stand in
    import importlib

    module = importlib.import_module(sampling.SAMPLER_MODULE)
    sampling.patch_sampler_module(module)
    sampling.patch_sampler_module(module)  # idempotent: the original is kept once
    assert module.sampling_from_probs_torch is sampling.sampling_from_probs_torch
    original = module._megarl_multinomial_sampling_from_probs_torch
    assert original.__module__ == sampling.SAMPLER_MODULE

    probs = torch.softmax(torch.randn(6, 32), -1)
    torch.manual_seed(3)
    got = module.sampling_from_probs_torch(probs)
    torch.manual_seed(3)
    assert torch.equal(got, sampling.inverse_cdf_sample(probs).view(-1).to(torch.int32))
    assert got.dtype == torch.int32 and got.shape == (6,)
    # A per-request sampling seed (SGLang's deterministic path, which needs sgl_kernel's CUDA/AMX
    # hash) keeps SGLang's own sampler.
    calls = []
    monkeypatch.setattr(module, "_megarl_multinomial_sampling_from_probs_torch", lambda *a: calls.append(a) or "own")
    seeds, positions = torch.arange(6), torch.zeros(6, dtype=torch.int64)
    assert module.sampling_from_probs_torch(probs, seeds, positions) == "own"
    assert calls == [(probs, seeds, positions)]
