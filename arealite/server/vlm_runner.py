"""Vision-language serving (Qwen2-VL family): what the embedded server adds for `image_data`.

The client sends `input_ids` already expanded by the HF processor (one `<|image_pad|>` per merged
patch) plus one base64 image per pad run, as AReaL's client does and SGLang accepts. Here each
image goes through the model's image processor; the k-th pad run must have exactly as many
tokens as image k yields (a run of one pad is expanded, as SGLang does), else the request is a
400 naming the image. Prefill feeds `pixel_values` / `image_grid_thw` and per-sequence M-RoPE
positions (`get_rope_index`); decoding continues at `L + rope_delta` on all three M-RoPE rows,
so the KV-cache batching of `ModelRunner` is reused unchanged. Text-only requests to a VLM take
the same path with plain positions. Pad tokens are never sampled (they would read as image
slots on resubmission and in training).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arealite.server.model_runner import ModelRunner, Sequence
from arealite.server.protocol import BadRequest, GenerateRequest
from arealite.utils.vision import (
    checkpoint_to_module_names,
    concat_mm_inputs,
    decode_base64_image,
    image_pad_runs,
    image_token_ids,
    is_vlm_config,
    rope_index,
)


@dataclass
class VisionSequence(Sequence):
    """A request with its preprocessed images (None when it has none)."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


class VLMRunner(ModelRunner):
    auto_model_class = "AutoModelForImageTextToText"
    accepts_images = True

    def __init__(self, model_path: str, dtype: str = "auto", device: str | None = None, seed=0):
        from transformers import AutoImageProcessor

        super().__init__(model_path, dtype=dtype, device=device, seed=seed)
        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.image_token_id, self.video_token_id = image_token_ids(self.model.config)
        self.merge_size = int(self.model.config.vision_config.spatial_merge_size)
        self._names: dict[str, str] | None = None
        self._pad_mask: torch.Tensor | None = None

    # ---- requests -------------------------------------------------------------------------
    def new_sequence(self, req: GenerateRequest) -> VisionSequence:
        """Decode and preprocess the images, check them against the pad runs (CPU work: the
        HTTP layer calls this off the event loop)."""
        base = super().new_sequence(req)
        if self.video_token_id is not None and self.video_token_id in req.input_ids:
            raise BadRequest("input_ids: video tokens are not supported by the embedded server")
        runs = image_pad_runs(req.input_ids, self.image_token_id)
        if len(runs) != len(req.image_data):
            raise BadRequest(
                f"image_data: {len(req.image_data)} images for {len(runs)} <|image_pad|> runs "
                "in input_ids (one image per run, in order)"
            )
        seq = VisionSequence(req=req, stop_ids=base.stop_ids)
        if not runs:
            return seq
        images = []
        for i, item in enumerate(req.image_data):
            try:
                images.append(decode_base64_image(item))
            except ValueError as e:
                raise BadRequest(f"image_data[{i}]: {e}") from None
        out = self.image_processor(images=images, return_tensors="pt")
        thw = out["image_grid_thw"].long()
        req.input_ids = self._check_runs(req, runs, thw, images)
        seq.pixel_values, seq.image_grid_thw = out["pixel_values"], thw
        return seq

    def _check_runs(self, req: GenerateRequest, runs, thw: torch.Tensor, images) -> list[int]:
        """input_ids with every pad run of the right length (single pads expanded)."""
        ids = list(req.input_ids)
        for k in reversed(range(len(runs))):  # right to left keeps earlier starts valid
            start, n = runs[k]
            need = int(thw[k].prod()) // self.merge_size**2
            if n == need:
                continue
            if n != 1:
                w, h = images[k].size
                raise BadRequest(
                    f"image_data[{k}]: its <|image_pad|> run in input_ids has {n} tokens, but "
                    f"the {w}x{h} image needs {need} (grid {thw[k].tolist()})"
                )
            ids[start : start + 1] = [self.image_token_id] * need
        budget = len(ids) + req.params.max_new_tokens
        if budget > self.max_positions:
            raise BadRequest(
                f"input_ids: expanded prompt ({len(ids)}) + max_new_tokens exceeds "
                f"max_position_embeddings={self.max_positions}"
            )
        return ids

    # ---- prefill --------------------------------------------------------------------------
    def _prefill_inputs(self, seqs: list[Sequence], ids: torch.Tensor, mask: torch.Tensor):
        """M-RoPE positions [3, B, W] per left-padded row, next position L + delta per row,
        and the rows' images concatenated in row order (the order of their pads in `ids`)."""
        B, W = ids.shape
        positions = torch.zeros(3, B, W, dtype=torch.long, device=ids.device)
        nxt = []
        for i, s in enumerate(seqs):
            L = len(s.req.input_ids)
            pos, delta = rope_index(self.model, ids[i, W - L :], s.image_grid_thw)
            positions[:, i, W - L :] = pos
            nxt.append(L + delta)
        extra = {}
        mm = concat_mm_inputs(
            [
                {"pixel_values": s.pixel_values, "image_grid_thw": s.image_grid_thw}
                for s in seqs
                if s.image_grid_thw is not None
            ]
        )
        if mm is not None:
            extra = {
                "pixel_values": mm["pixel_values"].to(self.device, self.dtype),
                "image_grid_thw": mm["image_grid_thw"].to(self.device),
            }
        return positions, torch.tensor(nxt, device=self.device), extra

    def _banned(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor | None:
        """Image/video pads are never sampled: a generated pad would read as an image slot when
        the trajectory is resubmitted or trained on. Logprobs still describe the full
        distribution (as the trainer computes them)."""
        banned = super()._banned(seqs, logits)
        if self._pad_mask is None or self._pad_mask.shape[-1] != logits.shape[-1]:
            mask = torch.zeros(1, logits.shape[-1], dtype=torch.bool)
            ids = [t for t in (self.image_token_id, self.video_token_id) if t is not None]
            mask[0, [t for t in ids if t < logits.shape[-1]]] = True
            self._pad_mask = mask.to(logits.device)
        return self._pad_mask if banned is None else banned | self._pad_mask

    # ---- weights --------------------------------------------------------------------------
    def _module_names(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint names (`model.layers.*`, `visual.*`) -> our module names."""
        if self._names is None:
            self._names = checkpoint_to_module_names(self.model)
        return {self._names.get(k, k): v for k, v in state.items()}

    def _read_safetensors(self, files: list[str]) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        state = self._module_names(state)
        return state if self._matches(state) else None

    def load_named_tensors(self, tensors: list[tuple[str, torch.Tensor]]) -> str:
        return super().load_named_tensors(list(self._module_names(dict(tensors)).items()))


def create_runner(model_path: str, **kwargs) -> ModelRunner:
    """A VLMRunner for a vision-language checkpoint (config has vision_config), else a
    ModelRunner: the text path stays exactly as it was."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    cls = VLMRunner if is_vlm_config(config) else ModelRunner
    return cls(model_path, **kwargs)
