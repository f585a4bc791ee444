"""What the expert-parallel dispatcher hands its planner and its ranks, in one process: the
``LayerShape`` of the step (the bytes of the activations' dtype on the wire, 3 GEMMs per expert for
SwiGLU and 2 otherwise) and the hardware profile (the device's default, or the one given); and the
handshake's error when ranks disagree, naming every rank's strategy and sizes (a stand-in
communicator plays the second rank). A wrong shape or profile changes only which plan is picked,
never the layer's numbers, so the equality tests cannot see it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mixmoe import MoE, MoEConfig
from mixmoe.comm import LocalCommunicator
from mixmoe.dispatch.expert_parallel import ExpertParallelDispatcher
from mixmoe.parallel import parallelize_moe
from mixmoe.placement.cost_model import LayerShape
from mixmoe.placement.profile import CPU_PROFILE, HardwareProfile
from mixmoe.types import Routing


def _planned(
    activation: str, dtype: torch.dtype, strategy: str, profile: HardwareProfile | None = None
):
    """(shape, profile) of the one plan of a forward of a 4-expert layer over a world of one."""
    torch.manual_seed(0)
    cfg = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4, activation=activation)
    layer = parallelize_moe(MoE(cfg, dtype=dtype), LocalCommunicator(), strategy, profile)
    spec = layer.dispatcher.spec
    seen = []

    def planner(C, shape, prof, config, sums=None):
        seen.append((shape, prof))
        return spec.planner(C, shape, prof, config, sums=sums)

    layer.dispatcher.spec = dataclasses.replace(spec, planner=planner)
    x = torch.randn(9, 8, dtype=dtype, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer(x)
    layer.dispatcher.close()
    assert len(seen) == 1, seen
    return seen[0]


@pytest.mark.parametrize("strategy", ["a2a", "mix"])
@pytest.mark.parametrize(
    ("activation", "dtype", "nbytes", "gemms"),
    [
        ("swiglu", torch.float64, 8, 3),
        ("gelu", torch.float32, 4, 2),
        ("silu", torch.bfloat16, 2, 2),
        ("swiglu", torch.float16, 2, 3),
    ],
)
def test_the_planner_prices_the_layer_as_it_runs(strategy, activation, dtype, nbytes, gemms):
    shape, profile = _planned(activation, dtype, strategy)
    want = LayerShape(
        model_dim=8,
        hidden_dim=12,
        experts_per_rank=4,
        world_size=1,
        bytes_per_element=nbytes,
        gemms_per_expert=gemms,
    )
    assert shape == want
    assert type(shape.bytes_per_element) is int
    assert profile is CPU_PROFILE  # the CPU step's default profile


def test_the_planner_gets_the_profile_given() -> None:
    mine = dataclasses.replace(CPU_PROFILE, name="mine", link_latency=1e-3)
    _, profile = _planned("gelu", torch.float32, "mix", mine)
    assert profile is mine


class _SecondRank(LocalCommunicator):
    """A world of two for the handshake only: rank 1's row is the other dispatcher's."""

    world_size = 2

    def __init__(self) -> None:
        self.other: ExpertParallelDispatcher | None = None

    def all_gather_rows(self, x_C: torch.Tensor) -> torch.Tensor:
        theirs = []
        self.other.comm = LocalCommunicator()  # its own row, gathered alone
        self.other.comm.all_gather_rows = lambda row: theirs.append(row) or row[None]
        self.other._handshake(x_C.device)
        return torch.stack([x_C, theirs[0]])


def test_handshake_error_names_every_rank_strategy_and_sizes() -> None:
    comm = _SecondRank()
    mine = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4, top_k=2)
    theirs = MoEConfig(model_dim=16, hidden_dim=24, num_experts=6, top_k=3)
    dispatcher = ExpertParallelDispatcher(comm, mine, "mix")
    comm.other = ExpertParallelDispatcher(LocalCommunicator(), theirs, "shadow")
    with pytest.raises(ValueError) as err:
        dispatcher._handshake(torch.device("cpu"))
    assert (
        "(rank 0: strategy='mix', num_experts=4, top_k=2, model_dim=8, hidden_dim=12; "
        "rank 1: strategy='shadow', num_experts=6, top_k=3, model_dim=16, hidden_dim=24)"
    ) in str(err.value)
    assert not dispatcher._handshake_done


def test_handshake_passes_when_ranks_agree() -> None:
    comm = _SecondRank()
    cfg = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4, top_k=2)
    dispatcher = ExpertParallelDispatcher(comm, cfg, "a2a")
    comm.other = ExpertParallelDispatcher(comm, cfg, "a2a")  # the same fingerprint (W = 2)
    dispatcher._handshake(torch.device("cpu"))
    assert dispatcher._handshake_done


def test_the_handshake_runs_once_before_the_first_count_exchange() -> None:
    """One all_gather of the config row at the first step, then only the count exchange."""
    torch.manual_seed(0)
    cfg = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4)
    comm = LocalCommunicator()
    gathered = []
    comm.all_gather_rows = lambda row: gathered.append(row.numel()) or row[None].clone()
    layer = parallelize_moe(MoE(cfg, dtype=torch.float64), comm, "a2a")
    x = torch.randn(9, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer(x)
        # the handshake's 6 fields; then fingerprint, version (two words), counts
        assert gathered == [6, 3 + 4]
        layer(x)
    assert gathered == [6, 7, 7]


def test_the_count_exchange_sends_int32_words_and_refuses_what_they_cannot_hold() -> None:
    """The all_gather's row: int32 words (fingerprint, the version's two 31-bit words, the
    counts), the version back exactly above 2**31; a version outside [0, 2**62) and 2**31
    routed rows are refused before any collective."""
    cfg = MoEConfig(model_dim=8, hidden_dim=12, num_experts=4)
    comm = LocalCommunicator()
    sent = []
    comm.all_gather_rows = lambda row: sent.append(row) or row[None].clone()
    disp = ExpertParallelDispatcher(comm, cfg, "mix")
    counts = torch.tensor([5, 0, 2**31 - 1, 3])
    version = 2**40 + 2**31 + 7
    C, versions, _ = disp.exchange_counts(counts, version)
    assert sent[0].dtype == torch.int32 and sent[0].shape == (3 + 4,)
    assert versions == [version] and C.dtype == torch.int64 and C[0].tolist() == counts.tolist()
    for bad in (-1, 2**62):
        with pytest.raises(ValueError, match="weights version"):
            disp.exchange_counts(counts, bad)
    layer = parallelize_moe(MoE(cfg, dtype=torch.float64), comm, "mix")
    rows = 2**31  # no memory: one id and one weight, expanded
    huge = Routing(torch.zeros(1, 1, dtype=torch.int64).expand(rows, 1),
                   torch.ones(1, 1, dtype=torch.float64).expand(rows, 1),
                   torch.zeros(1, 4, dtype=torch.float64).expand(rows, 4))  # fmt: skip
    x = torch.zeros(1, 8, dtype=torch.float64).expand(rows, 8)
    with pytest.raises(ValueError, match="routed rows"):
        layer.dispatcher.dispatch(x, huge, layer.experts.weights())
    # the layer's first call ran its handshake (6 fields), then refused: no count exchange
    assert [t.numel() for t in sent] == [7, 6]


class _ThreeRanks(LocalCommunicator):
    """A world of three for ``_plan`` alone (it runs no collective)."""

    world_size = 3


def test_plans_are_checked_when_hooked_or_asked_never_by_default() -> None:
    # W = 3, E = 1: expert 0's stream is rank 2's 40 rows, then its owner's 20; a range of 20
    # rows cuts rank 2's segment inside a 16-row block (check_ranges' error)
    from mixmoe.placement.plan import Plan
    from mixmoe.placement.planner import plan_none

    cfg = MoEConfig(model_dim=8, hidden_dim=12, num_experts=3, block_size=16)
    disp = ExpertParallelDispatcher(_ThreeRanks(), cfg, "mix")
    C = torch.tensor([[20, 0, 0], [8, 0, 0], [40, 0, 0]])
    shape = LayerShape(8, 12, 1, 3, 4)
    base = plan_none(C, shape, CPU_PROFILE).prediction
    bad = Plan((0,), ((0, (1,)),), base, base, ranges=((0, ((1, 20),)),))
    disp.spec = dataclasses.replace(disp.spec, planner=lambda *args, **kw: bad)
    # the built-in planners' plans are trusted (their tests check them): no check by default
    assert disp._plan(C, torch.float32, torch.device("cpu")) is bad
    disp.check_plans = True
    with pytest.raises(ValueError, match="cut source 2's segment 20 rows in"):
        disp._plan(C, torch.float32, torch.device("cpu"))
    disp.check_plans = False
    disp.plan_hook = lambda C_WN, plan: bad  # a hook's plan: always checked
    disp.spec = dataclasses.replace(
        disp.spec, planner=lambda C, *args, **kw: plan_none(C, shape, CPU_PROFILE)
    )
    with pytest.raises(ValueError, match="cut source 2's segment 20 rows in"):
        disp._plan(C, torch.float32, torch.device("cpu"))
    disp.close()


def test_the_sums_a_plan_is_given_are_checked_when_plans_are() -> None:
    # the planner gets C's CountSums (from the device, or one compiled pass on the planning
    # thread); check_plans compares them with C's own sums
    from mixmoe.placement.counts import CountSums

    cfg = MoEConfig(model_dim=8, hidden_dim=12, num_experts=3, block_size=16)
    disp = ExpertParallelDispatcher(_ThreeRanks(), cfg, "mix")
    C = torch.tensor([[20, 0, 5], [8, 1, 0], [40, 0, 2]])
    given = []
    planner = disp.spec.planner

    def spy(C_WN, shape, profile, config, sums=None):
        given.append(sums)
        return planner(C_WN, shape, profile, config, sums=sums)

    disp.spec = dataclasses.replace(disp.spec, planner=spy)
    right = CountSums(C.sum(0), C.sum(1))
    want = disp._plan(C, torch.float32, torch.device("cpu"))
    assert repr(disp._plan(C, torch.float32, torch.device("cpu"), right)) == repr(want)
    assert given == [None, right]
    plan, step = disp._plan_step(C, torch.float32, torch.device("cpu"))  # a small C: not summed
    assert repr(plan) == repr(want) and given[-1] is None
    torch.testing.assert_close(step.expert_rows_N, C.sum(0), rtol=0, atol=0)
    disp.shared_sums_min = C.numel()
    plan, step = disp._plan_step(C, torch.float32, torch.device("cpu"))  # summed once, shared
    assert repr(plan) == repr(want)
    torch.testing.assert_close(given[-1].colsum_N, C.sum(0), rtol=0, atol=0)
    torch.testing.assert_close(given[-1].rowsum_W, C.sum(1), rtol=0, atol=0)
    torch.testing.assert_close(step.expert_rows_N, C.sum(0), rtol=0, atol=0)
    wrong = CountSums(C.sum(0).flip(0).contiguous(), C.sum(1))  # same totals: not caught in C++
    disp.check_plans = True
    with pytest.raises(RuntimeError, match="not the count matrix's column and row sums"):
        disp._plan(C, torch.float32, torch.device("cpu"), wrong)
    assert repr(disp._plan(C, torch.float32, torch.device("cpu"), right)) == repr(want)
    disp.close()
