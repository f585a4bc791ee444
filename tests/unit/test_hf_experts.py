"""mixmoe as a transformers experts implementation, on every MoE family of the installed
transformers: logits and every parameter's gradient equal ``eager`` in float32.

The families are found at test time (``_hf_families.moe_families``: no list to go stale). One
test per family; a family whose tiny model cannot be built (or whose eager forward fails) is a
skip with the reason; a mismatch or an error inside mixmoe is a failure. ``test_summary`` prints
the counts and insists that the families the docs name are among the equal ones.

Every experts module must be routed to at least two experts: DeepSeek-V4's tiny model used to be
two hash-routed layers with an all-zero token -> expert table (every token to expert 0, twice),
so one expert was compared, and its router's gradient is zero up to rounding (weights s / (s + s)):
a norm-relative error of that rounding noise reads ~0.8-1.6 in float32 and in float64 alike
(|grad| ~1e-9 and ~1e-17) while every other gradient agrees to 1e-7 (float64: 1e-15).
"""

from __future__ import annotations

import pytest
import torch
from _hf_families import NotBuildable, build_tiny, moe_families
from torch.testing import assert_close

import mixmoe.hf  # noqa: F401  registers "mixmoe"
from mixmoe.hf import experts as hf_experts

FAMILIES = moe_families()
RESULTS: dict[str, str] = {}  # family -> "equal" or the skip reason
# the families the docs name, and DeepSeek-V4 (its tiny model was vacuous: see the docstring)
MUST_BE_EQUAL = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v4",
    "glm4_moe",
)
# float32, deep tiny models (softcaps, norms, scaled embeddings): summation-order rounding grows
# with depth, so the tolerance is relative to each tensor's own scale (float64 agrees to ~1e-15)
RTOL = 1e-3


def close(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    atol = 1e-5 + 1e-4 * float(ref.abs().max()) if ref.numel() else 1e-5
    assert_close(got, ref, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def _run(model, ids, dy, impl: str):
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, use_cache=False)
    logits = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    (logits * dy[..., : logits.shape[-1]]).sum().backward()
    grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    return logits.detach(), grads


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_equals_eager(family, monkeypatch):
    try:
        model, experts = build_tiny(family, FAMILIES[family], seed=sum(map(ord, family)))
    except NotBuildable as e:
        RESULTS[family] = f"not buildable: {e}"
        pytest.skip(RESULTS[family])
    gen = torch.Generator().manual_seed(len(family))
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (2, 7), generator=gen)
    dy = torch.randn(2, 7, max(vocab, model.config.hidden_size), generator=gen)
    try:
        logits_ref, grads_ref = _run(model, ids, dy, "eager")
    except Exception as e:
        RESULTS[family] = f"eager forward fails on the tiny model: {type(e).__name__}: {e}"
        pytest.skip(RESULTS[family])
    calls, ran = [], []
    real = hf_experts.hf_experts_layout
    monkeypatch.setattr(hf_experts, "hf_experts_layout", lambda m: calls.append(m) or real(m))
    routed: dict[int, set[int]] = {}  # experts module -> the expert ids it was given
    for m in experts:  # every experts module that runs must run through mixmoe
        m.register_forward_hook(lambda mod, args, out: ran.append(mod))
        m.register_forward_pre_hook(
            lambda mod, args: routed.setdefault(id(mod), set()).update(args[1].flatten().tolist())
        )
    logits, grads = _run(model, ids, dy, "mixmoe")
    assert calls, "the mixmoe experts implementation was never called"
    assert [id(m) for m in calls] == [id(m) for m in ran], "some experts bypassed mixmoe"
    # a model whose every token picks one expert (DeepSeek-V4's all-zero hash table) would
    # compare a single expert and a router gradient that is zero up to rounding: not a test
    narrow = {i: sorted(e) for i, e in routed.items() if len(e) < 2}
    assert not narrow, f"experts modules routed to fewer than 2 experts: {narrow}"
    close(logits, logits_ref, "logits")
    for name, g_ref in grads_ref.items():
        if g_ref is None:
            assert grads[name] is None, name
        else:
            close(grads[name], g_ref, f"grad of {name}")
    RESULTS[family] = "equal"


def test_summary(capsys):
    """Runs after the families (file order): the counts, and the families that must pass."""
    if not RESULTS:
        pytest.skip("run with the family tests to get the summary")
    equal = sorted(f for f, r in RESULTS.items() if r == "equal")
    skipped = {f: r for f, r in RESULTS.items() if r != "equal"}
    with capsys.disabled():
        print(
            f"\nmixmoe experts vs eager: {len(equal)} equal / {len(RESULTS)} run of "
            f"{len(FAMILIES)} families with @use_experts_implementation"
        )
        for f, r in sorted(skipped.items()):
            print(f"  skipped {f}: {r[:160]}")
    if len(RESULTS) == len(FAMILIES):
        missing = [f for f in MUST_BE_EQUAL if f in FAMILIES and f not in equal]
        assert not missing, f"{missing} must build and equal eager: {skipped}"


def test_sentinel_ids_are_dropped_choices_and_register_is_idempotent():
    """Ids >= num_experts (transformers' EP sentinels) contribute nothing, as in batched_mm
    under expert parallelism; registering again changes nothing."""
    from transformers import MixtralConfig
    from transformers.integrations.moe import ExpertsInterface, batched_mm_experts_forward
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    mixmoe.hf.register()
    assert ExpertsInterface._global_mapping["mixmoe"] is hf_experts.mixmoe_experts_forward
    torch.manual_seed(5)
    experts = MixtralExperts(
        MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)
    )
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    experts._is_expert_parallel = True
    x = torch.randn(9, 16)
    ids = torch.randint(0, 4, (9, 2))
    ids[::3, 1] = 4  # sentinel
    w = torch.rand(9, 2)
    outs = []
    for fn in (batched_mm_experts_forward, hf_experts.mixmoe_experts_forward):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        experts.zero_grad()
        y = fn(experts, xi, ids, wi)
        y.square().sum().backward()
        outs.append((y, xi.grad, wi.grad, experts.gate_up_proj.grad.clone()))
    for got, ref in zip(outs[1], outs[0], strict=True):
        assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert bool((outs[1][2][::3, 1] == 0).all())
