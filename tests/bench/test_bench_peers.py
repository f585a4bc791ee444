"""The peer comparison runs on tiny shapes: mixmoe and transformers' Mixtral block (every experts
implementation) hold the same weights and agree before anything is timed."""

from __future__ import annotations

import pytest

from mixmoe.bench.peers import PROVIDERS, PeerBenchConfig, run_peers


def test_peers_agree_and_time() -> None:
    pytest.importorskip("transformers", reason="the hf-* providers need transformers")
    cfg = PeerBenchConfig(
        model_dim=16,
        hidden_size=24,
        num_experts=4,
        top_k=2,
        tokens=40,
        steps=2,
        warmup=0,
        threads=0,
        providers=PROVIDERS,
    )
    result = run_peers(cfg)  # raises if any provider disagrees with mixmoe
    assert set(result) == set(PROVIDERS)
    assert all(r["median_ms"] > 0 for r in result.values())


def test_unknown_provider_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown providers"):
        PeerBenchConfig(providers=("mixmoe", "hf-magic"))
