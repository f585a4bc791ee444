"""One experts EP call (forward + backward) of the ``mixmoe bench hf`` shape on 2 gloo ranks:
transformers' ``AllToAllEP`` vs mixmoe's EP implementations, on plain (non-FSDP) Mixtral experts
sharded by hand, so that nothing but the EP call is timed (no attention, FSDP or optimizer).
Interleaved, warm-up excluded, median of the slowest rank per repetition; every output and
gradient is checked against the first implementation before the medians are printed.

A name ending in ``_split`` runs that implementation with gate_up_proj read as two views (gate,
up), the layout before the fused [gate | up] weight: an in-run A/B of that change.

    PYTHONPATH=$PWD python scripts/hf_ep_call.py [uniform|skewed] [reps] [impl,impl,...] [--profile]

Legend: T tokens per rank, D hidden, F intermediate, N experts, K top-k, W ranks.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from mixmoe.comm.launch import spawn_gloo

D, F, N, K, T = 256, 512, 8, 2, 512  # bench hf's shape: 4 x 128 tokens per rank
WARMUP = 5


def _classes(names: list[str]) -> dict:
    from transformers.distributed.expert_parallel import EPImplementationInterface

    import mixmoe.hf  # noqa: F401  registers mixmoe_*
    from mixmoe.hf.ep import EP_CLASSES
    from mixmoe.ops.expert_mlp import split_gate_up

    def split(base):
        class Split(base):
            def _layout(self):
                spec = base._layout(self)
                return dataclasses.replace(spec, weights=split_gate_up(spec.weights))

        return Split

    registry = EPImplementationInterface()
    return {
        n: split(EP_CLASSES[n.removesuffix("_split")]) if n.endswith("_split") else registry[n]
        for n in names
    }


def _rank(comm, routing: str, reps: int, names: list[str], profile: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    W, r = comm.world_size, comm.rank
    mesh = init_device_mesh("cpu", (W, 1), mesh_dim_names=("ep", "tp"))
    cfg = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=N)
    cfg._experts_implementation = "grouped_mm"  # what the bench's models run
    E = N // W
    impls = {}
    for name, cls in _classes(names).items():
        torch.manual_seed(0)  # the same weights for every implementation
        ex = MixtralExperts(cfg)
        with torch.no_grad():
            gate_up = ex.gate_up_proj.normal_(0, 0.05)[r * E : (r + 1) * E].clone()
            down = ex.down_proj.normal_(0, 0.05)[r * E : (r + 1) * E].clone()
        ex.gate_up_proj, ex.down_proj = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
        ex.num_experts, ex._is_expert_parallel = E, True
        impls[name] = (ex, cls(ex, mesh["ep"], mesh["tp"]))
    gen = torch.Generator().manual_seed(1 + r)
    logits_TN = torch.randn(T, N, generator=gen)
    if routing == "skewed":
        logits_TN[:, 0] += 10.0  # expert 0 in every token's top-2: half of all slots
    w_TK, ids_TK = torch.softmax(logits_TN, -1).topk(K, -1)
    x_TD, dy_TD = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)

    def call(ex, impl):
        x, w = x_TD.clone().requires_grad_(), w_TK.clone().requires_grad_()
        y = impl(x, ids_TK, w)
        y.backward(dy_TD)
        out = (y.detach(), x.grad, w.grad, ex.gate_up_proj.grad, ex.down_proj.grad)
        ex.zero_grad(set_to_none=True)
        return out

    times = {n: [] for n in impls}
    outs = {}
    for rep in range(WARMUP + reps):
        for name, (ex, impl) in impls.items():
            dist.barrier()
            t0 = time.perf_counter()
            outs[name] = call(ex, impl)
            if rep >= WARMUP:
                times[name].append((time.perf_counter() - t0) * 1e3)
    for name, out in outs.items():
        for a, b in zip(out, outs[names[0]], strict=True):
            torch.testing.assert_close(
                a, b, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )
    table = None
    if profile:
        with torch.profiler.profile() as prof:
            for _ in range(10):
                for name, (ex, impl) in impls.items():
                    with torch.profiler.record_function("CALL " + name):
                        call(ex, impl)
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=50)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    every = [torch.empty_like(t) for _ in range(W)]
    dist.all_gather(every, t)
    slowest = torch.stack(every).max(0).values
    return {
        "median_ms": {n: statistics.median(slowest[i].tolist()) for i, n in enumerate(names)},
        "table": table,
    }


def main(argv: list[str]) -> None:
    profile = "--profile" in argv
    args = [a for a in argv if a != "--profile"]
    routing = args[0] if args else "uniform"
    reps = int(args[1]) if len(args) > 1 else 40
    names = args[2].split(",") if len(args) > 2 else ["all_to_all", "mixmoe_a2a", "mixmoe_mix"]
    res = spawn_gloo(_rank, 2, routing, reps, names, profile, threads=1, timeout_s=900)[0]
    med = res["median_ms"]
    print(routing, " ".join(f"{n}={v:.2f}ms({v / med[names[0]]:.3f})" for n, v in med.items()))
    if res["table"]:
        print(res["table"])


if __name__ == "__main__":
    main(sys.argv[1:])
