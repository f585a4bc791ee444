"""Routers and auxiliary losses on hand-computed cases, tie-breaking, switch jitter, GShard
random-routing statistics.

Legend: T tokens, N experts, K top-k.
"""

from __future__ import annotations

import math

import pytest
import torch
from _unit_helpers import make_layer, seed_for
from torch.testing import assert_close

from mixmoe.config import GateConfig
from mixmoe.gating import (
    gshard_route,
    load_balancing_loss,
    route,
    router_z_loss,
    switch_route,
    topk_route,
)

LN2, LN3 = math.log(2.0), math.log(3.0)


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ---------------------------------------------------------------- routing weights by hand


@pytest.mark.parametrize("normalize", ["topk_softmax", "softmax_renorm"])
def test_topk_weights_by_hand(normalize):
    # logits ln 3, 0, ln 2: probs 3/6, 1/6, 2/6; top-2 = experts 0 and 2;
    # softmax over the two selected logits = (3/5, 2/5) = renormalised probs (3/6, 2/6) / (5/6).
    r = topk_route(t64([[LN3, 0.0, LN2]]), 2, normalize)
    assert r.ids_TK.tolist() == [[0, 2]]
    assert r.ids_TK.dtype == torch.int64
    assert_close(r.weights_TK, t64([[0.6, 0.4]]), rtol=0, atol=1e-6)
    r1 = topk_route(t64([[LN3, 0.0, LN2]]), 1, normalize)
    assert r1.ids_TK.tolist() == [[0]]
    assert_close(r1.weights_TK, t64([[1.0]]))


def test_topk_default_normalisation_is_topk_softmax():
    # the two normalisations are equal in exact arithmetic (see above), not in float32 rounding:
    # bitwise equality pins the default to the documented ``topk_softmax`` computation
    torch.manual_seed(seed_for("topk-default"))
    logits = torch.randn(64, 8) * 3
    default = topk_route(logits, 2)
    explicit = topk_route(logits, 2, "topk_softmax")
    assert torch.equal(default.ids_TK, explicit.ids_TK)
    assert torch.equal(default.weights_TK, explicit.weights_TK)
    renorm = topk_route(logits, 2, "softmax_renorm")
    assert_close(renorm.weights_TK, explicit.weights_TK)  # same values up to rounding


def test_topk_softmax_without_renormalisation_by_hand():
    # probs 3/6, 1/6, 2/6: top-2 = experts 0 and 2 with their probabilities as they are
    # (sum 5/6, Qwen-MoE's norm_topk_prob=False); top-1 keeps 1/2, not 1
    r = topk_route(t64([[LN3, 0.0, LN2]]), 2, "softmax")
    assert r.ids_TK.tolist() == [[0, 2]]
    assert_close(r.weights_TK, t64([[0.5, 1 / 3]]), rtol=0, atol=1e-6)
    assert_close(topk_route(t64([[LN3, 0.0, LN2]]), 1, "softmax").weights_TK, t64([[0.5]]))


def test_switch_weight_is_softmax_probability():
    # probs 3/6, 1/6, 2/6 -> top-1 expert 0 with weight 1/2 (NOT renormalised to 1)
    r = switch_route(t64([[LN3, 0.0, LN2], [0.0, LN2, LN3]]))
    assert r.ids_TK.tolist() == [[0], [2]]
    assert_close(r.weights_TK, t64([[0.5], [0.5]]), rtol=0, atol=1e-6)


def test_gshard_weights_renormalised_over_two():
    r = gshard_route(t64([[LN3, 0.0, LN2]]))
    assert r.ids_TK.tolist() == [[0, 2]]
    assert_close(r.weights_TK, t64([[0.6, 0.4]]), rtol=0, atol=1e-6)


def test_routing_keeps_logits_and_dtype():
    torch.manual_seed(seed_for("keep-logits"))
    logits = torch.randn(7, 5)
    for r in (topk_route(logits, 3), switch_route(logits), gshard_route(logits)):
        assert r.logits_TN is logits
        assert r.weights_TK.dtype == logits.dtype
        assert r.ids_TK.shape == r.weights_TK.shape
    for r in (topk_route(logits, 3), gshard_route(logits)):  # renormalised over the K chosen
        assert_close(r.weights_TK.sum(-1), torch.ones(7))


# ---------------------------------------------------------------- tie-breaking


@pytest.mark.parametrize(
    "gate,k", [("topk", 1), ("topk", 2), ("topk", 4), ("switch", 1), ("gshard", 2)]
)
@pytest.mark.parametrize("normalize", ["topk_softmax", "softmax_renorm"])
def test_ties_choose_lower_id(gate, k, normalize):
    cfg = GateConfig(type=gate, normalize=normalize)
    logits = torch.tensor(
        [
            [1.5, 1.5, 1.5, 1.5],  # all equal: 0, 1, 2, 3
            [0.0, 2.0, 2.0, 2.0],  # tie for first among 1, 2, 3
            [3.0, 1.0, 1.0, -1.0],  # tie for second between 1 and 2
            [-1.0, 0.5, -1.0, 0.5],  # two ties
        ]
    )
    expected = [[0, 1, 2, 3], [1, 2, 3, 0], [0, 1, 2, 3], [1, 3, 0, 2]]
    r = route(logits, k, cfg, training=False)
    assert r.ids_TK.tolist() == [row[: r.ids_TK.shape[1]] for row in expected]


@pytest.mark.parametrize("num_experts", [64, 256])
@pytest.mark.parametrize("gate,k", [("topk", 8), ("switch", 1), ("gshard", 2)])
def test_ties_choose_lower_id_with_many_experts(gate, k, num_experts):
    """Tie-heavy logits at DeepSeek/OLMoE expert counts against a per-row loop. torch's CPU
    ``sort(stable=False)`` keeps index order only for short rows (< 32 here), so the 4-expert
    cases above cannot tell the stable sort from an unstable one; these can."""
    torch.manual_seed(seed_for("ties-many", gate, k, num_experts))
    logits = torch.randint(0, 3, (16, num_experts)).float()  # each row: ~N/3 tied maxima
    r = route(logits, k, GateConfig(type=gate), training=False)
    expected = [
        sorted(range(num_experts), key=lambda i, row=row: (-row[i], i))[:k]
        for row in logits.tolist()
    ]
    assert r.ids_TK.tolist() == expected


@pytest.mark.parametrize("gate", ["topk", "switch", "gshard"])
def test_ties_choose_lower_id_through_the_layer(gate):
    """A gate whose logits are all equal (weight 0, bias constant) picks experts 0..K-1."""
    torch.manual_seed(seed_for("tie-layer", gate))
    layer = make_layer(gate=gate, num_experts=5, dtype=torch.float32)
    with torch.no_grad():
        layer.gate.wg.weight.zero_()
        layer.gate.wg.bias.fill_(0.3)
    routing, _, _ = layer.gate(torch.randn(9, 8))
    K = layer.config.top_k
    assert routing.ids_TK.tolist() == [list(range(K))] * 9
    _, aux = layer(torch.randn(9, 8))
    assert aux.counts_N.tolist() == [9] * K + [0] * (5 - K)


# ---------------------------------------------------------------- losses by hand


def test_balance_loss_uniform_routing_is_one():
    # probs (3/4, 1/4) and (1/4, 3/4): P = (1/2, 1/2); ids 0 and 1: f = (1/2, 1/2);
    # N * sum f_i P_i = 2 * (1/4 + 1/4) = 1
    logits = t64([[LN3, 0.0], [0.0, LN3]])
    ids = torch.tensor([[0], [1]])
    assert_close(load_balancing_loss(logits, ids), torch.tensor(1.0), check_dtype=False)


def test_balance_loss_skewed_by_hand():
    # both tokens probs (3/4, 1/4), both routed to 0: P = (3/4, 1/4), f = (1, 0) -> 2 * 3/4 = 1.5
    logits = t64([[LN3, 0.0], [LN3, 0.0]])
    ids = torch.tensor([[0], [0]])
    assert_close(load_balancing_loss(logits, ids), torch.tensor(1.5), check_dtype=False)


def test_balance_loss_top2_all_choices_and_first_only():
    # token 0 logits (ln 2, 0, 0) -> probs (1/2, 1/4, 1/4); token 1 (0, 0, 0) -> (1/3, 1/3, 1/3)
    # P = (5/12, 7/24, 7/24)
    logits = t64([[LN2, 0.0, 0.0], [0.0, 0.0, 0.0]])
    ids = torch.tensor([[0, 1], [0, 1]])
    # all choices: f = (2/4, 2/4, 0) -> 3 * (1/2 * 5/12 + 1/2 * 7/24) = 51/48
    assert_close(load_balancing_loss(logits, ids), torch.tensor(51 / 48), check_dtype=False)
    # first choice only: f = (1, 0, 0) -> 3 * 5/12 = 5/4
    got = load_balancing_loss(logits, ids, first_choice_only=True)
    assert_close(got, torch.tensor(1.25), check_dtype=False)


def test_balance_loss_ignores_dropped_choices():
    # ids (0, -1), (1, 2): kept rows 0, 1, 2 -> f = (1/3, 1/3, 1/3) -> 3 * 1/3 * sum(P) = 1
    logits = t64([[LN2, 0.0, 0.0], [0.0, LN3, 0.0]])
    ids = torch.tensor([[0, -1], [1, 2]])
    assert_close(load_balancing_loss(logits, ids), torch.tensor(1.0), check_dtype=False)


def test_balance_loss_is_switch_formula_on_random_input():
    torch.manual_seed(seed_for("switch-formula"))
    T, N = 13, 5
    logits = torch.randn(T, N, dtype=torch.float64)
    ids = torch.randint(0, N, (T, 1))
    f = torch.tensor([(ids == i).sum().item() / T for i in range(N)], dtype=torch.float64)
    P = torch.softmax(logits, -1).mean(0)
    expected = N * (f * P).sum()
    assert_close(load_balancing_loss(logits, ids), expected, check_dtype=False, rtol=1e-6, atol=0)


def test_balance_loss_gradient_flows_to_logits_only_through_P():
    logits = t64([[LN3, 0.0], [LN3, 0.0]]).requires_grad_()
    ids = torch.tensor([[0], [0]])
    load_balancing_loss(logits, ids).backward()
    # d/dlogits of 2 * mean_t softmax_0: per token (1/2)*2*p0*(1-p0) = 3/16 on logit 0, -3/16 on 1
    assert_close(logits.grad, t64([[3 / 16, -3 / 16]] * 2), rtol=0, atol=1e-6)


def test_z_loss_by_hand():
    # one token (ln 3, 0): logsumexp = ln 4 -> (ln 4)^2
    assert_close(
        router_z_loss(t64([[LN3, 0.0]])), torch.tensor(math.log(4.0) ** 2), check_dtype=False
    )
    # (0, 0): ln 2; (ln 3, ln 3): ln 6 -> mean of squares
    expected = (math.log(2.0) ** 2 + math.log(6.0) ** 2) / 2
    assert_close(
        router_z_loss(t64([[0.0, 0.0], [LN3, LN3]])), torch.tensor(expected), check_dtype=False
    )


def test_z_loss_is_stable_for_large_logits():
    # naive log(sum(exp)) overflows; logsumexp(1000, 1000) = 1000 + ln 2
    got = router_z_loss(torch.tensor([[1000.0, 1000.0]]))
    assert_close(got, torch.tensor((1000.0 + LN2) ** 2), rtol=1e-6, atol=0)


def test_aux_losses_of_zero_tokens_are_zero_with_a_gradient():
    # a rank may route no tokens: the losses are exactly 0 (not NaN from a mean over nothing)
    logits = torch.randn(0, 4, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    for loss in (load_balancing_loss(logits, ids), router_z_loss(logits)):
        assert loss.dtype == torch.float32 and loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, logits)
        assert grad.shape == (0, 4)


def test_route_defaults_to_eval_no_random_drops():
    gate = GateConfig(type="gshard", random_routing=True)
    torch.manual_seed(seed_for("route-default-eval"))
    routing = route(torch.randn(256, 8), 2, gate)  # training defaults to False
    assert (routing.ids_TK >= 0).all()


@pytest.mark.parametrize("first_choice_only", [False, True])
def test_aux_losses_accumulate_in_float32_from_bf16_logits(first_choice_only):
    """bf16 logits at a realistic size (4096 x 8, scale 4): both losses come back in float32 and
    within 1e-5 relative of float64. Computing them in bf16 (no upcast) is off by 1e-4 .. 5e-3."""
    torch.manual_seed(seed_for("aux-bf16", first_choice_only))
    logits16 = (torch.randn(4096, 8, dtype=torch.float64) * 4.0).bfloat16()
    logits64 = logits16.double()  # exactly the values the bf16 tensor holds
    ids = torch.topk(logits64, 2, dim=-1).indices
    chosen = ids[:, :1] if first_choice_only else ids
    f = torch.bincount(chosen.reshape(-1), minlength=8).double() / chosen.numel()
    balance_ref = 8 * (f * torch.softmax(logits64, dim=-1).mean(dim=0)).sum()
    z_ref = torch.logsumexp(logits64, dim=-1).square().mean()

    balance = load_balancing_loss(logits16, ids, first_choice_only=first_choice_only)
    z = router_z_loss(logits16)
    assert balance.dtype == torch.float32 and z.dtype == torch.float32
    assert_close(balance.double(), balance_ref, rtol=1e-5, atol=0)
    assert_close(z.double(), z_ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("gate", ["topk", "switch", "gshard"])
def test_layer_gate_losses_are_the_formulas(gate):
    torch.manual_seed(seed_for("gate-losses", gate))
    layer = make_layer(gate=gate, num_experts=4, dtype=torch.float32)
    x = torch.randn(30, 8)
    routing, balance, z = layer.gate(x)
    logits = torch.nn.functional.linear(x, layer.gate.wg.weight, layer.gate.wg.bias)
    assert_close(routing.logits_TN, logits)
    first = gate == "gshard"
    assert_close(balance, load_balancing_loss(logits, routing.ids_TK, first_choice_only=first))
    assert_close(z, torch.logsumexp(logits, -1).square().mean())


# ---------------------------------------------------------------- training-only randomness


def test_switch_jitter_changes_logits_only_in_training():
    torch.manual_seed(seed_for("jitter"))
    layer = make_layer(gate="switch", jitter_eps=0.1, dtype=torch.float32)
    x = torch.randn(40, 8)
    clean = torch.nn.functional.linear(x, layer.gate.wg.weight, layer.gate.wg.bias)

    layer.eval()
    assert torch.equal(layer.gate(x)[0].logits_TN, clean)

    layer.train()
    layer.gate.generator = torch.Generator().manual_seed(7)
    noisy = layer.gate(x)[0].logits_TN
    assert not torch.allclose(noisy, clean)
    # bounded: the input is scaled by U(0.9, 1.1) per element, so |noisy - clean| <= 0.1 * |x| |w|
    bound = 0.1 * x.abs() @ layer.gate.wg.weight.abs().t() + 1e-5
    assert ((noisy - clean).abs() <= bound).all()
    # reproducible with the same generator seed
    layer.gate.generator = torch.Generator().manual_seed(7)
    assert torch.equal(layer.gate(x)[0].logits_TN, noisy)


def test_gshard_random_routing_drop_rate():
    """The 2nd choice is kept with probability min(1, 2 * w2): the drop rate matches in mean."""
    torch.manual_seed(seed_for("drop-rate"))
    logits = torch.randn(20000, 4)
    gen = torch.Generator().manual_seed(3)
    r = gshard_route(logits, random_routing=True, generator=gen)
    w2 = gshard_route(logits).weights_TK[:, 1]
    expected_drop = (1.0 - torch.clamp(2.0 * w2, max=1.0)).mean().item()
    got_drop = (r.ids_TK[:, 1] == -1).float().mean().item()
    # binomial std over 20000 draws < 0.0036; 4 sigma
    assert abs(got_drop - expected_drop) < 0.015
    kept = r.ids_TK[:, 1] >= 0
    # kept choices keep their renormalised weights (no re-renormalisation), dropped are 0
    assert_close(r.weights_TK[kept], gshard_route(logits).weights_TK[kept])
    assert (r.weights_TK[~kept, 1] == 0).all()


def test_random_routing_never_drops_in_eval_via_route():
    logits = torch.randn(100, 4)
    cfg = GateConfig(type="gshard", random_routing=True)
    assert (route(logits, 2, cfg, training=False).ids_TK >= 0).all()
    assert (route(logits, 2, cfg, training=True).ids_TK == -1).any()
