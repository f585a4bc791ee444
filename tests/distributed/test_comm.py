"""The Communicator's collectives and the differentiable all-to-alls (``mixmoe/comm``) on 3 gloo
ranks, against the results written down row by row in the parent: rank order of the gather,
uneven splits with empty blocks (sync and async), the reduce ops, a broadcast inside a subgroup
(group rank -> global rank), and the all-to-all gradients (backward swaps the splits; the cached
forward moves nothing yet still sends the gradient home). ``LocalCommunicator`` (world size 1) too.
"""

from __future__ import annotations

import pytest
import torch

from mixmoe.comm.autograd import (
    all_to_all,
    all_to_all_start,
    all_to_all_wait,
    cached_all_to_all,
)
from mixmoe.comm.communicator import LocalCommunicator

W = 3


def _n(s: int, q: int) -> int:
    """Rows rank s sends to rank q: uneven, with empty blocks (0 for (0, 1), (1, 2), (2, 0))."""
    return (s + 2 * q) % 3 + (s == q)


def _send_rows(s: int) -> torch.Tensor:
    """Rank s's send buffer: for each destination q in order, rows [s, q, i]."""
    rows = [[s, q, i] for q in range(W) for i in range(_n(s, q))]
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)


def _recv_rows(r: int) -> torch.Tensor:
    rows = [[s, r, i] for s in range(W) for i in range(_n(s, r))]
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)


def _coef(r: int, rows: int) -> torch.Tensor:
    """The loss weight of each received row on rank r: sum(y * coef)."""
    return ((r + 1) * 10.0 + torch.arange(rows, dtype=torch.float64))[:, None].expand(rows, 3)


def _grad_of_send(s: int) -> torch.Tensor:
    """d sum(y_q * coef_q) / d x_s: the coefficient each sent row meets at its receiver."""
    out = []
    for q in range(W):
        offset = sum(_n(p, q) for p in range(s))  # rows of lower sources come first at q
        coef = _coef(q, sum(_n(p, q) for p in range(W)))
        out += [coef[offset + i] for i in range(_n(s, q))]
    return torch.stack(out) if out else torch.zeros(0, 3, dtype=torch.float64)


class _Counting:
    """A Communicator that counts its all_to_all calls (the rest is the wrapped one's)."""

    def __init__(self, comm) -> None:
        self.comm, self.calls = comm, 0

    def all_to_all(self, *args, **kwargs):
        self.calls += 1
        return self.comm.all_to_all(*args, **kwargs)


def _worker(comm) -> dict:
    import torch.distributed as dist

    from mixmoe.comm.communicator import ProcessGroupCommunicator

    r = comm.rank
    out: dict = {"rank": comm.rank, "world": comm.world_size, "backend": comm.backend}
    out["gather"] = comm.all_gather_rows(torch.tensor([r, 10 * r + 1, -r], dtype=torch.int64))
    in_splits = [_n(r, q) for q in range(W)]
    out_splits = [_n(s, r) for s in range(W)]
    x = _send_rows(r)
    recv = torch.full((sum(out_splits), 3), -7.0, dtype=torch.float64)
    # synchronous by default (bench/calibrate.py times the call): a completed handle comes back
    out["sync_handles"] = [
        type(comm.all_to_all(recv, x, out_splits, in_splits)).__name__,
        type(comm.all_reduce(torch.zeros(1))).__name__,
    ]
    out["a2a"] = recv.clone()
    recv.fill_(-7.0)
    comm.all_to_all(recv, x, out_splits, in_splits, async_op=True).wait()
    out["a2a_async"] = recv.clone()
    for op in ("sum", "max", "min"):
        t = torch.tensor([r + 1.0, 5.0 - r])
        comm.all_reduce(t, op).wait()
        out[op] = t
        t = torch.tensor([r + 1.0, 5.0 - r])
        comm.all_reduce(t, op, async_op=True).wait()
        out[op + "_async"] = t
    mine = torch.tensor([r * 2.0, -1.0 * r])
    out["max_of"] = comm.all_reduce_max(mine)
    out["max_input_kept"] = mine.clone()
    # a subgroup of global ranks 1 and 2: group rank 1 is global rank 2
    sub = dist.new_group([1, 2])
    if r in (1, 2):
        sub_comm = ProcessGroupCommunicator(sub)
        out["sub"] = (sub_comm.rank, sub_comm.world_size)
        b = torch.tensor([float(r)] * 2)
        sub_comm.broadcast(b, src=1)
        out["sub_bcast"] = b
        out["sub_gather"] = sub_comm.all_gather_rows(torch.tensor([float(r)]))
    b = torch.tensor([float(r), 3.0 * r])
    comm.broadcast(b, src=2)
    out["bcast"] = b
    comm.barrier()
    # the differentiable all-to-alls: forward, and the gradient of sum(y * coef)
    for name in ("sync", "async", "cached"):
        xg = _send_rows(r).requires_grad_(True)
        counting = _Counting(comm)
        if name == "sync":
            y = all_to_all(counting, xg, out_splits, in_splits)
        elif name == "async":
            y, pending = all_to_all_start(counting, xg, out_splits, in_splits)
            y = all_to_all_wait(y, pending)
        else:  # what the receiver already holds (here: marked rows), nothing moves forward
            cached = _recv_rows(r) + 0.5
            y = cached_all_to_all(counting, xg, out_splits, in_splits, cached)
            out["cached_is_copy"] = y.data_ptr() != cached.data_ptr()
        forward_calls = counting.calls
        (y * _coef(r, y.shape[0])).sum().backward()
        # one all_to_all each way (the async backward waits for the one its wait started)
        out[f"calls_{name}"] = (forward_calls, counting.calls - forward_calls)
        out[f"y_{name}"] = y.detach()
        out[f"dx_{name}"] = xg.grad
    return out


@pytest.mark.dist
def test_collectives_and_all_to_all_gradients_on_three_ranks() -> None:
    from mixmoe.comm.launch import spawn_gloo

    got = spawn_gloo(_worker, W, timeout_s=120)
    exact = {"rtol": 0, "atol": 0}
    for r, out in enumerate(got):
        assert (out["rank"], out["world"], out["backend"]) == (r, W, "gloo")
        assert out["sync_handles"] == ["_Done", "_Done"]
        want_gather = torch.tensor([[s, 10 * s + 1, -s] for s in range(W)], dtype=torch.int64)
        torch.testing.assert_close(out["gather"], want_gather, **exact)
        for key in ("a2a", "a2a_async", "y_sync", "y_async"):
            torch.testing.assert_close(out[key], _recv_rows(r), **exact, msg=f"rank {r} {key}")
        torch.testing.assert_close(out["sum"], torch.tensor([6.0, 12.0]))
        torch.testing.assert_close(out["max"], torch.tensor([3.0, 5.0]))
        torch.testing.assert_close(out["min"], torch.tensor([1.0, 3.0]))
        for op in ("sum", "max", "min"):
            torch.testing.assert_close(out[op + "_async"], out[op])
        torch.testing.assert_close(out["max_of"], torch.tensor([4.0, 0.0]))
        torch.testing.assert_close(out["max_input_kept"], torch.tensor([2.0 * r, -1.0 * r]))
        torch.testing.assert_close(out["bcast"], torch.tensor([2.0, 6.0]))
        if r in (1, 2):
            assert out["sub"] == (r - 1, 2)
            torch.testing.assert_close(out["sub_bcast"], torch.tensor([2.0, 2.0]))
            torch.testing.assert_close(out["sub_gather"], torch.tensor([[1.0], [2.0]]))
        torch.testing.assert_close(out["y_cached"], _recv_rows(r) + 0.5, **exact)
        assert out["cached_is_copy"]
        assert out["calls_sync"] == out["calls_async"] == (1, 1), out
        assert out["calls_cached"] == (0, 1), out
        for name in ("sync", "async", "cached"):
            torch.testing.assert_close(
                out[f"dx_{name}"], _grad_of_send(r), **exact, msg=f"rank {r} dx {name}"
            )


def test_local_communicator_is_a_world_of_one() -> None:
    comm = LocalCommunicator()
    # the Communicator interface: backend (train/loop.py branches on it), group None = world
    assert (comm.rank, comm.world_size, comm.backend, comm.group) == (0, 1, "local", None)
    x = torch.tensor([1.0, 2.0])
    gathered = comm.all_gather_rows(x)
    torch.testing.assert_close(gathered, x[None])
    gathered[0, 0] = 9.0  # a copy, not a view of the input
    assert x[0] == 1.0
    out = torch.zeros(3, 2)
    src = torch.arange(6.0).view(3, 2)
    comm.all_to_all(out, src, [3], [3]).wait()
    torch.testing.assert_close(out, src)
    with pytest.raises(ValueError, match="equal splits"):
        comm.all_to_all(torch.zeros(2, 2), src, [2], [3])
    t = torch.tensor([4.0])
    assert comm.all_reduce(t, "max").wait() and t.item() == 4.0
    m = comm.all_reduce_max(t)
    m += 1  # a new tensor
    assert t.item() == 4.0
    # autograd through the world of one: identity forward, identity gradient
    xg = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    y = all_to_all(comm, xg, [4], [4])
    (y * 3.0).sum().backward()
    torch.testing.assert_close(y.detach(), xg.detach())
    torch.testing.assert_close(xg.grad, torch.full((4, 2), 3.0, dtype=torch.float64))


def test_communicator_needs_an_initialised_process_group() -> None:
    import torch.distributed as dist

    from mixmoe.comm.communicator import ProcessGroupCommunicator

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_distributed"):
        ProcessGroupCommunicator()
