"""``moefy`` on tiny Hugging Face GPT-2 and BERT models (random init from configs).

- one expert, top-1, the dense FFN copied in: the moefy'd model IS the original model (logits and
  every gradient; float64 and float32); several experts upcycled from the dense FFN too;
- several experts, random init: the whole model with mixmoe's MoE equals the same model with the
  per-token oracle in every MoE block (logits, aux loss, every gradient);
- ``layers=`` selection and its errors; aux losses of the last forward, per model.

Legend: B batch, S sequence, D model dim, F FFN hidden dim, E experts.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from _hf_models import BLOCKS, BUILDERS, ReferenceMoE, batch, gpt2, moe_config, tol_for
from torch import nn
from torch.testing import assert_close

from mixmoe import MoEConfig
from mixmoe.models.moe_ffn import MoEFFN
from mixmoe.models.moefy import moe_aux, moe_aux_loss, moe_layers, moefy

FAMILIES = ["gpt2", "bert"]
DTYPES = [torch.float64, torch.float32]


def _counterpart(family: str, name: str) -> tuple[str, bool] | None:
    """The moefy'd model's parameter holding the dense parameter ``name`` as expert 0:
    (name, transposed). None for a parameter that keeps its name."""
    if family == "gpt2":
        m = re.fullmatch(r"(.*\.mlp)\.c_(fc|proj)\.(weight|bias)", name)
        if m:
            which = {"fc": "1", "proj": "2"}[m[2]]
            return f"{m[1]}.moe.experts.{'w' if m[3] == 'weight' else 'b'}{which}", False
        return None
    m = re.fullmatch(r"(.*\.layer\.\d+)\.(intermediate|output)\.dense\.(weight|bias)", name)
    if m:
        which = {"intermediate": "1", "output": "2"}[m[2]]
        kind = "w" if m[3] == "weight" else "b"
        return f"{m[1]}.intermediate.moe.experts.{kind}{which}", kind == "w"
    return None


def _loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    out = model(input_ids=ids, labels=labels)
    return out.logits, out.loss


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("experts,top_k", [(1, 1), (4, 2)], ids=["E1k1", "upcycled-E4k2"])
def test_dense_init_equals_the_original_model(family, dtype, experts, top_k):
    torch.manual_seed(0)
    dense = BUILDERS[family](dtype)
    moe_model = moefy(copy.deepcopy(dense), moe_config(experts, top_k), init="dense")
    assert len(moe_layers(moe_model)) == BLOCKS
    ids, labels = batch(1)
    logits_d, loss_d = _loss(dense, ids, labels)
    logits_m, loss_m = _loss(moe_model, ids, labels)
    tol = tol_for(dtype)
    assert_close(logits_m, logits_d, **tol)
    assert_close(loss_m, loss_d, **tol)
    loss_d.backward()
    loss_m.backward()

    moe_params = dict(moe_model.named_parameters())
    seen = set()
    for name, p in dense.named_parameters():
        where = _counterpart(family, name)
        if where is None:
            seen.add(name)
            assert_close(moe_params[name].grad, p.grad, **tol, msg=name)
            continue
        target, transposed = where
        seen.add(target)
        grad = moe_params[target].grad.sum(0)  # upcycled: the dense grad splits over experts
        assert_close(grad.t() if transposed else grad, p.grad, **tol, msg=name)
    # the rest is the routers: the combine weights of the chosen experts sum to one, so the
    # task loss does not depend on the router at all
    rest = set(moe_params) - seen
    assert rest and all(".moe.gate.wg." in n for n in rest), rest
    for n in rest:
        assert moe_params[n].grad.abs().max() < 1e-5, n


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_several_experts_equal_the_per_token_reference(family, dtype):
    torch.manual_seed(1)
    model = moefy(BUILDERS[family](dtype), moe_config(4, 2), layers=[0, 2])
    ref = copy.deepcopy(model)
    for _, ffn in [(n, m) for n, m in ref.named_modules() if isinstance(m, MoEFFN)]:
        ffn.moe = ReferenceMoE(ffn.moe)
    ids, labels = batch(2)
    logits, loss = _loss(model, ids, labels)
    logits_r, loss_r = _loss(ref, ids, labels)
    aux, aux_r = moe_aux_loss(model), moe_aux_loss(ref)
    tol = tol_for(dtype)
    assert_close(logits, logits_r, **tol)
    assert_close(aux.to(dtype), aux_r, **tol)
    for name, a in moe_aux(model).items():
        assert a.counts_N.tolist() == moe_aux(ref)[name].counts_N.tolist(), name
    (loss + aux).backward()
    (loss_r + aux_r).backward()
    ref_params = dict(ref.named_parameters())
    assert set(ref_params) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert p.grad is not None and ref_params[name].grad is not None, name
        assert_close(p.grad, ref_params[name].grad, **tol, msg=name)
    # the router learns from the task loss and the aux loss
    for name, moe in moe_layers(model):
        assert moe.gate.wg.weight.grad.abs().max() > 0, name


def test_bert_moe_output_enters_the_same_dropout_residual_and_layernorm():
    torch.manual_seed(2)
    model = BUILDERS["bert"]()
    layer = model.bert.encoder.layer[1]
    norm, drop = layer.output.LayerNorm, layer.output.dropout
    moefy(model, moe_config(2, 1), layers=[1])
    assert layer.output.LayerNorm is norm and layer.output.dropout is drop
    assert isinstance(layer.output.dense, nn.Identity)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    ffn_in = torch.randn(2, 5, 16, dtype=torch.float64)
    y = layer.output(layer.intermediate(ffn_in), x)
    y_moe, _ = layer.intermediate.moe(ffn_in)
    assert_close(y, norm(y_moe + x))


def test_gpt2_moe_output_goes_through_the_mlps_own_dropout():
    model = gpt2()
    drop = model.transformer.h[0].mlp.dropout
    moefy(model, moe_config(2, 1), layers=[0])
    assert model.transformer.h[0].mlp.dropout is drop
    drop.p = 0.5
    ffn, x = model.transformer.h[0].mlp.train(), torch.randn(3, 4, 16, dtype=torch.float64)
    y_moe, _ = ffn.moe(x)
    y = ffn(x)
    kept = y != 0
    assert 0 < kept.sum() < y.numel()
    assert_close(y[kept], 2 * y_moe[kept])


@pytest.mark.parametrize(
    "layers,expected",
    [
        ("all", [0, 1, 2]),
        ("every:2", [1]),
        ("every:1", [0, 1, 2]),
        ([0, 2], [0, 2]),
        ("2,0", [0, 2]),
    ],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_selects_blocks(family, layers, expected):
    torch.manual_seed(3)
    model = moefy(BUILDERS[family](), moe_config(2, 1), layers=layers)
    blocks = model.transformer.h if family == "gpt2" else model.bert.encoder.layer
    ffns = [b.mlp if family == "gpt2" else b.intermediate for b in blocks]
    assert [i for i, f in enumerate(ffns) if isinstance(f, MoEFFN)] == expected
    ids, labels = batch(3)
    _loss(model, ids, labels)
    prefix = "transformer.h" if family == "gpt2" else "bert.encoder.layer"
    suffix = "mlp" if family == "gpt2" else "intermediate"
    assert sorted(moe_aux(model)) == [f"{prefix}.{i}.{suffix}" for i in expected]


@pytest.mark.parametrize(
    "layers,error,match",
    [
        ([3], ValueError, r"\[3\] are out of range .* use indices 0\.\.2"),
        ([-1], ValueError, "out of range"),
        ("every:4", ValueError, "use every:N with N <= 3"),
        ("every:0", ValueError, "N must be >= 1"),
        ("some", ValueError, "use 'all', 'every:N'"),
        ([], ValueError, "selects no block"),
        ([1, 1], ValueError, "repeats a block"),
        (2, TypeError, "ambiguous"),
        ([0.5], TypeError, "not an int"),
    ],
)
def test_bad_layers_raise_naming_the_fix(layers, error, match):
    with pytest.raises(error, match=match):
        moefy(gpt2(), moe_config(2, 1), layers=layers)


def test_bad_models_and_configs_raise_naming_the_fix():
    with pytest.raises(ValueError, match=r"use MoEConfig\(model_dim=16"):
        moefy(gpt2(), MoEConfig(model_dim=8, hidden_dim=24, num_experts=2))
    with pytest.raises(ValueError, match="activation_function='gelu'"):
        moefy(gpt2(activation="gelu_new"), moe_config(1, 1), init="dense")
    with pytest.raises(ValueError, match=r"use MoEConfig\(activation='relu'"):
        moefy(gpt2(activation="relu"), moe_config(1, 1), init="dense")
    with pytest.raises(ValueError, match="init='sparse' is unknown"):
        moefy(gpt2(), moe_config(1, 1), init="sparse")
    with pytest.raises(TypeError, match="supports Hugging Face GPT-2 and BERT"):
        moefy(nn.Sequential(nn.Linear(16, 16)), moe_config(1, 1))
    model = moefy(gpt2(), moe_config(2, 1), layers=[1])
    with pytest.raises(ValueError, match=r"block 1 \(transformer.h.1\) already has a MoE FFN"):
        moefy(model, moe_config(2, 1), layers="all")
    chunked = BUILDERS["bert"]()
    for layer in chunked.bert.encoder.layer:
        layer.chunk_size_feed_forward = 4
    with pytest.raises(ValueError, match="chunk_size_feed_forward=0"):
        moefy(chunked, moe_config(2, 1))
    with pytest.raises(ValueError, match="has no MoE FFN"):
        moe_aux_loss(gpt2())
    with pytest.raises(ValueError, match="run a forward"):
        moe_aux_loss(moefy(gpt2(), moe_config(2, 1)))


def test_aux_losses_are_the_last_forwards_and_never_shared_between_models():
    torch.manual_seed(4)
    model = moefy(gpt2(), moe_config(4, 2), layers="every:2")
    moefy(model, moe_config(4, 1), layers=[0])  # a second call joins the same collector
    twin = copy.deepcopy(model)
    ids1, _ = batch(5)
    ids2, _ = batch(6, B=3, S=5)

    model(input_ids=ids1)
    first = moe_aux(model)
    assert sorted(first) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert [int(a.counts_N.sum()) for a in first.values()] == [16, 32]  # T*K per layer
    ffns = [m for m in model.modules() if isinstance(m, MoEFFN)]
    assert_close(moe_aux_loss(model), sum(f.aux.loss for f in ffns))

    twin(input_ids=ids2)  # the copy has its own collector: the model's aux is untouched
    assert all(moe_aux(model)[n] is a for n, a in first.items())
    assert [int(a.counts_N.sum()) for a in moe_aux(twin).values()] == [15, 30]

    model(input_ids=ids2)  # a second forward replaces the first's aux
    second = moe_aux(model)
    assert all(second[n] is not first[n] for n in first)
    assert [int(a.counts_N.sum()) for a in second.values()] == [15, 30]
    assert_close(moe_aux_loss(model), moe_aux_loss(twin))  # same weights, same input
