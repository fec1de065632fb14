"""Datasets: GSM8K from local files, the synthetic arithmetic task, SFT masks, sharding, errors."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
from transformers import AutoTokenizer

from arealite.dataset import DatasetFormatError
from arealite.dataset.common import chat_prompt_ids
from arealite.tasks import get_custom_dataset
from arealite.tasks.arith import generate_arith_problems, generate_mixed_problems
from arealite.tasks.gsm8k import INSTRUCTION, write_synthetic_gsm8k_jsonl


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def gsm8k_jsonl(tmp_path_factory) -> str:
    return write_synthetic_gsm8k_jsonl(str(tmp_path_factory.mktemp("gsm8k") / "train.jsonl"), 40)


def _rows(ds) -> list[dict]:
    return [ds[i] for i in range(len(ds))]


# ----------------------------------------------------------------------------- GSM8K


def test_gsm8k_local_jsonl_rl_rows(gsm8k_jsonl):
    raw = [json.loads(line) for line in open(gsm8k_jsonl)]
    ds = get_custom_dataset("gsm8k", 0, 1, type="rl", source=gsm8k_jsonl)
    assert len(ds) == len(raw) == 40
    for src, row in zip(raw, _rows(ds)):
        assert row["messages"] == [{"role": "user", "content": src["question"] + INSTRUCTION}]
        assert row["answer"] == src["answer"].split("####")[-1].strip()
        assert row["answer"].lstrip("-").isdigit()
    assert len({r["query_id"] for r in _rows(ds)}) == 40


def test_synthetic_gsm8k_answers_are_right(gsm8k_jsonl):
    """The worked solutions' arithmetic must be correct, or the demo would teach nonsense."""
    for line in open(gsm8k_jsonl):
        row = json.loads(line)
        for expr, value in re.findall(r"<<([^=]+)=(-?\d+)>>", row["answer"]):
            assert eval(expr) == int(value), row  # digits and + - * only: safe here
        last_calc = re.findall(r"<<[^=]+=(-?\d+)>>", row["answer"])[-1]
        assert row["answer"].endswith(f"#### {last_calc}")


def test_gsm8k_sft_loss_mask_covers_only_the_answer(gsm8k_jsonl, tokenizer):
    raw = [json.loads(line) for line in open(gsm8k_jsonl)]
    ds = get_custom_dataset("gsm8k", 0, 1, type="sft", tokenizer=tokenizer, source=gsm8k_jsonl)
    for src, row in zip(raw[:10], _rows(ds)[:10]):
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(ids) == len(mask)
        prompt = chat_prompt_ids(
            tokenizer, [{"role": "user", "content": src["question"] + INSTRUCTION}]
        )
        n_prompt = len(prompt)
        assert ids[:n_prompt] == prompt
        assert mask[:n_prompt] == [0] * n_prompt and all(m == 1 for m in mask[n_prompt:])
        assert ids[-1] == tokenizer.eos_token_id
        answer_text = tokenizer.decode(ids[n_prompt:-1])
        final = src["answer"].split("####")[-1].strip()
        assert answer_text.endswith(f"\\boxed{{{final}}}.")
        assert "<<" not in answer_text and "####" not in answer_text


def test_gsm8k_directory_with_parquet_splits(tmp_path, gsm8k_jsonl):
    import datasets

    rows = [json.loads(line) for line in open(gsm8k_jsonl)]
    (tmp_path / "main").mkdir()
    datasets.Dataset.from_list(rows[:30]).to_parquet(str(tmp_path / "main" / "train-0.parquet"))
    datasets.Dataset.from_list(rows[30:]).to_parquet(str(tmp_path / "main" / "test-0.parquet"))
    train = get_custom_dataset("gsm8k", 0, 1, split="train", source=str(tmp_path))
    test = get_custom_dataset("gsm8k", 0, 1, split="test", source=str(tmp_path))
    assert (len(train), len(test)) == (30, 10)
    assert test[0]["messages"][0]["content"].startswith(rows[30]["question"])


def test_missing_field_error_names_row_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [{"question": "1+1?", "answer": "2 #### 2"}, {"question": "2+2?", "answer": None}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DatasetFormatError, match=r"row 1 is missing field 'answer'"):
        get_custom_dataset("gsm8k", 0, 1, source=str(path))
    path.write_text(json.dumps({"question": "q", "answer": "no final number"}) + "\n")
    with pytest.raises(DatasetFormatError, match=r"row 0 field 'answer' has no '####"):
        get_custom_dataset("gsm8k", 0, 1, source=str(path))


def test_max_length_drops_and_counts_long_prompts(gsm8k_jsonl, tokenizer, caplog):
    full = get_custom_dataset("gsm8k", 0, 1, type="rl", source=gsm8k_jsonl)
    lengths = [len(chat_prompt_ids(tokenizer, r["messages"])) for r in _rows(full)]
    limit = sorted(lengths)[len(lengths) // 2]
    expected_kept = sum(n <= limit for n in lengths)
    with caplog.at_level(logging.WARNING, logger="arealite.dataset"):
        ds = get_custom_dataset(
            "gsm8k", 0, 1, tokenizer=tokenizer, max_length=limit, source=gsm8k_jsonl
        )
    assert len(ds) == expected_kept < len(full)
    assert f"dropped {len(full) - expected_kept} of {len(full)}" in caplog.text
    assert all(len(chat_prompt_ids(tokenizer, r["messages"])) <= limit for r in _rows(ds))


def test_bad_arguments_fail_clearly(gsm8k_jsonl):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        get_custom_dataset(gsm8k_jsonl, 0, 1, type="sft")
    with pytest.raises(FileNotFoundError, match=r"'no/such-dataset' \(hub id.*built-in tasks"):
        get_custom_dataset("no/such-dataset", 0, 1)
    with pytest.raises(ValueError, match="'rl' or 'sft'"):
        get_custom_dataset(gsm8k_jsonl, 0, 1, type="dpo")
    with pytest.raises(ValueError, match="rank must be in"):
        get_custom_dataset(gsm8k_jsonl, 2, 2)
    with pytest.raises(TypeError, match="unknown options \\['batch_size'\\]"):
        get_custom_dataset("arith", 0, 1, batch_size=4)
    with pytest.raises(TypeError, match="not a built-in task, so options"):
        get_custom_dataset(gsm8k_jsonl, 0, 1, max_digits=4)


def test_gsm8k_hub_id_offline_error_points_to_local_files(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="local .jsonl/.parquet"):
        get_custom_dataset("gsm8k", 0, 1, source="openai/gsm8k-not-cached-anywhere")


# ----------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_partition_the_dataset(gsm8k_jsonl, world_size):
    full = [r["query_id"] for r in _rows(get_custom_dataset("gsm8k", 0, 1, source=gsm8k_jsonl))]
    shards = [
        [
            r["query_id"]
            for r in _rows(get_custom_dataset("gsm8k", rank, world_size, source=gsm8k_jsonl))
        ]
        for rank in range(world_size)
    ]
    assert sorted(sum(shards, [])) == sorted(full)  # union is everything, nothing twice
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_arith_shards_do_not_overlap():
    a = _rows(get_custom_dataset("arith", 0, 2, size=101, seed=3))
    b = _rows(get_custom_dataset("arith", 1, 2, size=101, seed=3))
    assert len(a) + len(b) == 101
    assert not {r["query_id"] for r in a} & {r["query_id"] for r in b}
    # Unique problems, so no question is seen by both ranks either.
    assert not {r["messages"][0]["content"] for r in a} & {r["messages"][0]["content"] for r in b}


# ----------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    "knobs",
    [
        dict(max_digits=1, n_operands=2, ops="+"),  # 100 problems: enumerated, repeats
        dict(max_digits=2, n_operands=2, ops="+"),  # 10^4 problems: enumerated
        dict(max_digits=3, n_operands=3, ops="+-*"),  # 9*10^9: sampled
    ],
)
def test_arith_train_and_test_never_overlap(knobs):
    train = {e for seed in (0, 1) for e, _ in generate_arith_problems(3000, seed, "train", **knobs)}
    test = {e for seed in (0, 7) for e, _ in generate_arith_problems(500, seed, "test", **knobs)}
    assert train and test and not train & test


def test_arith_rows_are_correct_and_seeded():
    ds = get_custom_dataset("arith", 0, 1, size=200, seed=5, max_digits=3, n_operands=3)
    rows = _rows(ds)
    for r in rows:
        expr = r["messages"][0]["content"]
        assert re.fullmatch(r"\d{1,3}(\+\d{1,3}){2}=", expr)
        assert int(r["answer"]) == eval(expr[:-1])  # generated digits and '+': safe here
    assert len({r["messages"][0]["content"] for r in rows}) == 200  # unique problems
    again = _rows(get_custom_dataset("arith", 0, 1, size=200, seed=5, max_digits=3, n_operands=3))
    other = _rows(get_custom_dataset("arith", 0, 1, size=200, seed=6, max_digits=3, n_operands=3))
    assert rows == again and rows != other
    mixed = generate_arith_problems(300, 0, "train", max_digits=2, n_operands=3, ops="+-*")
    assert all(v == eval(e) for e, v in mixed)
    assert any(v < 0 for _, v in mixed) and any("*" in e for e, _ in mixed)


def test_arith_sft_rows_are_short_and_mask_the_digits(tokenizer):
    ds = get_custom_dataset("arith", 0, 1, type="sft", tokenizer=tokenizer, size=50)
    for r in _rows(ds):
        ids, mask = r["input_ids"], r["loss_mask"]
        answer_ids = [t for t, m in zip(ids, mask) if m]
        assert answer_ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(answer_ids[:-1]).isdigit()
        assert mask == [0] * mask.index(1) + [1] * (len(mask) - mask.index(1))
        assert len(ids) <= 20  # short enough for a tiny model to learn quickly


def test_arith_follow_up_rows_are_two_turn_with_the_loss_on_the_second_answer(tokenizer):
    ds = get_custom_dataset(
        "arith",
        0,
        1,
        type="sft",
        tokenizer=tokenizer,
        size=200,
        max_digits=1,
        n_operands=3,
        follow_up=0.5,
    )
    two_turn = 0
    for r in _rows(ds):
        ids, mask = r["input_ids"], r["loss_mask"]
        prompt = tokenizer.decode(ids[: mask.index(1)])
        answer = int(tokenizer.decode([t for t, m in zip(ids, mask) if m][:-1]))
        turns = re.findall(r"user\n([\d+]+)=", prompt)
        if len(turns) == 2:  # "a+b+c=" -> its value, then "+k=" -> value + k
            two_turn += 1
            first = eval(turns[0])  # noqa: S307 - digits and '+' only
            assert f"assistant\n{first}" in prompt
            assert answer == first + int(turns[1])
        else:
            assert answer == eval(turns[0])  # noqa: S307
    assert 70 <= two_turn <= 130  # half, seeded
    with pytest.raises(ValueError, match="follow_up makes two-turn SFT rows"):
        get_custom_dataset("arith", 0, 1, type="rl", tokenizer=tokenizer, size=5, follow_up=0.5)
    with pytest.raises(ValueError, match="follow_up must be in"):
        get_custom_dataset("arith", 0, 1, type="sft", tokenizer=tokenizer, size=5, follow_up=2)


def test_arith_bad_knobs_fail_clearly():
    with pytest.raises(ValueError, match="ops"):
        generate_arith_problems(10, ops="/")
    with pytest.raises(ValueError, match="n_operands"):
        generate_arith_problems(10, n_operands=1)
    with pytest.raises(ValueError, match="split"):
        generate_arith_problems(10, split="dev")


def test_arith_rl_rows_load_into_a_dataloader():
    """The rows collate with torchdata's StatefulDataLoader (the trainers' loader)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = get_custom_dataset("arith", 0, 1, size=16)
    loader = StatefulDataLoader(ds, batch_size=4, collate_fn=lambda rows: rows)
    batch = next(iter(loader))
    assert len(batch) == 4 and set(batch[0]) == {"messages", "answer", "query_id"}
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest keeps tests off the hub


def test_empty_dataset_file_is_named(tmp_path):
    empty = tmp_path / "my_empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetFormatError, match="my_empty.jsonl.*empty"):
        get_custom_dataset(str(empty), 0, 1)


def test_too_long_rows_drop_or_fail(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    full = get_custom_dataset("arith", 0, 1, tokenizer=tok, size=20, n_operands=3)
    kept = get_custom_dataset("arith", 0, 1, tokenizer=tok, size=20, n_operands=3, max_length=10)
    assert len(kept) < len(full)  # every prompt is longer than 10 tokens with the template
    with pytest.raises(DatasetFormatError, match=r"row 0 has \d+ tokens, over max_length=10"):
        get_custom_dataset(
            "arith", 0, 1, tokenizer=tok, size=20, n_operands=3, max_length=10, too_long="fail"
        )


MIX = [{"n_operands": 2}, {}, {"max_digits": 2, "ops": "*", "n_operands": 2}]


def test_arith_mix_interleaves_tiers_and_caps_the_held_out_tiers():
    rows = _rows(get_custom_dataset("arith", 0, 1, size=31, max_digits=1, n_operands=3, mix=MIX))
    exprs = [r["messages"][0]["content"][:-1] for r in rows]
    shapes = [r"\d\+\d", r"\d\+\d\+\d", r"\d{1,2}\*\d{1,2}"]  # easy, the defaults, hard
    assert len(exprs) == 31
    for i, e in enumerate(exprs):  # round-robin: every batch sees every tier
        assert re.fullmatch(shapes[i % 3], e), (i, e)
    assert all(int(r["answer"]) == eval(r["messages"][0]["content"][:-1]) for r in rows)
    test = generate_mixed_problems(
        300, 0, "test", dict(max_digits=1, n_operands=3, ops="+"), MIX, 0.2
    )
    easy = [e for e, _ in test if re.fullmatch(shapes[0], e)]
    assert len(easy) == len(set(easy)) < 100  # only ~20 distinct two-digit sums are held out
    assert len(test) == len(set(test)) == len(easy) + 200


def test_arith_mix_bad_tiers_fail_naming_the_tier():
    with pytest.raises(ValueError, match=r"mix\[1\]: unknown knob\(s\) \['digits'\]"):
        get_custom_dataset("arith", 0, 1, size=4, mix=[{}, {"digits": 2}])
    with pytest.raises(ValueError, match="mix must be a list of tiers"):
        get_custom_dataset("arith", 0, 1, size=4, mix={"n_operands": 2})
    with pytest.raises(ValueError, match="n_operands"):
        get_custom_dataset("arith", 0, 1, size=4, mix=[{"n_operands": 1}])
    with pytest.raises(ValueError, match="size=2 is smaller than the 3 tiers"):
        get_custom_dataset("arith", 0, 1, size=2, mix=MIX)
