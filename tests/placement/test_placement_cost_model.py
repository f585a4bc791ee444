"""The cost model: hand-computed predictions on a 2-rank toy, invariants, input validation.

Legend: W ranks, E experts per rank, N = W*E experts, counts_WN[s][g] = rows s routes to g.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings
from array import array

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixmoe.placement import HardwareProfile, LayerShape, predict
from mixmoe.placement.cost_model import (
    LOADS,
    Prediction,
    StepModel,
    baseline_loads,
    counts_as_lists,
    counts_as_tensor,
    counts_with_sums,
    plan_loads,
    rank_loads,
    replica_map,
    step_model,
)

# Toy: W=2, E=1, D=2, F=4, fp32.
#   flops_per_row = 6 * 2 * D * F = 96; row_bytes rb = 8; P = (2*D*F + F + D) * 4 = 88 bytes.
# Profile: 96 FLOP/s -> 1 s per row; 8 B/s; 0.5 s per collective.
TOY_SHAPE = LayerShape(
    model_dim=2, hidden_dim=4, experts_per_rank=1, world_size=2, bytes_per_element=4
)
TOY_PROFILE = HardwareProfile("toy", gemm_flops=96.0, link_bandwidth=8.0, link_latency=0.5)
TOY_COUNTS = [[3, 2], [1, 4]]  # rank 0: 3 rows -> e0 (own), 2 -> e1; rank 1: 1 -> e0, 4 -> e1 (own)


def test_toy_no_replication_no_overlap() -> None:
    p = predict(TOY_COUNTS, {}, TOY_SHAPE, TOY_PROFILE, overlap=False)
    # rows computed: rank 0 = 3 + 1 (from rank 1) = 4; rank 1 = 2 (from rank 0) + 4 = 6
    assert p.rows == (4, 6)
    assert p.compute_s == (4.0, 6.0)
    # remote rows touching each rank: 2 (0 -> 1) + 1 (1 -> 0) = 3; sent = 2 * rb * 3 = 48 B
    # token time = 4 collectives * 0.5 s + 48 B / 8 B/s = 2 + 6 = 8 s; no replicas -> no weight time
    assert p.comm_s == (8.0, 8.0)
    assert p.token_bytes == (96, 96)  # sent + received = 4 * rb * 3
    assert p.weight_bytes == (0, 0)
    assert p.step_s == 14.0  # max(4 + 8, 6 + 8)


def test_toy_no_replication_overlap() -> None:
    p = predict(TOY_COUNTS, {}, TOY_SHAPE, TOY_PROFILE, overlap=True)
    # local compute (rows whose source is the computing rank): rank 0 = 3 s, rank 1 = 4 s
    # exposed token time = max(0, 8 - local): rank 0 = 5, rank 1 = 4
    assert p.comm_s == (5.0, 4.0)
    assert p.step_s == 10.0  # max(4 + 5, 6 + 4)


def test_toy_with_replica() -> None:
    p = predict(TOY_COUNTS, {1: (0,)}, TOY_SHAPE, TOY_PROFILE, overlap=True)
    # e1 replicated on rank 0: rank 0 computes 3 + 1 + 2 = 6 rows, rank 1 computes 4
    assert p.rows == (6, 4)
    assert p.compute_s == (6.0, 4.0)
    # only (1 -> e0) is remote: remote = 1 on both; token time = 2 + 2 * 8 * 1 / 8 = 4 s, hidden
    # behind local compute (rank 0: 3 + 2 = 5 s, rank 1: 4 s) -> exposed 0.
    # weights: rank 1 sends P = 88 B to rank 0 (fwd) and receives the grad (bwd): replica io = 1
    # on both; weight time = 2 collectives * 0.5 + 88 / 8 = 12 s, never overlapped.
    assert p.comm_s == (12.0, 12.0)
    assert p.token_bytes == (32, 32)
    assert p.weight_bytes == (176, 176)
    assert p.step_s == 18.0  # max(6 + 12, 4 + 12)


def test_toy_fixed_costs() -> None:
    """The optional fixed costs, each added where the module doc says, on the replica toy."""
    fixed = HardwareProfile(
        "toy-fixed",
        gemm_flops=96.0,
        link_bandwidth=8.0,
        link_latency=0.5,
        step_fixed_s=0.25,
        row_overhead_s=0.5,
        replica_fixed_s=3.0,
    )
    p = predict(TOY_COUNTS, {1: (0,)}, TOY_SHAPE, fixed, overlap=True)
    # compute: rows * (1 s + 0.5 s) + 0.25 s: rank 0 = 6 * 1.5 + 0.25, rank 1 = 4 * 1.5 + 0.25
    assert p.compute_s == (9.25, 6.25)
    # token 4 s hidden behind local (rank 0: 5 rows * 1.5 s, rank 1: 4 * 1.5) -> 0 exposed;
    # weights: 12 s + 1 replica (served / held) * 3 s
    assert p.comm_s == (15.0, 15.0)
    assert p.step_s == 24.25
    # nothing replicated: no replica term, step_fixed and row_overhead stay
    q = predict(TOY_COUNTS, {}, TOY_SHAPE, fixed, overlap=False)
    assert q.compute_s == (6.25, 9.25) and q.comm_s == (8.0, 8.0) and q.step_s == 17.25
    # all 0.0 (the default): the model without them, bit for bit
    zero = HardwareProfile("toy", 96.0, 8.0, 0.5, 0.0, 0.0, 0.0)
    assert predict(TOY_COUNTS, {1: (0,)}, TOY_SHAPE, zero) == predict(
        TOY_COUNTS, {1: (0,)}, TOY_SHAPE, TOY_PROFILE
    )


def test_hot_forms_agree() -> None:
    counts_WN = [[5, 1, 0, 7], [2, 9, 4, 0]]
    shape = LayerShape(4, 8, experts_per_rank=2, world_size=2, bytes_per_element=2)
    profile = HardwareProfile("p", 1e6, 1e5, 1e-4)
    # experts 0, 1 on rank 0; 2, 3 on rank 1. Remote sources: e0 <- 1, e1 <- 1, e3 <- 0.
    ref = predict(counts_WN, {1: (1,), 3: (0,)}, shape, profile)
    assert predict(counts_WN, [(1, [1]), (3, (0,))], shape, profile) == ref
    assert predict(counts_WN, [3, 1], shape, profile) == ref  # bare ids: the mixed rule
    assert predict(torch.tensor(counts_WN), {3: [0], 1: [1]}, shape, profile) == ref
    assert ref.rows == (5 + 1 + 7 + 2, 9 + 4)  # only (1 -> e0) still travels


@settings(max_examples=100, deadline=None)
@given(
    W=st.integers(1, 6),
    E=st.integers(1, 4),
    data=st.data(),
)
def test_invariants(W: int, E: int, data: st.DataObject) -> None:
    N = W * E
    counts_WN = data.draw(
        st.lists(st.lists(st.integers(0, 300), min_size=N, max_size=N), min_size=W, max_size=W)
    )
    hot = data.draw(st.lists(st.integers(0, N - 1), unique=True))
    shape = LayerShape(16, 32, E, W, 2)
    profile = HardwareProfile("p", 1e9, 1e8, 1e-5)
    p = predict(counts_WN, hot, shape, profile)
    assert sum(p.rows) == sum(map(sum, counts_WN))  # every row computed exactly once
    assert sum(p.token_bytes) % (4 * shape.row_bytes * 2) == 0  # each remote row: 2 ranks, 4 hops
    assert p.step_s == max(c + m for c, m in zip(p.compute_s, p.comm_s, strict=True))
    assert all(m >= 0 for m in p.comm_s)
    no_overlap = predict(counts_WN, hot, shape, profile, overlap=False)
    assert all(a <= b for a, b in zip(p.comm_s, no_overlap.comm_s, strict=True))


def test_bad_counts() -> None:
    with pytest.raises(ValueError, match=r"\(3, 2\).*\(2, 2\)"):
        predict(torch.ones(3, 2, dtype=torch.int64), {}, TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(ValueError, match="expected"):
        predict([[1, 2, 3], [1, 2, 3]], {}, TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(ValueError, match="expected"):
        predict([[1, 2]], {}, TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(ValueError, match=r"counts_WN\[1\]\[0\] = -4"):
        predict([[1, 2], [-4, 3]], {}, TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(ValueError, match=r"counts_WN\[0\]\[1\] = -1"):
        predict(torch.tensor([[1, -1], [0, 3]]), {}, TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(TypeError, match="float"):
        predict(torch.ones(2, 2), {}, TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(TypeError, match="counts_WN"):
        predict([[1.5, 2], [0, 3]], {}, TOY_SHAPE, TOY_PROFILE)


def test_bad_hot() -> None:
    with pytest.raises(ValueError, match="owner rank 1"):
        predict(TOY_COUNTS, {1: (1,)}, TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(ValueError, match="hot expert 5"):
        predict(TOY_COUNTS, {5: (0,)}, TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(ValueError, match="hot expert -1"):
        predict(TOY_COUNTS, [-1], TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(ValueError, match="listed twice"):
        predict(TOY_COUNTS, [1, (1, (0,))], TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(ValueError, match="distinct ranks"):
        predict(TOY_COUNTS, {1: (0, 0)}, TOY_SHAPE, TOY_PROFILE)
    with pytest.raises(ValueError, match="distinct ranks"):
        predict(TOY_COUNTS, {1: (2,)}, TOY_SHAPE, TOY_PROFILE)


@pytest.mark.parametrize("W", [1, 7, 8, 9, 16, 19])
@pytest.mark.parametrize("E", [1, 3])
def test_baseline_loads_equal_rank_loads(W: int, E: int) -> None:
    """The vectorised a2a aggregates (column sums reduced 8 rows at a time, plus the rest) equal
    the per-rank loop, for W below, at and above multiples of 8."""
    g = torch.Generator().manual_seed(W * 10 + E)
    C_WN = torch.randint(0, 1000, (W, W * E), generator=g)
    loads_4W, colsum_N, own_N = baseline_loads(C_WN, E)
    rows, local, remote, replica = rank_loads(C_WN.tolist(), {}, E)
    assert loads_4W.dtype == torch.float64
    assert loads_4W.tolist() == [rows, local, remote, replica]
    # LOADS names the stacked rows (the order the docstrings and the planner's deltas use)
    named = dict(zip(LOADS, loads_4W.tolist(), strict=True))
    assert named == {"rows": rows, "local": local, "remote": remote, "replica": replica}
    assert colsum_N.tolist() == [sum(C_WN[s, n].item() for s in range(W)) for n in range(W * E)]
    assert own_N.tolist() == [C_WN[n // E, n].item() for n in range(W * E)]


def test_check_exact_bounds_counts_and_factors() -> None:
    """Aggregates and per-row factors must stay below 2**53 (exact in float64)."""
    model = StepModel(TOY_SHAPE, TOY_PROFILE, overlap=True)
    model.check_exact(2**53 - 1)
    with pytest.raises(ValueError, match="too large"):
        model.check_exact(2**53)
    with pytest.raises(ValueError, match="too large"):
        predict([[2**53, 0], [0, 0]], {}, TOY_SHAPE, TOY_PROFILE)
    # the per-replica factor P = (2 D F + F + D) * bytes: with D = 1, 8 bytes, F = (2**50 - 1) / 3
    # it is exactly 2**53 (too large), one step of F below it is exact
    F = (2**50 - 1) // 3
    at = LayerShape(1, F, 1, 2, 8)
    below = LayerShape(1, F - 1, 1, 2, 8)
    assert at.params_bytes_per_expert == 2**53 > max(at.flops_per_row, 2 * at.row_bytes)
    StepModel(below, TOY_PROFILE, overlap=True).check_exact(1)
    with pytest.raises(ValueError, match="too large"):
        StepModel(at, TOY_PROFILE, overlap=True).check_exact(1)


SHAPE_FIELDS = (
    "model_dim",
    "hidden_dim",
    "experts_per_rank",
    "world_size",
    "bytes_per_element",
    "gemms_per_expert",
)


@pytest.mark.parametrize("field", SHAPE_FIELDS)
def test_layer_shape_takes_one_and_rejects_bools(field: str) -> None:
    """Every size may be 1 (a single GEMM, expert, rank or byte); ``True`` is no size even
    though ``bool`` is an ``int`` subclass: TypeError naming the field and the value."""
    sizes = dict(model_dim=8, hidden_dim=32, experts_per_rank=2, world_size=2, bytes_per_element=4)
    assert getattr(LayerShape(**{**sizes, field: 1}), field) == 1
    for flag in (True, False):
        want = rf"^LayerShape\.{field} must be an int, got {flag} \(bool\)$"
        with pytest.raises(TypeError, match=want):
            LayerShape(**{**sizes, field: flag})


def test_shape_and_prediction_are_frozen_and_shape_is_hashable() -> None:
    p = predict(TOY_COUNTS, {}, TOY_SHAPE, TOY_PROFILE)
    for record, name in ((TOY_SHAPE, "world_size"), (p, "step_s")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, name, 3)
    assert hash(TOY_SHAPE) == hash(dataclasses.replace(TOY_SHAPE))


def test_step_model_is_shared_and_refuses_a_non_bool_overlap() -> None:
    """Equal arguments give the same (immutable) model; ``1`` is refused even after ``True`` was
    cached (``True == 1`` and hash alike, so a cache lookup alone would hand the model out)."""
    shape = dataclasses.replace(TOY_SHAPE, model_dim=3)  # a key no other test caches
    model = step_model(shape, TOY_PROFILE, True)
    assert step_model(dataclasses.replace(shape), TOY_PROFILE, True) is model
    assert step_model(shape, TOY_PROFILE, False) is not model
    assert model.overlap is True and model.flops_per_row == shape.flops_per_row
    for bad in (1, 0, None):
        with pytest.raises(TypeError, match=f"overlap must be a bool, got {bad}"):
            step_model(shape, TOY_PROFILE, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.float16, torch.float64])
def test_count_tensors_must_hold_integers(dtype: torch.dtype) -> None:
    C_WN = torch.ones(2, 2, dtype=dtype)
    for check in (counts_as_tensor, counts_with_sums, counts_as_lists):
        with pytest.raises(TypeError, match=f"must hold integers, got dtype {dtype}"):
            check(C_WN, TOY_SHAPE)


def test_count_tensors_must_be_on_the_host() -> None:
    C_WN = torch.ones(2, 2, dtype=torch.int64, device="meta")
    for check in (counts_as_tensor, counts_with_sums):
        with pytest.raises(ValueError, match="must be a CPU tensor .* got device meta"):
            check(C_WN, TOY_SHAPE)


def test_count_tensor_forms() -> None:
    """An int64 contiguous tensor is returned as is; other integer tensors and nested lists are
    converted to int64 [W, N] with the same values; zeros are valid counts."""
    C_WN = torch.tensor([[0, 7], [2**40, 0]])
    assert counts_as_tensor(C_WN, TOY_SHAPE) is C_WN
    assert counts_as_lists(C_WN, TOY_SHAPE) == [[0, 7], [2**40, 0]]
    for form in (C_WN.t().contiguous().t(), [[0, 7], [2**40, 0]], ((0, 7), (2**40, 0))):
        got = counts_as_tensor(form, TOY_SHAPE)
        assert got.dtype == torch.int64 and got.is_contiguous() and torch.equal(got, C_WN)
    small = torch.tensor([[0, 7], [300, 0]], dtype=torch.int16)
    C, colsum_N, rowsum_W = counts_with_sums(small, TOY_SHAPE)
    assert C.dtype == torch.int64 and C.tolist() == [[0, 7], [300, 0]]
    assert colsum_N.tolist() == [300, 7] and rowsum_W.tolist() == [7, 300]


def test_negative_count_of_a_one_by_one_layer() -> None:
    """W = N = 1: a single count, checked by every entry point (no shortcut for tiny C)."""
    one = LayerShape(2, 4, experts_per_rank=1, world_size=1, bytes_per_element=4)
    for check in (counts_as_tensor, counts_with_sums, counts_as_lists):
        with pytest.raises(ValueError, match=r"counts_WN\[0\]\[0\] = -3 is negative"):
            check(torch.tensor([[-3]]), one)
        with pytest.raises(ValueError, match=r"counts_WN\[0\]\[0\] = -3 is negative"):
            check([[-3]], one)
    C, colsum_N, rowsum_W = counts_with_sums(torch.tensor([[5]]), one)
    assert (C.tolist(), colsum_N.tolist(), rowsum_W.tolist()) == ([[5]], [5], [5])


def test_replica_map_bare_ids_pick_the_non_owners_that_route_to_the_expert() -> None:
    """A bare id g means a replica on every rank s != owner with C[s][g] > 0: a rank with one
    row gets one, a rank with none does not; holders ascend; the last expert id is N - 1."""
    shape = LayerShape(4, 8, experts_per_rank=2, world_size=4, bytes_per_element=2)
    C = [[0] * 8 for _ in range(4)]
    for s, c in ((0, 1), (1, 0), (2, 5), (3, 9)):
        C[s][3] = c  # expert 3: owner rank 1
    C[0][7] = 4  # expert 7 (the last): owner rank 3
    assert replica_map([3, 7], C, shape) == {3: (0, 2, 3), 7: (0,)}
    assert replica_map({7: [2, 0]}, C, shape) == {7: (0, 2)}
    assert replica_map([(7, (2, 0)), [3, []]], C, shape) == {7: (0, 2), 3: ()}
    with pytest.raises(ValueError, match=r"hot expert 8 is out of range \[0, 8\)"):
        replica_map([8], C, shape)
    with pytest.raises(ValueError, match=r"holders \(4,\) of hot expert 3 must be distinct"):
        replica_map({3: (4,)}, C, shape)
    with pytest.raises(
        ValueError, match=r"holders \(2, 1\) of hot expert 3 contain its owner rank 1"
    ):
        replica_map({3: (2, 1)}, C, shape)  # E = 2: the owner is 3 // 2


def test_plan_loads_skips_an_empty_holder_list_and_goes_on() -> None:
    W, E = 3, 2
    C_WN = torch.randint(1, 50, (W, W * E), generator=torch.Generator().manual_seed(5))
    replicas = ((0, ()), (3, (0, 2)), (5, ()), (4, (1,)))
    want = rank_loads(C_WN.tolist(), dict(replicas), E)
    assert plan_loads(C_WN, replicas, E).tolist() == [list(map(float, v)) for v in want]
    assert want[3] == [1, 3, 2]  # e3 (owner 1) on ranks 0, 2; e4 (owner 2) on rank 1


def test_count_lists_of_the_wrong_shape_name_their_shape() -> None:
    want = r"^counts_WN has {}, expected \(world_size, num_experts\) = \(2, 2\)$"
    for counts_WN, got in (
        ([[1, 2, 3], [1, 2, 3]], r"2 rows of lengths \[3\]"),
        ([[1, 2], [1], [4, 5, 6]], r"3 rows of lengths \[1, 2, 3\]"),
        ([], r"0 rows of lengths \[\]"),
    ):
        with pytest.raises(ValueError, match=want.format(got)):
            counts_as_lists(counts_WN, TOY_SHAPE)


def test_counts_with_sums_blocks_write_their_own_rows_without_a_resize(monkeypatch) -> None:
    """The row-block path (forced: blocks of 2 rows, the last one short) writes each block's row
    sums into its slice of the output, no resize of an ``out=`` view (torch warns on one)."""
    import mixmoe.placement.counts as counts_mod  # the count arithmetic's own module

    monkeypatch.setattr(counts_mod, "_BLOCK_BYTES", 8 * 6 * 2)
    monkeypatch.setattr(counts_mod, "_ONE_PASS_BYTES", 0)
    shape = LayerShape(8, 8, experts_per_rank=2, world_size=3, bytes_per_element=2)
    C_WN = torch.randint(0, 1000, (3, 6), generator=torch.Generator().manual_seed(9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C, colsum_N, rowsum_W = counts_with_sums(C_WN, shape)
    assert C is C_WN
    assert colsum_N.tolist() == [sum(row[n] for row in C_WN.tolist()) for n in range(6)]
    assert rowsum_W.tolist() == [sum(row) for row in C_WN.tolist()]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 10**7), min_size=4, max_size=4),
    st.booleans(),
    st.integers(0, 5),
    st.booleans(),
    st.sampled_from([0.0, 1.3e-7]),
    st.sampled_from([0.0, 2.5e-5]),
)
def test_total_fn_equals_rank_total_bit_for_bit(loads, any_remote, rounds, overlap, row_s, rep_s):
    """The search's bound closure and ``rank_total`` give the same float (fixed costs on and
    off, overlap on and off, no rounds or several)."""
    profile = HardwareProfile(
        "p", 3.7e14, 4.1e10, 2.9e-5, step_fixed_s=row_s * 1e3, row_overhead_s=row_s,
        replica_fixed_s=rep_s,
    )  # fmt: skip
    model = StepModel(LayerShape(1024, 4096, 4, 8, 2, 3), profile, overlap)
    total = model.total_fn(any_remote, rounds)
    rows, local, remote, replica = loads
    local = min(local, rows)
    want = model.rank_total(rows, local, remote, replica, any_remote, rounds)
    assert total(rows, local, remote, replica) == want
    assert want == sum(model.rank_seconds(rows, local, remote, replica, any_remote, rounds))


def test_a_packed_prediction_is_the_eager_one():
    """``Prediction.packed`` (the compiled planner's): each field decoded when first read, the
    others left packed; equal, equally hashed and printed, pickled and copied as the eager one,
    before and after decoding; frozen."""
    eager = Prediction((0.5, 1.25, -0.0), (2.0, 0.1, 3.5), (1, 2, 3), (4, 5, 6), (7, 8, 2**40), 4.0)

    def packed() -> Prediction:
        reals = array("d", [*eager.compute_s, *eager.comm_s]).tobytes()
        ints = array("q", [*eager.token_bytes, *eager.weight_bytes, *eager.rows]).tobytes()
        return Prediction.packed(eager.step_s, reals, ints)

    p = packed()
    assert p.rows == eager.rows and "rows" in vars(p) and "compute_s" not in vars(p)
    assert p.comm_s == eager.comm_s and p.weight_bytes == eager.weight_bytes
    for q in (packed(), p):  # nothing decoded yet; partly decoded
        assert q == eager and eager == q and hash(q) == hash(eager) and repr(q) == repr(eager)
        assert [x.hex() for x in q.compute_s] == [x.hex() for x in eager.compute_s]
    for q in (packed(), p):
        assert pickle.loads(pickle.dumps(q)) == eager
        assert copy.deepcopy(q) == eager and dataclasses.replace(q) == eager
    with pytest.raises(dataclasses.FrozenInstanceError):
        packed().rows = ()
    with pytest.raises(AttributeError, match="no attribute 'rank'"):
        packed().rank  # noqa: B018


def test_fill_link_blends_the_two_links_by_the_share_of_far_peers() -> None:
    """``StepModel.fill_link``: on one link (or one node) the model itself; across nodes a copy
    whose one link charges a byte the mean time over a rank's peers, every term else unchanged."""
    nodes = HardwareProfile("nodes", 1e12, 4e9, 1e-5, ranks_per_node=4, inter_node_bandwidth=1e9,
                            inter_node_latency=3e-5)  # fmt: skip
    shape = LayerShape(model_dim=8, hidden_dim=16, experts_per_rank=2, world_size=13,
                       bytes_per_element=4)  # fmt: skip
    model = StepModel(shape, nodes, True)
    one = StepModel(shape, TOY_PROFILE, True)
    assert one.fill_link(13, None) is one
    assert model.fill_link(4, 4) is model and model.fill_link(3, 4) is model  # one node
    fill = model.fill_link(13, 4)
    # 9 of 12 peers far: a byte takes 9/12 of 1 ns + 3/12 of 0.25 ns = 0.8125 ns
    assert fill.bw == pytest.approx(1 / 0.8125e-9, rel=1e-15)
    assert fill.bw == 1.0 / ((13 - 4) / (13 - 1) / 1e9 + (1.0 - (13 - 4) / (13 - 1)) / 4e9)
    assert fill.bw_inter is None and model.bw == 4e9 and model.bw_inter == 1e9  # a copy
    assert fill.lat == model.lat == 3e-5  # the nodes' latency already (W spans nodes)
    loads_4W = torch.tensor([[64.0, 8.0], [16.0, 0.0], [48.0, 8.0], [1.0, 0.0]])
    compute, comm = fill.seconds_W(loads_4W, True, 1)
    for r in range(2):  # the batch and the scalar arithmetic agree on the new link
        rows, local, remote, replica = (int(x) for x in loads_4W[:, r])
        c, m = fill.rank_seconds(rows, local, remote, replica, True, 1)
        assert (compute[r].item(), comm[r].item()) == (c, m)
        assert c == model.rank_seconds(rows, local, remote, replica, True, 1)[0]
        assert m > model.rank_seconds(rows, local, remote, replica, True, 1)[1]  # slower link


def test_split_totals_price_each_copy_at_its_link() -> None:
    """A fill's copy across nodes keeps both links for the relay's copies (``bw_near``,
    ``bw_far``): ``split_total_fn`` charges the rows at the blend and each copy at the link it
    crosses (a hand reference); with no copy crossing it is the one link's total with the copies
    at the intra-node link; a model not from ``fill_link`` has no split."""
    nodes = HardwareProfile("nodes", 1e12, 4e9, 1e-5, ranks_per_node=4, inter_node_bandwidth=1e9,
                            inter_node_latency=3e-5, replica_fixed_s=2e-6)  # fmt: skip
    shape = LayerShape(model_dim=8, hidden_dim=16, experts_per_rank=2, world_size=13,
                       bytes_per_element=4)  # fmt: skip
    model = StepModel(shape, nodes, True)
    fill = model.fill_link(13, 4)
    assert (fill.bw_near, fill.bw_far) == (4e9, 1e9) and model.bw_far is None
    with pytest.raises(ValueError, match="fill_link"):
        model.split_total_fn(True, 1)
    P, fpr, tbr = shape.params_bytes_per_expert, shape.flops_per_row, 2 * shape.row_bytes
    for rows, local, remote, replica, inter, rounds in [
        (64, 8, 48, 1.75, 0.5, 2), (0, 0, 0, 0.0, 0.0, 0), (10, 10, 0, 3.0, 1.0, 3), (5, 0, 90, 1.0, 1.0, 1)
    ]:  # fmt: skip
        got = fill.split_total_fn(True, rounds)(rows, local, remote, replica, inter)
        token = max(0.0, 4 * 3e-5 + remote * tbr / fill.bw - local * fpr / 1e12)  # 4 collectives
        weight = 0.0
        if rounds:
            weight = 2 * rounds * 3e-5 + (replica - inter) * P / 4e9 + inter * P / 1e9
            weight += replica * 2e-6
        assert got == pytest.approx(rows * fpr / 1e12 + token + weight, rel=1e-14)
        one = StepModel(shape, HardwareProfile("one", 1e12, 4e9, 1e-5, replica_fixed_s=2e-6), True)
        one.bw, one.lat = fill.bw, fill.lat  # rows at the blend, no copy crossing a node
        near = one.rank_total(rows, local, remote, 0, True, 0) + (
            2 * rounds * 3e-5 + replica * P / 4e9 + replica * 2e-6 if rounds else 0.0
        )
        assert fill.split_total_fn(True, rounds)(rows, local, remote, replica, 0.0) == (
            pytest.approx(near, rel=1e-14)
        )
