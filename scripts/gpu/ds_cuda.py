"""DeepSeek-style layer on CUDA: fp32 router under bf16 + autocast, bf16 vs float64 layer."""

import torch

from mixmoe import GateConfig, MoE, MoEConfig
from mixmoe.gating.routing import scored_route

torch.manual_seed(0)
gate = GateConfig(
    score="sigmoid",
    normalize="renorm",
    n_groups=8,
    topk_groups=4,
    route_scale=2.5,
    router_dtype="float32",
    expert_bias=True,
)
cfg = MoEConfig(
    model_dim=512,
    hidden_dim=256,
    num_experts=64,
    top_k=6,
    activation="swiglu",
    bias=False,
    gate=gate,
    shared_experts=1,
    balance_loss="sequence",
    aux_loss_coef=1e-4,
)
ref = MoE(cfg, device="cpu", dtype=torch.float64)  # float64 runs on the CPU only
with torch.no_grad():
    ref.gate.expert_bias.copy_(torch.randn(64) * 0.05)
bf = MoE(cfg, device="cuda", dtype=torch.float32)
bf.load_state_dict(ref.state_dict())
bf = bf.to(torch.bfloat16)
print(
    "router",
    bf.gate.wg.weight.dtype,
    "bias",
    bf.gate.expert_bias.dtype,
    "experts",
    bf.experts.w1.dtype,
)
x = torch.randn(4, 256, 512, device="cuda", dtype=torch.float64)
xb = x.to(torch.bfloat16)
with torch.autocast("cuda", dtype=torch.bfloat16):
    r, _, _ = bf.gate(xb.reshape(-1, 512))
want = scored_route(bf.gate.wg(xb.reshape(-1, 512).float()), 6, gate, bf.gate.expert_bias)
print(
    "routing under autocast equals fp32 router:",
    torch.equal(r.ids_TK, want.ids_TK),
    r.logits_TN.dtype,
)
y_ref, aux_ref = ref(x.to(torch.bfloat16).double().cpu())
y_bf, aux_bf = bf(xb)
err = ((y_bf.double().cpu() - y_ref).norm() / y_ref.norm()).item()
print(f"bf16 layer vs float64 layer: relative error {err:.2e}")
(y_bf.float().square().mean() + aux_bf.loss).backward()
print(
    "router grad dtype",
    bf.gate.wg.weight.grad.dtype,
    "finite",
    bool(bf.gate.wg.weight.grad.isfinite().all()),
)
rec = bf.end_step()
print(
    "load",
    rec.load_N.sum().item(),
    "max/mean",
    round(rec.max_over_mean, 3),
    "bias range",
    rec.bias_min,
    rec.bias_max,
)
assert err < 3e-2
