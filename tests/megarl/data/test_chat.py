"""Chat rendering with assistant masks, turn suffixes for multi-turn rollouts, SFT data and batches.

Oracles are the rendered strings written out by hand, not the code under test."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from megarl.data.chat import (
    ChatDataset,
    ChatTemplateError,
    PrefixMismatchError,
    check_extends,
    collate_chat,
    render_chat,
    turn_suffix_ids,
)
from megarl.data.dataset import PromptDataset, PromptLoader
from model_specs.tokenizer import char_tokenizer as build_char_tokenizer
from model_specs.tokenizer import save_char_tokenizer

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6"},
]
TOOL_CALL = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "6*7"}}}
WITH_TOOLS = [
    {"role": "user", "content": "6*7?"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": "42"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "it is 42"},
]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "evaluate an expression"}}]
CALL_TEXT = '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def chatml():
    return build_char_tokenizer("chatml")


def _masked(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


def _conversation(i, answer="x" * 3):
    return [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": answer}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _check_render(tok, messages, expected_text, expected_masked, tools=None):
    ids, mask = render_chat(tok, messages, tools=tools)
    assert len(ids) == len(mask)
    assert tok.decode(ids) == expected_text
    assert tok.apply_chat_template(messages, tokenize=False, tools=tools) == expected_text
    assert _masked(tok, ids, mask) == expected_masked
    return ids, mask


def test_render_chat_char_template(char_tok):
    _check_render(char_tok, CONVERSATION, "<system>be brief\n<user>2+2?\n<assistant>4\n<user>and 3+3?\n<assistant>6\n",
                  "4\n6\n")
    _check_render(char_tok, WITH_TOOLS, "<user>6*7?\n<assistant>\n<tool>42\n<tool>ok\n<assistant>it is 42\n",
                  "\nit is 42\n")


def test_render_chat_chatml(chatml):
    assert chatml.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [95, 96] and len(chatml) < 200
    _check_render(
        chatml, CONVERSATION,
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n",
        "4<|im_end|>\n6<|im_end|>\n",
    )
    tools_system = (
        "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "calc", "description": "evaluate an expression"}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call>"
        ' XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    )
    ids, mask = _check_render(
        chatml, WITH_TOOLS,
        tools_system + "<|im_start|>user\n6*7?<|im_end|>\n<|im_start|>assistant\n" + CALL_TEXT + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nit is 42<|im_end|>\n",
        CALL_TEXT + "<|im_end|>\nit is 42<|im_end|>\n",
        tools=TOOLS,
    )
    assert 2 not in ids  # no <unk>: "\n\n" in the tools prompt is two tokens


def test_bad_conversations(char_tok):
    with pytest.raises(ChatTemplateError, match="no assistant message"):
        render_chat(char_tok, CONVERSATION[:2], origin="f.jsonl:row 3")
    with pytest.raises(ValueError, match="message 1 must be a dict"):
        render_chat(char_tok, [{"role": "user", "content": "hi"}, {"role": "assistant"}])


def test_a_template_that_rewrites_earlier_turns_is_refused(char_tok):
    drops_past_assistants = (
        "{%- set ns = namespace(last=-1) %}"
        "{%- for m in messages %}{% if m.role == 'assistant' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
        "{%- for m in messages %}<{{ m.role }}>"
        "{% if m.role != 'assistant' or loop.index0 == ns.last %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{%- if add_generation_prompt %}<assistant>{% endif %}"
    )
    with pytest.raises(ChatTemplateError) as err:
        render_chat(char_tok, CONVERSATION, chat_template=drops_past_assistants, origin="d.jsonl:row 7")
    message = str(err.value)
    # "<system>be brief\n<user>2+2?\n<assistant>" is 39 tokens; the "4" there is token 39
    assert "d.jsonl:row 7: message 4" in message and "token 39" in message and "data.chat_template" in message
    # a generation prompt unlike the assistant turn's start: caught at the first assistant message
    other_prompt = char_tok.chat_template.replace("prompt %}<assistant>", "prompt %}<bot>")
    with pytest.raises(ChatTemplateError, match=r"messages: message 2 \(assistant\).*first difference at token 29"):
        render_chat(char_tok, CONVERSATION, chat_template=other_prompt)


def test_turn_suffix_ids(chatml, char_tok):
    tool = [{"role": "tool", "content": "42"}]
    rest = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    finished = turn_suffix_ids(chatml, tool, sampled_text="it is<|im_end|>", finished=True)
    assert chatml.decode(finished) == "\n" + rest
    truncated = turn_suffix_ids(chatml, tool, sampled_text="it is", finished=False)
    assert chatml.decode(truncated) == "<|im_end|>\n" + rest
    # the char tokenizer's <eos> is not in its template: the whole "\n" end of turn is added
    eos = turn_suffix_ids(char_tok, tool, sampled_text="it is<eos>", finished=True, tools=TOOLS)
    assert char_tok.decode(eos) == "\n<tool>42\n<assistant>"


def test_prompt_sampled_and_suffix_ids_are_the_rendered_conversation(chatml):
    """Token-in/token-out: what a multi-turn rollout builds equals render_chat of the conversation."""
    full_ids, _ = render_chat(chatml, WITH_TOOLS, tools=TOOLS)
    prompt = chatml.apply_chat_template(WITH_TOOLS[:1], tokenize=False, add_generation_prompt=True, tools=TOOLS)
    ids = chatml.encode(prompt, add_special_tokens=False)
    ids += chatml.encode(CALL_TEXT + "<|im_end|>", add_special_tokens=False)  # sampled, stopped on <|im_end|>
    ids += turn_suffix_ids(chatml, WITH_TOOLS[2:4], sampled_text=CALL_TEXT + "<|im_end|>", finished=True, tools=TOOLS)
    ids += chatml.encode("it is 42", add_special_tokens=False)  # sampled, cut by max tokens
    ids += turn_suffix_ids(chatml, [{"role": "user", "content": "ok"}], sampled_text="it is 42", finished=False)
    assert ids[: len(full_ids)] == full_ids
    assert chatml.decode(ids[len(full_ids) :]) == "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_dataset_shows_the_tools_and_the_chatml_tokenizer_saves(tmp_path, chatml):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "6*7?", "data_source": "s"}])
    text = PromptDataset(path, chatml, ground_truth_key=None, tools=TOOLS)[0].text
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "calc"' in text
    assert text.endswith("<|im_start|>user\n6*7?<|im_end|>\n<|im_start|>assistant\n")
    assert PromptDataset(path, chatml, ground_truth_key=None)[0].text == text[text.index("<|im_start|>user"):]
    loaded = AutoTokenizer.from_pretrained(save_char_tokenizer(tmp_path / "tok", chat_format="chatml"))
    assert loaded.encode(text, add_special_tokens=False) == chatml.encode(text, add_special_tokens=False)
    assert loaded.chat_template == chatml.chat_template


def test_check_extends(char_tok):
    check_extends([3, 4], [3, 4, 5])
    check_extends([], [1])
    ids = char_tok.encode("abcdef")
    with pytest.raises(PrefixMismatchError, match=r"first difference at token 2 \(tokens 0..: before 'abcdef', now 'abXdefg'\)"):
        check_extends(ids, char_tok.encode("abXdefg"), char_tok, what="tool turn")
    with pytest.raises(PrefixMismatchError, match="ends at token 3"):
        check_extends(ids, ids[:3])


def test_chat_dataset_from_jsonl_and_parquet(tmp_path, chatml, caplog):
    a = _jsonl(tmp_path / "a.jsonl", [{"messages": _conversation(0)}, {"messages": _conversation(1, "y" * 50)}])
    b = tmp_path / "b.parquet"  # parquet fills tool_calls with None where a message has none
    rows = [{"messages": WITH_TOOLS[:3] + [{"role": "assistant", "content": None}]}, {"messages": _conversation(2)}]
    pq.write_table(pa.Table.from_pylist(rows), b)
    with caplog.at_level(logging.WARNING):
        ds = ChatDataset([a, b], chatml, max_length=40)
    assert (len(ds), ds.num_rows, ds.num_dropped) == (2, 4, 2) and "dropped 2 of 4" in caplog.text
    assert [s.index for s in ds] == [0, 1] and ds[1].origin.endswith("b.parquet:row 1")
    assert chatml.decode(ds[0].input_ids) == "<|im_start|>user\nq0<|im_end|>\n<|im_start|>assistant\nxxx<|im_end|>\n"
    assert _masked(chatml, ds[0].input_ids, ds[0].loss_mask) == "xxx<|im_end|>\n"

    tool_turns = ChatDataset(b, chatml)[0]  # None content: "" (a turn with only tool calls)
    assert _masked(chatml, tool_turns.input_ids, tool_turns.loss_mask) == CALL_TEXT + "<|im_end|>\n<|im_end|>\n"
    with pytest.raises(ValueError, match="b.parquet:row 0: no tools field 'tools'"):
        ChatDataset(b, chatml, tools_key="tools")
    with_tools = _jsonl(tmp_path / "t.jsonl", [{"messages": WITH_TOOLS, "tools": json.dumps(TOOLS)}])
    sample = ChatDataset(with_tools, chatml, tools_key="tools")[0]
    assert (sample.input_ids, sample.loss_mask) == render_chat(chatml, WITH_TOOLS, tools=TOOLS)


def test_chat_dataset_errors(tmp_path, chatml, char_tok):
    good = _jsonl(tmp_path / "g.jsonl", [{"messages": _conversation(0)}])
    with pytest.raises(ValueError, match=r"bad.jsonl:row 1: no messages field 'messages'.*messages_key"):
        ChatDataset(_jsonl(tmp_path / "bad.jsonl", [{"messages": _conversation(0)}, {"chat": []}]), chatml)
    with pytest.raises(ValueError, match=r"m.jsonl:row 0: messages\[1\] must be a dict with 'role' and 'content'"):
        ChatDataset(_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "a"}, "hi"]}]), chatml)
    with pytest.raises(ChatTemplateError, match=r"u.jsonl:row 0: no assistant message"):
        ChatDataset(_jsonl(tmp_path / "u.jsonl", [{"messages": _conversation(0)[:1]}]), chatml)
    with pytest.raises(ValueError, match=r"all 1 are longer than max_length=5 tokens \(26 to 26 tokens\); raise max_length"):
        ChatDataset(good, chatml, max_length=5)
    bare = build_char_tokenizer()
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template; set data.chat_template"):
        ChatDataset(good, bare)
    assert len(ChatDataset(good, bare, chat_template=char_tok.chat_template)) == 1


def test_collate_chat_aligns_the_mask_with_the_targets(tmp_path, chatml):
    rows = [{"messages": _conversation(0)}, {"messages": CONVERSATION}, {"messages": WITH_TOOLS}]
    ds = ChatDataset(_jsonl(tmp_path / "c.jsonl", rows), chatml)
    batch = collate_chat([ds[0], ds[1], ds[2]])
    lengths = [len(s.input_ids) for s in ds]
    assert batch["input_ids"].shape == (3, max(lengths)) and batch["loss_mask"].shape == (3, max(lengths) - 1)
    assert batch["loss_mask"].dtype == torch.float32 and batch["uid"] == [0, 1, 2]
    assert batch["prompt_lengths"].tolist() == [1, 1, 1]
    assert batch["response_lengths"].tolist() == [n - 1 for n in lengths]
    expected = ["xxx<|im_end|>\n", "4<|im_end|>\n6<|im_end|>\n", CALL_TEXT + "<|im_end|>\nit is 42<|im_end|>\n"]
    for row, n in enumerate(lengths):
        targets = batch["input_ids"][row, 1:n][batch["loss_mask"][row, : n - 1] == 1]
        assert chatml.decode(targets.tolist()) == expected[row]
        assert batch["input_ids"][row, n:].eq(0).all() and batch["loss_mask"][row, n - 1 :].eq(0).all()


def test_prompt_loader_batches_and_resumes_a_chat_dataset(tmp_path, chatml):
    ds = ChatDataset(_jsonl(tmp_path / "r.jsonl", [{"messages": _conversation(i, "a" * (i + 1))} for i in range(7)]),
                     chatml)
    full = PromptLoader(ds, batch_size=2, seed=3, collate_fn=collate_chat)
    expected = [full.next_batch() for _ in range(6)]
    assert set(expected[0]) == {"input_ids", "prompt_lengths", "response_lengths", "loss_mask", "uid"}
    first = PromptLoader(ds, batch_size=2, seed=3, collate_fn=collate_chat)
    got = [first.next_batch() for _ in range(4)]
    resumed = PromptLoader(ds, batch_size=2, seed=3, collate_fn=collate_chat)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.next_batch() for _ in range(2)]
    for a, b in zip(got, expected):
        assert a["uid"] == b["uid"] and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
