"""The generic loader: every source kind `datasets` reads, column mapping, prompt templates,
SFT masks on assistant turns (token by token), and errors that name the row and the column."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from arealite.dataset import DatasetFormatError, DatasetNotFoundError
from arealite.tasks import default_reward, get_custom_dataset, load_rows

ROWS = [{"question": f"{i}+{i}?", "solution": str(2 * i), "difficulty": i % 3} for i in range(12)]
MAPPING = {"prompt": "question", "answer": "solution"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _check_rows(ds, template_suffix=""):
    assert len(ds) == len(ROWS)
    for src, row in zip(ROWS, ds):
        assert row["messages"] == [{"role": "user", "content": src["question"] + template_suffix}]
        assert str(row["answer"]) == src["solution"]  # csv reads "4" as 4
        assert row["difficulty"] == src["difficulty"]  # other columns reach the reward
        # the user's own names reach the reward too (`columns: {answer: solution}`)
        assert row["solution"] == row["answer"] and row["question"] == src["question"]
        assert set(row) == {"messages", "answer", "difficulty", "query_id", "question", "solution"}
    assert len({r["query_id"] for r in ds}) == len(ROWS)


def _datasets_kinds(tmp_path) -> dict[str, str]:
    """The same rows as a jsonl, json, parquet, csv file, two save_to_disk folders and a folder
    in hub layout (data/train-*.parquet, read by `datasets.load_dataset(folder)`)."""
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    paths = {"jsonl": _write_jsonl(tmp_path / "d.jsonl", ROWS)}
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    paths["json"] = str(tmp_path / "d.json")
    ds.to_parquet(str(tmp_path / "d.parquet"))
    paths["parquet"] = str(tmp_path / "d.parquet")
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    paths["csv"] = str(tmp_path / "d.csv")
    ds.save_to_disk(str(tmp_path / "disk"))
    paths["save_to_disk"] = str(tmp_path / "disk")
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(
        str(tmp_path / "disk_dict")
    )
    paths["save_to_disk_dict"] = str(tmp_path / "disk_dict")
    (tmp_path / "hub" / "data").mkdir(parents=True)
    ds.to_parquet(str(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet"))
    ds.select(range(3)).to_parquet(str(tmp_path / "hub" / "data" / "test-00000-of-00001.parquet"))
    paths["hub_layout_folder"] = str(tmp_path / "hub")
    return paths


@pytest.mark.parametrize(
    "kind",
    ["jsonl", "json", "parquet", "csv", "save_to_disk", "save_to_disk_dict", "hub_layout_folder"],
)
def test_every_source_kind_loads_with_column_mapping(tmp_path, kind):
    path = _datasets_kinds(tmp_path)[kind]
    ds = get_custom_dataset(path, columns=MAPPING, prompt_template="{prompt} Think.")
    _check_rows(ds, " Think.")


HUB_ID_IN_CACHE = """
import json, sys
from arealite.tasks import get_custom_dataset
ds = get_custom_dataset("org/my_data", columns=json.loads(sys.argv[1]), prompt_template="{prompt} Think.")
print(json.dumps([dict(r) for r in ds]))
"""


def fake_datasets_cache(hf_home, repo_id: str, parquet: str) -> None:
    """`repo_id` in `datasets`' own cache under HF_HOME, as a first online `load_dataset(repo_id)`
    leaves it (<ns>___<name>/default/<version>/<hash>/ with arrow files + dataset_info.json)."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    ns, name = repo_id.split("/")
    cache = str(hf_home / "datasets")
    Parquet(
        cache_dir=cache, dataset_name=name, data_files={"train": parquet}, hash="0123abcd"
    ).download_and_prepare()
    ((config_dir,),) = [os.listdir(os.path.join(cache, name))]  # default-<hash of data_files>
    os.makedirs(os.path.join(cache, f"{ns}___{name}"))
    os.rename(
        os.path.join(cache, name, config_dir), os.path.join(cache, f"{ns}___{name}", "default")
    )


def load_in_child(env: dict) -> subprocess.CompletedProcess:
    """HUB_ID_IN_CACHE in a fresh interpreter with `env` (the hub's variables are read once)."""
    cmd = [sys.executable, "-c", HUB_ID_IN_CACHE, json.dumps(MAPPING)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_hub_id_loads_offline_from_the_datasets_cache(tmp_path):
    """A hub dataset id with HF_HUB_OFFLINE=1 reads the local cache (no network)."""
    parquet = _datasets_kinds(tmp_path)["parquet"]
    fake_datasets_cache(tmp_path / "home", "org/my_data", parquet)
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    p = load_in_child(env)
    assert p.returncode == 0, p.stderr[-3000:]
    _check_rows(json.loads(p.stdout.strip().splitlines()[-1]), " Think.")
    env["HF_HOME"] = str(tmp_path / "empty")  # not cached: fails naming the id
    p = load_in_child(env)
    assert p.returncode != 0 and "org/my_data" in p.stderr.splitlines()[-1], p.stderr[-3000:]


def test_splits_of_folders(tmp_path):
    paths = _datasets_kinds(tmp_path)
    assert len(get_custom_dataset(paths["save_to_disk_dict"], split="test", columns=MAPPING)) == 2
    assert len(get_custom_dataset(paths["hub_layout_folder"], split="test", columns=MAPPING)) == 3
    with pytest.raises(DatasetNotFoundError, match=r"splits \['test', 'train'\], not 'dev'"):
        get_custom_dataset(paths["save_to_disk_dict"], split="dev", columns=MAPPING)


def test_prompt_template_may_use_other_columns(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2", "unit": "apples", "answer": "4"}])
    ds = get_custom_dataset(path, prompt_template="{prompt} (in {unit}), \\boxed{{}}")
    assert ds[0]["messages"][0]["content"] == "2+2 (in apples), \\boxed{}"
    with pytest.raises(DatasetFormatError, match=r"row 0: prompt_template .*'colour'"):
        get_custom_dataset(path, prompt_template="{prompt} {colour}")


def test_first_reward_row_is_what_the_reward_receives(tmp_path):
    """Preflight calls the reward on this row: canonical and own column names both present."""
    from arealite.api.data_config import DatasetConfig
    from arealite.tasks import first_reward_row

    cfg = DatasetConfig(path=_write_jsonl(tmp_path / "r.jsonl", ROWS), columns=MAPPING)
    row = first_reward_row(cfg)
    assert row["answer"] == row["solution"] == "0" and row["question"] == "0+0?"
    assert row["messages"] == [{"role": "user", "content": "0+0?"}] and row["query_id"]
    arith = first_reward_row(DatasetConfig(path="arith", options={"size": 8}))
    assert arith["answer"] is not None and arith["messages"]


def test_messages_rows_drop_a_final_assistant_turn_for_rl(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
    ]
    path = _write_jsonl(tmp_path / "m.jsonl", [{"messages": chat, "answer": "2"}])
    assert get_custom_dataset(path)[0]["messages"] == chat[:2]


def test_bad_rows_name_the_row_and_column(tmp_path):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}, {"answer": "3"}]
    with pytest.raises(DatasetFormatError, match=r"row 2 has neither 'messages' nor 'prompt'"):
        get_custom_dataset(_write_jsonl(tmp_path / "a.jsonl", rows))
    rows = [{"messages": [{"role": "user", "content": "x"}]}, {"messages": [{"role": "user"}]}]
    with pytest.raises(DatasetFormatError, match=r"row 1 column 'messages' turn 0 needs"):
        get_custom_dataset(_write_jsonl(tmp_path / "b.jsonl", rows))
    with pytest.raises(DatasetFormatError, match=r"columns.prompt='q' but the data has no column"):
        get_custom_dataset(_write_jsonl(tmp_path / "c.jsonl", ROWS), columns={"prompt": "q"})
    with pytest.raises(DatasetFormatError, match="unsupported extension '.txt'"):
        (tmp_path / "d.txt").write_text("hello\n")
        get_custom_dataset(str(tmp_path / "d.txt"))
    with pytest.raises(DatasetNotFoundError, match="no such file or folder.*built-in tasks"):
        get_custom_dataset(str(tmp_path / "missing.jsonl"))


def test_sft_messages_loss_on_assistant_tokens_only(tmp_path, tokenizer):
    chat = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "and 3+4?"},
        {"role": "assistant", "content": "7 of them"},
    ]
    path = _write_jsonl(tmp_path / "sft.jsonl", [{"messages": chat}])
    row = get_custom_dataset(path, type="sft", tokenizer=tokenizer)[0]
    ids, mask = row["input_ids"], row["loss_mask"]
    # The full rendering of the chat, token by token, is what is trained on.
    full = tokenizer.apply_chat_template(chat, tokenize=False)
    assert tokenizer.decode(ids) == full
    trained = [tokenizer.decode([t for t, m in zip(ids, mask) if m])]
    im_end = "<|im_end|>\n"
    assert trained == ["3" + im_end + "7 of them" + im_end]
    # Each masked span is exactly one assistant turn (content + end-of-turn marker).
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans, cur = spans + [cur], []
    spans += [cur] if cur else []
    assert [tokenizer.decode(s) for s in spans] == ["3" + im_end, "7 of them" + im_end]
    for t, m in zip(ids, mask):  # no prompt or header token is trained on
        if tokenizer.decode([t]) in ("<|im_start|>", "user", "system", "assistant"):
            assert m == 0


def test_sft_prompt_completion_rows(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"q": "5+5=", "a": "10"}])
    row = get_custom_dataset(
        path, type="sft", tokenizer=tokenizer, columns={"prompt": "q", "completion": "a"}
    )[0]
    answer = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
    assert answer[-1] == tokenizer.eos_token_id and tokenizer.decode(answer[:-1]) == "10"
    with pytest.raises(DatasetFormatError, match="row 0: SFT needs 'messages' or 'prompt' \\+"):
        get_custom_dataset(path, type="sft", tokenizer=tokenizer, columns={"prompt": "q"})


def test_arith_test_split_is_capped_at_distinct_problems(caplog):
    with caplog.at_level(logging.WARNING, logger="arealite.dataset"):
        ds = get_custom_dataset("arith", split="test", size=200, max_digits=1, n_operands=3)
    prompts = [r["messages"][0]["content"] for r in ds]
    assert len(prompts) == len(set(prompts)) < 200
    assert f"only {len(prompts)} distinct problems exist" in caplog.text


def test_config_options_reach_the_builtin_task():
    from arealite.api.cli_args import DatasetConfig

    cfg = DatasetConfig(path="arith", options={"size": 10, "max_digits": 1, "n_operands": 2})
    rows = load_rows(cfg, 0, 1, "rl")
    assert len(rows) == 10 and all(len(r["messages"][0]["content"]) == 4 for r in rows)
    assert default_reward("arith") == "arith" and default_reward("openai/gsm8k") == "math_verify"
    assert default_reward("my.jsonl") is None
