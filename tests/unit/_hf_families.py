"""The MoE families of the installed transformers, found at test time, and a tiny model of each.

A family is a ``transformers/models/<name>/modeling_<name>.py`` whose source decorates a class with
``@use_experts_implementation`` (a text scan: only those modules are imported). Its model is built
from its own config class with every size shrunk (``TINY``), random init, float32; nothing is
downloaded. ``build_tiny`` raises ``NotBuildable`` with the reason when a tiny config cannot make a
model (the tests report it as a skip, and the summary counts it).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import torch

DECORATOR = re.compile(r"^@use_experts_implementation\b[^\n]*\nclass (\w+)", re.M)

# Sizes shrunk on whichever of these attributes a config has. hidden = heads * head_dim.
TINY: dict[str, object] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 24,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "shared_intermediate_size": 16,
    "shared_experts_intermediate_size": 16,
    "dense_intermediate_size": 24,
    "moe_hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "moe_topk": 2,
    "top_k_experts": 2,
    "n_group": 1,
    "n_shared_experts": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "decoder_sparse_step": 1,
    "moe_layer_interval": 1,
    "moe_layer_start_index": 0,
    "mlp_only_layers": [],
    "layer_types": None,
    "mlp_layer_types": None,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_head_dim": 8,
    "linear_num_heads": 2,
    "max_position_embeddings": 128,
    "sliding_window": 8,
    "num_nextn_predict_layers": 0,
    "num_mtp_layers": 0,
    "router_jitter_noise": 0.0,
    "input_jitter_noise": 0.0,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
}
MAX_PARAMS = 4_000_000


class NotBuildable(Exception):
    """A tiny model of this family cannot be built (the message says why)."""


def transformers_models_dir() -> Path:
    import transformers.models

    return Path(transformers.models.__file__).parent


def moe_families() -> dict[str, list[str]]:
    """``{family: [experts class names]}`` for every modeling module that decorates a class with
    ``@use_experts_implementation``."""
    out: dict[str, list[str]] = {}
    for path in sorted(transformers_models_dir().glob("*/modeling_*.py")):
        found = DECORATOR.findall(path.read_text(encoding="utf-8"))
        if found:
            out[path.parent.name] = found
    return out


def _model_class(module, experts_names: list[str]):
    """A text model class of the module whose config has no sub-configs: ``*ForCausalLM`` first,
    then a base ``*Model``."""
    from transformers import PreTrainedModel

    candidates = []
    for name in getattr(module, "__all__", dir(module)):
        cls = getattr(module, name, None)
        if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
            continue
        config_cls = getattr(cls, "config_class", None)
        if config_cls is None or getattr(config_cls, "sub_configs", None):
            continue
        rank = 0 if name.endswith("ForCausalLM") else 1 if name.endswith("Model") else 2
        candidates.append((rank, name, cls))
    if not candidates:
        raise NotBuildable("no text model class with a flat config (multimodal only)")
    return min(candidates, key=lambda c: (c[0], c[1]))[2]


# Per-family corrections where the generic sizes contradict a family's own constraints.
FAMILY_TINY: dict[str, dict[str, object]] = {
    # one hash-routed layer (its frozen token -> expert table is randomised by build_tiny) and one
    # top-k routed layer: the default (3 hash layers first) would leave a 2-layer model with no
    # learned routing, and the all-zero table sends every token to expert 0 twice
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe"]},
    # MLA attention rotating head_dim (= qk_rope_head_dim) dims
    "deepseek_v3": {"head_dim": 8},
    "axk1": {"head_dim": 8},
    # no default layer list (the model indexes config.layer_types): one conv, one attention layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # sliding-window layers double the kv heads: keep them at most the attention heads
    "mimo_v2_flash": {"num_key_value_heads": 1},
    # multimodal rope: the sections must sum to half the rotary dim (16 * 0.5 / 2)
    "glm4v_moe": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 2],
        }
    },
}


def _settable(config, name: str) -> bool:
    """The config has ``name`` as a field, or as an alias (``attribute_map``) for a size (a None
    given through an alias would erase a list the family does not recompute)."""
    if name in config.to_dict():
        return True
    return TINY[name] is not None and name in getattr(config, "attribute_map", {})


def _shrunk_config(config_cls, family: str = "", extra: dict | None = None):
    try:
        default = config_cls()
    except Exception as e:
        raise NotBuildable(f"{config_cls.__name__}() does not build: {e}") from e
    overrides = {k: v for k, v in TINY.items() if _settable(default, k)}
    overrides.update(FAMILY_TINY.get(family, {}))
    overrides.update(extra or {})
    try:
        config = config_cls(**overrides)
    except Exception as e:
        raise NotBuildable(f"{config_cls.__name__} rejects the tiny sizes: {e}") from e
    # layer-type lists the config does not recompute from None: the default's first layers
    n = int(TINY["num_hidden_layers"])
    fixed = {
        key: listed[:n]
        for key in ("layer_types", "mlp_layer_types")
        if getattr(config, key, 0) is None
        and isinstance(listed := default.to_dict().get(key), list)
    }
    return config_cls(**overrides, **fixed) if fixed else config


def _randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Parameters left constant by the init (zero routers, unit norms) get noise: routing ties
    and dead gradients would make equality tests vacuous. Routers' selection biases
    (``e_score_correction_bias``, zero at init) get noise too, so selection-only bias paths run,
    and frozen token -> expert tables (DeepSeek-V4's ``tid2eid``, all zero at init: every token
    to expert 0, K times) get K distinct random experts per token."""
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for m in model.modules():
            bias = getattr(m, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.add_(0.05 * torch.randn(bias.shape, generator=gen, dtype=bias.dtype))
            table = getattr(m, "tid2eid", None)  # [vocab, K] expert ids of each token id
            if isinstance(table, torch.Tensor):
                n, k = int(m.num_experts), table.shape[1]
                rows = [torch.randperm(n, generator=gen)[:k] for _ in range(len(table))]
                table.copy_(torch.stack(rows))


def build_tiny(family: str, experts_names: list[str], seed: int, extra: dict | None = None):
    """``(model, experts modules)``: the family's tiny float32 model in eval mode (no dropout,
    no jitter) with its experts modules. ``extra``: config values over the tiny ones."""
    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except Exception as e:
        raise NotBuildable(f"modeling module does not import: {e}") from e
    model_cls = _model_class(module, experts_names)
    config = _shrunk_config(model_cls.config_class, family, extra)
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in model_cls(config).parameters())
    except Exception as e:
        raise NotBuildable(f"{model_cls.__name__} does not build from a tiny config: {e}") from e
    if n > MAX_PARAMS:
        raise NotBuildable(f"{model_cls.__name__}: tiny config still has {n} parameters")
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    _randomize(model, torch.Generator().manual_seed(seed))
    classes = tuple(getattr(module, name) for name in experts_names)
    experts = [m for m in model.modules() if isinstance(m, classes)]
    if not experts:
        raise NotBuildable(f"{model_cls.__name__} with the tiny config has no experts module")
    return model, experts
