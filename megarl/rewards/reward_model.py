"""The interface of a learned reward model, next to the function rewards.

A reward model scores whole sequences (prompt + response token ids) with one scalar each. The
implementation is completed with the workers: a Megatron model with a scalar value head
(hidden size -> 1) read at each sequence's last non-padding token, sharded like the actor and
run by the reward worker group. Only the protocol lives here, so that the controller can treat
function rewards and model rewards alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class RewardModel(Protocol):
    """Anything with ``score(input_ids, attention_mask) -> scores``.

    ``input_ids`` and ``attention_mask`` are ``[batch, seq]`` (right- or left-padded; the mask
    says which tokens are real); the result is a float tensor ``[batch]``, the score at each
    sequence's last real token. Completed with the workers (Megatron model with a scalar head).
    """

    def score(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor": ...
