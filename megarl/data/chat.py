"""Chat conversations as token ids with assistant masks: SFT data and multi-turn rollouts.

``render_chat`` turns a conversation into the ids its chat template gives and a mask that is 1 on
the tokens the assistant messages contribute (their content and end-of-turn tokens), 0 on the rest
(system, user and tool turns, and the generation prompt that opens each assistant turn). It renders
growing prefixes of the conversation and takes each assistant turn's tokens as what its rendering
adds, so the mask is exact for any template, provided the template renders earlier turns
unchanged when later ones follow; one that rewrites them (Qwen3 drops the reasoning of past
assistant turns) is refused with the first differing token, since no single sequence then holds
every turn as the model saw it.

A multi-turn rollout keeps the sampled ids as they are (token-in/token-out: re-tokenising decoded
text can give other ids) and appends ``turn_suffix_ids``: the end of the assistant turn the policy
did not sample, the next messages (tool results, user turns) and the next generation prompt.
``check_extends`` verifies that a sequence still starts with the one it continues.

``ChatDataset`` reads conversations from parquet / jsonl files for SFT; ``collate_chat`` makes the
training batch of ``megarl/workers/batch.py``, with the mask as its response-shaped ``loss_mask``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from megarl.data.dataset import _encode, _is_sentencepiece, data_rows
from megarl.data.io import get_field

logger = logging.getLogger(__name__)

_FIX = "use a chat template that renders earlier turns unchanged, e.g. data.chat_template"
_CONTEXT = 8  # tokens of decoded context either side of a difference
# The stand-in conversation whose rendering turn_suffix_ids cuts off.
_STAND_IN = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})


class ChatTemplateError(ValueError):
    """A conversation the chat template cannot turn into one masked token sequence."""


class PrefixMismatchError(ValueError):
    """A token sequence does not start with the sequence it should continue."""


@dataclass
class ChatSample:
    """One conversation, tokenised, with its assistant mask."""

    index: int  # position in the dataset (after filtering)
    input_ids: list[int]
    loss_mask: list[int]  # 1 on the tokens assistant messages contribute, 0 elsewhere
    origin: str = ""  # "file:row" for messages


def _decode(tokenizer, ids: Sequence[int]) -> str:
    if _is_sentencepiece(tokenizer):
        return tokenizer.DecodeIds(list(ids))
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def _difference(previous: Sequence[int], current: Sequence[int], tokenizer) -> str | None:
    """None if ``current`` starts with ``previous``, else the first differing position (and, with a
    tokenizer, the decoded tokens around it in both)."""
    pos = next((i for i, (a, b) in enumerate(zip(previous, current)) if a != b), None)
    if pos is None:
        if len(current) >= len(previous):
            return None
        pos = len(current)
        where = f"it ends at token {pos}, before the {len(previous)} earlier tokens do"
    else:
        where = f"first difference at token {pos}"
    if tokenizer is not None:
        lo = max(0, pos - _CONTEXT)
        before = _decode(tokenizer, previous[lo : pos + _CONTEXT])
        now = _decode(tokenizer, current[lo : pos + _CONTEXT])
        where += f" (tokens {lo}..: before {before!r}, now {now!r})"
    return where


def check_extends(previous: Sequence[int], current: Sequence[int], tokenizer=None, *, what: str = "turn") -> None:
    """Raise ``PrefixMismatchError`` unless ``current[:len(previous)] == previous``; the message gives
    the first differing position and, with a tokenizer, the decoded context of both."""
    difference = _difference(previous, current, tokenizer)
    if difference is not None:
        raise PrefixMismatchError(f"the {what} does not extend the {len(previous)} tokens before it: {difference}")


def _require_template(tokenizer, chat_template: str | None, where: str) -> None:
    if _is_sentencepiece(tokenizer) or not hasattr(tokenizer, "apply_chat_template"):
        raise ChatTemplateError(
            f"{where}: tokenizer {type(tokenizer).__name__} cannot render chat messages; use an HF tokenizer "
            "and set data.chat_template to a Jinja chat template"
        )
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ChatTemplateError(
            f"{where}: tokenizer {name} has no chat template; set data.chat_template to a Jinja chat template"
        )


def _check_messages(messages, origin: str) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{origin}: messages must be a list of chat messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or message.get("content") is None:
            raise ValueError(
                f"{origin}: message {i} must be a dict with a string 'role' and a 'content' ('' for a turn "
                f"with only tool calls), got {str(message)[:80]!r}"
            )


def _render_text(tokenizer, messages, *, generation_prompt: bool, chat_template, tools, origin: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt,
            chat_template=chat_template, tools=tools,
        )
    except Exception as exc:  # jinja errors name neither the conversation nor the message
        raise ChatTemplateError(
            f"{origin}: the chat template failed on the first {len(messages)} messages ({type(exc).__name__}: {exc})"
        ) from exc


def render_chat(
    tokenizer,
    messages: list[dict],
    *,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    origin: str = "messages",
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and its assistant mask.

    For each assistant message ``i``, ``messages[:i]`` with the generation prompt must render to
    an extension of everything before it, and ``messages[:i+1]`` to an extension of that; the
    tokens the latter adds are the assistant's (mask 1). Other messages are checked only where the
    next assistant turn (or the end) is rendered: a template may close a block of consecutive tool
    results only after the last of them (Qwen2.5 does). Rendered text is tokenised without added
    special tokens (the template writes BOS if it has one). ``ChatTemplateError`` if the template
    rewrites earlier turns or if there is no assistant message; ``origin`` names the
    conversation in errors.
    """
    _check_messages(messages, origin)
    _require_template(tokenizer, chat_template, origin)
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatTemplateError(
            f"{origin}: no assistant message (roles: {[m['role'] for m in messages]}); a conversation needs at "
            "least one assistant turn to learn from"
        )

    def render(upto: int, generation_prompt: bool) -> list[int]:
        text = _render_text(tokenizer, messages[:upto], generation_prompt=generation_prompt,
                            chat_template=chat_template, tools=tools, origin=origin)
        return _encode(tokenizer, text, add_special_tokens=False)

    ids: list[int] = []
    mask: list[int] = []

    def extend(new: list[int], value: int, index: int, problem: str) -> None:
        nonlocal ids
        difference = _difference(ids, new, tokenizer)
        if difference is not None:
            raise ChatTemplateError(
                f"{origin}: message {index} ({messages[index]['role']}): {problem}: {difference}; the assistant "
                f"mask needs every rendering to extend the one before it; {_FIX}"
            )
        mask.extend([value] * (len(new) - len(ids)))
        ids = new

    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        extend(render(i, True), 0, i, "with its generation prompt, the conversation before it renders earlier turns "
                                      "differently")
        extend(render(i + 1, False), 1, i, "its rendering does not extend the conversation before it and the generation "
                                           "prompt (the template rewrites an earlier turn, or opens assistant turns "
                                           "unlike its generation prompt)")
    if messages[-1]["role"] != "assistant":
        extend(render(len(messages), False), 0, len(messages) - 1, "the whole conversation renders earlier turns "
                                                                    "differently")
    return ids, mask


def turn_suffix_ids(
    tokenizer,
    new_messages: list[dict],
    *,
    sampled_text: str,
    finished: bool,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """The tokens to append after an assistant turn the policy sampled (token-in/token-out: sampled
    ids are never re-tokenised): the rest of the template's end-of-assistant-turn that the policy did
    not sample, then ``new_messages`` (tool results / user turns) as the template renders them, then
    the generation prompt for the next assistant turn. Tokenised once.

    ``sampled_text`` is the decoded sampled turn with special tokens kept. If the policy stopped on
    its own (``finished``) and its text ends with a beginning of the template's end-of-turn text
    (``<|im_end|>`` of ``<|im_end|>\\n``), only the rest is added; otherwise (truncated, or stopped by
    a token the template does not write, like an eos) the whole end-of-turn text is.

    The end-of-turn text and the new messages are cut from renderings of a stand-in conversation
    (``user "x", assistant "y"``) instead of the real one, so a system prompt listing the tools is
    not rendered again; this assumes the template renders the new messages independently of the
    earlier content, which holds for ChatML-style templates.
    """
    _check_messages(new_messages, "new_messages")
    _require_template(tokenizer, chat_template, "turn_suffix_ids")

    def render(messages, generation_prompt: bool) -> str:
        return _render_text(tokenizer, messages, generation_prompt=generation_prompt,
                            chat_template=chat_template, tools=tools, origin="turn_suffix_ids")

    base = [dict(m) for m in _STAND_IN]
    rendered = render(base, False)
    full = render(base + list(new_messages), True)
    if not full.startswith(rendered):
        pos = next((i for i, (a, b) in enumerate(zip(rendered, full)) if a != b), len(full))
        raise ChatTemplateError(
            f"turn_suffix_ids: the chat template renders an assistant turn differently once "
            f"{[m['role'] for m in new_messages]} messages follow it (character {pos}: before "
            f"{rendered[max(0, pos - 20):pos + 20]!r}, now {full[max(0, pos - 20):pos + 20]!r}); {_FIX}"
        )
    # What follows the assistant content: where renderings with contents "y" and "z" stop agreeing.
    other = render(base[:1] + [{"role": "assistant", "content": "z"}], False)
    content_at = next((i for i, (a, b) in enumerate(zip(rendered, other)) if a != b), None)
    if content_at is None:
        raise ChatTemplateError(f"turn_suffix_ids: the chat template does not render assistant content; {_FIX}")
    assistant_end = rendered[content_at + 1 :]
    remainder = assistant_end
    if finished:
        sampled_end = next((k for k in range(len(assistant_end), 0, -1) if sampled_text.endswith(assistant_end[:k])), 0)
        remainder = assistant_end[sampled_end:]
    return _encode(tokenizer, remainder + full[len(rendered) :], add_special_tokens=False)


def _plain(value):
    """Python lists and dicts for what parquet readers or numpy give (arrays, tuples, numpy scalars)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class ChatDataset(Sequence[ChatSample]):
    """Conversations from parquet / jsonl files, rendered with ``render_chat``, length-filtered: SFT data.

    Args:
        files: one path or a list of paths (``.parquet``, ``.jsonl``).
        tokenizer: an HF tokenizer with a chat template (or ``chat_template``).
        messages_key: the (dotted) field with the list of ``{"role", "content", ...}`` messages.
            Keys that parquet fills with None for messages without them are dropped; a None content
            becomes "" (a turn with only tool calls). Other keys (``tool_calls``, ``name``) pass through.
        chat_template: a Jinja chat template that replaces the tokenizer's own.
        tools_key: the optional field with the row's tool schemas (a list of dicts, or that list as a
            JSON string: the safer form in parquet, whose struct columns give every tool the union
            of all tools' keys).
        max_length: conversations with more tokens are dropped (and counted); None keeps all.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer,
        *,
        messages_key: str = "messages",
        chat_template: str | None = None,
        tools_key: str | None = None,
        max_length: int | None = None,
    ):
        files = [files] if isinstance(files, (str, Path)) else list(files)
        if not files:
            raise ValueError("ChatDataset: no data files given; pass a list of .parquet/.jsonl paths")
        if max_length is not None and max_length <= 0:
            raise ValueError(f"max_length must be > 0 or None, got {max_length}")
        _require_template(tokenizer, chat_template, "ChatDataset")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_length = max_length

        samples: list[ChatSample] = []
        self.num_rows = 0
        self.num_dropped = 0
        lengths = []
        for origin, row in data_rows(files, "chat"):
            self.num_rows += 1
            messages = self._messages(row, messages_key, origin)
            tools = self._tools(row, tools_key, origin) if tools_key is not None else None
            ids, mask = render_chat(tokenizer, messages, chat_template=chat_template, tools=tools, origin=origin)
            lengths.append(len(ids))
            if max_length is not None and len(ids) > max_length:
                self.num_dropped += 1
                continue
            samples.append(ChatSample(len(samples), ids, mask, origin))
        if self.num_dropped:
            logger.warning(
                "dropped %d of %d conversations longer than max_length=%d tokens (longest: %d)",
                self.num_dropped, self.num_rows, max_length, max(lengths),
            )
        if not samples:
            raise ValueError(
                f"no conversations left in {[str(f) for f in files]}: all {self.num_rows} are longer than "
                f"max_length={max_length} tokens ({min(lengths)} to {max(lengths)} tokens); raise max_length"
            )
        self.samples = samples

    @staticmethod
    def _messages(row: dict, key: str, origin: str) -> list[dict]:
        try:
            messages = _plain(get_field(row, key))
        except KeyError:
            raise ValueError(
                f"{origin}: no messages field {key!r} (fields: {sorted(row)}); set messages_key to the field "
                "with the list of chat messages"
            ) from None
        if not isinstance(messages, list) or not messages:
            raise ValueError(
                f"{origin}: field {key!r} must be a non-empty list of {{'role': ..., 'content': ...}} messages, "
                f"got {type(messages).__name__}: {str(messages)[:80]!r}"
            )
        normalised = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(
                    f"{origin}: {key}[{i}] must be a dict with 'role' and 'content' keys, got {str(message)[:80]!r}"
                )
            message = {k: v for k, v in message.items() if v is not None or k == "content"}
            normalised.append(dict(message, content="" if message["content"] is None else message["content"]))
        return normalised

    @staticmethod
    def _tools(row: dict, key: str, origin: str) -> list[dict] | None:
        try:
            tools = _plain(get_field(row, key))
        except KeyError:
            raise ValueError(
                f"{origin}: no tools field {key!r} (fields: {sorted(row)}); set tools_key to the field with the "
                "tool schemas, or to None"
            ) from None
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{origin}: field {key!r} is a string but not JSON ({exc.msg})") from None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"{origin}: field {key!r} must be a list of tool schema dicts, got {str(tools)[:80]!r}")
        return tools

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def collate_chat(samples: Sequence[ChatSample]) -> dict:
    """The training batch of ``megarl/workers/batch.py`` for conversations: ``input_ids`` ``[B, T]``
    right-padded with 0; every token after the first is a "response" token (``prompt_lengths`` 1,
    ``response_lengths`` ``len - 1``), and ``loss_mask`` ``[B, R]`` (float) marks the assistant
    tokens among them, the targets to learn; ``uid`` lists the samples' dataset indices."""
    import torch

    if not samples:
        raise ValueError("collate_chat: no samples")
    width = max(len(s.input_ids) for s in samples)
    input_ids = torch.zeros((len(samples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width - 1), dtype=torch.float)
    for row, s in enumerate(samples):
        input_ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.long)
        loss_mask[row, : len(s.input_ids) - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.float)
    return {
        "input_ids": input_ids,
        "prompt_lengths": torch.ones(len(samples), dtype=torch.long),
        "response_lengths": torch.tensor([len(s.input_ids) - 1 for s in samples], dtype=torch.long),
        "loss_mask": loss_mask,
        "uid": [s.index for s in samples],
    }
