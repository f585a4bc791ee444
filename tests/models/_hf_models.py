"""Tiny Hugging Face GPT-2 / BERT models built from configs (random init, nothing downloaded),
and a reference MoE module that computes a mixmoe layer with the per-token oracle.

Legend: B batch, S sequence, D model dim, F FFN hidden dim, N experts.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

from mixmoe import GateConfig, MoEConfig
from mixmoe.reference.moe import reference_moe
from mixmoe.types import MoEAux

VOCAB, D, F, BLOCKS = 40, 16, 24, 3
F64_TOL = {"rtol": 1e-9, "atol": 1e-10}
# float32: the MoE path (grouped GEMM over rows) and the dense path (addmm) sum in different
# orders; a few ulps of intermediates, ~1e-6 relative after backward through 3 blocks
F32_TOL = {"rtol": 1e-4, "atol": 1e-5}


def tol_for(dtype: torch.dtype) -> dict:
    return F64_TOL if dtype == torch.float64 else F32_TOL


def gpt2(dtype: torch.dtype = torch.float64, activation: str = "gelu") -> nn.Module:
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=D,
        n_inner=F,
        n_layer=BLOCKS,
        n_head=2,
        activation_function=activation,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg).to(dtype)


def bert(dtype: torch.dtype = torch.float64, activation: str = "gelu") -> nn.Module:
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=BLOCKS,
        num_attention_heads=2,
        hidden_act=activation,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=32,
    )
    return BertForMaskedLM(cfg).to(dtype)


BUILDERS = {"gpt2": gpt2, "bert": bert}


def moe_config(num_experts: int, top_k: int, **kw) -> MoEConfig:
    kw.setdefault("aux_loss_coef", 0.1)
    kw.setdefault("z_loss_coef", 0.01)
    return MoEConfig(
        model_dim=D,
        hidden_dim=F,
        num_experts=num_experts,
        top_k=top_k,
        activation="gelu",
        gate=GateConfig(type="topk"),
        block_size=16,
        **kw,
    )


def batch(seed: int, B: int = 2, S: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    return ids, labels


class ReferenceMoE(nn.Module):
    """The same gate and experts (the very parameter objects, under the same names) computed by
    ``mixmoe.reference.moe.reference_moe``; returns ``(y, MoEAux)`` like ``MoE``."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.config = moe.config
        self.gate, self.experts = moe.gate, moe.experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        cfg, ex = self.config, self.experts
        params = {
            "gate_w": self.gate.wg.weight,
            "gate_b": self.gate.wg.bias,
            **{n: getattr(ex, n) for n in ("w1", "b1", "w2", "b2", "w3", "b3")},
        }
        y, balance, z, counts = reference_moe(
            x,
            params,
            top_k=cfg.top_k,
            gate_type=cfg.gate.type,
            normalize=cfg.gate.normalize,
            activation=cfg.activation,
        )
        loss = cfg.aux_loss_coef * balance + cfg.z_loss_coef * z
        return y, MoEAux(balance, z, loss, torch.tensor(counts))
