"""Tiny tokenizers made in the test session (no downloads)."""

import io

import pytest


@pytest.fixture(scope="session")
def char_tokenizer():
    """A character-level HF fast tokenizer with a simple chat template."""
    from model_specs.tokenizer import char_tokenizer as build

    return build()


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
