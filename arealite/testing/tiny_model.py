"""Offline tiny models: a tokenizer trained in a second and a randomly initialised causal LM.

Tests and the CPU demo must never touch a model hub, yet they should exercise exactly the code
path real users take (`AutoTokenizer` / `AutoModelForCausalLM.from_pretrained(path)`). So we
write a real HF model directory, then everything else loads it by path.

Tokenizer pitfall (see docs/design.md): with `model_type=qwen2`, transformers 5 loads `Qwen2Tokenizer`,
which swaps in Qwen's own normalizer and pre-tokenizer whatever `tokenizer.json` says. So we train
with exactly that pipeline (NFC, Qwen's split regex, ByteLevel without its own regex): the ids are
then the same whichever tokenizer class (or transformers version, e.g. inside vLLM) loads it.

Usage: ``python -m arealite.testing.tiny_model OUT_DIR [--hidden-size 256 --layers 4 | --qwen2.5-0.5b-shapes]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
from dataclasses import dataclass

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen2's pre-tokenizer regex (digits are split one by one, which also suits arithmetic).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an is are was what how many much if then so answer question solve compute total "
    "each has have had more less than and or of to in on for with by from at per left right "
    "apples books cars dogs cats students people dollars hours minutes days weeks boxes eggs "
    "plus minus times divided equals sum difference product result count objects image shapes "
    "red blue green yellow circle square triangle there therefore step first second next final "
    "system user assistant please think reason carefully put your inside boxed correct wrong "
    "try again feedback"
).split()


def _training_corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Arithmetic, short English and LaTeX-ish answers: enough to learn useful merges."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(f"What is {a}{op}{b}? {words}. The answer is \\boxed{{{a + b}}}.")
        lines.append(f"{words} #### {rng.randint(0, 10000)}")
    return lines


def build_tiny_tokenizer(out_dir: str, vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer (digits split individually) and save it as a HF tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.model_max_length = 2048
    os.makedirs(out_dir, exist_ok=True)
    hf_tok.save_pretrained(out_dir)
    _pin_tokenizer_class(out_dir)
    return hf_tok


def _pin_tokenizer_class(out_dir: str) -> None:
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


@dataclass(frozen=True)
class TextModelSpec:
    """Decoder sizes shared by the tiny causal LM and the tiny VLM's language model."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 1024
    # Embedding rows: 0 = the tokenizer's size; more pads them, as Qwen2.5 has 151,936 rows for
    # 151,665 tokens (the logits of a real vocabulary are a large share of a step's cost).
    model_vocab_size: int = 0

    def qwen2_fields(self, tok) -> dict:
        """The Qwen2(-VL) text-config fields these sizes and tokenizer `tok` fix."""
        return dict(
            vocab_size=max(len(tok), self.model_vocab_size),
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            eos_token_id=tok.convert_tokens_to_ids(EOS_TOKEN),
            pad_token_id=tok.convert_tokens_to_ids(PAD_TOKEN),
            bos_token_id=None,
            rms_norm_eps=1e-6,
        )


def model_sizes(
    hidden: int, layers: int, heads: int, intermediate: int, kv_heads: int = 2, model_vocab: int = 0
) -> dict:
    """`build_tiny_model`'s size keywords in one positional call: a bench names a shape in a line."""
    spec = TextModelSpec(
        hidden, layers, heads, kv_heads, intermediate, model_vocab_size=model_vocab
    )
    return dataclasses.asdict(spec)


# Qwen2.5-0.5B's shapes (494M parameters, tied embeddings) with the tiny tokenizer, randomly
# initialised: GPU throughput figures at a real model's size with no hub download.
QWEN25_05B = model_sizes(896, 24, 14, 4864, model_vocab=151936)


def build_tiny_model(
    out_dir: str,
    seed: int = 1,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    **sizes: int,
) -> str:
    """Write tokenizer + random Qwen2 causal LM (about 3M parameters by default) into `out_dir`.

    `sizes` are `TextModelSpec` fields (hidden_size, num_layers, ...).
    """
    from transformers import AutoModelForCausalLM, Qwen2Config

    spec = TextModelSpec(**sizes)
    tok = build_tiny_tokenizer(out_dir, vocab_size=spec.vocab_size)
    config = Qwen2Config(
        **spec.qwen2_fields(tok),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.02,
    )
    return save_random_model(AutoModelForCausalLM, config, config, seed, out_dir)


def save_random_model(auto_cls, config, text_config, seed: int, out_dir: str) -> str:
    """A seeded random `auto_cls` model of `config`, saved with its EOS / pad ids."""
    import torch

    torch.manual_seed(seed)
    model = auto_cls.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = text_config.eos_token_id
    model.generation_config.pad_token_id = text_config.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--qwen2.5-0.5b-shapes",
        dest="qwen05b",
        action="store_true",
        help="Qwen2.5-0.5B's sizes (494M parameters) instead of the flags above",
    )
    a = p.parse_args(argv)
    sizes = model_sizes(a.hidden_size, a.layers, a.heads, a.intermediate_size, a.kv_heads)
    if a.qwen05b:
        sizes = dict(QWEN25_05B, tie_word_embeddings=True)
    build_tiny_model(a.out_dir, seed=a.seed, **sizes)
    print(f"tiny model written to {a.out_dir}")


if __name__ == "__main__":
    main()
