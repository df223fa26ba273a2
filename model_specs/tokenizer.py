"""A character-level HF tokenizer built locally: the tokenizer of every tiny preset model.

Tests, the quickstart and the benchmarks need a tokenizer without downloads. One character is one
token, so single-digit arithmetic answers are one token each (what makes the quickstart's GRPO
signal strong). Ids: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then the characters below; every
preset's vocabulary (>= 200) holds them all.
"""

from __future__ import annotations

import os

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*=?.,:;!<>/\n'\"#_{}|\\$()[]^%"
PAD_ID, EOS_ID = 0, 1


def char_tokenizer():
    """A ``PreTrainedTokenizerFast``: one token per character, with a simple chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID, "<unk>": 2}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join back without WordLevel's default spaces
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_char_tokenizer(path: str | os.PathLike) -> str:
    """Save ``char_tokenizer()`` into ``path`` (e.g. next to a tiny model's weights)."""
    char_tokenizer().save_pretrained(str(path))
    return str(path)
