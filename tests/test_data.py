"""Prompt data: JSONL / Parquet / built-in records, chat templates, dotted answer keys, overlong prompts dropped or
refused, error messages that name the file, record, key and fix, and the seeded, resumable epoch stream."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data import DataError, Prompt, PromptDataset, PromptSampler, check_files, read_records
from megarl.models.tiny import save_byte_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = save_byte_tokenizer(str(tmp_path_factory.mktemp("tok")))
    tok.chat_template = None  # plain text only (the byte tokenizer has a template of its own)
    return tok


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = str(tmp_path_factory.mktemp("chat_tok"))
    tok = save_byte_tokenizer(out)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)  # the template survives saving, as a run would load it


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _load(files, tokenizer, **kw):
    args = dict(prompt_key="prompt", answer_key="", max_prompt_length=64, on_overlong="drop")
    return PromptDataset.from_files(files, tokenizer=tokenizer, **{**args, **kw})


def _message(excinfo) -> str:
    return str(excinfo.value)


# ---- reading -----------------------------------------------------------------------------------------------------


def test_jsonl_and_parquet_round_trip(tmp_path, tokenizer):
    rows = [{"prompt": f"question {i}", "answer": str(i), "meta": {"id": i}} for i in range(5)]
    jsonl = _write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_records(jsonl) == rows == read_records(str(tmp_path / "d.parquet"))
    a = _load([jsonl], tokenizer, answer_key="answer")
    b = _load([str(tmp_path / "d.parquet")], tokenizer, answer_key="answer")
    assert [vars(p) for p in a.prompts] == [vars(p) for p in b.prompts]
    assert a[2] == Prompt(
        index=2,
        prompt_ids=tokenizer("question 2", add_special_tokens=False)["input_ids"],
        prompt_text="question 2",
        ground_truth="2",
        extras={"answer": "2", "meta": {"id": 2}},
        source="question 2",
    )
    assert len(a[2].prompt_ids) == len("question 2")  # byte-level, no BOS added


def test_several_files_are_concatenated_in_order(tmp_path, tokenizer):
    first = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a0"}, {"prompt": "a1"}])
    second = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b0"}])
    ds = _load([first, second], tokenizer)
    assert [(p.index, p.prompt_text) for p in ds.prompts] == [(0, "a0"), (1, "a1"), (2, "b0")]


def test_blank_lines_a_bom_and_a_json_array(tmp_path):
    (tmp_path / "d.jsonl").write_text('\ufeff{"prompt": "a"}\n\n{"prompt": "b"}\n', encoding="utf-8")
    assert read_records(str(tmp_path / "d.jsonl")) == [{"prompt": "a"}, {"prompt": "b"}]
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2))
    assert read_records(str(tmp_path / "d.json")) == [{"prompt": "a"}, {"prompt": "b"}]


def test_builtin_digits_loads(tokenizer):
    ds = _load(["builtin:digits"], tokenizer, answer_key="answer")
    assert len(ds) == 2048 and ds.dropped == 0
    assert ds[0].prompt_text.endswith(f" {ds[0].ground_truth}:") and ds[0].ground_truth in "0123456789"
    assert len(read_records("builtin:digits", "val")) == 64
    assert read_records("builtin:digits") == read_records("builtin:digits", "train")  # seeded: same every time


def test_builtin_dm_math_is_seeded_disjoint_and_leaves_the_global_rngs_alone(chat_tokenizer):
    import random

    import numpy as np

    from megarl.data.builtin import DM_MATH_INSTRUCTION, _dm_math_splits
    from megarl.rewards.math_verify_reward import math_score

    name = "builtin:dm_math/arithmetic__add_or_sub"
    _dm_math_splits.cache_clear()
    random.seed(7), np.random.seed(7)
    expected = random.random(), float(np.random.rand())
    random.seed(7), np.random.seed(7)
    train, val = read_records(name, "train"), read_records(name, "val")
    assert (random.random(), float(np.random.rand())) == expected  # the generator's draws restored what was there
    questions = lambda records: [r["prompt"][0]["content"] for r in records]  # noqa: E731
    assert len(set(questions(train))) == len(train) == 2048 and len(set(questions(val))) == len(val) == 128
    assert not set(questions(train)) & set(questions(val))  # validation never seen in training
    _dm_math_splits.cache_clear()
    assert read_records(name + ":easy@0", "val") == val  # the defaults, drawn again: the same questions
    assert read_records(name + "@1", "val") != val
    assert all(q.endswith(DM_MATH_INSTRUCTION) for q in questions(val))
    assert all(math_score(r["answer"], r["answer"]) == 1.0 for r in val[:16])  # every answer is Math-Verify's to read
    ds = _load([name], chat_tokenizer, answer_key="answer")
    rendered = {f"<user>{r['prompt'][0]['content']}<assistant>": r["answer"] for r in train}
    assert len(ds) > 0 and all(rendered[p.prompt_text] == p.ground_truth for p in ds)  # chat prompts, their answers


def test_builtin_dm_math_draws_the_same_questions_in_every_process():
    """Its symbols come from a set of letters whose order follows PYTHONHASHSEED (another in every process) unless
    megarl.compat.dm_math sorts them: two processes with other hash seeds must draw the same equations."""
    import subprocess
    import sys

    code = ("import json; from megarl.compat.dm_math import modules; from megarl.data.builtin import _draw; "
            "g = modules().train(lambda r: r)['algebra']['linear_1d']; "
            "print(json.dumps(_draw(g, 32, 0, set())))")  # fmt: skip
    drawn = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                            capture_output=True, text=True, check=True).stdout for seed in ("1", "2")]  # fmt: skip
    assert drawn[0] == drawn[1] and len(json.loads(drawn[0])) == 32


@pytest.mark.parametrize(
    "name, message",
    [
        ("builtin:dm_math/arithmetic__nope", "unknown dm_math module 'arithmetic__nope'; choose one of ["),
        ("builtin:dm_math/algebra__linear_1d_composed", "composed modules draw differently in every process"),
        ("builtin:dm_math/arithmetic__mul:tough", "difficulty must be one of ['any', 'easy', 'hard', 'medium']"),
        ("builtin:dm_math/arithmetic__mul@x", "the seed after @ must be a non-negative integer"),
        ("builtin:dmmath", "unknown built-in dataset 'builtin:dmmath'"),
    ],
)
def test_builtin_names_that_do_not_exist_are_refused_in_one_line(name, message):
    with pytest.raises((DataError, ValueError)) as e:
        read_records(name, "train")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_from_records_names_its_source(tokenizer):
    ds = PromptDataset.from_records(
        [{"prompt": "hi", "answer": 1}],
        tokenizer=tokenizer,
        prompt_key="prompt",
        answer_key="answer",
        max_prompt_length=8,
        on_overlong="drop",
    )
    assert len(ds) == 1 and ds[0].ground_truth == 1 and ds[0].prompt_text == "hi"
    with pytest.raises(DataError, match=r"^inline, record 1: no field 'prompt'"):
        PromptDataset.from_records(
            [{"q": "hi"}],
            tokenizer=tokenizer,
            prompt_key="prompt",
            answer_key="",
            max_prompt_length=8,
            on_overlong="drop",
            source="inline",
        )


# ---- chat messages and keys --------------------------------------------------------------------------------------


def test_chat_message_prompts_through_the_template(tmp_path, chat_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    pq.write_table(pa.Table.from_pylist([{"prompt": messages, "answer": "4"}]), tmp_path / "chat.parquet")
    ds = _load([str(tmp_path / "chat.parquet")], chat_tokenizer, answer_key="answer")
    text = "<system>Be brief.<user>2+2?<assistant>"
    assert ds[0].prompt_text == text
    assert ds[0].prompt_ids == chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ds[0].extras == {"answer": "4"}


def test_chat_messages_without_a_template_name_the_fix(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError) as e:
        _load([path], tokenizer)
    assert f"{path}, record 1: the prompt is a list of chat messages but the tokenizer has no chat template" in (
        _message(e)
    )
    assert "plain-text prompts" in _message(e)


def test_a_prompt_of_the_wrong_type(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "n.jsonl", [{"prompt": "ok"}, {"prompt": 7}])
    with pytest.raises(DataError, match=r"n\.jsonl, record 2: a prompt must be a string or a non-empty list"):
        _load([path], tokenizer)


def test_dotted_answer_key(tmp_path, tokenizer):
    rows = [{"prompt": "2+2?", "reward_model": {"ground_truth": "4", "style": "rule"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "nested.parquet")
    ds = _load([str(tmp_path / "nested.parquet")], tokenizer, answer_key="reward_model.ground_truth")
    assert ds[0].ground_truth == "4" and ds[0].extras == {"reward_model": {"ground_truth": "4", "style": "rule"}}
    with pytest.raises(DataError) as e:
        _load([str(tmp_path / "nested.parquet")], tokenizer, answer_key="reward_model.answer")
    assert "no field 'reward_model.answer' (fields of reward_model: ['ground_truth', 'style'])" in _message(e)


def test_no_answer_key_means_no_ground_truth(tmp_path, tokenizer):
    ds = _load([_write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "1"}])], tokenizer, answer_key="")
    assert ds[0].ground_truth is None and ds[0].extras == {"answer": "1"}


# ---- errors ------------------------------------------------------------------------------------------------------


def test_missing_file(tmp_path, tokenizer):
    missing = str(tmp_path / "no_such.jsonl")
    with pytest.raises(DataError) as e:
        read_records(missing)
    assert _message(e) == (
        f"data file not found: {missing}; set data.train_files / data.val_files to existing JSONL or Parquet files"
    )
    with pytest.raises(DataError, match="data file not found"):
        _load([missing], tokenizer)
    with pytest.raises(DataError, match="data file not found"):
        check_files([missing], "prompt", "")


def test_unsupported_format_names_the_supported_ones(tmp_path):
    (tmp_path / "d.csv").write_text("prompt\nhi\n")
    with pytest.raises(DataError) as e:
        read_records(str(tmp_path / "d.csv"))
    assert "d.csv: unsupported format" in _message(e)
    assert all(ext in _message(e) for ext in (".jsonl", ".json", ".parquet", "builtin:NAME"))


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{oops\n')
    with pytest.raises(DataError, match=rf"^{path}:3: not a JSON object \(.*\); write one JSON object per line"):
        read_records(str(path))
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=rf"^{path}:2: a list, not a JSON object"):
        read_records(str(path))


def test_corrupt_parquet(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"d\.parquet: not a readable Parquet file"):
        read_records(str(tmp_path / "d.parquet"))


def test_missing_prompt_key_names_file_record_keys_and_option(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "ok"}, {"question": "a", "answer": "1"}])
    with pytest.raises(DataError) as e:
        _load([path], tokenizer)
    assert _message(e) == (
        f"{path}, record 2: no field 'prompt' (fields: ['answer', 'question']); set data.prompt_key=<one of them>"
    )


def test_missing_answer_key_names_the_option(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a", "solution": "1"}])
    with pytest.raises(DataError) as e:
        _load([path], tokenizer, answer_key="answer")
    assert f"{path}, record 1: no field 'answer' (fields: ['prompt', 'solution']); set data.answer_key=" in (
        _message(e)
    )


def test_unknown_builtin_and_split():
    with pytest.raises(DataError, match=r"unknown built-in dataset 'builtin:nope'; choose one of \['builtin:digits'"):
        read_records("builtin:nope")
    with pytest.raises(DataError, match="builtin:digits: no split 'test'"):
        read_records("builtin:digits", "test")


# ---- overlong prompts --------------------------------------------------------------------------------------------


def test_overlong_prompts_dropped_and_counted(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * n} for n in (4, 40, 10, 11, 8)])
    ds = _load([path], tokenizer, max_prompt_length=10)
    assert ds.dropped == 2 and [len(p.prompt_ids) for p in ds.prompts] == [4, 10, 8]
    assert [p.index for p in ds.prompts] == [0, 1, 2]  # positions in the kept dataset


def test_overlong_prompt_refused_names_record_length_limit_and_fixes(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * n} for n in (4, 40)])
    with pytest.raises(DataError) as e:
        _load([path], tokenizer, max_prompt_length=10, on_overlong="error")
    assert _message(e) == (
        f"{path}, record 2: the prompt has 40 tokens > data.max_prompt_length=10; raise data.max_prompt_length "
        "or set data.on_overlong=drop"
    )


def test_nothing_left_after_filtering(tmp_path, tokenizer):
    long_only = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 20}])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"no usable prompts in .*long\.jsonl.*empty\.jsonl.* \(1 dropped as longer"):
        _load([long_only, str(empty)], tokenizer, max_prompt_length=10)
    ds = _load([long_only, str(empty), _write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "ok"}])], tokenizer,
               max_prompt_length=10)  # fmt: skip
    assert len(ds) == 1 and ds.dropped == 1  # one file emptied by the filter is fine when others have prompts


# ---- check_files -------------------------------------------------------------------------------------------------


def test_check_files_reads_every_record_or_the_first_n(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2"}\n{this line is broken\n')
    with pytest.raises(DataError) as e:
        check_files([str(path)], "prompt", "answer")  # data.check=full, the default
    assert _message(e).startswith(f"{path}:4: not a JSON object (")
    assert check_files([str(path)], "prompt", "answer", check="first:2") == 3  # three records (lines counted)
    assert check_files([str(path)], "prompt", "answer", check="off") is None
    (tmp_path / "no_answer.jsonl").write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(DataError, match=r"no_answer.jsonl:2: no field 'answer'"):
        check_files([str(tmp_path / "no_answer.jsonl")], "prompt", "answer")
    with pytest.raises(DataError, match="data file not found"):
        check_files([str(tmp_path / "missing.jsonl")], "prompt", "", check="off")
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "rm": {"gt": "1"}}] * 3
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert check_files([str(tmp_path / "d.parquet"), "builtin:digits"], "prompt", "") == 3 + 2048
    assert check_files([str(tmp_path / "d.parquet")], "prompt", "rm.gt", check="first:1") == 3


def test_check_files_errors(tmp_path):
    path = _write_jsonl(tmp_path / "q.jsonl", [{"question": "a", "answer": "1"}])
    with pytest.raises(DataError) as e:
        check_files([path], "prompt", "")
    assert f"{path}:1: no field 'prompt' (fields: ['answer', 'question']); set data.prompt_key=" in (
        _message(e)
    )
    with pytest.raises(DataError, match=r"no field 'solution' .*set data\.answer_key="):
        check_files([path], "question", "solution")
    with pytest.raises(DataError, match="builtin:digits, record 1: no field 'answer.value'"):
        check_files(["builtin:digits"], "prompt", "answer.value")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl holds no records"):
        check_files([str(tmp_path / "empty.jsonl")], "prompt", "")
    with pytest.raises(DataError, match="a prompt must be a string"):
        check_files([_write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"text": "hi"}]}])], "prompt", "")


# ---- sampler -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ten(tmp_path_factory, tokenizer):
    path = _write_jsonl(tmp_path_factory.mktemp("ten") / "d.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    return _load([path], tokenizer)


def _indices(prompts):
    return [p.index for p in prompts]


def test_sampler_same_seed_same_order(ten):
    first = _indices(PromptSampler(ten, seed=3, shuffle=True).take(10))
    assert first == _indices(PromptSampler(ten, seed=3, shuffle=True).take(10))
    assert sorted(first) == list(range(10)) and first != list(range(10))
    assert first != _indices(PromptSampler(ten, seed=4, shuffle=True).take(10))


def test_sampler_epochs_are_distinct_permutations_and_no_epoch_repeats_another_seed(ten):
    """Epoch e of seed s is not epoch 0 of seed s + e (it was: both were seeded s + e), so runs with nearby seeds do
    not replay each other's data order one epoch later."""
    sampler = PromptSampler(ten, seed=3, shuffle=True)
    epochs = [_indices(sampler.take(10)) for _ in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3 and sampler.epoch == 2
    for e in (1, 2):
        assert epochs[e] != _indices(PromptSampler(ten, seed=3 + e, shuffle=True).take(10))
    assert _indices(PromptSampler(ten, seed=3, shuffle=False).take(12)) == list(range(10)) + [0, 1]


def test_take_crosses_epoch_boundaries(ten):
    whole = _indices(PromptSampler(ten, seed=5, shuffle=True).take(30))  # three epochs in one call
    sampler = PromptSampler(ten, seed=5, shuffle=True)
    parts = [_indices(sampler.take(k)) for k in (7, 6, 0, 17)]
    assert [len(p) for p in parts] == [7, 6, 0, 17] and sum(parts, []) == whole
    assert sampler.state_dict() == {"epoch": 2, "position": 10}
    assert sampler.epoch == 2 and sorted(whole[10:20]) == list(range(10))


def test_state_dict_restores_the_stream_exactly(ten):
    reference = PromptSampler(ten, seed=3, shuffle=True)
    reference.take(7)
    saved = reference.state_dict()
    assert saved == {"epoch": 0, "position": 7}
    expected = _indices(reference.take(25))  # the rest of epoch 0, all of epoch 1, part of epoch 2
    restored = PromptSampler(ten, seed=3, shuffle=True)
    restored.load_state_dict(json.loads(json.dumps(saved)))  # a checkpoint stores it as JSON
    assert _indices(restored.take(25)) == expected
    assert restored.state_dict() == reference.state_dict() == {"epoch": 3, "position": 2}


def test_state_that_does_not_fit_the_dataset(ten):
    with pytest.raises(ValueError, match="does not fit a dataset of 10 prompts"):
        PromptSampler(ten, seed=0, shuffle=True).load_state_dict({"epoch": 1, "position": 11})
