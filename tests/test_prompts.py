"""Prompt data: JSONL / Parquet / built-in records, chat templates, dotted answer keys, overlong handling, errors
that name the file and key, and the seeded epoch stream with a saveable position."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import DataError, PromptDataset, PromptSampler, check_files, read_records
from megarl.models.tiny import save_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = save_byte_tokenizer(str(tmp_path_factory.mktemp("tok")))
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    return tok


def _load(files, tokenizer, **kw):
    args = dict(prompt_key="prompt", answer_key="", max_prompt_length=64, on_overlong="drop")
    return PromptDataset.from_files(files, tokenizer=tokenizer, **{**args, **kw})


def test_jsonl_and_parquet_give_the_same_prompts(tmp_path, tokenizer):
    rows = [{"prompt": f"question {i}", "answer": str(i), "id": i} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    a = _load([str(tmp_path / "d.jsonl")], tokenizer, answer_key="answer")
    b = _load([str(tmp_path / "d.parquet")], tokenizer, answer_key="answer")
    assert [p.prompt_ids for p in a.prompts] == [p.prompt_ids for p in b.prompts]
    assert a[2].prompt_text == "question 2" and a[2].ground_truth == "2" and a[2].extras == {"answer": "2", "id": 2}
    assert a[0].prompt_ids == tokenizer("question 0", add_special_tokens=False)["input_ids"]


def test_chat_messages_and_dotted_answer_key(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    ds = _load([str(tmp_path / "chat.parquet")], tokenizer, answer_key="reward_model.ground_truth")
    assert ds[0].prompt_text == "<user>2+2?<assistant>" and ds[0].ground_truth == "4"


def test_chat_messages_without_a_template(tmp_path):
    plain = save_byte_tokenizer(str(tmp_path / "plain"))
    (tmp_path / "c.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DataError, match="record 1: the prompt is a list of chat messages but the tokenizer has no"):
        _load([str(tmp_path / "c.jsonl")], plain)


def test_overlong_prompts_are_dropped_and_counted_or_refused(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": "x" * n}) + "\n" for n in (4, 40, 8, 50)))
    ds = _load([str(tmp_path / "d.jsonl")], tokenizer, max_prompt_length=10)
    assert len(ds) == 2 and ds.dropped == 2
    with pytest.raises(DataError, match=r"record 2: the prompt has 40 tokens > data.max_prompt_length=10"):
        _load([str(tmp_path / "d.jsonl")], tokenizer, max_prompt_length=10, on_overlong="error")


def test_errors_name_the_file_and_the_fix(tmp_path, tokenizer):
    with pytest.raises(DataError, match="data file not found: /no/such.jsonl; set data.train_files"):
        read_records("/no/such.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a JSON object"):
        read_records(str(tmp_path / "bad.jsonl"))
    (tmp_path / "d.csv").write_text("prompt\n")
    with pytest.raises(DataError, match="unsupported format"):
        read_records(str(tmp_path / "d.csv"))
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "a", "answer": "1"}) + "\n")
    with pytest.raises(DataError, match=r"record 1: no field 'prompt' \(fields: \['answer', 'question'\]\); set data"
                                        r"\.prompt_key"):  # fmt: skip
        check_files([str(tmp_path / "q.jsonl")], "prompt", "")
    with pytest.raises(DataError, match="no field 'solution'.*set data.answer_key"):
        check_files([str(tmp_path / "q.jsonl")], "question", "solution")
    with pytest.raises(DataError, match="unknown built-in dataset 'builtin:nope'"):
        read_records("builtin:nope")


def test_builtin_digits(tokenizer):
    ds = _load(["builtin:digits"], tokenizer, answer_key="answer")
    assert len(ds) == 2048 and ds[0].prompt_text.endswith(f"{ds[0].ground_truth}:")
    assert len(read_records("builtin:digits", "val")) == 64


def test_sampler_epochs_are_seeded_and_resumable(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(10)))
    ds = _load([str(tmp_path / "d.jsonl")], tokenizer)
    a, b = PromptSampler(ds, seed=3), PromptSampler(ds, seed=3)
    first = [p.index for p in a.take(10)]
    assert first == [p.index for p in b.take(10)] and sorted(first) == list(range(10))
    second = [p.index for p in a.take(10)]
    assert sorted(second) == list(range(10)) and second != first and a.epoch == 1
    crossing = PromptSampler(ds, seed=3)
    crossing.take(7)
    saved = crossing.state_dict()
    assert saved == {"epoch": 0, "position": 7}
    rest = [p.index for p in crossing.take(6)]  # 3 of epoch 0, then 3 of epoch 1
    restored = PromptSampler(ds, seed=3)
    restored.load_state_dict(saved)
    assert [p.index for p in restored.take(6)] == rest == first[7:] + second[:3]
    assert [p.index for p in PromptSampler(ds, seed=3, shuffle=False).take(12)] == list(range(10)) + [0, 1]
