"""The offline tiny model loads through the same from_pretrained path users take."""

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_model_loads_and_tokenizes_consistently(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = Tokenizer.from_file(f"{tiny_model_dir}/tokenizer.json")
    for text in ["What is 12+345? \\boxed{357}", "Héllo  wörld\n\nline", "it's 1,000 apples"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == raw.encode(text, add_special_tokens=False).ids  # no silent pipeline swap
        assert tok.decode(ids) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert 1e6 <= n_params <= 10e6
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5 or tok.eos_token_id in out[0].tolist()
