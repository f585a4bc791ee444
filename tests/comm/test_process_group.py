"""``mixmoe.comm.process_group`` and ``mixmoe.comm.fsdp`` in one process: ``init_distributed``'s
three ways in (a store, torchrun variables, explicit rank / world size), its backend choice and
timeout, ``shutdown_distributed``, the layout of ``new_expert_groups`` for every rank of a larger
world (the world stood in for), and ``sharded_parameters_version`` of an FSDP2 unit of one rank.
(The collectives over real groups of several ranks are in tests/distributed.)"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mixmoe.comm import (
    Communicator,
    init_distributed,
    init_file_store,
    new_expert_groups,
    shutdown_distributed,
)
from mixmoe.comm import process_group as pg_module
from mixmoe.comm.fsdp import sharded_parameters_version

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def fresh_world(monkeypatch):
    """No process group before the test, none left after it; no torchrun variables."""
    assert not dist.is_initialized()
    for k in _ENV:
        monkeypatch.delenv(k, raising=False)
    yield
    shutdown_distributed()
    assert not dist.is_initialized()


def _timeout(comm: Communicator) -> datetime.timedelta:
    """The collective timeout of the default group's CPU (gloo) backend."""
    group = dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_over_a_store_picks_gloo_without_cuda_and_sets_the_timeout(fresh_world, tmp_path):
    assert not torch.cuda.is_available()  # "auto" means gloo here
    store = dist.FileStore(str(tmp_path / "store"), 1)
    comm = init_distributed(rank=0, world_size=1, store=store, timeout_s=7.5)  # backend "auto"
    assert dist.is_initialized()
    assert (comm.rank, comm.world_size, comm.backend, comm.group) == (0, 1, "gloo", None)
    assert _timeout(comm) == datetime.timedelta(seconds=7.5)
    # a second call joins the group already there (no second init, which torch refuses)
    again = init_distributed("gloo", timeout_s=99.0)
    assert (again.rank, again.world_size, again.backend) == (0, 1, "gloo")
    assert _timeout(again) == datetime.timedelta(seconds=7.5)
    shutdown_distributed()
    assert not dist.is_initialized()
    shutdown_distributed()  # nothing to tear down: a no-op


def test_init_file_store_defaults_to_gloo_and_passes_the_timeout(fresh_world, tmp_path):
    comm = init_file_store(str(tmp_path / "store"), rank=0, world_size=1, timeout_s=4.0)
    assert (comm.rank, comm.world_size, comm.backend) == (0, 1, "gloo")
    assert _timeout(comm) == datetime.timedelta(seconds=4.0)


def test_init_without_a_timeout_keeps_torchs_default(fresh_world, tmp_path):
    comm = init_file_store(str(tmp_path / "store"), rank=0, world_size=1)
    assert _timeout(comm) == dist.distributed_c10d._get_default_timeout("gloo")


def test_init_from_torchrun_variables(fresh_world, monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    comm = init_distributed("gloo", timeout_s=5.0)
    assert (comm.rank, comm.world_size, comm.backend) == (0, 1, "gloo")
    assert _timeout(comm) == datetime.timedelta(seconds=5.0)


def test_init_with_rank_and_world_size_given_and_only_the_address_in_the_environment(
    fresh_world, monkeypatch
):
    # RANK / WORLD_SIZE absent: the explicit values must reach torch (env:// needs them)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    comm = init_distributed("gloo", rank=0, world_size=1)
    assert (comm.rank, comm.world_size, comm.backend) == (0, 1, "gloo")


@pytest.mark.parametrize("present", [(), ("RANK", "WORLD_SIZE", "MASTER_ADDR")])
def test_init_without_torchrun_variables_names_the_missing_ones(fresh_world, monkeypatch, present):
    for k in present:
        monkeypatch.setenv(k, "0" if k != "MASTER_ADDR" else "127.0.0.1")
    missing = [k for k in _ENV if k not in present]
    with pytest.raises(RuntimeError, match="torchrun") as err:
        init_distributed("gloo")
    assert str(missing) in str(err.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("kw", [dict(rank=0), dict(world_size=1), {}])
def test_init_over_a_store_needs_rank_and_world_size(fresh_world, tmp_path, kw):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(ValueError, match="needs rank and world_size"):
        init_distributed("gloo", store=store, **kw)
    assert not dist.is_initialized()


def test_init_refuses_an_unknown_backend(fresh_world):
    with pytest.raises(ValueError, match="'mpi' is not supported"):
        init_distributed("mpi")


class _Stand:
    """Stands in for torch where a GPU would be: records what ``init_distributed`` asks of
    ``init_process_group`` and ``torch.cuda.set_device`` (no NCCL on this machine)."""

    def __init__(self, monkeypatch, rank: int, devices: int) -> None:
        self.inits: list[tuple[str, dict]] = []
        self.devices: list[int] = []
        self.timeouts: list = []  # collective timeouts set after the start-up barrier
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
        monkeypatch.setattr(torch.cuda, "set_device", self.devices.append)
        monkeypatch.setattr(dist, "is_initialized", lambda: False)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(
            dist, "init_process_group", lambda backend, **kw: self.inits.append((backend, kw))
        )
        monkeypatch.setattr(pg_module, "ProcessGroupCommunicator", lambda group=None: "comm")
        monkeypatch.setattr(dist, "barrier", lambda group=None: None)
        import torch.distributed.distributed_c10d as c10d

        monkeypatch.setattr(c10d, "_set_pg_timeout", lambda t, group=None: self.timeouts.append(t))


def test_auto_picks_nccl_where_cuda_is_and_sets_the_local_device(fresh_world, monkeypatch):
    store = object()
    stand = _Stand(monkeypatch, rank=6, devices=4)
    assert init_distributed(rank=6, world_size=8, store=store) == "comm"  # backend "auto"
    assert stand.inits == [("nccl", dict(store=store, rank=6, world_size=8))]
    assert stand.devices == [2]  # no LOCAL_RANK: the global rank modulo the devices
    monkeypatch.setenv("LOCAL_RANK", "3")
    init_distributed("nccl", rank=7, world_size=8, store=store, timeout_s=2.0)
    # the rendezvous may take STARTUP_TIMEOUT_S; the collectives after it 2 s
    startup = datetime.timedelta(seconds=pg_module.STARTUP_TIMEOUT_S)
    assert stand.inits[1] == ("nccl", dict(store=store, rank=7, world_size=8, timeout=startup))
    assert stand.timeouts == [datetime.timedelta(seconds=2.0)]
    assert stand.devices == [2, 3]  # torchrun's LOCAL_RANK wins


def test_gloo_never_sets_a_cuda_device(fresh_world, monkeypatch):
    stand = _Stand(monkeypatch, rank=1, devices=2)
    init_distributed("gloo", rank=1, world_size=2, store=object())
    assert [b for b, _ in stand.inits] == ["gloo"] and stand.devices == []


def _groups_of(monkeypatch, world: int, rank: int, ep_size: int) -> tuple:
    """``new_expert_groups(ep_size)`` on ``rank`` of a stand-in world of ``world`` ranks: the
    groups it creates, in order (every rank must create the same ones in the same order), and
    the (ep, edp) member lists it returns."""
    created: list[tuple[int, ...]] = []

    def new_group(ranks, **kw):
        created.append(tuple(ranks))
        return tuple(ranks)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(pg_module, "ProcessGroupCommunicator", lambda group: group)
    ep, edp = new_expert_groups(ep_size)
    return created, ep, edp


@pytest.mark.parametrize("world, ep_size", [(1, 1), (6, 1), (6, 2), (6, 3), (6, 6), (8, 4)])
def test_expert_groups_are_consecutive_blocks_and_their_strided_twins(monkeypatch, world, ep_size):
    blocks = [tuple(range(s, s + ep_size)) for s in range(0, world, ep_size)]
    strides = [tuple(range(o, world, ep_size)) for o in range(ep_size)]
    for rank in range(world):
        created, ep, edp = _groups_of(monkeypatch, world, rank, ep_size)
        assert created == blocks + strides, (rank, created)
        assert ep == blocks[rank // ep_size] and rank in ep
        assert edp == strides[rank % ep_size] and rank in edp


@pytest.mark.parametrize("ep_size", [0, -2, 4, 5, 7])
def test_expert_groups_refuse_a_size_that_does_not_divide_the_world(monkeypatch, ep_size):
    with pytest.raises(ValueError, match=f"ep_size={ep_size} must divide the world size 6"):
        _groups_of(monkeypatch, 6, 0, ep_size)


def test_sharded_parameters_version_of_an_fsdp_unit(fresh_world, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_file_store(str(tmp_path / "store"), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    unit = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert sharded_parameters_version(unit) is None  # not (yet) an FSDP2 unit
    fully_shard(unit, mesh=mesh)
    unit(torch.randn(3, 4)).sum().backward()
    sharded = [p.sharded_param for p in unit._get_fsdp_state()._fsdp_param_group.fsdp_params]
    assert len(sharded) == 4

    def counters() -> int:
        return sum(p._version + p._local_tensor._version for p in sharded)

    v0 = sharded_parameters_version(unit)
    assert v0 == counters()
    torch.optim.SGD(unit.parameters(), lr=0.1).step()  # bumps the DTensor wrappers
    v1 = sharded_parameters_version(unit)
    assert v1 == counters() and v1 >= v0 + 4
    with torch.no_grad():  # a write below autograd: only the local shard's counter moves
        sharded[0]._local_tensor.add_(1.0)
    v2 = sharded_parameters_version(unit)
    assert v2 == counters() and v2 == v1 + 1
    # an FSDP2 unit without parameters of its own has no version (never cached)
    empty = nn.ReLU()
    fully_shard(empty, mesh=mesh)
    assert sharded_parameters_version(empty) is None
