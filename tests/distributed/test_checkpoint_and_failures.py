"""Checkpoints reshard across world sizes; mismatched configs and missing ranks fail clearly."""

from __future__ import annotations

import pytest
import torch
from _cases import make_layer, rank_inputs

from mixmoe import MoE
from mixmoe.parallel import gather_full_state_dict, load_full_state_dict, parallelize_moe

pytestmark = pytest.mark.dist

CASE = {
    "num_experts": 4,
    "top_k": 2,
    "skew": "hot",
    "dtype": torch.float64,
    "seed": 11,
    "tokens": [50, 40, 30, 20],
}


def _save_w4(comm) -> dict | None:
    layer = parallelize_moe(make_layer(CASE), comm, "mix")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x, dy = rank_inputs(CASE, comm.rank)
    y, _ = layer(x)
    (y * dy).sum().backward()
    opt.step()  # the checkpoint holds trained (rank-specific) weights, not the seed's
    return gather_full_state_dict(layer, comm)


def _load_and_run(comm, full: dict, strategy: str) -> torch.Tensor:
    case = dict(CASE, seed=999)  # different init: everything must come from the checkpoint
    layer = parallelize_moe(make_layer(case), comm, strategy)
    load_full_state_dict(layer, full)
    xs = [rank_inputs(CASE, r)[0] for r in range(4)]
    # rank r of W' ranks handles the tokens of original ranks r, r + W', ...
    x = torch.cat(xs[comm.rank :: comm.world_size])
    with torch.no_grad():
        return layer(x)[0]


def test_checkpoint_reshards_4_to_2_to_1() -> None:
    from mixmoe.comm.launch import spawn_gloo

    full = spawn_gloo(_save_w4, 4)[0]
    assert full["experts.w1"].shape[0] == 4
    out2 = spawn_gloo(_load_and_run, 2, full, "a2a")
    single = make_layer(dict(CASE, seed=5))
    load_full_state_dict(single, full)
    xs = [rank_inputs(CASE, r)[0] for r in range(4)]
    with torch.no_grad():
        ref = [single(torch.cat(xs[r::2]))[0] for r in range(2)]
    for r in range(2):
        torch.testing.assert_close(out2[r], ref[r], rtol=1e-12, atol=1e-12)
    # W=1 keeps the checkpoint's keys and shapes: a plain load_state_dict works too
    plain = MoE(single.config, dtype=torch.float64)
    plain.load_state_dict(full)
    with torch.no_grad():
        torch.testing.assert_close(plain(torch.cat(xs[0::2]))[0], ref[0], rtol=0, atol=0)


def _gather_untrained(comm, case: dict) -> dict | None:
    return gather_full_state_dict(parallelize_moe(make_layer(case), comm, "a2a"), comm)


@pytest.mark.parametrize(
    ("world", "activation"), [(2, "gelu"), (3, "swiglu")], ids=["W2-gelu", "W3-swiglu"]
)
def test_gathered_checkpoint_is_the_unsharded_layer(world: int, activation: str) -> None:
    """Untrained: the gathered dict is exactly the single-device layer of the same seed, every
    tensor, every expert in global order (a permuted gather is self-consistent on reload, so only
    this comparison catches it). Several experts per rank, odd and even world sizes."""
    from mixmoe.comm.launch import spawn_gloo

    case = dict(CASE, num_experts=6, activation=activation, dtype=torch.float32)
    full = spawn_gloo(_gather_untrained, world, case)
    assert all(out is None for out in full[1:])
    single = make_layer(case).state_dict()
    assert sorted(full[0]) == sorted(single)
    for key, tensor in single.items():
        torch.testing.assert_close(full[0][key], tensor, rtol=0, atol=0, msg=key)


def _mismatch(comm, field: str) -> str:
    case = dict(CASE, strategy="a2a")
    if comm.rank == 1:
        case[field] = {"num_experts": 8, "top_k": 1}[field]
    layer = parallelize_moe(make_layer(case), comm, "a2a")
    x, _ = rank_inputs(CASE, comm.rank)
    try:
        layer(x)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("field", ["num_experts", "top_k"])
def test_mismatched_config_fails_on_every_rank(field: str) -> None:
    from mixmoe.comm.launch import spawn_gloo

    messages = spawn_gloo(_mismatch, 2, field, timeout_s=120)
    for msg in messages:
        assert "differs across ranks" in msg, msg
        assert field in msg or "fingerprint" in msg


def _absent_rank(comm) -> str:
    layer = parallelize_moe(make_layer(dict(CASE, strategy="a2a")), comm, "a2a")
    if comm.rank == 1:
        return "skipped"  # never joins the count exchange
    x, _ = rank_inputs(CASE, 0)
    try:
        layer(x)
    except RuntimeError as err:
        return f"error: {err}"
    return "no error"


def test_process_group_timeout_is_honoured() -> None:
    from mixmoe.comm.launch import spawn_gloo

    out = spawn_gloo(_absent_rank, 2, timeout_s=120, pg_timeout_s=3.0)
    assert out[1] == "skipped"
    assert out[0].startswith("error:"), out[0]
