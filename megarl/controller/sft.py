"""Supervised fine-tuning on chat conversations: what ``megarl sft`` runs.

The same ``Run`` as an RL run (Ray, one ``MegatronWorker`` per rank at any Megatron layout,
atomic checkpoints, resume, SIGTERM, HF export) with no engines and no rewards. Each step takes
``data.batch_size`` conversations (``megarl.data.chat``: rendered with the chat template, a mask on
the tokens assistant messages add), and makes one optimizer step of the ``sft`` loss, the masked
negative log-likelihood: with ``actor.loss_agg_mode=token-mean`` (the default) HF's masked
cross-entropy over the step's assistant tokens. Padded, packed (``actor.sequence_packing``) and
token-budget micro-batches all work as in RL. The exported ``hf_final`` is an HF checkpoint an RL
config can start from (``model.path``).
"""

from __future__ import annotations

import time
from typing import Callable

from megarl.config.schema import RunConfig
from megarl.controller.run import Run
from megarl.controller.step_metrics import batch_tokens, train_tflops_per_s


class SFTTrainer:
    """One optimizer step per batch of conversations; ``cfg`` is ``RunConfig.for_sft`` of the
    user's (``load_config(..., mode="sft")``)."""

    HEADLINE = ("actor/nll", "nll")

    def __init__(self, cfg: RunConfig, log: Callable[[str], None] = print):
        from megarl.data.chat import ChatDataset, collate_chat
        from megarl.data.dataset import PromptLoader

        self.cfg = cfg
        self.run = Run(cfg, log)
        d, s = cfg.data, cfg.sft
        dataset = ChatDataset(d.train_files, self.run.tokenizer, messages_key=s.messages_key,
                              chat_template=d.chat_template, tools_key=s.tools_key, max_length=s.max_length)
        self.loader = PromptLoader(dataset, d.batch_size, seed=d.seed, shuffle=d.shuffle, collate_fn=collate_chat)
        self.run.start_workers()

    @property
    def step(self) -> int:
        return self.run.step

    def fit(self) -> list[dict[str, float]]:
        return self.run.fit(self)

    def run_state(self) -> dict:
        return {"data": self.loader.state_dict()}

    def load_run_state(self, state: dict) -> None:
        self.loader.load_state_dict(state["data"])

    def export_hf(self, target: str | None = None) -> str:
        return self.run.export_hf(target)

    def close(self) -> None:
        self.run.close()

    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next ``data.batch_size`` conversations."""
        start = time.perf_counter()
        batch = self.loader.next_batch()
        update_start = time.perf_counter()
        metrics = self.run.workers.update(batch, self.step + 1)
        ended = time.perf_counter()
        tokens = batch_tokens(batch)
        metrics.update({"time/step_s": ended - start, "throughput/tokens_per_s": tokens / (ended - start),
                        "perf/train_tflops_per_s": train_tflops_per_s(self.run.hf_config, batch, ended - update_start),
                        "sft/trained_tokens": float(batch["loss_mask"].sum())})
        return metrics
