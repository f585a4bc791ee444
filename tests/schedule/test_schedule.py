"""The block layout: vectorised ``build_block_schedule`` against the loop definition
``reference_block_schedule``, its invariants, and the routing-ids -> layout step.

Legend: G segments, Nb blocks, B block size, R valid rows, P padded rows, T tokens, K top-k.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixmoe.dispatch.layout import expert_row_layout
from mixmoe.reference.schedule import reference_block_schedule
from mixmoe.schedule.blocks import build_block_schedule
from mixmoe.schedule.sort import expert_counts, sort_by_expert

HYPO = settings(max_examples=150, deadline=None, database=None)

counts_strategy = st.lists(
    st.one_of(st.just(0), st.integers(1, 5), st.integers(60, 70), st.integers(0, 200)),
    min_size=0,
    max_size=8,
)


def _check_invariants(s, counts: list[int]) -> None:
    B = s.block_size
    R = sum(counts)
    assert s.num_rows == R
    assert s.src_P.numel() == s.num_padded_rows == s.num_blocks * B
    assert s.src_P.dtype == torch.int64
    # every valid row covered exactly once
    valid = s.src_P[s.src_P >= 0]
    assert sorted(valid.tolist()) == list(range(R))
    # partial blocks masked: src is -1 exactly at lanes >= rows of the block
    src_NbB = s.src_P.view(s.num_blocks, B)
    lane_B = torch.arange(B)
    masked_NbB = lane_B[None, :] >= s.block_rows_Nb[:, None]
    assert torch.equal(src_NbB < 0, masked_NbB)
    assert ((s.block_rows_Nb >= 1) & (s.block_rows_Nb <= B)).all()
    # inside a block rows are consecutive from block_row_start
    expect = s.block_row_start_Nb[:, None] + lane_B[None, :]
    assert torch.equal(src_NbB[~masked_NbB], expect[~masked_NbB])
    # padded_position_R is the inverse of src_P
    pos_R = s.padded_position_R()
    assert pos_R.shape == (R,)
    assert torch.equal(s.src_P[pos_R], torch.arange(R))
    # each block lies inside its segment
    seg_start = s.seg_row_start_G[s.block_seg_Nb]
    seg_end = seg_start + torch.tensor(counts, dtype=torch.int64)[s.block_seg_Nb]
    assert (s.block_row_start_Nb >= seg_start).all()
    assert (s.block_row_start_Nb + s.block_rows_Nb <= seg_end).all()


@HYPO
@given(
    counts=counts_strategy,
    block_size=st.sampled_from([1, 4, 64]),
    data=st.data(),
    pass_num_blocks=st.booleans(),
)
def test_matches_loop_reference(counts, block_size, data, pass_num_blocks):
    slots = data.draw(st.lists(st.integers(0, 9), min_size=len(counts), max_size=len(counts)))
    counts_G = torch.tensor(counts, dtype=torch.int64)
    slots_G = torch.tensor(slots, dtype=torch.int64)
    num_blocks = sum(-(-c // block_size) for c in counts) if pass_num_blocks else None
    s = build_block_schedule(counts_G, slots_G, num_blocks, block_size)
    ref = reference_block_schedule(counts, slots, block_size)

    assert s.block_size == block_size
    assert s.block_slot_Nb.tolist() == ref["block_slot"]
    assert s.block_seg_Nb.tolist() == ref["block_seg"]
    assert s.block_row_start_Nb.tolist() == ref["block_row_start"]
    assert s.block_rows_Nb.tolist() == ref["block_rows"]
    assert s.src_P.tolist() == ref["src"]
    starts = [sum(counts[:g]) for g in range(len(counts))]
    assert s.seg_row_start_G.tolist() == starts
    _check_invariants(s, counts)


def test_hand_example():
    # segments of 5, 0, 3 rows with slots 2, 0, 1 and B = 4:
    # seg 0 -> blocks [0..3], [4] ; seg 1 -> none ; seg 2 -> [5, 6, 7]
    s = build_block_schedule(torch.tensor([5, 0, 3]), torch.tensor([2, 0, 1]), block_size=4)
    assert s.block_slot_Nb.tolist() == [2, 2, 1]
    assert s.block_seg_Nb.tolist() == [0, 0, 2]
    assert s.block_row_start_Nb.tolist() == [0, 4, 5]
    assert s.block_rows_Nb.tolist() == [4, 1, 3]
    assert s.src_P.tolist() == [0, 1, 2, 3, 4, -1, -1, -1, 5, 6, 7, -1]
    assert s.padded_position_R().tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert s.num_rows == 8


def test_default_block_size_is_64():
    # DESIGN: "fixed 64-row blocks"; callers that pass no block size get exactly that layout
    counts, slots = [5, 0, 64, 65, 130], [3, 0, 1, 2, 4]
    s = build_block_schedule(torch.tensor(counts), torch.tensor(slots))
    ref = reference_block_schedule(counts, slots, 64)
    assert s.block_size == 64
    assert s.block_rows_Nb.tolist() == ref["block_rows"] == [5, 64, 64, 1, 64, 64, 2]
    assert s.src_P.tolist() == ref["src"]


def test_schedule_is_frozen():
    # a schedule is shared by the forward, the backward and the step's metadata: immutable
    s = build_block_schedule(torch.tensor([3, 1]), torch.tensor([0, 1]), block_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_rows = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.src_P = torch.zeros(4, dtype=torch.int64)  # type: ignore[misc]
    assert s.slot_ends is None  # set only by a layout that knows its segments' slot order
    rows = sort_by_expert(torch.tensor([[1, 0]]), 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rows.counts_N = torch.zeros(2, dtype=torch.int64)  # type: ignore[misc]


def test_built_on_the_input_device_without_host_sync():
    """With ``num_blocks`` and ``num_rows`` given, nothing is read back from the device: on the
    meta device (no data, so any ``.item()`` / ``int()`` / ``.tolist()`` raises) every tensor of
    the schedule is built, on the inputs' device, with the shapes of the CPU schedule."""
    counts, slots = [5, 0, 70, 64], [2, 0, 1, 3]
    cpu = build_block_schedule(torch.tensor(counts), torch.tensor(slots), block_size=16)
    meta = build_block_schedule(
        torch.tensor(counts, device="meta"),
        torch.tensor(slots, device="meta"),
        num_blocks=cpu.num_blocks,
        block_size=16,
        num_rows=sum(counts),
    )
    assert meta.num_rows == cpu.num_rows and meta.num_blocks == cpu.num_blocks
    for field in dataclasses.fields(cpu):
        want = getattr(cpu, field.name)
        if isinstance(want, torch.Tensor):
            got = getattr(meta, field.name)
            assert got.device.type == "meta", field.name
            assert (got.shape, got.dtype) == (want.shape, want.dtype), field.name
    pos_R = meta.padded_position_R()
    assert pos_R.device.type == "meta" and pos_R.shape == (sum(counts),)


def test_all_empty_segments():
    s = build_block_schedule(torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]), block_size=4)
    assert s.num_blocks == 0 and s.num_rows == 0 and s.src_P.numel() == 0
    assert s.padded_position_R().numel() == 0


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_block_size(bad):
    with pytest.raises(ValueError, match=f"block_size must be >= 1, got {bad}"):
        build_block_schedule(torch.tensor([1]), torch.tensor([0]), block_size=bad)


def test_mismatched_segment_tensors():
    with pytest.raises(ValueError, match="must be 1-D and of equal length"):
        build_block_schedule(torch.tensor([1, 2]), torch.tensor([0]), block_size=4)


# ---------------------------------------------------------------- ids -> row layout


@HYPO
@given(
    T=st.integers(0, 40),
    K=st.integers(1, 3),
    N=st.integers(1, 5),
    block_size=st.sampled_from([1, 4, 64]),
    drop_p=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_expert_row_layout(T, K, N, block_size, drop_p, seed):
    g = torch.Generator().manual_seed(seed)
    ids_TK = torch.randint(0, N, (T, K), generator=g)
    ids_TK[torch.rand(T, K, generator=g) < drop_p] = -1
    lay = expert_row_layout(ids_TK, N, block_size)
    s = lay.schedule
    P = s.num_padded_rows
    counts = [int((ids_TK == e).sum()) for e in range(N)]
    assert lay.counts_host == counts and lay.counts_N.tolist() == counts
    assert (
        s.block_slot_Nb.tolist()
        == reference_block_schedule(counts, list(range(N)), block_size)["block_slot"]
    )
    _check_invariants(s, counts)
    # every kept (token, choice) has a padded row holding its token, on a block of its expert;
    # dropped ones point at P (the zero row)
    for t in range(T):
        for k in range(K):
            p = int(lay.pos_TK[t, k])
            if ids_TK[t, k] < 0:
                assert p == P
            else:
                assert 0 <= p < P
                assert int(lay.token_P[p]) == t
                assert int(s.block_slot_Nb[p // block_size]) == int(ids_TK[t, k])
    # padding rows point at token T (the zero row); rows of one expert keep token order
    assert torch.equal(lay.token_P[s.src_P < 0], torch.full_like(lay.token_P[s.src_P < 0], T))
    for e in range(N):
        rows = [p for p in range(P) if s.src_P[p] >= 0 and s.block_slot_Nb[p // block_size] == e]
        toks = [int(lay.token_P[p]) for p in rows]
        assert toks == sorted(toks)


@pytest.mark.parametrize("seed", range(4))
def test_expert_counts_equal_a_loop_and_the_sort(seed: int) -> None:
    """``expert_counts`` (the count exchange's and the balance loss's counts) against a loop:
    expert 0 counted, dropped (-1) rows not, every expert a bin even when the last is unused."""
    g = torch.Generator().manual_seed(seed)
    N = 6
    ids_TK = torch.randint(0, N - 1, (9, 2), generator=g)  # expert N - 1 unused
    if seed % 2:
        ids_TK[torch.rand(9, 2, generator=g) < 0.3] = -1
    ids_TK[0, 0] = 0
    loop = [sum(int(i) == e for i in ids_TK.flatten()) for e in range(N)]
    got = expert_counts(ids_TK, N)
    assert got.dtype == torch.int64 and got.tolist() == loop
    assert sort_by_expert(ids_TK, N).counts_N.tolist() == loop
    assert expert_counts(torch.tensor([[0]]), 1).tolist() == [1]
    assert expert_counts(torch.tensor([[-1, -1]]), 3).tolist() == [0, 0, 0]


def test_row_layout_hand_example():
    # tokens 0..2, K = 2; expert 1 gets (0,0),(1,1),(2,0); expert 0 gets (0,1); (1,0) -> 2; (2,1) dropped
    ids = torch.tensor([[1, 0], [2, 1], [1, -1]])
    lay = expert_row_layout(ids, 3, block_size=2)
    # expert 0: 1 row -> block [x, pad]; expert 1: 3 rows -> [x, x], [x, pad]; expert 2: [x, pad]
    assert lay.token_P.tolist() == [0, 3, 0, 1, 2, 3, 1, 3]
    assert lay.pos_TK.tolist() == [[2, 0], [6, 3], [4, 8]]


def test_slot_ends_of_segments_in_slot_order():
    from mixmoe.schedule.blocks import slot_ends

    # slot 0: 5 rows (2 blocks of 4) + 0 rows; slot 1: none; slot 2: 4 + 1 rows (1 + 1 blocks)
    assert slot_ends([5, 0, 4, 1], [0, 0, 2, 2], 3, 4) == (8, 8, 16)
    assert slot_ends([], [], 2, 4) == (0, 0)
    assert slot_ends([3, 3], [1, 0], 2, 4) is None  # a slot comes back: not sorted by slot
    assert slot_ends([1, 1, 1, 1], [0, 2, 1, 2], 3, 4) is None  # a decrease inside
    assert slot_ends([1, 0, 1], [0, 1, 0], 2, 4) is None  # an empty segment in between
    assert slot_ends([3], [2], 2, 4) is None  # a slot past num_slots


def test_row_layout_is_built_on_the_ids_device_whatever_the_default():
    """The layout follows ``ids_TK``'s device, not torch's default one (here: meta)."""
    ids = torch.tensor([[1, 0], [2, 1], [1, -1]])
    with torch.device("meta"):
        lay = expert_row_layout(ids, 3, block_size=2)
    for t in (lay.token_P, lay.pos_TK, lay.counts_N, lay.schedule.block_slot_Nb):
        assert t.device == ids.device
    assert lay.token_P.tolist() == [0, 3, 0, 1, 2, 3, 1, 3]
    assert lay.pos_TK.tolist() == [[2, 0], [6, 3], [4, 8]]
