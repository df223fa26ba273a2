"""The local character tokenizer: text round-trips exactly, also after save/load with AutoTokenizer.

The trainer decodes responses before scoring them: a decoder that put spaces between characters
made the reward read "57" as "5 7"."""

from transformers import AutoTokenizer

from model_specs.tokenizer import CHARS, EOS_ID, char_tokenizer, save_char_tokenizer

TEXTS = ["3+4=7", "12 + 45 = 57", "a b\nc", CHARS]


def test_one_token_per_character_and_exact_round_trip():
    tok = char_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text


def test_saved_tokenizer_decodes_the_same_and_drops_eos(tmp_path):
    tok = AutoTokenizer.from_pretrained(save_char_tokenizer(tmp_path))
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("57") + [EOS_ID], skip_special_tokens=True) == "57"


def test_saved_next_to_a_model_it_loads_as_saved(tmp_path, tiny_hf_model):
    """Next to a Qwen2 config.json, ``load_tokenizer`` gives the character tokenizer back (spaces
    and newlines included: the model type's byte-level class would drop them)."""
    import shutil

    from model_specs.tokenizer import char_tokenizer, load_tokenizer

    shutil.copy(f"{tiny_hf_model('tiny-qwen2')}/config.json", tmp_path / "config.json")
    tok = load_tokenizer(save_char_tokenizer(tmp_path))
    text = "<user>3 + 4 =\n\n<assistant>7\n"
    assert tok.encode(text, add_special_tokens=False) == char_tokenizer().encode(text, add_special_tokens=False)
    assert len(tok.encode(text, add_special_tokens=False)) == len(text)
    assert tok.apply_chat_template([{"role": "user", "content": "a b"}], tokenize=False) == "<user>a b\n"


def test_a_model_directory_without_a_tokenizer_is_refused(tmp_path, tiny_hf_model):
    """transformers would build an empty tokenizer from config.json alone (every prompt -> no
    tokens, which crashed the SGLang engines); load_tokenizer names the directory and the fix."""
    import shutil

    import pytest

    from model_specs.tokenizer import load_tokenizer

    shutil.copy(f"{tiny_hf_model('tiny-qwen3-moe')}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=f"{tmp_path} holds no tokenizer .*point model.tokenizer at one"):
        load_tokenizer(tmp_path)
