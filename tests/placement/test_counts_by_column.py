"""C stored by columns (``C_WN.t()`` contiguous: the mixed strategy's count exchange,
``dispatch.layout``): the compiled parts that read C in that storage (the baseline and its sums,
``plan_mix``, the fit, the step's bookkeeping) give what they give on the same counts stored
row-major, value for value, on every workload, with one link and with nodes, with and without
C's sums; counts they do not read that way fall back as before.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixmoe.dispatch.layout import count_matrix_to_host, pack_counts, unpack_counts
from mixmoe.dispatch.step_plan import build_step_plan
from mixmoe.gating.imbalance import workload_counts
from mixmoe.gating.synthetic import redrawn_counts
from mixmoe.placement import GPU_PROFILE, LayerShape, native_lib, plan_mix
from mixmoe.placement.counts import counts_storage
from mixmoe.placement.native_pricing import baseline, count_sums
from mixmoe.placement.profile_io import load_profile
from mixmoe.placement.refit import carried_plan, refit_plan
from mixmoe.placement.relay import node_distance

pytestmark = pytest.mark.skipif(not native_lib.available(), reason="the compiled planner")

NODES = load_profile("h100-nvlink-ib")  # 8 ranks a node
PROFILES = {"one link": GPU_PROFILE, "nodes of 4": dataclasses.replace(NODES, ranks_per_node=4),
            "nodes of 8": NODES}  # fmt: skip
WORKLOADS = ("zipf:1.2", "zipf:2.0", "hot:0.5", "hotset:4:0.5", "hotrank:0.5", "idle:0.25")


def by_column(C_WN: torch.Tensor) -> torch.Tensor:
    """The same counts, stored by columns (with one rank or one expert: both layouts)."""
    out = C_WN.t().contiguous().t()
    assert out.t().is_contiguous() and torch.equal(out, C_WN)
    assert out.is_contiguous() == (min(C_WN.shape) == 1)
    return out


def _shape(W: int, E: int) -> LayerShape:
    return LayerShape(model_dim=1024, hidden_dim=4096, experts_per_rank=E, world_size=W,
                      bytes_per_element=2)  # fmt: skip


def _counts(workload: str, W: int, E: int, seed: int = 0) -> torch.Tensor:
    return workload_counts(workload, W, 8192, 2, W * E, seed=seed)[0]


@pytest.mark.parametrize(("W", "E"), [(1, 3), (3, 2), (9, 1), (16, 4), (24, 3)])
def test_baseline_and_sums_by_columns(W, E):
    """One pass over C's storage by columns: the same loads, column sums, own rows and row
    sums (its rows are C's columns); a negative count anywhere still gives None."""
    C = torch.randint(0, 50, (W, W * E), generator=torch.Generator().manual_seed(W))
    C[W // 2, (W * E) // 3] = 2**40  # above int32
    want = baseline(C, E)
    got = baseline(by_column(C), E)
    assert want is not None and got is not None
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    sums = count_sums(by_column(C), E)
    assert sums.colsum_N.tolist() == C.sum(0).tolist()
    assert sums.rowsum_W.tolist() == C.sum(1).tolist()
    C[W - 1, W * E - 1] = -1  # the last count of the storage
    assert baseline(by_column(C), E) is None


def test_counts_storage_keeps_each_layout():
    C = torch.arange(12).reshape(3, 4)
    shape = _shape(3, 1)
    shape = dataclasses.replace(shape, experts_per_rank=1, world_size=3)
    with pytest.raises(ValueError, match="expected"):  # the checks are the same
        counts_storage(C, shape)
    shape = _shape(2, 2)
    C = torch.arange(8).reshape(2, 4)
    assert counts_storage(C, shape) == (C, False)
    K = by_column(C)
    got, flag = counts_storage(K, shape)
    assert flag and got.data_ptr() == K.data_ptr()  # no copy
    odd = torch.zeros(2, 8, dtype=torch.int64)[:, ::2]
    odd.copy_(C)
    got, flag = counts_storage(odd, shape)
    assert not flag and got.is_contiguous() and torch.equal(got, C)


@pytest.mark.parametrize("profile", list(PROFILES), ids=list(PROFILES))
@pytest.mark.parametrize("W", [8, 16, 24])
def test_plan_mix_fit_and_bookkeeping_by_columns(profile, W):
    """The plan, its fit to the next step's counts and every rank's bookkeeping are the same on
    C stored by columns as on C row-major (their reprs, floats included), given C's sums or
    summing C themselves, C before and after in either storage."""
    prof, E = PROFILES[profile], 2
    shape, distance = _shape(W, E), node_distance(PROFILES[profile])
    fitted = 0
    for workload in WORKLOADS:
        C1 = _counts(workload, W, E)
        C2 = redrawn_counts(C1, 7)
        s1, s2 = count_sums(C1, E), count_sums(C2, E)
        for sums in (s1, None):
            want = plan_mix(C1, shape, prof, 2, sums=sums)
            assert repr(plan_mix(by_column(C1), shape, prof, 2, sums=sums)) == repr(want)
        plan = plan_mix(C1, shape, prof, 2, sums=s1)
        want = refit_plan(plan, C1, C2, shape, prof, before_sums=s1, after_sums=s2)
        for before in (C1, by_column(C1)):
            for after in (C2, by_column(C2)):
                for sums in (s2, None):
                    got = refit_plan(plan, before, after, shape, prof, before_sums=s1,
                                     after_sums=sums)  # fmt: skip
                    assert repr(got) == repr(want), (workload, before.is_contiguous())
        fitted += bool(want.ranges or want.kept)
        carried = carried_plan(plan, C1, by_column(C2), shape, prof, before_sums=s1,
                               after_sums=s2)  # fmt: skip
        assert repr(carried) == repr(carried_plan(plan, C1, C2, shape, prof, before_sums=s1,
                                                  after_sums=s2))  # fmt: skip
        for r in range(W):
            for sums in (s2, None):
                a = build_step_plan(C2, want, r, E, distance, sums)
                b = build_step_plan(by_column(C2), want, r, E, distance, sums)
                assert repr(a) == repr(b), (workload, r)
    assert fitted >= 1  # fits with ranges or kept holders were compared (3 of 6, mostly)


def test_count_exchange_by_columns():
    """The layer's host sync by columns: the same C, headers and sums, C's storage transposed
    (on the CPU, and through the device side's pack and unpack)."""
    W, N, H = 5, 10, 2
    rows = torch.randint(0, 30, (W, H + N), dtype=torch.int32)
    C_want = rows[:, H:].to(torch.int64)
    C, headers, sums = count_matrix_to_host(rows, H, by_column=True)
    assert torch.equal(C, C_want) and C.t().is_contiguous() and sums is None
    assert torch.equal(headers, rows[:, :H].to(torch.int64))
    C, _, _ = count_matrix_to_host(rows, H)
    assert torch.equal(C, C_want) and C.is_contiguous()
    for flag in (False, True):
        C, headers, sums = unpack_counts(pack_counts(rows, H, flag), W, N, H, flag)
        assert torch.equal(C, C_want) and C.t().is_contiguous() == flag
        assert torch.equal(headers, rows[:, :H].to(torch.int64))
        assert sums.colsum_N.tolist() == C_want.sum(0).tolist()
        assert sums.rowsum_W.tolist() == C_want.sum(1).tolist()
