"""Engine of ``mixmoe bench peers`` (CLI: ``mixmoe.commands.bench_peers``): the same
Mixtral-shaped sparse block in mixmoe and in Hugging Face transformers (SwiGLU experts without
bias, softmax-then-renormalised top-k router), same weights, forward + backward medians from one
interleaved run.

Providers: ``mixmoe`` and ``hf-eager`` / ``hf-batched_mm`` / ``hf-grouped_mm`` (transformers'
``MixtralSparseMoeBlock`` with that experts implementation; transformers is optional and imported
only when an ``hf-*`` provider is asked for). Before timing, every provider's output and input
gradient are checked against mixmoe's.

Legend: T tokens, D model dim, F expert hidden dim, N experts, K top-k.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from mixmoe.bench.timing import median
from mixmoe.config import GateConfig, MoEConfig
from mixmoe.layers.moe import MoE
from mixmoe.validation import check_int

HF_IMPLS = ("eager", "batched_mm", "grouped_mm")
PROVIDERS = ("mixmoe",) + tuple(f"hf-{impl}" for impl in HF_IMPLS)


@dataclass(frozen=True)
class PeerBenchConfig:
    model_dim: int = 512
    hidden_size: int = 1024
    num_experts: int = 8
    top_k: int = 2
    tokens: int = 4096
    steps: int = 10
    warmup: int = 3
    threads: int = 1
    seed: int = 0
    # hf-batched_mm materialises one weight matrix per row: minutes per step on CPU at these
    # shapes, so it runs only when asked for
    providers: tuple[str, ...] = ("mixmoe", "hf-eager", "hf-grouped_mm")

    def __post_init__(self) -> None:
        unknown = set(self.providers) - set(PROVIDERS)
        if unknown:
            raise ValueError(f"unknown providers {sorted(unknown)}; use some of {PROVIDERS}")
        for name, lo in (
            ("model_dim", 1),
            ("hidden_size", 1),
            ("num_experts", 1),
            ("top_k", 1),
            ("tokens", 1),
            ("steps", 1),
            ("warmup", 0),
            ("threads", 0),
        ):
            check_int(name, getattr(self, name), lo)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}; use top_k <= "
                "num_experts"
            )


def _transformers():
    try:
        import transformers
        from transformers.models.mixtral import modeling_mixtral
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the hf-* providers need transformers: pip install 'mixmoe[models]' (or drop them "
            "with --providers mixmoe)"
        ) from err
    return transformers, modeling_mixtral


def mixmoe_block(cfg: PeerBenchConfig) -> MoE:
    moe_cfg = MoEConfig(
        model_dim=cfg.model_dim,
        hidden_dim=cfg.hidden_size,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        activation="swiglu",
        bias=False,
        gate=GateConfig(type="topk", normalize="softmax_renorm", bias=False),
        aux_loss_coef=0.0,
    )
    torch.manual_seed(cfg.seed)
    return MoE(moe_cfg)


def hf_block(cfg: PeerBenchConfig, impl: str, like: MoE) -> torch.nn.Module:
    """transformers' Mixtral block holding ``like``'s weights (gate_up = [w1; w3]^T, down = w2^T)."""
    transformers, modeling_mixtral = _transformers()
    hf_cfg = transformers.MixtralConfig(
        hidden_size=cfg.model_dim,
        intermediate_size=cfg.hidden_size,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        hidden_act="silu",
    )
    hf_cfg._experts_implementation = impl
    block = modeling_mixtral.MixtralSparseMoeBlock(hf_cfg)
    e = like.experts
    with torch.no_grad():
        block.gate.weight.copy_(like.gate.wg.weight)
        block.experts.gate_up_proj.copy_(torch.cat([e.w1, e.w3], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(e.w2.transpose(1, 2))
    return block


def _call(provider: str, block, x_TD: torch.Tensor) -> torch.Tensor:
    if provider == "mixmoe":
        return block(x_TD)[0]
    return block(x_TD.unsqueeze(0)).squeeze(0)


def run_peers(cfg: PeerBenchConfig) -> dict[str, dict[str, float]]:
    """{provider: {"median_ms", "min_ms"}} of forward + backward (input and every parameter)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ours = mixmoe_block(cfg)
    blocks = {
        p: ours if p == "mixmoe" else hf_block(cfg, p.removeprefix("hf-"), ours)
        for p in cfg.providers
    }
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    x_TD = torch.randn(cfg.tokens, cfg.model_dim, generator=gen)
    dy_TD = torch.randn(cfg.tokens, cfg.model_dim, generator=gen)
    reference = None
    for p, block in blocks.items():  # correctness before timing
        x = x_TD.clone().requires_grad_(True)
        y = _call(p, block, x)
        (y * dy_TD).sum().backward()
        if reference is None:
            reference = (y.detach(), x.grad)
        else:
            torch.testing.assert_close(y.detach(), reference[0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(x.grad, reference[1], rtol=1e-4, atol=1e-4)
        block.zero_grad(set_to_none=True)
    times: dict[str, list[float]] = {p: [] for p in blocks}
    for i in range(cfg.warmup + cfg.steps):
        for p, block in blocks.items():  # interleaved: drifts of the machine hit all alike
            x = x_TD.clone().requires_grad_(True)
            start = time.perf_counter()
            y = _call(p, block, x)
            (y * dy_TD).sum().backward()
            elapsed = (time.perf_counter() - start) * 1e3
            block.zero_grad(set_to_none=True)
            if i >= cfg.warmup:
                times[p].append(elapsed)
    return {p: {"median_ms": median(t), "min_ms": min(t)} for p, t in times.items()}
