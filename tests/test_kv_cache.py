"""The embedded server's KV cache layer with spare rows and columns (server/kv_batch.py
`SlackLayer`): through appends that outgrow its buffer, row selection, dropped leading columns,
stacked batches and rows replaced by the last ones it holds exactly what transformers'
DynamicLayer holds; decoding steps, joins that fit and leaves write in place; and a runner whose
rows join and leave mid-decode samples the logprobs of a teacher-forced forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _teacher_forced import teacher_forced_logprobs
from transformers.cache_utils import DynamicLayer

from arealite.server.kv_batch import (
    SlackLayer,
    can_join,
    fill_holes,
    new_cache,
    spare_columns,
    spare_rows,
)


def kv(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 2, cols, 4, generator=gen), torch.randn(
        rows, 2, cols, 4, generator=gen
    )


def same(slack: SlackLayer, plain: DynamicLayer) -> None:
    torch.testing.assert_close(slack.keys, plain.keys, rtol=0, atol=0)
    torch.testing.assert_close(slack.values, plain.values, rtol=0, atol=0)
    assert slack.get_seq_length() == plain.get_seq_length()


def holding(keys_values) -> tuple[SlackLayer, DynamicLayer]:
    """A SlackLayer and a DynamicLayer, each updated with the same keys and values."""
    slack, plain = SlackLayer(), DynamicLayer()
    for layer in (slack, plain):
        layer.update(*keys_values)
    return slack, plain


def assert_teacher_forced(ref, done: list, atol: float) -> None:
    """Each finished sequence's sampled logprobs are those of `ref` run over its whole text."""
    for s in done:
        want = teacher_forced_logprobs(ref, s.req.input_ids, s.output_ids)
        torch.testing.assert_close(torch.tensor(s.output_logprobs), want, atol=atol, rtol=0)


def test_slack_layer_matches_dynamic_layer_through_growth_and_surgery():
    gen = torch.Generator().manual_seed(0)
    slack, plain = holding(kv(3, 5, gen))
    same(slack, plain)
    for _ in range(60):  # 5 + 60 columns: outgrows 5 + spare_columns(5) at least once
        step = kv(3, 1, gen)
        k, v = slack.update(*step)
        plain.update(*step)
        torch.testing.assert_close(k, plain.keys, rtol=0, atol=0)
    same(slack, plain)
    rows = torch.tensor([2, 0, 0])  # a kept row and a repeated one
    for layer in (slack, plain):
        layer.batch_select_indices(rows)
    same(slack, plain)
    slack.drop_leading_columns(3)
    plain.keys, plain.values = plain.keys[:, :, 3:], plain.values[:, :, 3:]
    same(slack, plain)
    other_s, other_p = SlackLayer(), DynamicLayer()
    joining = kv(2, 70, gen)  # wider than the running rows: they are the ones padded
    other_s.update(*joining)
    other_p.update(*joining)
    slack.stack_rows(other_s, 70)
    padded = [F.pad(t, [0, 0, 70 - t.shape[2], 0]) for t in (plain.keys, plain.values)]
    plain.keys = torch.cat([padded[0], other_p.keys])
    plain.values = torch.cat([padded[1], other_p.values])
    same(slack, plain)
    step = kv(5, 1, gen)
    slack.update(*step)
    plain.update(*step)
    same(slack, plain)


def test_a_decoding_step_writes_into_the_buffer_it_already_has():
    gen = torch.Generator().manual_seed(1)
    layer = SlackLayer()
    layer.update(*kv(4, 10, gen))
    buffer = layer.keys.untyped_storage().data_ptr()
    for _ in range(spare_columns(10)):  # exactly the spare columns: no new buffer
        layer.update(*kv(4, 1, gen))
    assert layer.keys.untyped_storage().data_ptr() == buffer
    layer.update(*kv(4, 1, gen))  # one more: it grows
    assert layer.keys.untyped_storage().data_ptr() != buffer
    assert layer.get_seq_length() == 11 + spare_columns(10)


def test_rows_join_into_free_rows_and_leave_by_moving_the_last_ones():
    gen = torch.Generator().manual_seed(2)
    slack, plain = holding(kv(3, 6, gen))
    first, plain_first = holding(kv(2, 9, gen))  # wider: the running rows are re-laid out

    def stack(joining_s, joining_p, width):
        slack.stack_rows(joining_s, width)
        pad = [F.pad(t, [0, 0, width - t.shape[2], 0]) for t in (plain.keys, plain.values)]
        theirs = [
            F.pad(t, [0, 0, width - t.shape[2], 0]) for t in (joining_p.keys, joining_p.values)
        ]
        plain.keys, plain.values = torch.cat([pad[0], theirs[0]]), torch.cat([pad[1], theirs[1]])

    stack(first, plain_first, 9)
    same(slack, plain)
    assert slack._buffers["keys"].shape[0] == 5 + spare_rows(5)
    buffer = slack.keys.untyped_storage().data_ptr()
    narrow_s, narrow_p = holding(kv(4, 4, gen))  # narrower, within the free rows: in place
    stack(narrow_s, narrow_p, 9)
    same(slack, plain)
    assert slack.keys.untyped_storage().data_ptr() == buffer
    keep = [0, 2, 5, 7, 8]  # rows 1, 3, 4, 6 leave; 5, 7, 8 move into places 1, 3, 4
    order = fill_holes(keep)
    assert order == [0, 5, 2, 7, 8]
    moved = [i for i, o in enumerate(order) if o != i]
    slack.move_rows(torch.tensor([order[i] for i in moved]), torch.tensor(moved), len(order))
    plain.batch_select_indices(torch.tensor(order))
    same(slack, plain)
    assert slack.keys.untyped_storage().data_ptr() == buffer
    step = kv(5, 1, gen)
    slack.update(*step)
    plain.update(*step)
    same(slack, plain)


def test_rows_joining_and_leaving_mid_decode_keep_every_row_exact(tiny_model_dir):
    """Rows of different prompt and answer lengths join a running fp32 batch at different
    steps and leave as they finish (moved rows, joins into free rows, trimmed columns): every
    finished row's logprobs are a teacher-forced forward's."""
    from transformers import AutoModelForCausalLM

    from arealite.server.model_runner import ModelRunner
    from arealite.server.protocol import GenerateRequest, SamplingParams

    runner = ModelRunner(tiny_model_dir, dtype="float32", device="cpu")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def seq(i, prompt_len, n):
        params = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
        ids = [(7 * i + j) % 50 + 5 for j in range(prompt_len)]
        return runner.new_sequence(GenerateRequest(rid=str(i), input_ids=ids, params=params))

    joining = {
        0: [seq(0, 3, 30), seq(1, 12, 4), seq(2, 5, 9)],
        2: [seq(3, 20, 6)],
        5: [seq(4, 2, 25), seq(5, 4, 3), seq(6, 6, 12)],
        11: [seq(7, 3, 8), seq(8, 9, 2)],
    }
    done, step = [], 0
    with torch.inference_mode():
        while step <= max(joining) or runner.num_running:
            done += runner.step(joining.get(step, []))
            step += 1
        assert len(done) == 9
        assert_teacher_forced(ref, done, atol=1e-4)


def test_new_cache_uses_slack_layers_for_full_attention_only(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert can_join(new_cache(config))
    config.layer_types = ["sliding_attention"] + config.layer_types[1:]
    config.sliding_window = 8
    hybrid = new_cache(config)
    assert not can_join(hybrid) and isinstance(hybrid.layers[1], SlackLayer)


def test_a_bf16_model_on_cpu_attends_in_fp32_over_an_fp32_cache(tiny_model_dir):
    """server/cpu_attention.py: a bf16 model served on CPU keeps bf16 weights, an fp32 KV cache
    and fp32 attention; its sampled logprobs match a teacher-forced forward of the same bf16
    weights with the same attention, through a cache that grows mid-decode."""
    from transformers import AutoModelForCausalLM

    from arealite.server import cpu_attention
    from arealite.server.model_runner import ModelRunner
    from arealite.server.protocol import GenerateRequest, SamplingParams

    runner = ModelRunner(tiny_model_dir, dtype="bfloat16", device="cpu")
    assert runner.kv_dtype == torch.float32
    assert runner.model.config._attn_implementation == cpu_attention.NAME
    assert runner.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ref = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.bfloat16, attn_implementation=cpu_attention.NAME
    ).eval()

    def seq(ids, n):
        params = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)
        return runner.new_sequence(GenerateRequest(rid=str(ids), input_ids=ids, params=params))

    done = []
    with torch.inference_mode():
        done += runner.step([seq([5, 6, 7], 40), seq(list(range(10, 30)), 6)])
        layer = runner.batch.cache.layers[0]
        assert layer.keys.dtype == torch.float32 and layer.values.dtype == torch.float32
        while runner.num_running:
            done += runner.step([])
        # bf16 matmuls over other shapes round differently: bf16's tolerance, not 0
        assert_teacher_forced(ref, done, atol=0.01)
