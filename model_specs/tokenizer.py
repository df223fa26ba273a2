"""A character-level HF tokenizer built locally: the tokenizer of every tiny preset model.

Tests, the quickstart and the benchmarks need a tokenizer without downloads. One character is one
token, so single-digit arithmetic answers are one token each (what makes the quickstart's GRPO
signal strong). Ids: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then the characters below; every
preset's vocabulary (>= 200) holds them all.

Two chat formats: ``"char"`` (the default, ``<role>content\n``) and ``"chatml"``, which adds the
special tokens ``<|im_start|>`` and ``<|im_end|>`` after the characters and a Qwen2.5-style
template with tool calls, so multi-turn and agent code runs against a realistic template offline.
"""

from __future__ import annotations

import os

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*=?.,:;!<>/\n'\"#_{}|\\$()[]^%"
# Qwen2.5's template without its default system prompt: a system block only when there is a system
# message or tools; consecutive tool results share one user block.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
PAD_ID, EOS_ID = 0, 1


def char_tokenizer(chat_format: str = "char"):
    """A ``PreTrainedTokenizerFast``: one token per character, with the ``"char"`` chat template or,
    for ``"chatml"``, the ChatML special tokens (ids right after the characters) and template."""
    if chat_format not in ("char", "chatml"):
        raise ValueError(f"chat_format must be 'char' or 'chatml', got {chat_format!r}")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<unk>": 2}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # every character, newlines included (a regex "." would leave "\n\n" as one unknown piece)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without WordLevel's default spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    if chat_format == "chatml":
        hf.add_special_tokens({"additional_special_tokens": list(CHATML_SPECIAL_TOKENS)})
        hf.chat_template = CHATML_TEMPLATE
    else:
        hf.chat_template = CHAT_TEMPLATE
    return hf


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer saved in ``path``, as saved. ``AutoTokenizer``, except for one saved as a plain
    ``tokenizers`` pipeline (``tokenizer_class`` TokenizersBackend, as the character tokenizer is):
    next to a model's config.json, transformers 5 rebuilds those as the model type's class (Qwen2's
    byte-level pre-tokenizer), which silently drops characters such as spaces and newlines."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if Path(path).is_dir() and not any((Path(path) / name).is_file() for name in files):
        # transformers would build an empty tokenizer from config.json's model type: every text -> []
        raise ValueError(f"{path} holds no tokenizer (none of {', '.join(files)}); save the model's tokenizer "
                         "there, or point model.tokenizer at one")
    config = Path(path) / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in (
            "TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def save_char_tokenizer(path: str | os.PathLike, chat_format: str = "char") -> str:
    """Save ``char_tokenizer(chat_format)`` into ``path`` (e.g. next to a tiny model's weights)."""
    char_tokenizer(chat_format).save_pretrained(str(path))
    return str(path)
