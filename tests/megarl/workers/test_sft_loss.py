"""``megarl sft``'s loss on the Megatron worker: the masked negative log-likelihood of a batch of
conversations (the first token as "prompt", a ``loss_mask`` on the tokens to learn) equals HF
transformers' masked cross-entropy, and its gradient norm HF's, at TP1 (DP2), TP2, PP2 and with
packed rows."""

import pytest
import torch

from parallel.spawn import run_on_ranks
from tests.megarl.workers.rank_fns import worker_sft_step

LAYOUTS = {"tp1_dp2": (dict(tp=1), {}), "tp2": (dict(tp=2), {}), "pp2": (dict(pp=2), {}),
           "packed_tp2": (dict(tp=2), {"packed": True})}


def conversation_batch(vocab_size: int) -> dict:
    """Four conversations of different lengths, right-padded; the loss mask alternates spans of
    "assistant" tokens (1) with "user/tool" spans (0), as a multi-turn chat's does."""
    generator = torch.Generator().manual_seed(5)
    lengths = [14, 9, 17, 6]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros(len(lengths), max(lengths) - 1)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab_size, (n,), generator=generator)
        spans = torch.arange(n - 1) // 3 % 2  # 0 0 0 1 1 1 0 0 0 ...
        mask[i, : n - 1] = spans.roll(i)
    return {"input_ids": ids, "prompt_lengths": torch.ones(len(lengths), dtype=torch.long),
            "response_lengths": torch.tensor(lengths) - 1, "loss_mask": mask}


def hf_masked_cross_entropy(hf_dir: str, batch: dict) -> tuple[float, float]:
    """The oracle: HF's cross-entropy over the masked target tokens of the whole batch (labels
    -100 elsewhere, one mean over all of them) and the norm of its gradient."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    labels = batch["input_ids"].clone()
    labels[:, 1:][batch["loss_mask"] == 0] = -100
    labels[:, 0] = -100
    total = 1 + batch["response_lengths"]
    labels[torch.arange(labels.shape[1]).unsqueeze(0) >= total.unsqueeze(1)] = -100
    logits = model(batch["input_ids"]).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss.detach()), float(norm)


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("tiny-llama", seed=1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sft_loss_and_grad_norm_equal_hf(hf_dir, name):
    batch = conversation_batch(200)
    want_loss, want_norm = hf_masked_cross_entropy(hf_dir, batch)
    layout, batching = LAYOUTS[name]
    metrics = run_on_ranks(worker_sft_step, 2, hf_dir, layout, batch, 1, batching, timeout_s=240)[0]
    assert metrics["actor/nll"] == pytest.approx(want_loss, rel=1e-5)
    assert metrics["actor/loss"] == pytest.approx(want_loss, rel=1e-5)
    assert metrics["actor/grad_norm"] == pytest.approx(want_norm, rel=1e-4)
