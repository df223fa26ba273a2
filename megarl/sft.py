"""Supervised fine-tuning on chat conversations: what ``megarl sft`` runs.

The same controller as an RL run (``megarl.trainer.Trainer``: Ray, one ``MegatronWorker`` per
rank at any Megatron layout, atomic checkpoints, resume, SIGTERM, HF export) without engines or
rewards. Each step takes ``data.batch_size`` conversations (``megarl.data.chat``: rendered with
the chat template, a mask on the tokens assistant messages add), and makes one optimizer step of
the ``sft`` loss, the masked negative log-likelihood: with ``actor.loss_agg_mode=token-mean``
(the default) HF's masked cross-entropy over the step's assistant tokens. Padded, packed
(``actor.sequence_packing``) and token-budget micro-batches all work as in RL. The exported
``hf_final`` is an HF checkpoint an RL config can start from (``model.path``).
"""

from __future__ import annotations

import time

from megarl.trainer import Trainer


class SFTTrainer(Trainer):
    """``Trainer`` whose step is one optimizer step on a batch of conversations; the config is
    ``RunConfig.for_sft`` of the user's (``load_config(..., mode="sft")``)."""

    HEADLINE = ("actor/nll", "nll")

    def _build_data(self) -> None:
        from megarl.data.chat import ChatDataset, collate_chat
        from megarl.data.dataset import PromptLoader

        d, s = self.cfg.data, self.cfg.sft
        dataset = ChatDataset(d.train_files, self.tokenizer, messages_key=s.messages_key,
                              chat_template=d.chat_template, tools_key=s.tools_key, max_length=s.max_length)
        self.loader = PromptLoader(dataset, d.batch_size, seed=d.seed, shuffle=d.shuffle, collate_fn=collate_chat)

    def _start_engines(self, threads: int | None) -> None:
        self.engines = []  # nothing is generated

    def sync_weights(self) -> dict[str, float]:
        return {}

    def run_state(self) -> dict:
        return {"data": self.loader.state_dict()}

    def load_run_state(self, state: dict) -> None:
        self.loader.load_state_dict(state["data"])

    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next ``data.batch_size`` conversations."""
        start = time.perf_counter()
        batch = self.loader.next_batch()
        metrics = self.update(batch)
        elapsed = time.perf_counter() - start
        tokens = float((batch["prompt_lengths"] + batch["response_lengths"]).sum())
        metrics.update({"time/step_s": elapsed, "throughput/tokens_per_s": tokens / elapsed,
                        "sft/trained_tokens": float(batch["loss_mask"].sum())})
        return metrics
