"""The preflight memory plan (arealite/launcher/memory_plan.py): printed for real model shapes, and
checked against the real trainer's measured peak on CPU.

    python bench/memory_plan.py --dry [--gpu-gb 79.6]   # Qwen2.5-0.5B / 1.5B shapes, gsm8k config
    python bench/memory_plan.py --measure [CASE ...]    # CPU: plan vs measured peak RSS

--dry builds no model and downloads nothing: the shapes are config.json dicts, and the settings are
examples/configs/gsm8k_grpo.yaml's, as shipped (server and trainer on 2 GPUs) and on one GPU that
both share. --measure writes small random models (arealite/testing/tiny_model.py) and runs two
real FSDPEngine train steps (fp32, 1 rank, the SFT loss: packed, chunked logprobs) in a fresh
process each; the peak resident memory of the second step (the optimizer's states exist then)
above the process's memory before the model was built is compared with the plan's trainer peak.
glibc is told to unmap large freed blocks (MALLOC_MMAP_THRESHOLD_), so the resident peak tracks
what the tensors hold rather than what the heap keeps. One JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from arealite.api.cli_args import ConfigError, GRPOConfig, load_expr_config  # noqa: E402
from arealite.launcher.memory_plan import (  # noqa: E402
    GIB,
    ModelShape,
    TrainSetup,
    check_plan,
    plan_memory,
    trainer_terms,
)
from arealite.testing.tiny_model import model_sizes  # noqa: E402


def qwen25_config(hidden: int, layers: int, heads: int, intermediate: int) -> dict:
    """The config.json fields the plan reads, for a Qwen2.5 size (2 KV heads, tied embeddings,
    its 151,936-token vocabulary): a plan without any download."""
    return dict(
        vocab_size=151936,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        intermediate_size=intermediate,
        tie_word_embeddings=True,
    )


QWEN_SHAPES = {
    "Qwen2.5-0.5B": qwen25_config(896, 24, 14, 4864),
    "Qwen2.5-1.5B": qwen25_config(1536, 28, 12, 8960),
}
GSM8K = os.path.join(ROOT, "examples", "configs", "gsm8k_grpo.yaml")
LAYOUTS = {  # name -> overrides of the shipped config
    "as shipped (server GPU 0, trainer GPU 1)": [],
    "one GPU, shared": ["cluster.n_gpus_per_node=1", "cluster.share_gpus=true"],
    "one GPU, shared, mem_fraction_static 0.35": [
        "cluster.n_gpus_per_node=1",
        "cluster.share_gpus=true",
        "server.mem_fraction_static=0.35",
    ],
}

# Measured cases: tiny_model sizes, tokens per micro-batch (sequences of 128), checkpointing.
SEQ = 128
ACTIVATIONS_MODEL = model_sizes(512, 4, 8, 2048, model_vocab=1024)
CASES = {
    "states": (model_sizes(512, 6, 8, 2048, model_vocab=8192), 256, False),
    "logits": (model_sizes(256, 2, 4, 512, model_vocab=16384), 2048, False),
    # The same model and micro-batch with and without activation checkpointing.
    "activations": (ACTIVATIONS_MODEL, 1024, False),
    "checkpointing": (ACTIVATIONS_MODEL, 1024, True),
}


def dry(gpu_gb: float) -> list[dict]:
    """The plan of the gsm8k config for each shape and layout, printed; one record each."""
    out = []
    for name, fields in QWEN_SHAPES.items():
        shape = ModelShape.from_hf_config(fields)
        for layout, overrides in LAYOUTS.items():
            args = ["--config", GSM8K, "actor.path=unused", f"cluster.gpu_memory_gb={gpu_gb}"]
            config = load_expr_config([*args, *overrides], GRPOConfig)
            plan = plan_memory(config, shape, gpu_gb * GIB)
            verdict = "fits"
            try:
                check_plan(plan, lambda msg: None)
            except ConfigError as e:  # the refusal a launcher would print, knobs included
                verdict = "refused: " + next(x for x in str(e).splitlines() if " needs " in x)[:-7]
            print(f"== {name}, {layout}: {verdict}\n{plan.describe()}")
            out.append(
                dict(
                    model=name,
                    layout=layout,
                    verdict=verdict.split(":")[0],
                    gpus={w: round(p / GIB, 2) for w, p in plan.gpus},
                )
            )
    return out


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def child(model_dir: str, tokens: int, ckpt: bool) -> None:
    """Two real train steps; prints the peak RSS of the second above the pre-model baseline."""
    import torch
    from tensordict import TensorDict

    from arealite.api.cli_args import FSDPConfig, MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from arealite.engine.fsdp_engine import FSDPEngine
    from arealite.engine.sft.lm_engine import sft_loss_fn, sft_loss_weight

    cfg = TrainEngineConfig(
        path=model_dir,
        dtype="float32",
        attn_impl="sdpa_varlen",
        fsdp=FSDPConfig(param_dtype="float32"),
        gradient_checkpointing=ckpt,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=tokens),
        optimizer=OptimizerConfig(lr=1e-4),
    )
    n = tokens // SEQ
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))
    ones = torch.ones(n, SEQ, dtype=torch.long)
    batch = TensorDict(dict(input_ids=ids, attention_mask=ones, loss_mask=ones), batch_size=[n])
    base = _status_kb("VmRSS")
    engine = FSDPEngine(cfg)
    engine.initialize(None, None)
    engine.train()  # as the actor and SFT do: HF checkpoints layers only in train mode
    engine.train_batch(batch, sft_loss_fn, sft_loss_weight)  # creates Adam's states
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    engine.train_batch(batch, sft_loss_fn, sft_loss_weight)
    print(json.dumps({"measured_bytes": (_status_kb("VmHWM") - base) * 1024}))
    engine.destroy()


def measure(case: str, workdir: str) -> dict:
    """Build the case's model, run the child on it, compare with the plan's trainer peak."""
    from arealite.testing.tiny_model import build_tiny_model

    sizes, tokens, ckpt = CASES[case]
    model_dir = build_tiny_model(os.path.join(workdir, case), **sizes)
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "OMP_NUM_THREADS": "2",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, __file__, "--child", model_dir, str(tokens), str(int(ckpt))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{case}: child failed:\n{out.stderr[-3000:]}")
    measured = json.loads(out.stdout.strip().splitlines()[-1])["measured_bytes"]
    with open(os.path.join(model_dir, "config.json")) as f:
        shape = ModelShape.from_hf_config(json.load(f))
    terms = trainer_terms(shape, TrainSetup(4, 4, 1, ckpt, tokens, cuda=False))
    rec = dict(
        case=case,
        params_m=round(shape.params / 1e6, 1),
        tokens=tokens,
        ckpt=ckpt,
        plan_mb=round(terms["peak"] / 2**20, 1),
        measured_mb=round(measured / 2**20, 1),
        plan_over_measured=round(terms["peak"] / measured, 3),
        terms_mb={k: round(v / 2**20, 1) for k, v in terms.items() if k != "peak"},
    )
    print(json.dumps(rec), flush=True)
    return rec


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry", action="store_true", help="print the plans of the real shapes")
    p.add_argument("--gpu-gb", type=float, default=79.6, help="GPU memory, GiB (H100 80GB)")
    p.add_argument("--measure", nargs="*", metavar="CASE", help=f"of {sorted(CASES)}")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a.child[0], int(a.child[1]), bool(int(a.child[2])))
    if a.dry:
        dry(a.gpu_gb)
    if a.measure is not None:
        with tempfile.TemporaryDirectory() as workdir:
            for case in a.measure or sorted(CASES):
                measure(case, workdir)


if __name__ == "__main__":
    main()
