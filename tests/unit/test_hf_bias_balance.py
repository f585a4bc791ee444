"""``mixmoe.hf.bias_balance`` on a tiny random DeepSeek-V3 (and GLM-4-MoE): the counts and the
update against a per-token reference that shares no code (its own sigmoid top-k over the
router's weight and bias), once per optimizer step under gradient accumulation, recomputation
not counted, selection only (the logits of every step equal the reference model's), and the
bias moving the load towards balance.

Legend: T tokens, N experts, K top-k.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from mixmoe.hf.bias_balance import BiasBalancer, install_bias_balance

N, K, V = 8, 2, 64


def tiny_deepseek_v3(seed: int, hot: float = 0.0):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        head_dim=4,
        v_head_dim=8,
        n_routed_experts=N,
        num_experts_per_tok=K,
        n_shared_experts=1,
        n_group=2,
        topk_group=2,
        first_k_dense_replace=0,
        routed_scaling_factor=2.5,
        max_position_embeddings=64,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).float()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.weight.normal_(0, 0.3)  # the init leaves routers at zero: every score ties
                m.e_score_correction_bias[0] = hot  # sigmoid scores are < 1: 1.0 = always chosen
    return model


def reference_ids(router, x_TD: torch.Tensor) -> torch.Tensor:
    """Per-token twin of DeepSeek-V3's selection with every group eligible: the K best
    ``sigmoid(x . w_n) + bias_n``, computed token by token in float64."""
    w = router.weight.detach().double()
    b = router.e_score_correction_bias.double()
    out = []
    for x in x_TD.detach().double():
        score = [float(torch.sigmoid(x @ w[n])) + float(b[n]) for n in range(len(w))]
        out.append(sorted(range(len(w)), key=lambda n: -score[n])[:K])
    return torch.tensor(out)


def capture_router_inputs(model, on: dict) -> dict[str, list[torch.Tensor]]:
    """The routers' inputs while ``on["forward"]`` is True (the test turns it off around its
    backward, where checkpointing recomputes)."""
    inputs: dict[str, list[torch.Tensor]] = {}

    def hook(mod, args, name):
        if on["forward"]:
            inputs.setdefault(name, []).append(args[0].detach().clone())

    for name, m in model.named_modules():
        if hasattr(m, "e_score_correction_bias"):
            m.register_forward_pre_hook(lambda mod, args, name=name: hook(mod, args, name))
    return inputs


def reference_step(model, inputs: dict, rate: float) -> dict[str, torch.Tensor]:
    """The loads from the captured router inputs and the bias update, by hand."""
    loads = {}
    for name, xs in inputs.items():
        router = model.get_submodule(name)
        load = torch.zeros(N, dtype=torch.float64)
        for x in xs:
            for n in reference_ids(router, x.reshape(-1, x.shape[-1])).flatten().tolist():
                load[n] += 1
        with torch.no_grad():
            router.e_score_correction_bias += rate * torch.sign(load.mean() - load).float()
        loads[name] = load
    inputs.clear()
    return loads


def test_steps_equal_the_reference_and_count_once_per_step():
    """Three optimizer steps of two micro-batches each (the second through activation
    checkpointing): the balanced model and a reference model updated by hand give equal logits
    at every micro-batch, equal loads and equal biases; the bias moves by exactly +-rate or 0."""
    rate = 0.01
    model = tiny_deepseek_v3(seed=3)
    ref = copy.deepcopy(model)
    model.train(), ref.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    balancer = install_bias_balance(model, opt, rate=rate)
    assert [r.name for r in balancer.routers] == [
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.gate",
    ]
    on = {"forward": True}
    inputs = capture_router_inputs(ref, on)
    gen = torch.Generator().manual_seed(7)
    for step in range(3):
        before = {r.name: r.bias_N.clone() for r in balancer.routers}
        for micro in range(2):
            ids = torch.randint(1, V, (2, 9), generator=gen)
            for m in (model, ref):
                if micro == 1:  # recomputed inside the backward: counted once, not twice
                    emb = m.get_input_embeddings()(ids)
                    out = checkpoint(
                        lambda e, m=m: m(inputs_embeds=e, use_cache=False).logits,
                        emb,
                        use_reentrant=False,
                    )
                else:
                    out = m(input_ids=ids, use_cache=False).logits
                on["forward"] = False
                out.square().mean().backward()
                on["forward"] = True
                if m is model:
                    logits = out.detach()
            assert_close(logits, out.detach(), rtol=0, atol=0)  # selection only: same function
        assert all(len(v) == 2 for v in inputs.values())
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        want = reference_step(ref, inputs, rate)
        for r in balancer.routers:
            assert torch.equal(balancer.last_load[r.name].double(), want[r.name]), step
            assert int(want[r.name].sum()) == 2 * 18 * K
            assert torch.equal(r.bias_N, ref.get_submodule(r.name).e_score_correction_bias)
            moved = (r.bias_N - before[r.name]).abs()
            assert bool(((moved - rate).abs() < 1e-6).logical_or(moved == 0).all())
            assert int(r.load_N.sum()) == 0  # reset for the next step
    assert any(bool((r.bias_N != 0).any()) for r in balancer.routers)


def test_bias_moves_load_towards_balance_and_eval_is_not_counted():
    model = tiny_deepseek_v3(seed=5, hot=1.0)
    balancer = BiasBalancer(model, rate=0.05)
    ids = torch.randint(1, V, (4, 16), generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert all(int(r.load_N.sum()) == 0 for r in balancer.routers)  # eval: no count
    model.train()
    spread = []
    for _ in range(40):
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        load = balancer.step()["model.layers.0.mlp.gate"].double()
        spread.append(float(load.max() / load.mean()))
    assert spread[0] > 2.0, spread[0]  # the skew made expert 0 hot
    assert max(spread[-5:]) < 0.6 * spread[0], spread
    bias = balancer.routers[0].bias_N
    assert float(bias[0]) < 0.5  # the hot expert's bias came down from 1.0
    balancer.remove()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert all(int(r.load_N.sum()) == 0 for r in balancer.routers)  # hooks gone


def test_glm4_moe_and_errors():
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        n_routed_experts=N,
        num_experts_per_tok=K,
        first_k_dense_replace=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(config)
    balancer = BiasBalancer(model, rate=0.5)
    with torch.no_grad():
        model(input_ids=torch.randint(1, V, (1, 5)), use_cache=False)
    (name,) = [r.name for r in balancer.routers]
    load = balancer.step()[name]
    assert int(load.sum()) == 5 * K
    bias = model.get_submodule(name).e_score_correction_bias
    assert_close(bias, 0.5 * torch.sign(load.double().mean() - load.double()).float())
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        BiasBalancer(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="rate"):
        BiasBalancer(model, rate=0.0)


def _dp_worker(comm, steps: list[list[torch.Tensor]]):
    """One data-parallel rank: the same model everywhere, this rank's token batches per step
    (none at all in some steps: the rank still joins the all_reduce)."""
    model = tiny_deepseek_v3(seed=9, hot=0.3).train()
    balancer = BiasBalancer(model, rate=0.02, group=comm)
    biases = []
    for batches in steps:
        for ids in batches[comm.rank :: comm.world_size]:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
        balancer.step()
        biases.append(torch.stack([r.bias_N.clone() for r in balancer.routers]))
    return biases


@pytest.mark.dist
def test_two_gloo_ranks_agree_with_one_process_seeing_every_batch():
    from mixmoe.comm.launch import spawn_gloo

    gen = torch.Generator().manual_seed(4)
    steps = [[torch.randint(1, V, (1, 6), generator=gen) for _ in range(n)] for n in (2, 3, 1)]
    per_rank = spawn_gloo(_dp_worker, 2, steps, timeout_s=300)
    assert [torch.equal(a, b) for a, b in zip(per_rank[0], per_rank[1], strict=True)] == [True] * 3
    model = tiny_deepseek_v3(seed=9, hot=0.3).train()  # one process, every batch of the step
    balancer = BiasBalancer(model, rate=0.02)
    for batches, got in zip(steps, per_rank[0], strict=True):
        for ids in batches:
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
        balancer.step()
        assert torch.equal(torch.stack([r.bias_N for r in balancer.routers]), got)
    assert int((per_rank[0][-1] != per_rank[0][0]).sum()) > 2  # the biases moved


def _biased_families() -> dict[str, list[str]]:
    from _hf_families import moe_families, transformers_models_dir

    return {
        family: experts
        for family, experts in moe_families().items()
        if BIAS in (transformers_models_dir() / family / f"modeling_{family}.py").read_text()
    }


BIAS = "e_score_correction_bias"
BIASED = _biased_families()


@pytest.mark.parametrize("family", sorted(BIASED))
def test_every_installed_family_with_the_bias(family):
    """Each biased router's step load equals the ids its block's experts module received
    (captured independently), and its bias moves by the rule."""
    from _hf_families import NotBuildable, build_tiny

    try:
        model, experts = build_tiny(family, BIASED[family], seed=len(family))
    except NotBuildable as e:
        pytest.skip(f"no tiny model: {e}")
    balancer = BiasBalancer(model, rate=0.25)
    given: dict[str, torch.Tensor] = {}  # experts module name -> the ids it received
    names = {id(m): n for n, m in model.named_modules()}
    for m in experts:
        m.register_forward_pre_hook(
            lambda mod, args: given.__setitem__(names[id(mod)], args[1].reshape(-1).clone())
        )
    model.train()
    with torch.no_grad():
        model(input_ids=torch.randint(1, V, (2, 7)), use_cache=False)
    before = {r.name: r.bias_N.clone() for r in balancer.routers}
    loads = balancer.step()
    for r in balancer.routers:
        # the experts module nearest in the module tree (longest shared dotted prefix)
        near = max(given, key=lambda n: _shared_prefix(n, r.name))
        want = torch.bincount(given[near], minlength=r.bias_N.numel())
        assert torch.equal(loads[r.name], want), (r.name, near)
        step = torch.sign(want.double().mean() - want.double()) * 0.25
        assert_close(r.bias_N, before[r.name] + step.to(r.bias_N.dtype), rtol=0, atol=0)


def _shared_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        n += 1
    return n
