"""Tiny tokenizers made in the test session (no downloads)."""

import io

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*=?.,:;!<>/\n'\"#_{}|\\$()[]^%"


@pytest.fixture(scope="session")
def char_tokenizer():
    """A character-level HF fast tokenizer with a simple chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


@pytest.fixture(scope="session")
def sp_tokenizer():
    """A character-level sentencepiece model trained on a few lines."""
    import sentencepiece as spm

    lines = ["the quick brown fox jumps over the lazy dog", "question: what is 3+4? answer: 7 0123456789"] * 10
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=45, model_type="char",
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())
