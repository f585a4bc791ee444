"""The DeepSeek-style preset of ``mixmoe train`` (``--model deepseek``): its layer config, a
1-rank run whose step records carry the per-layer balance metrics (and whose bias moves), the
heat-map ``mixmoe report`` reads back, 2-rank runs with every strategy (and plain data
parallelism: the loads summed by one all_reduce) equal to the 1-rank run of the same shards
(``micro_batches = W``), balance records included, and resuming with the bias.

Legend: N experts, K top-k.
"""

from __future__ import annotations

import json

import pytest
import torch
from _train_helpers import run_many, tiny
from torch.testing import assert_close

from mixmoe.cli import main as cli_main
from mixmoe.comm.launch import spawn_gloo
from mixmoe.train.loop import train
from mixmoe.train.presets import preset

# the router runs in float32 whatever the model's dtype: ranks and the 1-rank twin sum its
# float32 gradients in other orders (see test_train_parallel's F32_TOL)
F32_TOL = {"rtol": 1e-4, "atol": 1e-5}
STEPS = 3


def ds(**kw):
    return tiny(**{"model": "deepseek", "num_experts": 12, "top_k": 4, "max_steps": STEPS, **kw})


def test_preset_layer_config():
    cfg = preset("deepseek").moe_config()
    g = cfg.gate
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_dim, cfg.activation) == (12, 4, 32, "swiglu")
    assert (g.score, g.normalize, g.n_groups, g.topk_groups, g.route_scale) == (
        "sigmoid",
        "renorm",
        4,
        2,
        2.5,
    )
    assert g.router_dtype == "float32" and g.expert_bias and g.bias_update_rate == 1e-3
    assert (cfg.shared_experts, cfg.balance_loss, cfg.aux_loss_coef) == (1, "sequence", 1e-4)
    base = preset("deepseek", "base").moe_config()
    assert (base.num_experts, base.top_k, base.gate.n_groups, base.gate.topk_groups) == (
        64,
        6,
        8,
        4,
    )
    # too few experts per group for a group limit: plain top-k; rate 0: no bias at all
    small = preset("deepseek", num_experts=4, top_k=2, bias_update_rate=0.0).moe_config()
    assert small.gate.n_groups == 1 and not small.gate.expert_bias
    with pytest.raises(ValueError, match="bias_update_rate must be finite and >= 0"):
        preset("deepseek", bias_update_rate=-1.0)


def test_one_rank_run_logs_balance_and_report_reads_it(tmp_path, capsys):
    out = tmp_path / "run"
    result = train(ds(router_skew=2.0, out=str(out), eval_every=STEPS))
    G, L = 4, 32
    for rec in result.steps:
        assert len(rec.moe) == 2  # both GPT-2 blocks
        for layer in rec.moe:
            assert sum(layer["load"]) == G * L * 4  # every token's K rows, once per step
            load = torch.tensor(layer["load"], dtype=torch.float64)
            assert layer["max_over_mean"] == pytest.approx(float(load.max() / load.mean()))
            assert layer["cv"] == pytest.approx(float(load.std(unbiased=False) / load.mean()))
            assert layer["dead"] >= 0 and layer["replicas"] == 0
    last = result.steps[-1].moe[0]
    # the skewed start overloads experts 0..5: the bias fell for them and rose for the others
    assert last["bias_min"] < 0 < last["bias_max"]
    assert (out / "load_heatmap.png").stat().st_size > 1000
    line = json.loads((out / "train.jsonl").read_text().splitlines()[0])
    assert line["moe"][0]["layer"] == "transformer.h.0.mlp.moe"
    plots = tmp_path / "plots"
    assert cli_main(["report", str(out / "train.jsonl"), "--plots", str(plots)]) == 0
    text = capsys.readouterr().out
    assert "transformer.h.1.mlp.moe" in text and "max/mean first" in text
    assert f"{result.steps[0].moe[0]['max_over_mean']:.3f}" in text
    assert (plots / "train_run0_load_heatmap.png").exists()
    # aux loss only: no bias anywhere
    off = train(ds(bias_update_rate=0.0, max_steps=1))
    assert off.steps[0].moe[0]["bias_min"] is None


def _same(results, ref) -> None:
    for rank, res in enumerate(results):
        got = torch.tensor([(s.loss, s.aux_loss, s.grad_norm) for s in res.steps])
        want = torch.tensor([(s.loss, s.aux_loss, s.grad_norm) for s in ref.steps])
        assert_close(got, want, **F32_TOL, msg=lambda m, r=rank, n=res.strategy: f"{n} {r}: {m}")
        for s, w in zip(res.steps, ref.steps, strict=True):  # the same global loads and biases
            for a, b in zip(s.moe, w.moe, strict=True):
                assert a["load"] == b["load"], (res.strategy, rank, s.step)
                assert a["bias_min"] == b["bias_min"] and a["bias_max"] == b["bias_max"]


@pytest.mark.dist
def test_every_strategy_on_2_ranks_equals_one_rank():
    # 2 steps: the second already routes with the bias the first step moved
    two = {s: ds(strategy=s, router_skew=2.0, max_steps=2) for s in ("a2a", "shadow", "mix")}
    two["dp"] = ds(strategy="local", ep_size=1, router_skew=2.0, max_steps=2)
    out2 = spawn_gloo(run_many, 2, list(two.values()))
    ref2 = train(ds(micro_batches=2, router_skew=2.0, max_steps=2))
    for i in range(len(two)):
        _same([out2[r][i] for r in range(2)], ref2)
    mix = out2[0][2]
    assert all(s.replicas > 0 for s in mix.steps)  # mix replicated, and the records say so
    assert all(s.replicas == sum(d["replicas"] for d in s.moe) * 2 for s in mix.steps)


def test_resume_restores_the_selection_bias(tmp_path):
    """2 steps then 1 resumed step equal 3 straight steps: the bias is in the checkpoint."""
    straight = train(ds(router_skew=2.0))
    ck = str(tmp_path / "ck.pt")
    train(ds(router_skew=2.0, max_steps=2, save=ck))
    resumed = train(ds(router_skew=2.0, resume=ck))
    (last,) = resumed.steps
    assert last.step == 2 and last.moe[0]["bias_max"] == straight.steps[2].moe[0]["bias_max"]
    assert last.moe[0]["load"] == straight.steps[2].moe[0]["load"]
    assert_close(last.loss, straight.steps[2].loss, rtol=1e-10, atol=0)
