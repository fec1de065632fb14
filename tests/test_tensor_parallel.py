"""Tensor parallelism (DTensor) in the FSDP engine: d1t2 and d2t2 over gloo equal d1t1.

One torchrun launch per mesh runs every check (tests/_torchrun_tp.py): per-token logprobs and
entropies, one SFT and one PPO step (loss, grad norm, updated weights), the HF export, and a
DCP checkpoint written at d2t2 resumed at d1t2.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from _launch import torchrun
from _torchrun_fsdp import engine_config, full_weights, make_batch
from _torchrun_tp import N_SEQS, critic_step, ppo_batch, ppo_config, weight_updates
from transformers import AutoModelForCausalLM

from arealite.api.cli_args import SFTConfig
from arealite.api.io_struct import AllocationMode
from arealite.engine.ppo.actor import FSDPPPOActor
from arealite.engine.rm.reward_model import FSDPRewardModel
from arealite.engine.sft.lm_engine import FSDPLMEngine
from arealite.engine.tensor_parallel import check_supported

TOL = 1e-5


def launch(model_dir: str, tmp, n_ranks: int, **flags) -> dict:
    out = tmp / f"r{n_ranks}.pt"
    script = os.path.join(os.path.dirname(__file__), "_torchrun_tp.py")
    args = ["--model", model_dir, "--out", out, "--hf-dir", tmp / f"hf{n_ranks}"]
    for k, v in flags.items():
        args += [f"--{k.replace('_', '-')}", v]
    torchrun(script, n_ranks, *args, CUDA_VISIBLE_DEVICES="")
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def meshes(tiny_model_dir, tmp_path_factory):
    """d2t2 (4 ranks) writes a DCP checkpoint after its SFT step; d1t2 resumes from it."""
    tmp = tmp_path_factory.mktemp("tp")
    d2t2 = launch(tiny_model_dir, tmp, 4, save_dcp=tmp / "dcp")
    d1t2 = launch(tiny_model_dir, tmp, 2, resume_from=tmp / "dcp")
    return {"d2t2": d2t2, "d1t2": d1t2, "tmp": tmp}


@pytest.fixture(scope="module")
def d1t1(tiny_model_dir, tmp_path_factory):
    """The reference: one rank, no tensor parallelism, the whole batches."""
    out = {}
    engine = FSDPLMEngine(engine_config(tiny_model_dir, 48))
    engine.initialize(None, None)
    try:
        batch = make_batch(n=N_SEQS, seed=0)
        out["logprobs"], out["entropy"] = engine.compute_logprobs(batch, with_entropy=True)
        out["sft"] = engine.train_lm(batch)
        out["sft_weights"] = full_weights(engine)
        out["resumed"] = engine.train_lm(make_batch(n=N_SEQS, seed=1))
        out["resumed_weights"] = full_weights(engine)
    finally:
        engine.destroy()
    out.update(critic_step(tiny_model_dir, 1, 0, 1))
    actor = FSDPPPOActor(ppo_config(tiny_model_dir, 1))
    actor.initialize(None, None)
    try:
        out["ppo"] = actor.ppo_update(ppo_batch())
        out["ppo_weights"] = full_weights(actor)
        disk = str(tmp_path_factory.mktemp("t1_update"))
        out["update"] = weight_updates(actor, 0, disk, broadcast=False)
    finally:
        actor.destroy()
    return out


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.integration
@pytest.mark.parametrize("mesh", ["d1t2", "d2t2"])
def test_tensor_parallel_equals_one_rank(meshes, d1t1, mesh):
    got = meshes[mesh]
    assert got["world"] == {"d1t2": 2, "d2t2": 4}[mesh]
    for key in ("logprobs", "entropy"):
        assert (got[key] - d1t1[key]).abs().max().item() < TOL, key
    for step in ("sft", "ppo"):
        assert abs(got[step]["loss"] - d1t1[step]["loss"]) < TOL, step
        # the norm of float32 gradients summed in another order: relative 1e-5 (~2e-6 seen)
        assert got[step]["grad_norm"] == pytest.approx(d1t1[step]["grad_norm"], rel=TOL)
        assert max_weight_diff(got[f"{step}_weights"], d1t1[f"{step}_weights"]) < TOL, step
    assert got["ppo"]["clip_ratio"] > 0  # the clipped branch took part
    # the last rank's batch had an extra key: its tensor group raised, and so did every other
    err = got["bad_batch_error"]
    assert err is not None and ("'extra'" in err or "rank(s) [2, 3]" in err), err
    if mesh == "d1t2":  # a critic: the backbone sharded, the value head whole
        for key in ("values", "critic_weights"):
            assert max_weight_diff(got[key], d1t1[key]) < TOL, key
        for stat in ("value_loss", "value_grad_norm"):
            assert got["critic"][stat] == pytest.approx(d1t1["critic"][stat], rel=TOL, abs=TOL)


@pytest.mark.integration
def test_checkpoint_moves_between_meshes_and_exports_full_weights(meshes, d1t1):
    resumed = meshes["d1t2"]  # from the checkpoint d2t2 wrote after its first step
    assert abs(resumed["resumed"]["loss"] - d1t1["resumed"]["loss"]) < TOL
    assert max_weight_diff(resumed["resumed_weights"], d1t1["resumed_weights"]) < TOL
    for n in (2, 4):  # HF export after the PPO step: DTensors gathered, rank 0 writes
        loaded = AutoModelForCausalLM.from_pretrained(meshes["tmp"] / f"hf{n}").state_dict()
        want = d1t1["ppo_weights"]
        assert max((loaded[k] - want[k]).abs().max().item() for k in want) < TOL


@pytest.mark.integration
@pytest.mark.parametrize("mesh", ["d1t2", "d2t2"])
def test_weight_update_reaches_the_server_as_at_t1(meshes, d1t1, mesh):
    """After the same PPO step, every update path hands the servers d1t1's weights: the HF
    checkpoint the disk update writes, the buckets (whole, alike on every rank), the tensor
    handles as the server opens them, and what a gloo broadcast delivers to the server's
    receiving code (several buckets each)."""
    got, want = meshes[mesh]["update"], d1t1["update"]
    assert got["buckets_agree"] and want["buckets_agree"]
    assert max_weight_diff(got["disk"], want["disk"]) < TOL
    for path in ("buckets", "tensor", "distributed"):
        assert max_weight_diff(got[path], want["buckets"]) < TOL, path
    assert max_weight_diff(want["tensor"], want["buckets"]) == 0


def test_allocation_mode_sets_the_tensor_group(tiny_model_dir, tmp_path):
    cfg = SFTConfig(
        experiment_name="e", trial_name="t", allocation_mode="d2t2",
        model=engine_config(tiny_model_dir), train_dataset={"path": "arith"},
    )  # fmt: skip
    assert cfg.model.tensor_parallel_size == 2 and cfg.allocation.train_world_size == 4


def test_refusals_name_what_to_change(tiny_model_dir):
    from transformers import AutoConfig

    qwen = AutoConfig.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="LoRA"):
        check_supported(qwen, 2, lora=True)
    with pytest.raises(ValueError, match=r"num_attention_heads.*allocation_mode"):
        check_supported(qwen, 3, lora=False)
    qwen.model_type = "gpt2"
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*allocation_mode=\.\.\.t1"):
        check_supported(qwen, 2, lora=False)
    with pytest.raises(ValueError, match="colocated"):
        AllocationMode.from_str("colocated+d1t2")
    with pytest.raises(ValueError, match="allocation_mode=dN"):  # scalar-head reward model
        FSDPRewardModel(engine_config(tiny_model_dir, is_critic=True, tensor_parallel_size=2))


def test_vocab_parallel_logprobs_equal_the_chunked_reference(build_engine, tiny_model_dir):
    """The Function's math and chunking, on a 1-rank tensor mesh (the reductions across ranks
    are the torchrun tests'): values and gradients of logp + entropy equal gather_logprobs's."""
    from torch.distributed.device_mesh import init_device_mesh

    from arealite.engine.logprobs import gather_logprobs_entropy
    from arealite.engine.tensor_parallel import vocab_parallel, vocab_parallel_logprobs
    from arealite.utils import distributed as du

    du.init_distributed()
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(11, 37, generator=g, dtype=torch.float64) * 3
        labels = torch.randint(0, 37, (11,), generator=g)
        weights = torch.randn(2, 11, generator=g, dtype=torch.float64)
        got_x, want_x = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        got = vocab_parallel_logprobs(vocab_parallel(got_x, mesh), labels, 0.7, True, 4)
        want = gather_logprobs_entropy(want_x, labels, 0.7)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        sum((w * x).sum() for w, x in zip(weights, got)).backward()
        sum((w * x).sum() for w, x in zip(weights, want)).backward()
        torch.testing.assert_close(got_x.grad, want_x.grad, atol=1e-12, rtol=0)
    finally:
        du.release_distributed()


@pytest.mark.integration
def test_grpo_through_the_launcher_at_t2(tmp_path, tiny_model_dir):
    """examples/grpo.py via the local launcher: one embedded server + a d1t2 trainer (2 gloo
    ranks, one tensor group), synchronous (eta 0) so step 1 trains on tokens the pushed
    weights generated: the server's logprobs then equal the trainer's (fp32 both sides), which
    only holds if the disk update carried the t2 trainer's full, gathered weights."""
    from _launch import local_launch, read_metrics
    from test_e2e import server_versions

    args = [
        f"cluster.fileroot={tmp_path}", "experiment_name=tp", "trial_name=t2",
        f"actor.path={tiny_model_dir}", "allocation_mode=local.d1p1t1+d1p1t2",
        "total_train_steps=2", "rollout.max_head_offpolicyness=0",
        "train_dataset.batch_size=4", "gconfig.n_samples=2", "gconfig.max_new_tokens=4",
        "valid_dataset=null", "actor.fsdp.param_dtype=float32", "server.dtype=float32",
        "weight_update=disk",  # varied rewards: non-zero advantages, no group filtered out
        "reward=tests/workflow_rewards.py:token_id_spread",
    ]  # fmt: skip
    p = local_launch("grpo.py", "arith_grpo.yaml", *args, timeout=900)  # ~2 min; 5 busy
    out = p.stdout + p.stderr
    run_dir = str(tmp_path / "tp" / "t2")
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert r["n_seqs"] == 8 and math.isfinite(r["loss"]), r
        assert r["grad_norm"] > 0, r  # the weights moved: the push at step 1 carries news
        assert r["staleness_max"] == 0 and r["behave_logp_absdiff_max"] < 1e-3, r
    assert server_versions(run_dir) == [1, 2]  # the server loaded both pushed versions
    assert "Saved HF checkpoint" in out or os.path.isdir(os.path.join(run_dir, "checkpoints"))
