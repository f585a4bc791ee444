"""Each rank builds only the experts it owns: ``build_model(spec, ep_rank=r, ep_size=W)``
holds exactly the full build's dense weights and its experts' rows (same seed), for every
preset family that builds its own MoE layers (Mixtral's converted blocks are sliced later)."""

from __future__ import annotations

import pytest
import torch

from mixmoe.train.checkpoint import expert_owners
from mixmoe.train.presets import build_model, preset


@pytest.mark.parametrize("model", ["gpt2", "bert", "transformer-xl", "deepseek"])
def test_owned_build_is_the_full_builds_slice(model):
    spec = preset(model, "tiny", num_experts=6)
    torch.manual_seed(5)
    full = build_model(spec).state_dict()
    for W in (2, 3):
        for r in range(W):
            torch.manual_seed(5)
            part = build_model(spec, ep_rank=r, ep_size=W)
            owners = expert_owners(part)
            assert owners, "no expert module"
            state = part.state_dict()
            assert sorted(state) == sorted(full)
            for key, value in state.items():
                want = full[key]
                if key in owners:  # rows r*E .. r*E+E-1 of the [N, ...] tensor
                    E = owners[key].num_experts
                    assert E == 6 // W and owners[key].first_expert == r * E
                    want = want[r * E : (r + 1) * E]
                torch.testing.assert_close(value, want, rtol=0, atol=0, msg=f"{key} r{r}/{W}")
