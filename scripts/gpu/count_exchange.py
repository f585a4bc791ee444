"""The count exchange's host side on a GPU (issue 26): what the layer does after the
all-gather, before the plan, at W ranks' worth of counts (N = 4 W experts) on one device.

- ``before``: the path of db5d449 (the gathered rows stacked, brought to a fresh pageable host
  tensor, then split on the host).
- ``now``: ``dispatch.layout.count_matrix_to_host`` (split and summed on the device, one copy
  into pinned memory).
- ``by columns``: the same, C transposed on the device (the mixed strategy's exchange).

Also the plan each way: ``plan_mix`` from C alone, then given the device's sums, on C row-major
and on C by columns (the same plan, asserted). Prints medians
(ms) of ``--repeats`` calls after 3 warm-up calls, each call synchronised. Runs on the CPU too
(``--device cpu``: the CPU path, no sums), to check the script itself.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixmoe.dispatch.layout import count_matrix_to_host
from mixmoe.gating.synthetic import RoutingSpec, synthetic_counts
from mixmoe.placement import GPU_PROFILE, LayerShape, plan_mix

HEADER = 3  # the layer's: fingerprint and the version's two words, int32 like the counts


def _before(rows_WX: torch.Tensor) -> torch.Tensor:
    every = torch.stack(list(rows_WX)).to("cpu", torch.int64).contiguous()
    return every[:, HEADER:].contiguous()


def _now(rows_WX: torch.Tensor, by_column: bool = False):
    return count_matrix_to_host(rows_WX, HEADER, by_column)


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _row(W: int, repeats: int, device: torch.device) -> str:
    """One table row: W ranks' counts (N = 4 W experts, zipf:1.2), the same results asserted."""
    N = 4 * W
    gen = torch.Generator().manual_seed(0)
    C = synthetic_counts(RoutingSpec.parse("zipf:1.2"), W, 8192, 2, N, gen, shuffle_experts=True)
    rows = torch.cat([torch.zeros(W, HEADER, dtype=torch.int32), C.to(torch.int32)], 1).to(device)
    C_host, _, sums = _now(rows)
    assert torch.equal(C_host, C) and torch.equal(_before(rows), C)
    before = _median_ms(lambda: _before(rows), repeats, device)
    now = _median_ms(lambda: _now(rows), repeats, device)
    K_host, _, col_sums = _now(rows, True)
    assert torch.equal(K_host, C) and K_host.t().is_contiguous()
    by_column = _median_ms(lambda: _now(rows, True), repeats, device)
    shape = LayerShape(1024, 4096, 4, W, 2)
    plan = _median_ms(lambda: plan_mix(C_host, shape, GPU_PROFILE, 4), repeats, device)
    given = given_col = "-"
    if sums is not None:
        assert torch.equal(sums.colsum_N, C.sum(0)) and torch.equal(sums.rowsum_W, C.sum(1))
        want = repr(plan_mix(C_host, shape, GPU_PROFILE, 4))
        assert repr(plan_mix(C_host, shape, GPU_PROFILE, 4, sums=sums)) == want
        assert repr(plan_mix(K_host, shape, GPU_PROFILE, 4, sums=col_sums)) == want
        ms = _median_ms(lambda: plan_mix(C_host, shape, GPU_PROFILE, 4, sums=sums), repeats, device)
        given = f"{ms:.3f}"
        ms = _median_ms(lambda: plan_mix(K_host, shape, GPU_PROFILE, 4, sums=col_sums), repeats,
                        device)  # fmt: skip
        given_col = f"{ms:.3f}"
    return (f"| {W} | {N} | {before:.3f} | {now:.3f} | {by_column:.3f} | {plan:.3f} | {given} "
            f"| {given_col} |")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--worlds", default="64,256,1024")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    print(f"device {device} torch {torch.__version__}; one host thread; medians of {args.repeats}")
    print("| W | N | before ms | now ms | by columns ms | plan from C ms | plan given sums ms "
          "| plan by columns, given sums ms |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for W in (int(w) for w in args.worlds.split(",")):
        print(_row(W, args.repeats, device), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
