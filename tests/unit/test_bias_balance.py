"""Aux-loss-free balancing on one device: the update rule by hand, once per optimizer step
(gradient accumulation sums its micro-batches, activation recomputation is not counted), the
hook, the state_dict, and the balance metrics of ``LoadRecord``.

Legend: T tokens, D model dim, N experts.
"""

from __future__ import annotations

import torch
from _unit_helpers import seed_for
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from mixmoe import GateConfig, MoE, MoEConfig
from mixmoe.gating.bias_balance import update_expert_bias
from mixmoe.layers.balance import end_balance_step, install_balance_hook
from mixmoe.types import LoadRecord


def _layer(rate: float = 0.01) -> MoE:
    gate = GateConfig(score="sigmoid", normalize="renorm", expert_bias=True, bias_update_rate=rate)
    return MoE(MoEConfig(model_dim=6, hidden_dim=5, num_experts=4, top_k=2, gate=gate))


def test_update_rule_by_hand():
    bias = torch.tensor([0.5, 0.0, -0.25, 0.0])
    update_expert_bias(bias, torch.tensor([7, 1, 2, 2]), 0.125)  # mean 3
    assert bias.tolist() == [0.375, 0.125, -0.125, 0.125]
    update_expert_bias(bias, torch.tensor([3, 3, 3, 3]), 0.125)  # balanced: no move
    assert bias.tolist() == [0.375, 0.125, -0.125, 0.125]


def test_accumulation_counts_once_per_step_and_recompute_is_not_counted():
    torch.manual_seed(seed_for("accumulate"))
    layer = _layer()
    xs = [torch.randn(9, 6) for _ in range(3)]
    layer.eval()  # eval forwards are not counted (and route the same: no randomness)
    counts = [layer(x)[1].counts_N for x in xs]
    assert int(layer.step_load_N.sum()) == 0
    layer.train()
    # three micro-batches; the second twice through activation checkpointing (non-reentrant,
    # reentrant): its forward counts, its recomputation inside the backward does not
    layer(xs[0])[0].sum().backward()
    for reentrant in (False, True):
        x = xs[1].clone().requires_grad_()
        checkpoint(lambda v: layer(v)[0], x, use_reentrant=reentrant).sum().backward()
    layer(xs[2])[0].sum().backward()
    want = counts[0] + 2 * counts[1] + counts[2]
    assert layer._step_forwards == 4
    assert torch.equal(layer.step_load_N, want)
    record = layer.end_step()
    assert torch.equal(record.load_N, want) and record.forwards == 4
    expected = torch.sign(want.double().mean() - want.double()) * 0.01
    assert_close(layer.gate.expert_bias, expected.float())
    assert record.bias_min == float(layer.gate.expert_bias.min())
    assert int(layer.step_load_N.sum()) == 0 and layer._step_forwards == 0


def test_hook_runs_once_per_optimizer_step_and_bias_is_checkpointed():
    torch.manual_seed(seed_for("hook"))
    layer = _layer()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    hook = install_balance_hook(opt, layer)
    for _ in range(2):
        for _ in range(2):  # two micro-batches
            y, aux = layer(torch.randn(8, 6))
            (y.square().sum() + aux.loss).backward()
        load = layer.step_load_N.clone()
        before = layer.gate.expert_bias.clone()
        opt.step()
        opt.zero_grad()
        ((name, record),) = hook.records
        assert name == "" and torch.equal(record.load_N, load) and record.forwards == 2
        want = before + 0.01 * torch.sign(load.double().mean() - load.double()).float()
        assert_close(layer.gate.expert_bias, want)
    hook.remove()
    state = layer.state_dict()
    assert "gate.expert_bias" in state and "step_load_N" not in state
    other = _layer()
    other.load_state_dict(state)
    assert torch.equal(other.gate.expert_bias, layer.gate.expert_bias)
    assert end_balance_step(torch.nn.Sequential(other))[0][0] == "0"


def test_all_reduce_callback_sees_the_step_counts():
    layer = _layer()
    layer(torch.randn(5, 6))
    seen = []
    layer.end_step(lambda t: (seen.append(t.clone()), t.mul_(2)))
    assert int(seen[0].sum()) == 10 and float(layer.gate.expert_bias.abs().sum()) > 0


def test_load_record_metrics():
    r = LoadRecord(torch.tensor([6, 2, 0, 0]), forwards=1, replicas=3)
    assert r.max_over_mean == 3.0
    assert abs(r.cv - 6**0.5 / 2) < 1e-12  # deviations 4, 0, -2, -2: variance 6, mean 2
    assert LoadRecord(torch.zeros(4, dtype=torch.int64), 0, 0).max_over_mean == 0.0


def test_docs_example_runs():
    """docs/modern-moe.md's "DeepSeek-style layer in a few lines" runs as written."""
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "modern-moe.md"
    code = re.search(r"```python\n(.*?)```", doc.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(code, str(doc), "exec"), scope)
    record = scope["hook"].records[0][1]
    assert record.forwards == 1 and int(record.load_N.sum()) == 8 * 64 * 4
    assert scope["layer"].gate.expert_bias.abs().max() == 1e-3


def test_one_all_reduce_per_step_for_all_layers():
    torch.manual_seed(seed_for("one-reduce"))
    model = torch.nn.Sequential(_layer(), _layer())
    for m in model:
        m(torch.randn(5, 6))
    calls = []

    def double(t):  # as if a second rank had routed the same rows
        calls.append(t.numel())
        t.mul_(2)

    loads = [m.step_load_N.clone() for m in model]
    records = end_balance_step(model, double)
    assert calls == [8]  # both layers' 4 counts, in one call
    for (_, rec), load in zip(records, loads, strict=True):
        assert torch.equal(rec.load_N, 2 * load)
