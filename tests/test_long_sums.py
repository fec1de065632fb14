"""The long_sums task (long, long-tailed worked answers), its reward, and the metrics that show
the regime: output lengths, off-policy token share, resumed sequences, server occupancy."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoTokenizer

from arealite.api.reward_api import RewardInput
from arealite.engine.ppo.update_stats import regime_stats
from arealite.inference.remote_base import parse_server_load
from arealite.server.metrics import ServerMetrics
from arealite.tasks import get_custom_dataset
from arealite.tasks.long_sums import (
    generate_problems,
    long_sums_reward_fn,
    prompt_text,
    scratchpad,
    term_count_weights,
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("pad", ["down", "up"])
def test_scratchpad_is_worked_line_by_line_and_ends_with_the_total(pad):
    assert prompt_text(37, 7, 3) == "37+7*3"
    want = {
        "down": "3: 37+7=44\n2: 44+7=51\n1: 51+7=58\n#### 58",
        "up": "1: 37+7=44\n2: 44+7=51\n3: 51+7=58\n#### 58",
    }
    assert scratchpad(37, 7, 3, pad) == want[pad]
    for start, digit, terms in generate_problems(300, seed=4):
        lines = scratchpad(start, digit, terms, pad).split("\n")
        assert len(lines) == terms + 1  # one line per partial sum, then the answer
        assert lines[-1] == f"#### {start + digit * terms}"
        for i, line in enumerate(lines[:-1], 1):
            count, work = line.split(": ")
            left, total = work.split("=")
            a, b = left.split("+")
            assert int(count) == (terms + 1 - i if pad == "down" else i)
            assert int(b) == digit and int(a) + digit == int(total)


def test_the_sft_rows_follow_the_pad_option_and_a_bad_one_is_named(tokenizer):
    down, up = (
        get_custom_dataset("long_sums", 0, 1, type="sft", tokenizer=tokenizer, size=20, pad=pad)
        for pad in ("down", "up")
    )
    default = get_custom_dataset("long_sums", 0, 1, type="sft", tokenizer=tokenizer, size=20)
    assert default[:] == down[:] and down["input_ids"] != up["input_ids"]
    with pytest.raises(ValueError, match="pad must be one of"):
        get_custom_dataset(
            "long_sums", 0, 1, type="sft", tokenizer=tokenizer, size=1, pad="sideways"
        )


def test_output_lengths_spread_over_ten_times_with_a_long_tail(tokenizer):
    ds = get_custom_dataset("long_sums", 0, 1, type="sft", tokenizer=tokenizer, size=3000)
    lengths = sorted(sum(r["loss_mask"]) for r in ds)
    p50, p90 = lengths[len(lengths) // 2], lengths[9 * len(lengths) // 10]
    assert lengths[-1] >= 10 * lengths[0]
    assert 200 <= lengths[-1] <= 256  # the longest worked answer stays under max_new_tokens
    assert p90 >= 3 * p50  # a long tail: the batch's longest is far from its median
    weights = term_count_weights(1, 18, 1.1)
    assert weights == sorted(weights, reverse=True) and abs(sum(weights) - 1) < 1e-9


def test_splits_never_share_a_problem_and_rows_are_seeded():
    train = {prompt_text(*p) for s in (0, 1) for p in generate_problems(5000, seed=s)}
    test = {prompt_text(*p) for p in generate_problems(500, seed=0, split="test")}
    assert not train & test
    a = get_custom_dataset("long_sums", 0, 1, size=50, seed=3)
    assert a[:] == get_custom_dataset("long_sums", 0, 1, size=50, seed=3)[:]
    start, rest = a[0]["messages"][0]["content"].split("+")
    digit, terms = rest.split("*")
    assert a[0]["answer"] == str(int(start) + int(digit) * int(terms))


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="max_terms"):
        generate_problems(10, max_terms=41)
    with pytest.raises(ValueError, match="distinct problems"):
        generate_problems(500, max_terms=2, test_fraction=0.01, split="test")
    with pytest.raises(ValueError, match="tail"):
        generate_problems(10, tail=-1)
    with pytest.raises(ValueError, match="split"):
        generate_problems(10, split="dev")


def test_reward_checks_the_final_answer_only():
    row = {"answer": "58"}

    def score(text: str) -> float:
        return long_sums_reward_fn.score(RewardInput("", text, [], [], row))

    assert score("1: 37+7=44\n2: 44+7=51\n3: 51+7=58\n#### 58") == 1.0
    assert score("1: 37+7=45\n#### 58") == 1.0  # a wrong pad, the right total
    assert score("1: 37+7=44\n2: 44+7=51\n3: 51+7=58\n#### 59") == 0.0
    assert score("no number") == 0.0


def _batch(lengths: list[int], versions: list[list[int]], prompt: int = 3) -> TensorDict:
    width = prompt + max(lengths)
    v = torch.full((len(lengths), width), -1, dtype=torch.int32)
    att = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, (n, vs) in enumerate(zip(lengths, versions)):
        att[i, : prompt + n] = True
        v[i, prompt : prompt + n] = torch.tensor(vs, dtype=torch.int32)
    return TensorDict({"versions": v, "attention_mask": att}, batch_size=[len(lengths)])


def test_regime_stats_count_lengths_old_tokens_and_resumed_sequences():
    # Trainer at version 3: row 0 fresh; row 1 started at 1, resumed at 3; row 2 all at 2.
    data = _batch([2, 4, 10], [[3, 3], [1, 1, 3, 3], [2] * 10])
    stats = regime_stats(data, version=3)
    assert stats["gen_len_max"] == 10 and stats["gen_len_p50"] == 4
    assert stats["gen_len_p90"] == pytest.approx(8.8)  # linear between 4 and 10
    assert stats["off_policy_token_frac"] == pytest.approx(12 / 16)
    assert stats["resumed_seq_frac"] == pytest.approx(1 / 3)


def test_server_load_parses_the_embedded_servers_metrics():
    metrics = ServerMetrics()
    metrics.on_step(4, 4, seconds=0.5)
    metrics.on_step(6, 6, seconds=0.25)
    load = parse_server_load(metrics.render())
    assert load == {"decode_steps": 2.0, "batch_rows": 10.0, "busy_seconds": 0.75}
    assert parse_server_load("# sglang_other_metric 1\n") is None
