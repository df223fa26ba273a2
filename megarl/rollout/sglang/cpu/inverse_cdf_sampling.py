"""Token sampling by inverse CDF for SGLang's ``pytorch`` sampling backend (the one its CPU path uses).

SGLang draws each next token with ``torch.multinomial(probs, 1)``. On a CPU that costs 11 ms for
128 rows of a 4096-token vocabulary (it draws and sorts far more random numbers than it needs),
the cost of two decoder layers of a 20M-parameter model, at every decode step. Inverse-CDF
sampling draws the same distribution with one uniform number per row: ``cumsum`` of the row, a
uniform ``u`` in [0, total), the first token whose cumulative mass exceeds ``u`` (0.3 ms here).
Tokens of probability 0 are never drawn (their cumulative mass equals the previous token's).

Only the plain case is replaced (no top-k/top-p/min-p filtering and no per-request
``sampling_seed``: SGLang's deterministic path keeps its own Gumbel sampler). The generator is
the scheduler's global torch RNG, as for ``torch.multinomial``, so ``SGLangEngine.reseed`` still
makes the tokens a function of (weights, seed). Installed in the engine's processes by
:func:`megarl.rollout.sglang.patches.install_scheduler_patch`.
"""

from __future__ import annotations

SAMPLER_MODULE = "sglang.srt.layers.sampler"


def inverse_cdf_sample(probs):
    """One token index per row of ``probs`` [rows, vocab] (non-negative, rows need not sum to 1),
    drawn with probability proportional to its entry: ``[rows, 1]`` int64."""
    import torch

    cdf = probs.to(torch.float32 if probs.dtype != torch.float64 else probs.dtype).cumsum(-1)
    u = torch.rand(probs.shape[0], 1, dtype=cdf.dtype, device=probs.device) * cdf[:, -1:]
    index = torch.searchsorted(cdf, u, right=True)
    overflow = index[:, 0] >= probs.shape[-1]  # u rounded up to the row's total: its last non-zero token
    if bool(overflow.any()):
        rows = probs[overflow] > 0
        index[overflow, 0] = probs.shape[-1] - 1 - rows.flip(-1).int().argmax(-1)
    return index


def sampling_from_probs_torch(probs, sampling_seed=None, positions=None):
    """Drop-in for SGLang's ``sampler.sampling_from_probs_torch`` (token ids ``[rows]`` int32)."""
    import sys

    import torch

    if sampling_seed is not None:
        return sys.modules[SAMPLER_MODULE]._megarl_multinomial_sampling_from_probs_torch(
            probs, sampling_seed, positions)
    return inverse_cdf_sample(probs).view(-1).to(torch.int32)


def patch_sampler_module(module) -> None:
    """Replace the module's plain sampler (the original stays as ``_megarl_multinomial_*``)."""
    import sys

    name = "sampling_from_probs_torch"
    if not hasattr(module, name):
        print(f"megarl: {module.__name__} lacks {name}; sampling left as SGLang wrote it", file=sys.stderr, flush=True)
        return
    if not hasattr(module, "_megarl_multinomial_" + name):
        setattr(module, "_megarl_multinomial_" + name, getattr(module, name))
        setattr(module, name, sampling_from_probs_torch)
