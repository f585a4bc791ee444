"""``moefy``: replace the dense FFN of chosen blocks of a Hugging Face GPT-2 or BERT model with
mixmoe MoE layers, in place.

Legend: D model dim (hidden_size), F FFN hidden dim, E experts.

GPT-2: ``block.mlp`` (c_fc -> act -> c_proj -> dropout) becomes a ``MoEFFN`` (MoE -> the same
dropout module).

BERT: the FFN is split over two modules: ``BertIntermediate`` (dense D->F, act) and
``BertOutput`` (dense F->D, dropout, ``LayerNorm(h + attention_output)``). The MoE replaces
``layer.intermediate`` (it maps D -> D) and ``layer.output.dense`` becomes ``nn.Identity``, so the
MoE output enters BertOutput's own dropout, residual and LayerNorm, untouched.

``init="dense"`` copies the dense FFN into every expert (sparse upcycling): with one expert, or
any number of experts and any top-k, the model then computes exactly what it computed before.
``init="random"`` keeps the experts' own seeded init. The router is always freshly initialised.

Aux losses: ``moe_aux_loss(model)`` (re-exported here from ``mixmoe.models.moe_ffn``) sums the
scaled aux loss of every MoE layer of the model's last forward.

transformers is imported lazily (the ``models`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from mixmoe.config import MoEConfig
from mixmoe.layers.moe import MoE
from mixmoe.models.layer_selection import LayerSpec, select_layers
from mixmoe.models.moe_ffn import MoEFFN, attach_collector, moe_aux, moe_aux_loss, moe_layers

__all__ = ["moe_aux", "moe_aux_loss", "moe_layers", "moefy"]

# Hugging Face activation names with an exact mixmoe twin (GPT-2's default 'gelu_new' is the tanh
# approximation: no twin, so a dense init with it would silently change the model)
_HF_ACTIVATIONS = {"gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu"}


def _transformers_models():
    try:
        from transformers.models.bert import modeling_bert
        from transformers.models.gpt2 import modeling_gpt2
    except ImportError as e:
        raise ImportError(
            "moefy needs Hugging Face transformers (the optional 'models' extra); install it with "
            "pip install 'mixmoe[models]' (or pip install 'transformers>=5')"
        ) from e
    return modeling_gpt2, modeling_bert


@dataclass(frozen=True)
class _DenseFFN:
    """One block's dense FFN in mixmoe's layout: ``y = act(x @ w1_DF + b1_F) @ w2_FD + b2_D``."""

    w1_DF: torch.Tensor
    b1_F: torch.Tensor | None
    w2_FD: torch.Tensor
    b2_D: torch.Tensor | None
    activation: object  # the model's activation setting (a name, or a callable)


def _gpt2_dense(block: nn.Module, hf_config) -> _DenseFFN:
    mlp = block.mlp
    # Conv1D stores weight [in, out] and computes x @ weight + bias: mixmoe's layout already
    return _DenseFFN(
        mlp.c_fc.weight,
        mlp.c_fc.bias,
        mlp.c_proj.weight,
        mlp.c_proj.bias,
        hf_config.activation_function,
    )


def _bert_dense(layer: nn.Module, hf_config) -> _DenseFFN:
    fc, proj = layer.intermediate.dense, layer.output.dense  # nn.Linear: weight [out, in]
    return _DenseFFN(fc.weight.t(), fc.bias, proj.weight.t(), proj.bias, hf_config.hidden_act)


def _check_dense_init(config: MoEConfig, dense: _DenseFFN, family: str) -> None:
    D, F = dense.w1_DF.shape
    act = _HF_ACTIVATIONS.get(dense.activation) if isinstance(dense.activation, str) else None
    if act is None:
        setting = "activation_function" if family == "gpt2" else "hidden_act"
        raise ValueError(
            f"init='dense' needs an activation mixmoe computes exactly; this {family} model uses "
            f"{dense.activation!r}. Build it with {setting} in {sorted(_HF_ACTIVATIONS)} (e.g. "
            f"{setting}='gelu', the exact erf GELU) or use init='random'"
        )
    if config.activation != act:
        raise ValueError(
            f"init='dense' copies a {act!r} FFN but the MoEConfig says activation="
            f"{config.activation!r}; use MoEConfig(activation={act!r}, ...)"
        )
    if config.hidden_dim != F:
        raise ValueError(
            f"init='dense' copies an FFN of hidden size {F} but the MoEConfig says hidden_dim="
            f"{config.hidden_dim}; use MoEConfig(hidden_dim={F}, ...)"
        )
    if not config.bias or dense.b1_F is None or dense.b2_D is None:
        raise ValueError("init='dense' copies the FFN's biases; use MoEConfig(bias=True, ...)")


@torch.no_grad()
def _copy_dense(moe: MoE, dense: _DenseFFN) -> None:
    experts = moe.experts
    E = experts.num_experts
    experts.w1.copy_(dense.w1_DF.expand(E, *dense.w1_DF.shape))
    experts.w2.copy_(dense.w2_FD.expand(E, *dense.w2_FD.shape))
    experts.b1.copy_(dense.b1_F.expand(E, *dense.b1_F.shape))
    experts.b2.copy_(dense.b2_D.expand(E, *dense.b2_D.shape))


def _blocks(model: nn.Module) -> tuple[str, list[tuple[str, nn.Module]]]:
    """(family, [(qualified name, block)]) of a GPT-2 or BERT model, blocks in model order."""
    gpt2, bert = _transformers_models()
    found = {
        "gpt2": [(n, m) for n, m in model.named_modules() if isinstance(m, gpt2.GPT2Block)],
        "bert": [(n, m) for n, m in model.named_modules() if isinstance(m, bert.BertLayer)],
    }
    families = [f for f, blocks in found.items() if blocks]
    if len(families) != 1:
        raise TypeError(
            f"moefy supports Hugging Face GPT-2 and BERT models (GPT2Block / BertLayer blocks); "
            f"{type(model).__name__} has {'both' if families else 'neither'}. For sparse-MoE "
            f"models convert their blocks instead; for other dense models wrap their FFNs in "
            f"mixmoe.models.moe_ffn.MoEFFN yourself"
        )
    return families[0], found[families[0]]


def moefy(
    model: nn.Module,
    config: MoEConfig,
    layers: LayerSpec = "all",
    *,
    init: Literal["random", "dense"] = "random",
    ep_rank: int = 0,
    ep_size: int = 1,
) -> nn.Module:
    """In place: the FFN of the blocks ``layers`` selects (``"all"``, ``"every:N"``, or a list of
    block indices; see ``mixmoe.models.layer_selection``) becomes a mixmoe ``MoE(config)`` with
    the dense weights' dtype and device. Returns ``model``.

    ``config.model_dim`` must equal the model's hidden size. ``init="dense"`` copies the dense FFN
    into every expert and needs ``hidden_dim``, ``activation`` and ``bias`` to match it.
    ``ep_rank`` / ``ep_size``: build only the experts this rank of an expert-parallel group owns
    (``MoE(config, ep_rank=..., ep_size=...)``: the weights the full build from the same seed
    holds for them), then ``parallelize_moe`` each layer of ``moe_layers(model)``.
    Blocks already holding a MoE FFN are refused. BERT with ``chunk_size_feed_forward > 0`` is
    refused (the FFN would run once per chunk, and the aux loss would count only one chunk).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a mixmoe.MoEConfig, got {type(config).__name__}")
    if init not in ("random", "dense"):
        raise ValueError(f"init={init!r} is unknown; use 'random' or 'dense'")
    family, blocks = _blocks(model)
    hf_config = getattr(model, "config", None)
    if hf_config is None:
        raise TypeError(
            f"{type(model).__name__} has no .config; pass the Hugging Face model itself "
            f"(e.g. the GPT2LMHeadModel / BertModel), not a container around it"
        )
    chosen = select_layers(layers, len(blocks))
    if config.model_dim != hf_config.hidden_size:
        raise ValueError(
            f"MoEConfig.model_dim={config.model_dim} differs from the model's hidden_size="
            f"{hf_config.hidden_size}; use MoEConfig(model_dim={hf_config.hidden_size}, ...)"
        )
    for i in chosen:
        name, block = blocks[i]
        ffn = block.mlp if family == "gpt2" else block.intermediate
        if isinstance(ffn, MoEFFN):
            raise ValueError(f"block {i} ({name}) already has a MoE FFN; leave it out of layers=")
        if family == "bert" and block.chunk_size_feed_forward:
            raise ValueError(
                f"BERT block {i} chunks its FFN (chunk_size_feed_forward="
                f"{block.chunk_size_feed_forward}); build the model with chunk_size_feed_forward=0"
            )
    collector = attach_collector(model)
    for i in chosen:
        name, block = blocks[i]
        dense = _gpt2_dense(block, hf_config) if family == "gpt2" else _bert_dense(block, hf_config)
        if init == "dense":
            _check_dense_init(config, dense, family)
        moe = MoE(
            config,
            ep_rank=ep_rank,
            ep_size=ep_size,
            device=dense.w1_DF.device,
            dtype=dense.w1_DF.dtype,
        )
        if init == "dense":
            _copy_dense(moe, dense)
        prefix = f"{name}." if name else ""
        if family == "gpt2":
            block.mlp = MoEFFN(
                moe, name=f"{prefix}mlp", collector=collector, dropout=block.mlp.dropout
            )
        else:
            block.intermediate = MoEFFN(moe, name=f"{prefix}intermediate", collector=collector)
            # BertOutput keeps its dropout, residual and LayerNorm; only its D<-F matmul goes
            block.output.dense = nn.Identity()
    return model
