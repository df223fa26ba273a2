"""Prompt datasets for RL: read, template, tokenise, filter; then batch with a resumable position.

``PromptDataset`` reads rows from parquet / JSON-lines files, takes each row's prompt (a string
or a list of chat messages), ground truth (a possibly dotted key, ``reward_model.ground_truth``)
and data source (which picks the reward function), renders the prompt with the tokenizer's chat
template (``add_generation_prompt=True``) or a plain ``prompt_template`` string (for tokenizers
without one, e.g. sentencepiece), tokenises it, and drops prompts longer than
``max_prompt_length`` tokens (counted and logged). Bad input fails here, before any model is
built, with the file, the row and the setting to change.

``PromptLoader`` yields batches of ``batch_size`` prompts in an order shuffled per epoch from
``(seed, epoch)`` alone, so its position is two integers: ``state_dict()`` gives
``{"epoch", "index"}`` (plus checks), and a new loader with ``load_state_dict`` continues with
exactly the batches the uninterrupted run would have produced.
"""

from __future__ import annotations

import logging
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from megarl.data.io import get_field, read_records

logger = logging.getLogger(__name__)

_MISSING = object()


@dataclass
class PromptSample:
    """One prompt, ready for generation."""

    index: int  # position in the dataset (after filtering)
    input_ids: list[int]
    prompt: Any  # the raw prompt: a string or a list of chat messages
    text: str  # the prompt after templating (what was tokenised)
    ground_truth: Any
    data_source: str
    extra_info: dict = field(default_factory=dict)
    origin: str = ""  # "file:row" for messages


def _is_sentencepiece(tokenizer) -> bool:
    return hasattr(tokenizer, "EncodeAsIds") and not hasattr(tokenizer, "apply_chat_template")


def tokenizer_pad_id(tokenizer) -> int:
    """The id used for left padding: pad, else eos, else 0."""
    if _is_sentencepiece(tokenizer):
        for token_id in (tokenizer.pad_id(), tokenizer.eos_id()):
            if token_id is not None and token_id >= 0:
                return int(token_id)
        return 0
    for name in ("pad_token_id", "eos_token_id"):
        token_id = getattr(tokenizer, name, None)
        if token_id is not None:
            return int(token_id)
    return 0


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if _is_sentencepiece(tokenizer):
        ids = list(tokenizer.EncodeAsIds(text))
        if add_special_tokens and tokenizer.bos_id() >= 0:
            ids = [tokenizer.bos_id()] + ids
        return ids
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def data_rows(files: Sequence[str | Path], what: str) -> Iterator[tuple[str, dict]]:
    """``("file:row N", row)`` for every row of ``files``, which must exist and hold rows; ``what``
    names the data in the errors ("prompt", "chat")."""
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise FileNotFoundError(f"{what} data file(s) do not exist: {missing}")
    for path in files:
        rows = read_records(path)
        if not rows:
            raise ValueError(f"{what} data file {str(path)!r} has no rows")
        for row_no, row in enumerate(rows):
            yield f"{path}:row {row_no}", row


def _check_messages(prompt, origin: str, prompt_key: str) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if (
        isinstance(prompt, (list, tuple))
        and prompt
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    ):
        return [dict(m) for m in prompt]
    raise ValueError(
        f"{origin}: field {prompt_key!r} must be a string or a non-empty list of "
        f"{{'role': ..., 'content': ...}} messages, got {type(prompt).__name__}: {str(prompt)[:80]!r}"
    )


class PromptDataset(Sequence[PromptSample]):
    """Templated, tokenised, length-filtered prompts from a list of parquet / jsonl files.

    Args:
        files: one path or a list of paths (``.parquet``, ``.jsonl``).
        tokenizer: an HF tokenizer, or a ``sentencepiece.SentencePieceProcessor``.
        prompt_key: the field with the prompt (a string or a list of chat messages).
        ground_truth_key: the (dotted) field with the reference answer; None if the reward needs
            none (a reward model).
        data_source_key: the field naming the data source; ``default_data_source`` is used for
            rows (or files) without it.
        extra_info_key: the optional dict field passed on to the reward function.
        prompt_template: a ``str.format`` template with ``{prompt}`` (and optionally
            ``{system}``), used instead of a chat template, e.g. ``"Q: {prompt}\\nA:"``. For a
            chat-message prompt, ``{prompt}`` is the user messages' text joined by newlines and
            ``{system}`` the system message's ("" if none). Tokenised with special tokens
            (BOS). Required when the tokenizer has no chat template.
        chat_template: a Jinja chat template that replaces the tokenizer's own.
        tools: tool schemas (OpenAI function format) passed to the chat template, so an agent's
            prompt lists the tools it may call; ignored by ``prompt_template``.
        max_prompt_length: prompts with more tokens are dropped (and counted); None keeps all.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer,
        *,
        prompt_key: str = "prompt",
        ground_truth_key: str | None = "reward_model.ground_truth",
        data_source_key: str = "data_source",
        default_data_source: str | None = None,
        extra_info_key: str | None = "extra_info",
        prompt_template: str | None = None,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        max_prompt_length: int | None = None,
    ):
        files = [files] if isinstance(files, (str, Path)) else list(files)
        if not files:
            raise ValueError("PromptDataset: no data files given; set data.train_files to a list of .parquet/.jsonl paths")
        if max_prompt_length is not None and max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be > 0 or None, got {max_prompt_length}")
        self.tokenizer = tokenizer
        self.prompt_template = prompt_template
        self.chat_template = chat_template
        self.tools = tools
        self.max_prompt_length = max_prompt_length
        self._use_chat_template = self._check_template()

        samples: list[PromptSample] = []
        self.num_rows = 0
        self.num_dropped = 0
        longest_dropped = 0
        shortest = None
        for origin, row in data_rows(files, "prompt"):
            self.num_rows += 1
            sample = self._make_sample(
                row, origin, prompt_key, ground_truth_key, data_source_key, default_data_source, extra_info_key
            )
            n_tokens = len(sample.input_ids)
            if n_tokens == 0:  # an engine cannot start a sequence from nothing (SGLang's scheduler crashes)
                raise ValueError(f"{origin}: the prompt {sample.text[:80]!r} tokenizes to no tokens; "
                                 "check the tokenizer (model.tokenizer, or the model directory's tokenizer files) "
                                 "and data.prompt_template")
            shortest = n_tokens if shortest is None else min(shortest, n_tokens)
            if max_prompt_length is not None and n_tokens > max_prompt_length:
                self.num_dropped += 1
                longest_dropped = max(longest_dropped, n_tokens)
                continue
            sample.index = len(samples)
            samples.append(sample)
        if self.num_dropped:
            logger.warning(
                "dropped %d of %d prompts longer than max_prompt_length=%d tokens (longest: %d)",
                self.num_dropped,
                self.num_rows,
                max_prompt_length,
                longest_dropped,
            )
        if not samples:
            raise ValueError(
                f"no prompts left in {[str(f) for f in files]}: all {self.num_rows} are longer than "
                f"max_prompt_length={max_prompt_length} tokens (the shortest has {shortest}); raise max_prompt_length"
            )
        self.samples = samples

    def _check_template(self) -> bool:
        if self.prompt_template is not None:
            fields = {name for _, name, _, _ in string.Formatter().parse(self.prompt_template) if name is not None}
            if "prompt" not in fields or not fields <= {"prompt", "system"}:
                raise ValueError(
                    f"prompt_template {self.prompt_template!r} must contain '{{prompt}}' and no fields other than "
                    f"{{prompt}} and {{system}} (found {sorted(fields)}); write literal braces as '{{{{' and '}}}}'"
                )
            return False
        if _is_sentencepiece(self.tokenizer) or not hasattr(self.tokenizer, "apply_chat_template"):
            raise ValueError(
                f"tokenizer {type(self.tokenizer).__name__} has no chat template support; pass "
                "prompt_template='...{prompt}...' (e.g. 'Question: {prompt}\\nAnswer:')"
            )
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {getattr(self.tokenizer, 'name_or_path', '') or type(self.tokenizer).__name__} has no "
                "chat template; pass chat_template='<jinja template>' or prompt_template='...{prompt}...'"
            )
        return True

    def render(self, prompt, origin: str = "prompt", prompt_key: str = "prompt") -> str:
        """The text a prompt (string or chat messages) becomes before tokenisation."""
        messages = _check_messages(prompt, origin, prompt_key)
        if self._use_chat_template:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, chat_template=self.chat_template, tools=self.tools
            )
        if isinstance(prompt, str):
            user, system = prompt, ""
        else:
            user = "\n".join(str(m["content"]) for m in messages if m["role"] == "user")
            system = "\n".join(str(m["content"]) for m in messages if m["role"] == "system")
        return self.prompt_template.format(prompt=user, system=system)

    def _make_sample(self, row, origin, prompt_key, gt_key, ds_key, default_ds, extra_key) -> PromptSample:
        fields = sorted(row)
        try:
            prompt = get_field(row, prompt_key)
        except KeyError:
            raise ValueError(
                f"{origin}: no prompt field {prompt_key!r} (fields: {fields}); set prompt_key to the field that holds "
                "the prompt"
            ) from None
        ground_truth = None
        if gt_key is not None:
            try:
                ground_truth = get_field(row, gt_key)
            except KeyError:
                raise ValueError(
                    f"{origin}: no ground-truth field {gt_key!r} (fields: {fields}); set ground_truth_key to the "
                    "(dotted) field with the reference answer, or to None if the reward needs none"
                ) from None
        data_source = row.get(ds_key, _MISSING) if isinstance(row, dict) else _MISSING
        if data_source is _MISSING or data_source is None:
            if default_ds is None:
                raise ValueError(
                    f"{origin}: no data source field {ds_key!r} (fields: {fields}); set data_source_key, or "
                    "default_data_source to the name whose reward function scores these prompts"
                )
            data_source = default_ds
        extra_info = {}
        if extra_key is not None and row.get(extra_key) is not None:
            extra_info = row[extra_key]
            if not isinstance(extra_info, dict):
                raise ValueError(f"{origin}: field {extra_key!r} must be a dict, got {type(extra_info).__name__}")
        text = self.render(prompt, origin, prompt_key)
        input_ids = _encode(self.tokenizer, text, add_special_tokens=not self._use_chat_template)
        return PromptSample(-1, input_ids, prompt, text, ground_truth, str(data_source), dict(extra_info), origin)

    @property
    def pad_token_id(self) -> int:
        return tokenizer_pad_id(self.tokenizer)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def collate_prompts(samples: Sequence[PromptSample], pad_token_id: int) -> dict:
    """A batch dict: left-padded ``input_ids``, ``attention_mask``, ``position_ids`` (``[B, L]``
    long tensors), unpadded ``prompt_ids`` (lists, what the rollout engine takes) and the
    per-sample metadata lists ``raw_prompt``, ``ground_truth``, ``data_source``, ``extra_info``,
    ``index``."""
    import torch

    width = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        if s.input_ids:
            input_ids[row, width - len(s.input_ids) :] = torch.tensor(s.input_ids, dtype=torch.long)
            attention_mask[row, width - len(s.input_ids) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "prompt_ids": [list(s.input_ids) for s in samples],
        "raw_prompt": [s.prompt for s in samples],
        "ground_truth": [s.ground_truth for s in samples],
        "data_source": [s.data_source for s in samples],
        "extra_info": [s.extra_info for s in samples],
        "index": [s.index for s in samples],
    }


class PromptLoader:
    """Batches of a ``PromptDataset`` (or any dataset), shuffled per epoch from ``(seed, epoch)``, resumable.

    ``next_batch()`` returns the next batch and moves to the next epoch after the last one;
    ``for batch in loader`` yields the rest of the current epoch. The position always names
    the next batch to produce, so ``state_dict()`` taken after batch k restores to batch k+1.
    With ``drop_last`` (default) every batch has exactly ``batch_size`` prompts and the last
    ``len(dataset) % batch_size`` of each epoch's order are skipped.

    Batches are ``collate_fn(samples)``, by default ``collate_prompts`` (``megarl.data.chat.
    collate_chat`` for a ``ChatDataset``).
    """

    def __init__(
        self,
        dataset: Sequence[PromptSample],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        collate_fn: Callable[[list[PromptSample]], Any] | None = None,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} prompts after filtering, fewer than batch_size={batch_size}; "
                "lower the batch size, add data, or raise max_prompt_length"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        if collate_fn is None:
            pad = getattr(dataset, "pad_token_id", 0)
            collate_fn = lambda samples: collate_prompts(samples, pad)  # noqa: E731
        self.collate_fn = collate_fn
        self.epoch = 0
        self.index = 0  # prompts of this epoch's order already handed out
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    @property
    def _usable(self) -> int:
        n = len(self.dataset)
        return n - n % self.batch_size if self.drop_last else n

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._usable // self.batch_size if self.drop_last else -(-len(self.dataset) // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The dataset positions of ``epoch`` in the order they are served."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            self._order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> list[int]:
        """Dataset positions of the next batch (advances the position)."""
        order = self.order(self.epoch)
        take = [int(i) for i in order[self.index : self.index + self.batch_size]]
        self.index += len(take)
        if self.index >= self._usable:
            self.epoch, self.index = self.epoch + 1, 0
        return take

    def next_batch(self):
        """The next batch (``collate_fn`` of its samples); rolls over into the next epoch."""
        return self.collate_fn([self.dataset[i] for i in self.next_indices()])

    def __iter__(self):
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """``{"epoch", "index"}``: the next batch's position, plus what it is only valid for."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_prompts": len(self.dataset),
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; ValueError if it was saved for other data or settings."""
        for key in ("seed", "batch_size", "num_prompts", "shuffle"):
            mine = {"num_prompts": len(self.dataset)}.get(key, getattr(self, key, None))
            if key in state and state[key] != mine:
                raise ValueError(
                    f"data position was saved with {key}={state[key]!r} but this loader has {key}={mine!r}; "
                    "resume with the same data files, filters and batch settings (or start the data from scratch)"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < max(self._usable, 1):
            raise ValueError(f"data position (epoch={epoch}, index={index}) is out of range for {self._usable} prompts")
        self.epoch, self.index = epoch, index
