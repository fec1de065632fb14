"""Training-loop services: phase timings, stats logger, progress line, frequency control,
saver and evaluator."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from arealite.api.cli_args import EvaluatorConfig, SaverConfig, StatsLoggerConfig
from arealite.api.io_struct import FinetuneSpec, SaveLoadMeta
from arealite.trainer import timings
from arealite.trainer.evaluator import Evaluator
from arealite.trainer.plotting import read_metrics_jsonl
from arealite.trainer.progress import ProgressLine, find_stat, format_progress
from arealite.trainer.run_summary import held_out_change, summary
from arealite.trainer.saver import Saver
from arealite.trainer.stats_logger import StatsLogger
from arealite.trainer.time_budget import TimeBudget
from arealite.trainer.timer import EpochStepTimeFreqCtl
from arealite.utils.network import find_free_port

# ----------------------------------------------------------------------------- phase timings


def test_phase_timings_are_exported_once_as_means():
    with timings.record_timing("step"):
        time.sleep(0.02)
    with timings.record_timing("step"):
        pass
    out = timings.export()
    assert set(out) == {"timeperf/step"} and 0.01 <= out["timeperf/step"] < 1.0
    assert timings.export() == {}  # export forgets


def _gloo_rank(rank: int, world_size: int, port: int, out_dir: str, decide) -> None:
    """One rank of a gloo group: writes `decide(rank)` to out_dir/rank{rank}.json."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(decide(rank), f)
    finally:
        dist.destroy_process_group()


def on_two_ranks(decide, tmp_path) -> list:
    """What `decide(rank)` returned on each of two gloo ranks."""
    mp.spawn(_gloo_rank, args=(2, find_free_port(), str(tmp_path), decide), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


def _freq_decisions(rank: int) -> list[bool]:
    # Time-based frequency control follows rank 0 even when clocks disagree.
    ctl = EpochStepTimeFreqCtl(freq_sec=5)
    ctl.load_state_dict({"epoch_counter": 0, "step_counter": 0, "elapsed_sec": 10 * rank})
    fired_when_rank0_not_due = ctl.check(steps=1)
    ctl.load_state_dict({"epoch_counter": 0, "step_counter": 0, "elapsed_sec": 10 - rank})
    fired_when_rank0_due = ctl.check(steps=1)
    return [fired_when_rank0_not_due, fired_when_rank0_due]


@pytest.mark.integration
def test_time_based_frequency_follows_rank_0_on_every_rank(tmp_path):
    assert on_two_ranks(_freq_decisions, tmp_path) == [[False, True]] * 2


# ----------------------------------------------------------------------------- stats logger


def _commit_steps(logger: StatsLogger, steps, offset: float = 0.0) -> None:
    for g in steps:
        stats = {
            "ppo_actor/task_reward/avg": g / 10 + offset,
            "ppo_actor/behave_kl/avg": 1e-5,
            "ppo_actor/pg_loss/avg": torch.tensor(1.0 - g / 10),
            "rollout/n_tokens": 640,
            "empty/avg": float("nan"),
        }
        logger.commit(epoch=0, step=g, global_step=g, stats=stats)


def _tb_scalars(tb_dir: str, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tb_dir)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


def test_stats_logger_writes_tensorboard_jsonl_png_and_summary(tmp_path):
    run_dir = str(tmp_path / "exp" / "trial")
    ft_spec = FinetuneSpec(total_train_epochs=1, dataset_size=80, train_batch_size=8)
    logger = StatsLogger(StatsLoggerConfig(), run_dir, ft_spec)
    _commit_steps(logger, range(5))
    summary = logger.close()

    records = read_metrics_jsonl(logger.metrics_path)
    assert [r["step"] for r in records] == list(range(5))
    assert records[3]["ppo_actor/task_reward/avg"] == pytest.approx(0.3)
    assert records[3]["empty/avg"] is None  # NaN is not JSON
    tb = _tb_scalars(logger.tb_dir, "ppo_actor/task_reward/avg")
    assert [s for s, _ in tb] == list(range(5))
    assert tb[2][1] == pytest.approx(0.2)
    with open(logger.plot_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(logger.plot_path) > 5000
    assert summary["n_steps"] == 5 and summary["last_step"] == 4
    assert summary["best"]["ppo_actor/pg_loss/avg"] == pytest.approx(0.6)
    assert summary["last"]["ppo_actor/task_reward/avg"] == pytest.approx(0.4)
    assert json.loads((tmp_path / "exp" / "trial" / "summary.json").read_text())["n_steps"] == 5


def test_run_summary_reports_the_held_out_change_of_a_run(tmp_path):
    logger = StatsLogger(StatsLoggerConfig(), str(tmp_path), FinetuneSpec(1, 16, 8))
    logger.commit(0, 0, 0, {"eval/accuracy_before_training": 0.2, "eval/accuracy": 0.3})
    logger.commit(0, 1, 1, {"eval/accuracy": None})
    logger.commit(0, 2, 2, {"eval/accuracy": 0.55})
    logger.close()
    assert held_out_change(str(tmp_path)) == (0.2, 0.55)
    line = summary(str(tmp_path), 75, "success")
    assert "held-out success: 20.0% before GRPO -> 55.0% after (+35.0 points) in 1m15s" in line
    logger = StatsLogger(StatsLoggerConfig(), str(tmp_path / "none"), FinetuneSpec(1, 16, 8))
    logger.commit(0, 0, 0, {"loss": 1.0})
    logger.close()
    with pytest.raises(SystemExit, match="no held-out evaluation"):
        held_out_change(str(tmp_path / "none"))


def test_stats_logger_resume_has_no_duplicate_steps(tmp_path):
    run_dir = str(tmp_path / "run")
    first = StatsLogger(StatsLoggerConfig(), run_dir)
    _commit_steps(first, range(6))
    first._metrics_file.write('{"step": 6, "torn')  # crashed mid-write
    first.close()

    resumed = StatsLogger(StatsLoggerConfig(), run_dir, start_step=3)
    _commit_steps(resumed, range(3, 8), offset=100.0)
    resumed.close()

    records = read_metrics_jsonl(resumed.metrics_path)
    assert [r["step"] for r in records] == list(range(8))
    rewards = [r["ppo_actor/task_reward/avg"] for r in records]
    assert rewards[:3] == pytest.approx([0.0, 0.1, 0.2])  # kept from the first run
    assert rewards[3:] == pytest.approx([100 + g / 10 for g in range(3, 8)])  # the resumed run
    tb = _tb_scalars(resumed.tb_dir, "ppo_actor/task_reward/avg")
    assert [s for s, _ in tb] == list(range(8))  # TensorBoard purged the stale steps too
    assert tb[4][1] == pytest.approx(100.4)


def test_stats_logger_only_rank0_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    logger = StatsLogger(StatsLoggerConfig(), str(tmp_path / "r1"))
    _commit_steps(logger, range(2))
    assert logger.close() is None
    assert not os.path.exists(tmp_path / "r1")


def test_stats_logger_missing_wandb_fails_clearly(tmp_path):
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed; this checks the message when it is not")
    except ImportError:
        pass
    with pytest.raises(ImportError, match=r"arealite\[wandb\]"):
        StatsLogger(StatsLoggerConfig(wandb_mode="offline"), str(tmp_path / "w"))


# ----------------------------------------------------------------------------- progress line


def test_progress_line_picks_keys_and_formats():
    stats = {
        "ppo_actor/task_reward/avg": 0.4375,
        "ppo_actor/task_reward/max": 1.0,
        "ppo_actor/behave_kl/avg": 2.1e-5,
        "rollout/staleness/avg": 1.5,
        "ppo_actor/pg_loss/avg": 0.25,
    }
    line = format_progress(12, 200, stats, secs_per_step=3.21, tokens_per_sec=1520, eta_secs=603)
    assert line == (
        "step 12/200 | reward 0.4375 | loss 0.2500 | 3.21 s/step | 1520 tok/s | "
        "staleness 1.50 | behave_kl 2.10e-05 | ETA 10m03s"
    )
    assert "reward 0.9000" in format_progress(1, None, stats, reward=0.9)
    assert find_stat({"a/loss": 1.0}, ("reward",)) is None


def test_progress_line_timing_eta_and_print_every(caplog):
    p = ProgressLine(total_steps=10, print_every=2)
    with caplog.at_level(logging.INFO, logger="arealite.progress"):
        time.sleep(0.5)  # the first step pays for start-up
        assert p.update(0, {"n_tokens": 100}) is None  # step 1: not printed
        time.sleep(0.05)
        line = p.update(1, {"n_tokens": 100})
    assert line is not None and line.startswith("step 2/10") and line in caplog.text
    secs = float(line.split(" | ")[1].split()[0])
    toks = float(line.split(" | ")[2].split()[0])
    # s/step is printed to 2 decimals: tok/s = 100 / (the unrounded seconds), within rounding
    assert secs >= 0.05 and 100 / (secs + 0.005) - 1 <= toks <= 100 / (secs - 0.005) + 1
    # 8 steps left at the second step's pace, not the start-up's (which would say ~3 s)
    assert "ETA 0m00s" in line or "ETA 0m01s" in line, line


def test_progress_line_prints_the_mean_since_the_last_line():
    """A slow step (an evaluation) is spread over its window, not printed as the run's pace."""
    p = ProgressLine(total_steps=10, print_every=4)
    p.update(0, {"n_tokens": 100})  # start-up: left out of the window
    for step, pause in zip((1, 2, 3), (0.02, 0.30, 0.02)):
        time.sleep(pause)
        line = p.update(step, {"n_tokens": 100})
    secs = float(line.split(" | ")[1].split()[0])
    toks = float(line.split(" | ")[2].split()[0])
    assert line.startswith("step 4/10")
    assert 0.11 <= secs < 0.25, line  # (0.02 + 0.30 + 0.02) / 3, not the last step's 0.02
    assert 300 / (3 * secs + 0.02) <= toks <= 300 / (3 * secs - 0.02), line


def test_the_first_step_prints_no_eta():
    line = ProgressLine(total_steps=10).update(0, {})
    assert line.startswith("step 1/10") and "ETA" not in line


def test_a_time_budget_bounds_the_eta():
    """A run that ends by the clock (total_train_secs) first: the ETA is the time left."""
    budget = TimeBudget(2.0)
    budget.start()
    p = ProgressLine(total_steps=1000, time_budget=budget)
    p.update(0, {})
    time.sleep(0.05)
    line = p.update(1, {})
    assert "ETA 0m01s" in line or "ETA 0m02s" in line, line  # not 998 steps x 0.05 s


# ----------------------------------------------------------------------------- time budget


def test_a_time_budget_decides_once_per_step():
    assert not TimeBudget(None).spent(0) and TimeBudget(None).remaining() is None
    budget = TimeBudget(0.2)
    assert budget.remaining() is None  # not started
    budget.start()
    assert not budget.spent(0) and 0 < budget.remaining() <= 0.2
    time.sleep(0.25)
    assert budget.remaining() == 0.0
    assert not budget.spent(0)  # step 0's answer stands: its services already ran
    assert budget.spent(1)


def _budget_decisions(rank: int) -> list[bool]:
    # Rank 0's clock decides: rank 1 is out of time first, then rank 0 alone.
    budget = TimeBudget(0.3 if rank == 0 else 0.01)
    budget.start()
    time.sleep(0.1)
    first = budget.spent(0)
    budget._start -= 1.0 if rank == 0 else 0.0
    return [first, budget.spent(1)]


@pytest.mark.integration
def test_a_time_budget_follows_rank_0_on_every_rank(tmp_path):
    assert on_two_ranks(_budget_decisions, tmp_path) == [[False, True]] * 2


# ----------------------------------------------------------------------------- frequency control


def test_freq_ctl_steps_epochs_and_none():
    ctl = EpochStepTimeFreqCtl(freq_step=3)
    assert [ctl.check(steps=1) for _ in range(7)] == [False, False, True] * 2 + [False]
    ctl = EpochStepTimeFreqCtl(freq_epoch=2)
    assert [ctl.check(epochs=1) for _ in range(4)] == [False, True, False, True]
    assert not any(EpochStepTimeFreqCtl().check(epochs=1, steps=1) for _ in range(5))
    with pytest.raises(ValueError, match="freq_step"):
        EpochStepTimeFreqCtl(freq_step=0)


def test_freq_ctl_seconds_and_state_dict():
    ctl = EpochStepTimeFreqCtl(freq_step=4, freq_sec=0.2)
    assert not ctl.check(steps=1)
    time.sleep(0.25)
    assert ctl.check(steps=1)  # time is due
    assert not ctl.check(steps=1)  # timer restarted; 3 steps counted
    restored = EpochStepTimeFreqCtl(freq_step=4, freq_sec=0.2)
    restored.load_state_dict(ctl.state_dict())
    assert restored.step_counter == 3
    assert restored.check(steps=1)  # the 4th step fires after the restore, as it would have


# ----------------------------------------------------------------------------- saver / evaluator


class _HFEngine:
    """A train engine reduced to `save`: writes a real HF model directory."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.metas: list[SaveLoadMeta] = []

    def save(self, meta: SaveLoadMeta) -> None:
        self.metas.append(meta)
        self.model.save_pretrained(meta.path)
        if meta.tokenizer is not None:
            meta.tokenizer.save_pretrained(meta.path)


def test_saver_saves_on_schedule_and_resumes_it(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ft_spec = FinetuneSpec(total_train_epochs=2, dataset_size=12, train_batch_size=4)  # 3/epoch
    engine = _HFEngine(tiny_model_dir)
    saver = Saver(SaverConfig(freq_steps=2), ft_spec, str(tmp_path))
    saved = []
    for g in range(4):
        epoch, step = divmod(g, ft_spec.steps_per_epoch)
        saved.append(saver.save(engine, epoch, step, g, tokenizer=tok))
    path = os.path.join(str(tmp_path), "checkpoints", "epoch1globalstep3")
    assert saved == [
        None,
        os.path.join(str(tmp_path), "checkpoints", "epoch0globalstep1"),
        None,
        path,
    ]
    assert all(m.weight_format == "hf" and isinstance(m, SaveLoadMeta) for m in engine.metas)
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(reloaded.lm_head.weight, engine.model.lm_head.weight)
    assert AutoTokenizer.from_pretrained(path).eos_token == tok.eos_token

    state = saver.state_dict()
    saver.save(engine, 1, 1, 4)  # one more step on the old saver: counter 1
    resumed = Saver(SaverConfig(freq_steps=2), ft_spec, str(tmp_path))
    resumed.load_state_dict(state)
    assert resumed.save(engine, 1, 1, 4) is None
    assert resumed.save(engine, 1, 2, 5, name="actor").endswith(
        os.path.join("checkpoints", "actor", "epoch1globalstep5")
    )
    assert Saver(SaverConfig(), ft_spec, str(tmp_path)).save(engine, 0, 0, 0) is None
    assert Saver(SaverConfig(), ft_spec, str(tmp_path)).save(engine, 0, 0, 0, force=True)


def test_evaluator_runs_at_epoch_ends():
    ft_spec = FinetuneSpec(total_train_epochs=2, dataset_size=12, train_batch_size=4)
    ev = Evaluator(EvaluatorConfig(freq_epochs=1), ft_spec)
    calls = []
    results = [
        ev.evaluate(lambda g=g: calls.append(g) or {"acc": g}, *divmod(g, 3), g) for g in range(6)
    ]
    assert calls == [2, 5]
    assert results == [None, None, {"acc": 2}, None, None, {"acc": 5}]

    # Every 2 epochs, interrupted after epoch 0: the restored evaluator still fires at g=5.
    ev = Evaluator(EvaluatorConfig(freq_epochs=2), ft_spec)
    assert [ev.evaluate(lambda: "ran", *divmod(g, 3), g) for g in range(3)] == [None] * 3
    restored = Evaluator(EvaluatorConfig(freq_epochs=2), ft_spec)
    restored.load_state_dict(ev.state_dict())
    assert [restored.evaluate(lambda: "ran", *divmod(g, 3), g) for g in range(3, 6)] == [
        None,
        None,
        "ran",
    ]
