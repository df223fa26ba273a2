import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megarl.data.dataset import PromptDataset, collate_prompts
from megarl.data.io import get_field, read_records, write_records


def _rows(n, start=0, source="openai/gsm8k"):
    return [
        {
            "data_source": source,
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i},
        }
        for i in range(start, start + n)
    ]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_with_chat_template(tmp_path, char_tokenizer):
    a = _jsonl(tmp_path / "a.jsonl", _rows(3))
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(2, start=3, source="math")), b)
    ds = PromptDataset([a, b], char_tokenizer)
    assert len(ds) == 5 and ds.num_dropped == 0
    assert [s.ground_truth for s in ds] == ["0", "1", "2", "3", "4"]
    assert [s.data_source for s in ds] == ["openai/gsm8k"] * 3 + ["math"] * 2
    assert [s.index for s in ds] == [0, 1, 2, 3, 4]
    assert ds[3].extra_info == {"index": 3}
    assert ds[4].text == "<system>be brief\n<user>q4?\n<assistant>"
    assert ds[4].input_ids == char_tokenizer.encode(ds[4].text, add_special_tokens=False)
    assert ds[0].origin.endswith("a.jsonl:row 0")


def test_string_prompts_and_a_plain_template_with_sentencepiece(tmp_path, sp_tokenizer):
    rows = [{"question": "what is 3+4?", "answer": "7"}, {"question": "the fox", "answer": "dog"}]
    path = _jsonl(tmp_path / "q.jsonl", rows)
    ds = PromptDataset(
        path, sp_tokenizer, prompt_key="question", ground_truth_key="answer",
        default_data_source="exact_match", prompt_template="question: {prompt} answer:",
    )
    assert ds[0].text == "question: what is 3+4? answer:"
    assert ds[0].input_ids == [sp_tokenizer.bos_id()] + sp_tokenizer.EncodeAsIds(ds[0].text)
    assert [s.data_source for s in ds] == ["exact_match", "exact_match"]
    assert ds.pad_token_id == 0
    # messages through a plain template: {prompt} is the user text, {system} the system text
    ds = PromptDataset(_jsonl(tmp_path / "m.jsonl", _rows(1)), sp_tokenizer, prompt_template="{system}|{prompt}")
    assert ds[0].text == "be brief|q0?"


def test_sentencepiece_without_template_fails_early(tmp_path, sp_tokenizer, char_tokenizer):
    path = _jsonl(tmp_path / "q.jsonl", _rows(1))
    with pytest.raises(ValueError, match="prompt_template="):
        PromptDataset(path, sp_tokenizer)
    with pytest.raises(ValueError, match=r"must contain '\{prompt\}'"):
        PromptDataset(path, sp_tokenizer, prompt_template="Q: {question}")
    saved = char_tokenizer.chat_template
    char_tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="has no chat template"):
            PromptDataset(path, char_tokenizer)
        ds = PromptDataset(path, char_tokenizer, chat_template="{{ messages[-1]['content'] }}=>")
        assert ds[0].text == "q0?=>"
    finally:
        char_tokenizer.chat_template = saved


def test_long_prompts_are_dropped_counted_and_logged(tmp_path, char_tokenizer, caplog):
    rows = [{"prompt": "x" * n, "gt": str(n), "data_source": "s"} for n in (2, 30, 5, 40)]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="megarl.data.dataset"):
        ds = PromptDataset(path, char_tokenizer, ground_truth_key="gt", max_prompt_length=25)
    # "<user>" + text + "\n<assistant>" adds 18 tokens: 20, 48, 23, 58
    assert [s.ground_truth for s in ds] == ["2", "5"]
    assert ds.num_dropped == 2 and ds.num_rows == 4
    assert any("dropped 2 of 4 prompts longer than max_prompt_length=25" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"all 4 are longer than max_prompt_length=10 tokens \(the shortest has 20\)"):
        PromptDataset(path, char_tokenizer, ground_truth_key="gt", max_prompt_length=10)


def test_bad_input_names_the_file_and_the_fix(tmp_path, char_tokenizer):
    good = _jsonl(tmp_path / "good.jsonl", _rows(2))
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        PromptDataset([good, tmp_path / "missing.parquet"], char_tokenizer)
    with pytest.raises(ValueError, match=r"bad.jsonl:row 1: no prompt field 'prompt' .*set prompt_key"):
        PromptDataset(_jsonl(tmp_path / "bad.jsonl", _rows(1) + [{"question": "x", "data_source": "s"}]), char_tokenizer)
    with pytest.raises(ValueError, match=r"no ground-truth field 'reward_model.answer'.*ground_truth_key"):
        PromptDataset(good, char_tokenizer, ground_truth_key="reward_model.answer")
    with pytest.raises(ValueError, match=r"no data source field 'data_source'.*default_data_source"):
        PromptDataset(_jsonl(tmp_path / "nods.jsonl", [{"prompt": "hi", "gt": "1"}]), char_tokenizer, ground_truth_key="gt")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl' has no rows"):
        PromptDataset(empty, char_tokenizer)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(_rows(1)[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not valid JSON"):
        PromptDataset(broken, char_tokenizer)
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported data file type '.csv'"):
        PromptDataset(csv, char_tokenizer)
    with pytest.raises(ValueError, match="must be a string or a non-empty list"):
        PromptDataset(_jsonl(tmp_path / "n.jsonl", [{"prompt": 5, "data_source": "s"}]), char_tokenizer, ground_truth_key=None)
    with pytest.raises(ValueError, match="no data files"):
        PromptDataset([], char_tokenizer)
    with pytest.raises(ValueError, match=r"blank.jsonl:row 0: the prompt '' tokenizes to no tokens; check the tokenizer"):
        PromptDataset(_jsonl(tmp_path / "blank.jsonl", [{"prompt": "", "data_source": "s"}]), char_tokenizer,
                      ground_truth_key=None, prompt_template="{prompt}")


def test_io_roundtrip_and_dotted_fields(tmp_path):
    rows = _rows(2)
    for name in ("r.jsonl", "r.parquet"):
        assert write_records(rows, tmp_path / name) == 2
        assert read_records(tmp_path / name) == rows
    assert get_field({"a": {"b": {"c": 1}}}, "a.b.c") == 1
    assert get_field({"a.b": 2, "a": {"b": 3}}, "a.b") == 2  # a literal dotted key wins
    with pytest.raises(KeyError):
        get_field({"a": {"b": 1}}, "a.c")


def test_collate_left_pads(tmp_path, char_tokenizer):
    rows = [{"prompt": p, "data_source": "s", "gt": p} for p in ("ab", "abcd")]
    ds = PromptDataset(_jsonl(tmp_path / "c.jsonl", rows), char_tokenizer, ground_truth_key="gt", prompt_template="{prompt}")
    batch = collate_prompts([ds[0], ds[1]], pad_token_id=0)
    a, b = char_tokenizer.encode("ab"), char_tokenizer.encode("abcd")
    assert batch["input_ids"].tolist() == [[0, 0] + a, b]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert batch["prompt_ids"] == [a, b]
    assert batch["ground_truth"] == ["ab", "abcd"] and batch["data_source"] == ["s", "s"]
    assert batch["index"] == [0, 1] and batch["input_ids"].dtype == torch.long
