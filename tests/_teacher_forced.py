"""The reference every generation test checks sampled logprobs against: one unpadded forward of
the whole text (prompt + answer), reading the logits that predicted each answer token."""

from __future__ import annotations

import torch


@torch.no_grad()
def forward_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logits [len(output), V] that predicted each output token (fp32)."""
    ids = torch.tensor([prompt + output[:-1]])
    return model(input_ids=ids).logits[0, len(prompt) - 1 :].float()


def teacher_forced_logprobs(
    model, prompt: list[int], output: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs [len(output)] of the output tokens under `model` at `temperature`."""
    return logprobs_of(forward_logits(model, prompt, output), output, temperature)


def logprobs_of(logits: torch.Tensor, output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Logprobs [len(output)] of the output tokens under `forward_logits`' logits."""
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(output)[:, None])[
        :, 0
    ]
