"""``layout.count_matrix_to_host``, the layer's one host sync: the all-gathered rows
``[header | counts]`` split into a contiguous int64 ``C_WN`` (the planners read it as one block)
and the headers, on the CPU and, where CUDA is, from the device into pinned memory with C's
column and row sums reduced there (``CountSums``)."""

from __future__ import annotations

import pytest
import torch

from mixmoe.dispatch.layout import count_matrix_to_host, pack_counts, unpack_counts


def _rows(W: int, N: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(W * 100 + N)
    return torch.randint(0, 1000, (W, H + N), generator=gen).to(dtype)


def _check(rows_WX: torch.Tensor, H: int, C_WN: torch.Tensor, headers_WH: torch.Tensor) -> None:
    want = rows_WX.cpu().to(torch.int64)
    assert C_WN.device.type == headers_WH.device.type == "cpu"
    assert C_WN.dtype == headers_WH.dtype == torch.int64
    # the compiled planners take it as one block: row-major, or by columns (C_WN.t())
    assert C_WN.is_contiguous() or C_WN.t().is_contiguous()
    torch.testing.assert_close(C_WN, want[:, H:], rtol=0, atol=0)
    torch.testing.assert_close(headers_WH, want[:, :H], rtol=0, atol=0)


@pytest.mark.parametrize("W, N, H", [(1, 4, 2), (2, 4, 2), (5, 12, 2), (3, 6, 0), (4, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("by_column", [False, True])
def test_split_on_the_cpu(W, N, H, dtype, by_column) -> None:
    rows = _rows(W, N, H, dtype)
    C_WN, headers_WH, sums = count_matrix_to_host(rows, H, by_column)
    _check(rows, H, C_WN, headers_WH)
    assert C_WN.t().is_contiguous() if by_column else C_WN.is_contiguous()
    assert sums is None  # the planning thread sums C on the host (native_pricing.count_sums)


@pytest.mark.parametrize("W, N, H", [(1, 4, 2), (2, 4, 2), (5, 12, 2), (3, 6, 0), (4, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("by_column", [False, True])
def test_the_device_packing_round_trips(W, N, H, dtype, by_column) -> None:
    """The accelerator path's packing and unpacking, run on the CPU (only the pinned copy
    between them needs a device): the counts (stored by columns where asked: the mixed
    strategy's), headers and C's exact sums come back."""
    rows = _rows(W, N, H, dtype)
    packed = pack_counts(rows, H, by_column)
    assert packed.dtype == torch.int64 and packed.shape == (W * N + W * H + N + W,)
    C_WN, headers_WH, sums = unpack_counts(packed.clone(), W, N, H, by_column)
    _check(rows, H, C_WN, headers_WH)
    assert C_WN.t().is_contiguous() if by_column else C_WN.is_contiguous()
    want = rows.to(torch.int64)[:, H:]
    torch.testing.assert_close(sums.colsum_N, want.sum(0), rtol=0, atol=0)
    torch.testing.assert_close(sums.rowsum_W, want.sum(1), rtol=0, atol=0)
    assert sums.colsum_N.is_contiguous() and sums.rowsum_W.is_contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a GPU machine)")
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("by_column", [False, True])
def test_split_on_the_device_lands_in_pinned_memory(dtype, by_column) -> None:
    rows = _rows(6, 24, 2, dtype).cuda()
    C_WN, headers_WH, sums = count_matrix_to_host(rows, 2, by_column)
    _check(rows, 2, C_WN, headers_WH)
    assert C_WN.t().is_contiguous() if by_column else C_WN.is_contiguous()
    want = rows.cpu().to(torch.int64)[:, 2:]
    torch.testing.assert_close(sums.colsum_N, want.sum(0), rtol=0, atol=0)
    torch.testing.assert_close(sums.rowsum_W, want.sum(1), rtol=0, atol=0)
    assert sums.colsum_N.is_contiguous() and sums.rowsum_W.is_contiguous()
    assert C_WN.is_pinned() and headers_WH.is_pinned()
    rows.zero_()  # the host copy is complete when the call returns
    torch.cuda.synchronize()
    assert int(C_WN.abs().sum()) > 0
