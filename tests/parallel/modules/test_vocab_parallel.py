"""Log-probs and entropy from vocab-parallel logits equal the full-vocabulary softmax's.

Oracle: torch's ``log_softmax`` over the real vocabulary (padded ids dropped) in fp64, with
autograd for the gradients. ``vocab_parallel_log_probs`` computes both in blocks of rows with a
closed-form backward; values and gradients must match to rounding for every combination of
upstream gradients (log-probs only, entropy only, both), padded ids must get no probability and
no gradient, and at TP=2 each rank's outputs and gradient slice must equal the oracle's.
"""

import pytest
import torch

from parallel.modules import vocab_parallel
from parallel.modules.vocab_parallel import vocab_parallel_log_probs
from parallel.spawn import run_on_ranks
from tests.parallel.modules.rank_fns import vocab_parallel_slice_outputs


def oracle(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, grad_logp, grad_entropy):
    """(log-probs, entropy, gradient w.r.t. the padded logits) by autograd over log_softmax."""
    logits = logits.detach().clone().requires_grad_(True)
    log_p = logits[..., :vocab_size].log_softmax(-1)
    logp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    upstream = [(out * g).sum() for out, g in ((logp, grad_logp), (entropy, grad_entropy)) if g is not None]
    if upstream:
        sum(upstream).backward()
    return logp.detach(), entropy.detach(), logits.grad


def random_case(shape, padded_vocab: int, vocab_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, padded_vocab, dtype=torch.float64, generator=generator) * 3
    targets = torch.randint(0, vocab_size, shape, generator=generator)
    return (logits, targets, torch.randn(shape, dtype=torch.float64, generator=generator),
            torch.randn(shape, dtype=torch.float64, generator=generator))


@pytest.mark.parametrize("upstream", ["both", "logp", "entropy"])
def test_values_and_gradients_equal_log_softmax(monkeypatch, upstream):
    # 7 x 5 tokens of a 200-id vocabulary padded to 256; blocks of 3 rows (the last one short)
    monkeypatch.setitem(vocab_parallel._BLOCK_ELEMENTS, "cpu", 3 * 256)
    logits, targets, grad_logp, grad_entropy = random_case((7, 5), 256, 200)
    logits[..., 200:] = 50.0  # huge padded logits: they must still take no probability
    grad_logp = None if upstream == "entropy" else grad_logp
    grad_entropy = None if upstream == "logp" else grad_entropy
    want_logp, want_entropy, want_grad = oracle(logits, targets, 200, grad_logp, grad_entropy)

    x = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_log_probs(x, targets, 200)
    torch.testing.assert_close(logp, want_logp, atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-12, rtol=0)
    loss = sum((out * g).sum() for out, g in ((logp, grad_logp), (entropy, grad_entropy)) if g is not None)
    loss.backward()
    torch.testing.assert_close(x.grad, want_grad, atol=1e-12, rtol=0)
    assert x.grad[..., 200:].abs().max() == 0


def test_fp32_logits_give_fp32_outputs_close_to_fp64():
    logits, targets, _, _ = random_case((4, 9), 128, 128, seed=1)
    logp, entropy = vocab_parallel_log_probs(logits.float(), targets, 128)
    want_logp, want_entropy, _ = oracle(logits, targets, 128, None, None)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp.double(), want_logp, atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), want_entropy, atol=2e-5, rtol=0)


def test_without_upstream_gradient_the_logits_get_zeros():
    logits, targets, _, _ = random_case((2, 3), 64, 64)
    x = logits.clone().requires_grad_(True)
    logp, entropy = vocab_parallel_log_probs(x, targets, 64)
    (logp.sum() * 0 + entropy.detach().sum()).backward()
    assert x.grad.abs().max() == 0


def test_mismatched_targets_are_refused():
    with pytest.raises(ValueError, match="targets shape"):
        vocab_parallel_log_probs(torch.zeros(2, 3, 8), torch.zeros(2, 4, dtype=torch.long), 8)


@pytest.mark.parametrize("vocab_size", [200, 100], ids=["rank1_partly_padded", "rank1_all_padding"])
def test_tensor_parallel_slices_equal_the_full_softmax(vocab_size):
    """TP=2 over a 256-column padded vocabulary: rank 1 holds ids 128..255, of which 72 are real
    (vocab 200) or none (vocab 100); every rank returns the full log-probs and entropy and the
    gradient of its own slice."""
    logits, targets, grad_logp, grad_entropy = random_case((3, 4), 256, vocab_size, seed=2)
    want_logp, want_entropy, want_grad = oracle(logits, targets, vocab_size, grad_logp, grad_entropy)
    for rank, got in enumerate(run_on_ranks(vocab_parallel_slice_outputs, 2, logits, targets, vocab_size,
                                            grad_logp, grad_entropy, timeout_s=120)):
        torch.testing.assert_close(got["logp"], want_logp, atol=1e-12, rtol=0)
        torch.testing.assert_close(got["entropy"], want_entropy, atol=1e-12, rtol=0)
        torch.testing.assert_close(got["grad"], want_grad[..., rank * 128:(rank + 1) * 128], atol=1e-12, rtol=0)
