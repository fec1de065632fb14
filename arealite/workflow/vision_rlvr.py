"""Vision RLVR: RLVR where the prompt holds images (Qwen2-VL family), e.g. CLEVR counting.

The HF processor renders the chat template and expands each image placeholder to one
`<|image_pad|>` per merged patch; those expanded ids go to the server together with the images
as base64 PNG (`ModelRequest.image_data`, SGLang's wire format), so server, client and trainer
agree on every token. The trainer needs the images again for its forward: each trajectory row
carries them under `MM_KEY` ("multi_modal_input": {"pixel_values", "image_grid_thw"}), a
per-sequence non-tensor entry that arealite/utils/data.py keeps through split / concat / pack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tensordict import TensorDict

from arealite.api.engine_api import InferenceEngine
from arealite.api.io_struct import GenerationHyperparameters, ModelRequest, ModelResponse
from arealite.utils.data import stack_non_tensor
from arealite.utils.vision import MM_KEY, decode_image, empty_mm_input, image_to_base64
from arealite.workflow.rlvr import RLVRWorkflow

# Row fields that are model inputs, not reward arguments.
_INPUT_FIELDS = ("images", "messages")


def vision_prompt(
    processor: Any, data: dict[str, Any], enable_thinking: bool = False
) -> tuple[str, list[int], list[Any], dict[str, Any]]:
    """(chat text, expanded prompt ids, RGB images, {pixel_values, image_grid_thw}) of a row
    {"messages", "images"}; the messages hold one image placeholder per image."""
    if "messages" not in data:
        raise KeyError(f"vision data item needs 'messages' (and 'images'), has {sorted(data)}")
    images = [decode_image(x).convert("RGB") for x in data.get("images") or []]
    kw = {"enable_thinking": True} if enable_thinking else {}
    text = processor.apply_chat_template(
        data["messages"], tokenize=False, add_generation_prompt=True, **kw
    )
    if images:
        enc = processor(text=[text], images=images, return_tensors="pt")
        mm = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"].long()}
    else:
        enc = processor.tokenizer([text], add_special_tokens=False, return_tensors="pt")
        mm = empty_mm_input()
    return text, enc["input_ids"][0].tolist(), images, mm


class _WithImages:
    """The inference engine, with this episode's images attached to every request (including
    resubmissions after an abort, which resend the same `ModelRequest`)."""

    def __init__(self, engine: InferenceEngine, image_data: list[str]):
        self._engine = engine
        self._image_data = image_data

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        return await self._engine.agenerate(dataclasses.replace(req, image_data=self._image_data))

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        with_images = [dataclasses.replace(r, image_data=self._image_data) for r in reqs]
        return await self._engine.agenerate_group(with_images)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class VisionRLVRWorkflow(RLVRWorkflow):
    """RLVRWorkflow on image prompts: the row's `messages` + `images` become expanded prompt
    ids and base64 images; sampling, rewards (`reward_fn(prompt, completions, prompt_ids,
    completion_ids, **row)`, row without its images and messages) and the trajectory layout are
    RLVRWorkflow's, plus `multi_modal_input` per row for the trainer."""

    def __init__(
        self,
        reward_fn: Callable[..., float],
        gconfig: GenerationHyperparameters,
        processor: Any,
        **options: Any,
    ):
        """`options`: RLVRWorkflow's (enable_thinking, dump_dir, reward_timeout, ...)."""
        super().__init__(reward_fn, gconfig, processor.tokenizer, **options)
        self.processor = processor

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        _, prompt_ids, images, mm = vision_prompt(self.processor, data, self.enable_thinking)
        row = {k: v for k, v in data.items() if k not in _INPUT_FIELDS}
        row["input_ids"] = prompt_ids
        image_data = [image_to_base64(img) for img in images]
        td = await super().arun_episode(_WithImages(engine, image_data), row)
        td.set(MM_KEY, stack_non_tensor([mm] * td.batch_size[0]))
        return td
