"""bench/long_regime.py's arms and figures: the arm names parse to the overrides the runs get,
and a run's summary reads the regime metrics a real metrics.jsonl carries."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import long_regime  # noqa: E402


def test_every_arm_parses_and_names_its_overrides():
    for arm in long_regime.PART_A + long_regime.PART_C + ["eta4_decoupled_mb1_inplace"]:
        eta, loss, mb, pause_mode = long_regime.parse_arm(arm)
        args = SimpleNamespace(
            workdir="/w", eval_secs=30, budget=300.0, arealite_args="gconfig.temperature=0.7"
        )
        over = long_regime.arm_overrides(arm, 1, "/m", args)
        assert "total_train_secs=300.0" in over  # the run ends itself, with a last evaluation
        assert f"rollout.max_head_offpolicyness={eta}" in over
        assert f"actor.ppo_n_minibatches={mb}" in over
        assert set(long_regime.LOSSES[loss]) <= set(over)
        assert f"rollout.pause_mode={pause_mode}" in over
        assert pause_mode == ("in_place" if arm.endswith("_inplace") else "abort")
        assert over[-1] == "gconfig.temperature=0.7"  # the user's overrides win: they come last
    with pytest.raises(ValueError, match="eta<E>"):
        long_regime.parse_arm("eta4_clipped_mb1")
    with pytest.raises(ValueError, match="inplace"):
        long_regime.parse_arm("eta4_decoupled_mb1_keep")


def test_a_run_summary_reads_the_regime_and_the_target():
    recs = [
        {"step": 0, "wall_time": 10.0, "eval/accuracy_before_training": 0.2, "n_tokens": 100},
        {
            "step": 1,
            "wall_time": 12.0,
            "n_tokens": 300,
            "gen_len_p50": 40.0,
            "behave_kl_k1": 0.01,
            "behave_imp_weight_std": 0.1,
            "behave_mask_ratio": 0.99,
            "rollout/server_busy_frac": 0.9,
            "rollout/interrupted_requests": 5.0,
            "eval/accuracy": 0.35,
            "timeperf/eval": 1.5,
        },
        {
            "step": 2,
            "wall_time": 14.0,
            "n_tokens": 500,
            "gen_len_p50": 60.0,
            "behave_kl_k1": 0.03,
            "behave_imp_weight_std": 0.3,
            "behave_mask_ratio": 0.97,
            "rollout/server_busy_frac": 0.7,
            "rollout/interrupted_requests": 7.0,
        },
    ]
    args = SimpleNamespace(budget=180.0, target=0.3, target_gain=None)
    s = long_regime.summarize_run("eta4_decoupled_mb1", 1, recs, args)
    gained = long_regime.summarize_run(
        "eta4_decoupled_mb1", 1, recs, SimpleNamespace(budget=180.0, target=0.3, target_gain=0.2)
    )
    assert gained["target"] == 0.4 and gained["time_to_target_s"] is None  # 0.2 + 0.2 not reached
    assert s["steps_per_s"] == 0.5 and s["tokens_per_s"] == 200.0  # steps 1.. over 4 s
    assert s["time_to_target_s"] == 12.0 and s["steps_to_target"] == 2
    # the training clock leaves out the evaluation's own 1.5 s
    assert s["time_to_target_training_clock_s"] == 10.5 and s["eval_s"] == 1.5
    assert s["training_clock_curve"][1] == [10.5, 2, 0.35]
    assert s["gen_len_p50"] == 50.0 and s["server_busy_frac"] == 0.8
    assert s["behave_kl_k1"] == 0.02 and s["imp_weight_std"] == 0.2
    assert s["capped_frac"] == pytest.approx(0.02) and s["interrupted_requests"] == 12.0


def _part_c_run(loss: str, eta: int, seed: int, before: float, end: float) -> dict:
    kl = 0.004 if loss == "decoupled" else 0.002
    return dict(
        eta=eta,
        minibatches=4,
        loss=loss,
        seed=seed,
        acc_before=before,
        acc_end=end,
        behave_kl_k1=kl,
    )


def test_part_c_verdict_needs_a_gap_beyond_the_seeds_and_the_evaluations_noise(capsys):
    runs = [
        # eta 16: naive ahead by 10 points, seeds agree
        *(_part_c_run("decoupled", 16, s, 0.50, 0.41 + 0.01 * s) for s in (1, 2, 3)),
        *(_part_c_run("naive", 16, s, 0.50, 0.52) for s in (1, 2, 3)),
        # eta 8: 2 points apart with identical seeds: under one evaluation's noise on a change
        *(_part_c_run("decoupled", 8, s, 0.50, 0.53) for s in (1, 2)),
        *(_part_c_run("naive", 8, s, 0.50, 0.51) for s in (1, 2)),
        # eta 4: decoupled ahead by 6 points, but its seeds spread by 10
        _part_c_run("decoupled", 4, 1, 0.50, 0.62),
        _part_c_run("decoupled", 4, 2, 0.50, 0.48),
        *(_part_c_run("naive", 4, s, 0.50, 0.49) for s in (1, 2)),
        # eta 2: one seed in common, no verdict; the unpaired seed 2 is left out
        _part_c_run("decoupled", 2, 1, 0.50, 0.40),
        *(_part_c_run("naive", 2, s, 0.50, 0.55) for s in (1, 2)),
        # an arm with no naive pair has no row
        dict(_part_c_run("naive", 0, 1, 0.5, 0.5), loss="unclipped"),
    ]
    rows = {r["eta"]: r for r in long_regime.decoupled_vs_naive(runs, answers=800)}
    assert sorted(rows) == [2, 4, 8, 16]
    assert rows[16]["verdict"] == "naive ahead" and rows[16]["decoupled_wins"] == 0
    assert rows[16]["mean_gap"] == pytest.approx(-0.09) and rows[16]["behave_kl_ratio"] == 2.0
    assert rows[8]["spread"] == pytest.approx(long_regime.change_noise(0.5, 800), abs=1e-4)
    assert rows[8]["verdict"] == "inside the spread" and rows[8]["decoupled_wins"] == 2
    assert rows[4]["verdict"] == "inside the spread" and rows[4]["spread"] == pytest.approx(0.099)
    assert rows[2]["verdict"] == "one seed" and rows[2]["seeds"] == [1]
    assert rows[2]["naive_change"] == [pytest.approx(0.05)]
    assert long_regime.evaluation_answers() == 800  # 200 held-out problems x avg@4
    long_regime.print_decoupled_vs_naive([rows[16]])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert table[0].startswith("| eta | mb |") and table[1] == "|---" * 8 + "|"
    assert (
        table[2]
        == "| 16 | 4 | -8.0 / -7.0 / -6.0 | +2.0 / +2.0 / +2.0 | 0 of 3 seeds | -9.0 (2.5) | 2.0 | naive ahead |"
    )


def test_the_machine_figure_says_how_busy_the_cpu_is(capsys, monkeypatch):
    import json

    import bench_io
    import psutil

    monkeypatch.setattr(psutil, "cpu_percent", lambda interval: 90.0)
    bench_io.emit_machine(workdir="/w")
    out = capsys.readouterr()
    line = json.loads(out.out)
    assert line["figure"] == "machine" and line["workdir"] == "/w"
    assert line["busy_cores"] == round(0.9 * os.cpu_count(), 2)
    assert "cpu" in line and "autogroup" in line and "load_1min" in line
    assert "cores busy before the bench" in out.err and "timings will be low" in out.err


def test_a_run_that_just_ended_is_no_busy_machine(capsys, monkeypatch):
    """The load average still counts the last minute's run; the cores are idle now."""
    import bench_io
    import psutil

    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval: 2.0)
    bench_io.emit_machine()
    assert capsys.readouterr().err == ""


def test_by_length_counts_a_right_number_on_wrong_work_as_lucky():
    """long_sums_by_length's lucky share: rewarded answers whose scratchpad has a wrong line."""
    import long_sums_by_length as by_length

    from arealite.tasks.long_sums import scratchpad

    right = scratchpad(38, 4, 2)  # "2: 38+4=42\n1: 42+4=46\n#### 46"
    lucky = "2: 38+4=41\n1: 41+4=46\n#### 46"  # two slips that cancel
    wrong = "2: 38+4=42\n1: 42+4=45\n#### 45"
    answers = [by_length.grade(t, 38, 4, 2) for t in (right, lucky, wrong, right)]
    row = by_length.summarize(answers[:1], answers)
    assert row == {"greedy": 1.0, "greedy_right_work": 1.0, "sampled": 0.75, "lucky_share": 1 / 3}


def test_trls_evaluation_matches_the_grpo_configs_evaluator():
    """vs_trl's TRL callback samples as arealite's evaluator does, task by task."""
    assert long_regime.TASKS["long_sums"].evaluation() == (1.0, 4)  # avg@4 at temperature 1
    assert long_regime.TASKS["arith"].evaluation() == (0.0, 1)  # one greedy answer


def test_part_b_without_trl_fails_before_any_run(tmp_path, monkeypatch):
    """TRL is in the `bench` extra only: a missing TRL must stop the bench at its arguments,
    not after the hours of parts a and c that run before part b."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "trl" else real_find_spec(name, *a),
    )
    argv = ["long_regime.py", "--workdir", str(tmp_path), "--arms", "eta0_decoupled_mb1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--parts", "a,b"])
    with pytest.raises(SystemExit, match=r"bench.*trl"):
        long_regime.parse_args()
    monkeypatch.setattr(sys, "argv", [*argv, "--parts", "a"])
    assert long_regime.parse_args().parts == ["a"]


def _result(arm, budget, curve, steps_per_s):
    """A results.jsonl row of one run (seed 1, target 0.8) with this accuracy curve."""
    eta, loss, mb, pause_mode = long_regime.parse_arm(arm)
    hit = long_regime.first_reaching(curve, 0.8)
    return dict(
        arm=arm, eta=eta, loss=loss, minibatches=mb, pause_mode=pause_mode, seed=1,
        budget_s=budget, accuracy_curve=curve, target=0.8, time_to_target_s=hit[0],
        steps_to_target=hit[1], steps_per_s=steps_per_s, tokens_per_s=steps_per_s * 100,
    )  # fmt: skip


def _report_pair(rows, tmp_path, monkeypatch, capsys) -> dict:
    """`long_regime.py --report` part a over these rows: its async_vs_sync figure."""
    import json

    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["long_regime.py", "--report", "--parts", "a", "--seeds", "1", "--workdir"]
    arms = "eta0_decoupled_mb1,eta2_decoupled_mb1_inplace"
    monkeypatch.setattr(sys, "argv", [*argv, str(tmp_path), "--arms", arms, "--levels", ".8,.9"])
    long_regime.main()
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    (pair,) = [x for x in lines if x["figure"] == "async_vs_sync"]
    return pair


def test_report_pairs_each_seed_with_its_longest_synchronous_run(tmp_path, monkeypatch, capsys):
    """--report runs nothing: runs of different budgets (a short async arm, a longer sync one)
    pair by seed, and part a gives the time to each --levels accuracy as async / sync."""
    rows = [
        _result("eta0_decoupled_mb1", 100.0, [[0, 0, 0.7], [100, 30, 0.75]], 0.3),
        _result("eta0_decoupled_mb1", 400.0, [[0, 0, 0.7], [200, 60, 0.8], [400, 120, 0.9]], 0.3),
        _result("eta2_decoupled_mb1_inplace", 300.0, [[0, 0, 0.7], [120, 60, 0.85]], 0.5),
    ]
    pair = _report_pair(rows, tmp_path, monkeypatch, capsys)
    assert pair["sync_time_to_target_s"] == 200 and pair["async_time_to_target_s"] == 120
    assert pair["async_time_fraction_by_level"] == {
        "0.8": {"sync_s": 200, "async_s": 120, "async_over_sync": 0.6},
        "0.9": {"sync_s": 400, "async_s": None, "async_over_sync": None},
    }
    assert pair["steps_per_s_ratio"] == 1.67 and not pair["within_half"]
    assert (tmp_path / "long_regime.png").exists()


@pytest.mark.parametrize("async_s, within_half", [(180, True), (250, False)])
def test_within_half_when_sync_never_got_there(tmp_path, monkeypatch, capsys, async_s, within_half):
    """Synchronous' time is then only known to exceed its budget (400 s): async within half of
    it is shown at <= 200 s, not merely by reaching the target at all."""
    rows = [
        _result("eta0_decoupled_mb1", 400.0, [[0, 0, 0.7], [400, 120, 0.75]], 0.3),
        _result("eta2_decoupled_mb1_inplace", 300.0, [[0, 0, 0.7], [async_s, 60, 0.85]], 0.5),
    ]
    pair = _report_pair(rows, tmp_path, monkeypatch, capsys)
    assert pair["sync_time_to_target_s"] is None and pair["within_half"] is within_half


def test_within_half_reads_a_synchronous_time_of_zero_as_a_time():
    """A synchronous run whose first evaluation was already at the target took 0 s, not 'never'."""
    assert not long_regime.within_half(50.0, 0.0, 400.0)
    assert long_regime.within_half(0.0, 0.0, 400.0) and not long_regime.within_half(None, None, 1)


def test_an_accuracy_equal_to_the_level_reaches_it_even_through_float32():
    """228 of 400 logged through float32 reads 0.5699999928: still a tie with 0.57."""
    tie = float(torch.tensor(228 / 400, dtype=torch.float32))
    assert tie < 0.57
    curve = [(0.0, 0, 0.5), (150.0, 40, tie), (300.0, 80, 0.58)]
    assert long_regime.first_reaching(curve, 0.57) == (150.0, 40)
    assert long_regime.first_reaching(curve, 0.5701) == (300.0, 80)
    assert long_regime.first_reaching([(0.0, 0, None)], 0.1) == (None, None)


def test_the_report_reads_each_crossing_from_the_curve(tmp_path, monkeypatch, capsys):
    """A run stored before the tie fix holds a later time than its curve shows; the report
    reads the curve."""
    tie = float(torch.tensor(0.8, dtype=torch.float32))
    sync = _result("eta0_decoupled_mb1", 400.0, [[0, 0, 0.7], [200, 60, tie], [300, 90, 0.85]], 0.3)
    sync["time_to_target_s"] = 300  # what the float32 comparison stored
    rows = [sync, _result("eta2_decoupled_mb1_inplace", 300.0, [[0, 0, 0.7], [90, 40, 0.81]], 0.5)]
    pair = _report_pair(rows, tmp_path, monkeypatch, capsys)
    assert pair["sync_time_to_target_s"] == 200 and pair["within_half"]


@pytest.mark.parametrize("goal, within", [(1 / 2, False), (2 / 3, True)])
def test_part_bs_verdict_holds_arealite_to_the_goal_it_is_given(capsys, goal, within):
    """Part b's goal on long_sums is half TRL's time, the short task's two thirds: a crossing at
    0.53 of TRL's time meets one and not the other."""
    import json

    import vs_trl

    trl = {"system": "trl", "seed": 3, "accuracy_by_minute": [[0.0, 0.51], [10.0, 0.54]]}
    curve = [[0.0, 0.50], [4.3, 0.52], [5.3, 0.55], [10.5, 0.53]]
    arealite = {"system": "arealite", "seed": 3, "accuracy_by_minute": curve}
    vs_trl.per_seed_goal({"trl": [trl], "arealite": [arealite]}, goal)
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert line["fraction_of_trl_time"] == 0.53 and line["within_goal"] is within
    assert line["goal_fraction"] == round(goal, 3)


def test_part_b_reports_the_goal_on_arealites_training_clock_too(capsys):
    """arealite's clock includes its evaluations and TRL's does not: the per-seed figure is also
    read on arealite's training clock, while the verdict stays on the wall clock."""
    import json

    import vs_trl

    trl = {"system": "trl", "seed": 3, "accuracy_by_minute": [[0.0, 0.51], [10.0, 0.54]]}
    arealite = {
        "system": "arealite",
        "seed": 3,
        "accuracy_by_minute": [[0.0, 0.50], [5.3, 0.55]],
        "accuracy_by_training_minute": [[0.0, 0.50], [4.2, 0.55]],
    }
    vs_trl.per_seed_goal({"trl": [trl], "arealite": [arealite]}, 1 / 2)
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert line["fraction_of_trl_time"] == 0.53 and line["fraction_on_training_clock"] == 0.42
    assert line["within_goal"] is False


def test_part_b_resumes_from_its_own_file_and_reports_from_it(tmp_path, monkeypatch, capsys):
    """A part b cut short re-runs only the runs missing from part_b.jsonl (here seed 2's), and
    --report compares those stored without running anything."""
    import json

    import vs_trl

    def stored(system, seed, final):
        steps = 200 if system == "arealite" else 60
        levels = long_regime.TASKS["long_sums"].levels
        run = vs_trl.summarize(system, seed, [(0, 0.5), (600, final)], steps, 600, 1, 1, levels)
        return {**run, "minutes": 10.0}

    (tmp_path / "part_b.jsonl").write_text(
        "".join(json.dumps(stored(s, 1, 0.55)) + "\n" for s in ("trl", "arealite"))
    )
    ran = []

    def fake_run(system):
        def run(model, seed, *a, **kw):
            ran.append((system, seed))
            return {k: v for k, v in stored(system, seed, 0.6).items() if k != "minutes"}

        return run

    monkeypatch.setattr(long_regime, "run_trl", fake_run("trl"))
    monkeypatch.setattr(long_regime, "run_arealite", fake_run("arealite"))
    monkeypatch.setattr(long_regime, "require_trl", lambda: None)
    argv = ["long_regime.py", "--parts", "b", "--seeds", "1,2", "--workdir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", [*argv, "--model-path", "m"])
    long_regime.main()
    assert ran == [("trl", 2), ("arealite", 2)]
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", [*argv, "--report"])
    long_regime.main()
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert ran == [("trl", 2), ("arealite", 2)]  # --report ran nothing
    goals = {x["seed"]: x for x in lines if x["figure"] == "goal_per_seed"}
    assert goals[1]["trl_final_accuracy"] == 0.55 and goals[2]["trl_final_accuracy"] == 0.6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_trls_evaluations_compute_as_its_prepared_policy_samples(dtype):
    """TRL's accuracy curve is read in one precision: the first evaluation (before train()
    prepares the policy) runs in the autocast accelerate gives the prepared policy later."""
    import vs_trl
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    class Probe(torch.nn.Module):  # records the autocast state its forward runs under
        def forward(self, x):
            on = torch.is_autocast_enabled("cpu")
            return on, torch.get_autocast_dtype("cpu") if on else torch.float32

    mixed = "bf16" if dtype == torch.bfloat16 else "no"
    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton
    try:
        prepared = Accelerator(mixed_precision=mixed, cpu=True).prepare(Probe())
        with vs_trl.trl_sampling_precision("cpu", dtype):
            evaluated = Probe()(torch.zeros(1))
        assert evaluated == prepared(torch.zeros(1)) == (dtype != torch.float32, dtype)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
