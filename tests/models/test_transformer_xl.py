"""The compact Transformer-XL: relative-position alignment, segment-level memory (equal to the
concatenated context where the memory holds all of it, detached, truncated to mem_len), its loss
falling on real text (the pydoc topics, byte-level), and MoE FFNs with a reachable aux loss.

Legend: B batch, Q segment length, M memory length, K = M + Q, D model dim, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mixmoe import MoEConfig
from mixmoe.models.moe_ffn import MoEFFN, moe_aux, moe_aux_loss
from mixmoe.models.transformer_xl import TransformerXL, TransformerXLConfig, rel_shift
from mixmoe.train.corpus import byte_streams, pydoc_topics_bytes

F64_TOL = {"rtol": 1e-9, "atol": 1e-10}
tiny = TransformerXLConfig.tiny


def _model(seed: int = 0, **overrides) -> TransformerXL:
    torch.manual_seed(seed)
    return TransformerXL(tiny(**overrides)).double().eval()


def _ids(seed: int, B: int, Q: int) -> torch.Tensor:
    return torch.randint(0, 256, (B, Q), generator=torch.Generator().manual_seed(seed))


def test_rel_shift_aligns_distances_with_keys():
    B, H, Q, M = 2, 3, 5, 4
    K = M + Q
    x = torch.randn(B, H, Q, K)
    out = rel_shift(x)
    for i in range(Q):
        for j in range(M + i + 1):  # visible keys; row m = j + Q-1-i has distance M+i-j
            assert_close(out[:, :, i, j], x[:, :, i, j + Q - 1 - i])


def test_defaults_are_the_base_enwik8_sizes():
    cfg = TransformerXLConfig()
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner) == (12, 512, 8, 64, 2048)
    assert (cfg.tgt_len, cfg.mem_len, cfg.dropout, cfg.vocab_size) == (512, 512, 0.1, 256)


def test_memory_of_the_whole_history_equals_the_concatenated_context():
    model = _model(n_layer=3)
    ids = _ids(1, B=2, Q=24)
    full = model(ids).logits
    first = model(ids[:, :12])
    second = model(ids[:, 12:], mems=first.mems)
    assert_close(first.logits, full[:, :12], **F64_TOL)
    assert_close(second.logits, full[:, 12:], **F64_TOL)


def test_memory_changes_the_output_and_is_detached_and_truncated():
    model = _model(mem_len=8)
    a, b, nxt = _ids(2, 2, 12), _ids(3, 2, 12), _ids(4, 2, 12)
    mem_a, mem_b = model(a).mems, model(b).mems
    with_a = model(nxt, mems=mem_a).logits
    assert not torch.allclose(with_a, model(nxt, mems=mem_b).logits)  # the past matters
    assert not torch.allclose(with_a, model(nxt).logits)
    # stored: the last mem_len inputs of every layer, no gradient into the past
    h0 = model.embed(a) * model.config.d_model**0.5
    assert len(mem_a) == 2 and all(m.shape == (2, 8, 32) for m in mem_a)
    assert_close(mem_a[0], h0[:, -8:].detach())
    assert all(not m.requires_grad and m.grad_fn is None for m in mem_a)
    out = model.train()(nxt, mems=mem_a, labels=nxt)
    out.loss.backward()
    assert model.blocks[0].attn.r_r_bias.grad.abs().max() > 0
    # next memory: the last 8 of [memory | this segment]
    again = model(nxt, mems=out.mems)
    assert again.mems[0].shape == (2, 8, 32)
    # no memory at all: the past is forgotten
    amnesiac = _model(mem_len=0)
    assert amnesiac(a).mems[0].shape == (2, 0, 32)
    assert_close(amnesiac(nxt, mems=amnesiac(a).mems).logits, amnesiac(nxt).logits)


def test_bad_configs_and_inputs_raise_naming_the_fix():
    with pytest.raises(ValueError, match=r"use MoEConfig\(model_dim=32"):
        tiny(moe=MoEConfig(model_dim=16, hidden_dim=8, num_experts=2))
    with pytest.raises(ValueError, match="out of range"):
        tiny(moe=MoEConfig(model_dim=32, hidden_dim=8, num_experts=2), moe_layers=[2])
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        tiny(dropout=1.0)
    model = _model()
    with pytest.raises(ValueError, match="pass mems=None"):
        model(_ids(0, 3, 4), mems=model(_ids(0, 2, 4)).mems)
    with pytest.raises(TypeError, match="int64"):
        model(torch.zeros(2, 4))


def _train(cfg: TransformerXLConfig, steps: int, B: int = 8) -> list[float]:
    torch.manual_seed(0)
    model = TransformerXL(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    streams = byte_streams(pydoc_topics_bytes(), B)
    Q, mems, losses = cfg.tgt_len, None, []
    for step in range(steps):
        seg = streams[:, step * Q : step * Q + Q + 1]
        out = model(seg[:, :-1], mems=mems, labels=seg[:, 1:])
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mems = out.mems
        losses.append(out.loss.item())
    return losses


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_loss_falls_on_the_pydoc_topics(moe):
    moe_cfg = MoEConfig(model_dim=32, hidden_dim=64, num_experts=4, top_k=2, activation="relu")
    cfg = tiny(tgt_len=32, mem_len=32, moe=moe_cfg if moe else None, moe_layers="every:2")
    losses = _train(cfg, steps=40)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # uniform bytes: ln 256 = 5.55 nats; English bytes' unigram entropy is ~3 nats
    assert first > 4.5 and last < first - 1.5, (first, last)


def test_moe_ffn_aux_loss_is_returned_and_reachable():
    moe_cfg = MoEConfig(model_dim=32, hidden_dim=48, num_experts=4, top_k=2, activation="relu")
    model = _model(n_layer=3, moe=moe_cfg, moe_layers="every:2")
    ffns = [(n, m) for n, m in model.named_modules() if isinstance(m, MoEFFN)]
    assert [n for n, _ in ffns] == ["blocks.1.ff.core"]
    ids = _ids(5, 2, 10)
    out = model.train()(ids, labels=ids)
    out2 = model(ids[:, :7], mems=out.mems, labels=ids[:, :7])
    assert sorted(moe_aux(model)) == ["blocks.1.ff.core"]
    assert int(moe_aux(model)["blocks.1.ff.core"].counts_N.sum()) == 2 * 7 * 2  # last forward's
    assert_close(out2.aux_loss, moe_aux_loss(model))
    assert out2.aux_loss > 0
    (out2.loss + out2.aux_loss).backward()
    gate = ffns[0][1].moe.gate.wg.weight
    assert gate.grad is not None and gate.grad.abs().max() > 0
