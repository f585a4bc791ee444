"""Drop-in transformer FFNs: ``MixMOETransformerMLP`` (Tutel-style arguments) and
``FMoETransformerMLP`` (FastMoE-style arguments).

Legend: B batch, S sequence, D model dim, F hidden dim, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _unit_helpers import seed_for
from torch import nn
from torch.testing import assert_close

from mixmoe import FMoETransformerMLP, MixMOETransformerMLP, MoE


def make_mlp(scan=None) -> MixMOETransformerMLP:
    return MixMOETransformerMLP(
        gate_type={"type": "top", "k": 2},
        experts={
            "num_local_expert": 4,
            "hidden_size": 32,
            "activation_fn": lambda x: torch.nn.functional.relu(x),
        },
        model_dim=16,
        scan_expert_func=scan,
    )


def test_config_from_tutel_arguments():
    mlp = make_mlp()
    cfg = mlp.config
    assert (cfg.model_dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k) == (16, 32, 4, 2)
    assert cfg.activation == "relu" and cfg.gate.type == "topk"
    assert isinstance(mlp.moe, MoE)


def test_forward_shape_equals_moe_and_refreshes_aux():
    torch.manual_seed(seed_for("tutel-forward"))
    mlp = make_mlp()
    assert mlp.aux is None and mlp.l_aux is None
    x = torch.randn(2, 7, 16)
    y = mlp(x)
    assert y.shape == x.shape
    y_moe, aux_moe = mlp.moe(x)
    assert_close(y, y_moe)
    aux1 = mlp.aux
    assert aux1 is not None
    assert_close(mlp.l_aux, aux_moe.loss)
    assert_close(aux1.counts_N, aux_moe.counts_N)
    assert int(aux1.counts_N.sum()) == 2 * 7 * 2

    x2 = torch.randn(3, 5, 16)
    y2 = mlp(x2)
    assert y2.shape == x2.shape
    assert mlp.aux is not aux1, "aux must be refreshed on every forward"
    assert int(mlp.aux.counts_N.sum()) == 3 * 5 * 2
    assert_close(mlp.l_aux, mlp.moe(x2)[1].loss)
    assert mlp.l_aux.requires_grad


def test_scan_expert_func_called_once_per_expert_parameter():
    calls = []
    mlp = make_mlp(scan=lambda name, p: calls.append((name, p)))
    expected = mlp.moe.experts.named_expert_parameters()
    assert [n for n, _ in calls] == [n for n, _ in expected] == ["w1", "b1", "w2", "b2"]
    for (_, got), (_, want) in zip(calls, expected, strict=True):
        assert got is want
    # the parameters handed over are the module's own (e.g. for marking skip_allreduce)
    own = {id(p) for p in mlp.parameters()}
    assert all(id(p) in own for _, p in calls)
    assert not any(p is mlp.moe.gate.wg.weight for _, p in calls)


def test_fmoe_alias_uses_topk_gate():
    torch.manual_seed(seed_for("fmoe"))
    mlp = FMoETransformerMLP(num_expert=4, d_model=16, d_hidden=32, top_k=2)
    cfg = mlp.config
    assert cfg.gate.type == "topk" and cfg.gate.normalize == "topk_softmax"
    assert (cfg.num_experts, cfg.model_dim, cfg.hidden_dim, cfg.top_k) == (4, 16, 32, 2)
    assert cfg.activation == "gelu"
    x = torch.randn(3, 6, 16)
    y = mlp(x)
    assert y.shape == x.shape
    assert_close(y, mlp.moe(x)[0])
    assert int(mlp.aux.counts_N.sum()) == 3 * 6 * 2


def test_activation_given_as_module_class_or_name():
    for act, name in (
        (nn.GELU, "gelu"),
        (nn.SiLU(), "silu"),
        ("swish", "silu"),
        (F.relu, "relu"),
        ("swiglu", "swiglu"),
    ):
        mlp = FMoETransformerMLP(num_expert=2, d_model=8, d_hidden=8, activation=act)
        assert mlp.config.activation == name, act


class TinyBlock(nn.Module):
    """Pre-norm transformer block whose FFN is the MoE."""

    def __init__(self, d: int, ffn: nn.Module) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ffn(self.ln2(x))


def test_as_ffn_of_a_transformer_block_with_backward():
    torch.manual_seed(seed_for("block"))
    blocks = nn.Sequential(TinyBlock(16, make_mlp()), TinyBlock(16, make_mlp()))
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    x = torch.randn(2, 9, 16)
    target = torch.randn(2, 9, 16)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        y = blocks(x)
        l_aux = sum(b.ffn.l_aux for b in blocks)
        loss = F.mse_loss(y, target) + l_aux
        loss.backward()
        losses.append(loss.item())
        for name, p in blocks.named_parameters():
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all(), name
        assert blocks[0].ffn.moe.gate.wg.weight.grad.abs().sum() > 0
        assert blocks[0].ffn.moe.experts.w1.grad.abs().sum() > 0
        opt.step()
    assert losses[-1] < losses[0]


def test_tutel_key_aliases():
    mlp = MixMOETransformerMLP(
        gate_type={"type": "gshard"},
        experts={"count_per_node": 3, "hidden_size_per_expert": 24, "activation_fn": "silu"},
        model_dim=8,
    )
    cfg = mlp.config
    assert (cfg.num_experts, cfg.hidden_dim, cfg.top_k, cfg.gate.type) == (3, 24, 2, "gshard")
    assert cfg.activation == "silu"
    switch = MixMOETransformerMLP(
        gate_type={"type": "switch"}, experts={"num_local_expert": 2, "hidden_size": 8}, model_dim=8
    )
    assert switch.config.top_k == 1 and switch.config.activation == "gelu"
