"""CPU time per rank of ``bench layer``'s step and of every traced span, on W gloo ranks: what
each rank WORKS (``time.process_time``: all its threads, gloo's included; and the main thread's
``time.thread_time``) next to its wall time. CPU time holds on a shared, loaded host where wall
times do not, and it is what the simulator's processor sharing aggregates (a rank's seconds at
the calibrated all-busy share x P / W). README, "Simulator validation" (issue 9) used it.

    PYTHONPATH=$PWD python scripts/cpu_spans.py ROUTING PROFILE STRATEGIES D F T E W STEPS WARMUP
        [OUT.jsonl]

e.g. ``hot:0.8 prof.json a2a,shadow,mix 256 1024 512 2 4 6 2``: the steps are bench layer's
(forward + backward + SGD, strategies interleaved, a barrier before each), one torch thread per
rank. Prints per strategy and rank the medians over the steps (wall / process CPU / main-thread
CPU, ms) of forward, backward, optimizer and every span, then, with ``a2a`` among the
strategies, the CPU of each rank against a line of CPU vs rows computed fitted to a2a's ranks
(rows per rank: the planner's plan for the run's counts and PROFILE, as ``simulate`` predicts
it): what a strategy's ranks spend beyond their rows (replicas). Legend: W ranks, D model dim,
F expert hidden, T tokens per rank, E experts per rank.
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import time

import torch


def _rank(comm, cfg, steps: int, warmup: int) -> dict:
    import mixmoe.tracing.span as span_mod
    from mixmoe.bench.layer import _inputs, build_layer
    from mixmoe.tracing import TraceRecorder

    spans: list[tuple[str, float, float, float]] = []
    starts: dict[int, tuple[float, float, float]] = {}
    enter, leave = span_mod._RecordedSpan.__enter__, span_mod._RecordedSpan.__exit__

    def now() -> tuple[float, float, float]:
        return time.perf_counter(), time.process_time(), time.thread_time()

    def timed_enter(self):
        starts[id(self)] = now()
        return enter(self)

    def timed_exit(self, *exc):
        end, start = now(), starts.pop(id(self))
        spans.append((self._meta[0], *(b - a for a, b in zip(start, end, strict=True))))
        return leave(self, *exc)

    span_mod._RecordedSpan.__enter__, span_mod._RecordedSpan.__exit__ = timed_enter, timed_exit
    torch.set_num_threads(1)
    x_TD, dy_TD, ids_TK = _inputs(cfg, comm.rank)
    layers = {s: build_layer(cfg, s, ids_TK, comm) for s in cfg.strategies}
    opts = {s: torch.optim.SGD(m.parameters(), lr=cfg.lr) for s, m in layers.items()}
    with torch.no_grad():
        counts_N = next(iter(layers.values()))(x_TD)[1].counts_N.to(torch.int64)
    counts_WN = comm.all_gather_rows(counts_N).tolist()
    recorder = TraceRecorder(rank=comm.rank, stage_id=0, device="cpu")
    out = []
    for i in range(warmup + steps):
        for s, layer in layers.items():
            comm.barrier()
            spans.clear()
            marks = [now()]
            with recorder.op("forward_step", batch_id=i, mg_state="cpu", description=s):
                y_TD, aux = layer(x_TD)
            marks.append(now())
            with recorder.op("backward_step", batch_id=i, mg_state="cpu", description=s):
                torch.autograd.backward([y_TD, aux.loss], [dy_TD, torch.ones_like(aux.loss)])
            marks.append(now())
            opts[s].step()
            opts[s].zero_grad(set_to_none=True)
            marks.append(now())
            if i >= warmup:
                phases = {
                    name: [b - a for a, b in zip(m0, m1, strict=True)]
                    for name, m0, m1 in zip(
                        ("fwd", "bwd", "opt"), marks[:-1], marks[1:], strict=True
                    )
                }
                out.append({"strategy": s, "rank": comm.rank, "phases": phases, "spans": spans[:]})
    return {"records": out, "counts_WN": counts_WN}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def summarize(records: list[dict], rows: dict[str, list[int]]) -> None:
    """Print the medians and, with a2a, each rank's CPU against a2a's line (module doc)."""
    by = collections.defaultdict(list)
    for r in records:
        by[(r["strategy"], r["rank"])].append(r)
    W = 1 + max(r["rank"] for r in records)
    cpu: dict[str, list[float]] = {}
    for s in rows:
        print(f"== {s} (ms: wall / process CPU / main-thread CPU, medians over steps)")
        names = list(
            dict.fromkeys(n for r in records if r["strategy"] == s for n, *_ in r["spans"])
        )
        cpu[s] = []
        for k in range(W):
            rs = by[(s, k)]
            total = [_median([sum(r["phases"][p][j] for p in r["phases"]) * 1e3 for r in rs])
                     for j in range(3)]  # fmt: skip
            cpu[s].append(total[1])
            line = "  ".join(
                f"{p} "
                + "/".join(
                    f"{_median([r['phases'][p][j] * 1e3 for r in rs]):.1f}" for j in range(3)
                )  # fmt: skip
                for p in ("fwd", "bwd", "opt")
            )
            print(f"r{k} rows {rows[s][k]}  {line}  | step " + "/".join(f"{v:.1f}" for v in total))
            for n in names:
                vals = [[sum(x[j] for x in r["spans"] if x[0] == n) * 1e3 for j in (1, 2, 3)]
                        for r in rs]  # fmt: skip
                print(f"     {n:28s} " + " ".join(f"{_median([v[j] for v in vals]):7.1f}"
                                                  for j in range(3)))  # fmt: skip
    if "a2a" not in rows or len(set(rows["a2a"])) < 2:
        return
    xs, ys = rows["a2a"], cpu["a2a"]
    mx, my = sum(xs) / W, sum(ys) / W
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    icpt = my - slope * mx
    print(f"a2a's line: {icpt:.1f} ms + {slope * 1e3:.1f} us per row computed")
    for s in rows:
        extra = [c - (icpt + slope * n) for c, n in zip(cpu[s], rows[s], strict=True)]
        print(f"{s:6s} CPU {[round(c, 1) for c in cpu[s]]} (sum {sum(cpu[s]):.1f}); beyond the "
              f"line {[round(e, 1) for e in extra]} (sum {sum(extra):.1f})")  # fmt: skip


def main(argv: list[str]) -> None:
    from mixmoe.bench.layer import LayerBenchConfig
    from mixmoe.comm.launch import spawn_gloo
    from mixmoe.placement import LayerShape
    from mixmoe.placement.profile_io import load_profile
    from mixmoe.simulate.layer import predict_layer

    if len(argv) not in (10, 11):
        raise SystemExit(__doc__)
    routing, profile, strategies = argv[0], argv[1], tuple(argv[2].split(","))
    D, F, T, E, W, steps, warmup = (int(v) for v in argv[3:10])
    cfg = LayerBenchConfig(model_dim=D, hidden_size=F, tokens=T, num_local_experts=E, top_k=2,
                           routing=routing, strategies=strategies, world_size=W, threads=1,
                           profile=profile, steps=steps, warmup=warmup)  # fmt: skip
    res = spawn_gloo(_rank, W, cfg, steps, warmup, timeout_s=1200, threads=1)
    records = [r for rank in res for r in rank["records"]]
    counts_WN = res[0]["counts_WN"]
    shape = LayerShape(model_dim=D, hidden_dim=F, experts_per_rank=E, world_size=W,
                       bytes_per_element=4)  # fmt: skip
    preds = predict_layer(counts_WN, shape, load_profile(profile), top_k=2,
                          strategies=tuple(s for s in strategies if s != "local"))  # fmt: skip
    rows = {s: list(p.rows_W) for s, p in preds.items()}
    if len(argv) == 11:
        with open(argv[10], "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    summarize(records, rows)


if __name__ == "__main__":
    main(sys.argv[1:])
