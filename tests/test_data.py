"""Round trips of the batch plumbing (padding, packing, micro-batching)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from arealite.utils.data import (
    allocate_balanced_mbs,
    concat_padded_tensors,
    lengths_of,
    pack_tensor_dict,
    pad_sequences_to_tensors,
    split_padded_tensor_dict,
    split_padded_tensor_dict_into_mb_list,
    unpack_sequence,
    unpack_tensor_dict,
)

lengths_st = st.lists(st.integers(min_value=0, max_value=12), min_size=0, max_size=10)


def _rows(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(1, 100, (n,), generator=g),
            "logprobs": torch.randn(n, generator=g, dtype=torch.float64),
            "rewards": torch.tensor(float(i)),
        }
        for i, n in enumerate(lengths)
    ]


def _assert_rows_equal(td: TensorDict, rows):
    lens = lengths_of(td).tolist()
    assert lens == [len(r["input_ids"]) for r in rows]
    for i, r in enumerate(rows):
        n = lens[i]
        assert torch.equal(td["input_ids"][i, :n], r["input_ids"])
        assert torch.equal(td["logprobs"][i, :n], r["logprobs"])
        assert td["rewards"][i].item() == r["rewards"].item()
        assert not td["attention_mask"][i, n:].any()


@given(lengths_st)
@settings(max_examples=60, deadline=None)
def test_pad_pack_unpack_round_trip(lengths):
    rows = _rows(lengths)
    td = pad_sequences_to_tensors(rows)
    if not lengths:
        assert td.batch_size[0] == 0
        return
    _assert_rows_equal(td, rows)
    packed = pack_tensor_dict(td)
    assert packed["input_ids"].shape == (sum(lengths),)
    assert packed["cu_seqlens"].tolist()[-1] == sum(lengths)
    assert set(packed["seq_keys"]) == {"input_ids", "logprobs"}
    for seq, r in zip(unpack_sequence(packed["input_ids"], packed["cu_seqlens"]), rows):
        assert torch.equal(seq, r["input_ids"])
    back = unpack_tensor_dict(packed)
    _assert_rows_equal(back, rows)


@given(st.lists(lengths_st.filter(bool), min_size=1, max_size=4))
@settings(max_examples=40, deadline=None)
def test_concat_pads_to_longest(groups):
    all_rows, tds = [], []
    for gi, lengths in enumerate(groups):
        rows = _rows(lengths, seed=gi)
        all_rows += rows
        tds.append(pad_sequences_to_tensors(rows))
    out = concat_padded_tensors(tds)
    assert out["input_ids"].shape[1] == max(max(g) for g in groups)
    _assert_rows_equal(out, all_rows)


@given(
    st.lists(st.integers(min_value=1, max_value=50), min_size=0, max_size=30),
    st.integers(min_value=1, max_value=120),
    st.integers(min_value=1, max_value=5),
)
@settings(max_examples=200, deadline=None)
def test_balanced_mbs_cover_respect_budget(lengths, budget, n_mbs):
    groups = allocate_balanced_mbs(lengths, budget, n_mbs)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(len(lengths)))  # every sequence exactly once
    for g in groups:
        tokens = sum(lengths[i] for i in g)
        assert tokens <= budget or len(g) == 1  # an oversize sequence sits alone
    if lengths:
        assert len(groups) >= min(n_mbs, len(lengths))


def test_balanced_mbs_are_balanced():
    lengths = [512, 16, 300, 200, 100, 90, 80, 70, 60, 50, 40, 30]
    groups = allocate_balanced_mbs(lengths, 600, 1)
    loads = [sum(lengths[i] for i in g) for g in groups]
    assert len(groups) == 3  # ceil(1548 / 600)
    assert max(loads) - min(loads) <= 100, loads


@given(lengths_st.filter(bool), st.integers(min_value=1, max_value=30), st.integers(1, 4))
@settings(max_examples=60, deadline=None)
def test_mb_list_restores_order(lengths, budget, n_mbs):
    rows = _rows(lengths)
    td = pad_sequences_to_tensors(rows)
    mbl = split_padded_tensor_dict_into_mb_list(td, budget, n_mbs)
    # Each mb is trimmed to its own longest row.
    for mb in mbl:
        assert mb["input_ids"].shape[1] == int(lengths_of(mb).max())
    in_mb_order = [r for mb in mbl for r in mb["rewards"].tolist()]
    restored = [in_mb_order[i] for i in mbl.backward_indices]
    assert restored == [float(i) for i in range(len(lengths))]


def test_empty_and_length_one_sequences():
    rows = _rows([0, 1, 0, 1])
    td = pad_sequences_to_tensors(rows)
    assert td["input_ids"].shape == (4, 1)
    packed = pack_tensor_dict(td)
    assert packed["cu_seqlens"].tolist() == [0, 0, 1, 1, 2]
    _assert_rows_equal(unpack_tensor_dict(packed), rows)


def test_split_padded_tensor_dict_contiguous():
    td = pad_sequences_to_tensors(_rows([3, 1, 4, 1, 5]))
    parts = split_padded_tensor_dict(td, 2)
    assert [p.batch_size[0] for p in parts] == [3, 2]
    assert torch.cat([p["rewards"] for p in parts]).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_mismatched_row_lengths_named():
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}]
    try:
        pad_sequences_to_tensors(rows)
    except ValueError as e:
        assert "row 0" in str(e) and "loss_mask" in str(e)
    else:
        raise AssertionError("expected a ValueError")
