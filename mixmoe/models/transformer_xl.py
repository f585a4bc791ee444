"""Transformer-XL (Dai et al., 2019): a compact language model with relative positional attention
and segment-level memory, whose FFNs can be mixmoe MoE layers.

Legend: B batch, Q segment (query) length, M memory length, K = M + Q key length, D model dim,
H heads, A head dim, F FFN hidden dim, V vocabulary, L layers.

Transformers 5 no longer ships Transformer-XL, so it lives here, written from the paper and the
authors' PyTorch code (``RelPartialLearnableMultiHeadAttn``, post-LayerNorm, no adaptive softmax):

- attention score of query i and key j = (q_i + u)·k_j + (q_i + v)·W_r R_{i-j}, with u = r_w_bias
  and v = r_r_bias (learned, per layer and head) and R the sinusoid of the relative distance;
  the second term is computed for all distances at once and aligned by ``rel_shift``;
- memory: the input of every layer over the last ``mem_len`` positions is kept, detached (no
  gradient flows into past segments), and prepended to the keys and values of the next segment.
  With a memory holding the whole history, a segment's output equals recomputing it with the
  concatenated context (the tests check it).

Defaults are the classic ``base`` enwik8 configuration (12 layers, d_model 512, 8 heads of 64,
d_inner 2048, dropout 0.1, segment and memory 512), byte-level (V = 256).
``TransformerXLConfig.tiny()`` is a seconds-on-CPU size for tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from mixmoe.config import MoEConfig
from mixmoe.layers.moe import MoE
from mixmoe.models.layer_selection import LayerSpec, select_layers
from mixmoe.models.moe_ffn import MoEFFN, attach_collector
from mixmoe.validation import check_int


@dataclass(frozen=True)
class TransformerXLConfig:
    """Sizes of the model; ``moe`` set: the FFN of the blocks ``moe_layers`` selects is a
    ``MoE(moe)`` (``moe.model_dim`` must equal ``d_model``)."""

    vocab_size: int = 256  # byte-level, as mixmoe.train.corpus
    n_layer: int = 12
    d_model: int = 512
    n_head: int = 8
    d_head: int = 64
    d_inner: int = 2048
    dropout: float = 0.1
    dropatt: float = 0.0
    tgt_len: int = 512
    mem_len: int = 512
    tie_weight: bool = True
    moe: MoEConfig | None = None
    moe_layers: LayerSpec = "all"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner", "tgt_len"):
            check_int(name, getattr(self, name), 1)
        check_int("mem_len", self.mem_len, 0)
        for name in ("dropout", "dropatt"):
            p = getattr(self, name)
            if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p!r}")
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                raise TypeError(f"moe must be a MoEConfig or None, got {type(self.moe).__name__}")
            if self.moe.model_dim != self.d_model:
                raise ValueError(
                    f"moe.model_dim={self.moe.model_dim} differs from d_model={self.d_model}; "
                    f"use MoEConfig(model_dim={self.d_model}, ...)"
                )
            select_layers(self.moe_layers, self.n_layer)  # fail here, not at build

    @classmethod
    def tiny(cls, **overrides) -> TransformerXLConfig:
        """2 layers, d_model 32, 2 heads of 16, d_inner 64, segment and memory 16, no dropout."""
        base = cls(
            n_layer=2,
            d_model=32,
            n_head=2,
            d_head=16,
            d_inner=64,
            dropout=0.0,
            tgt_len=16,
            mem_len=16,
        )
        return replace(base, **overrides)


@dataclass(frozen=True)
class TransformerXLOutput:
    """logits [B, Q, V]; loss: mean next-token cross entropy (None without labels); mems: the
    memory for the next segment, one [B, M', D] tensor per layer, detached (M' <= mem_len);
    aux_loss: the summed MoE aux loss of this forward (None without MoE layers)."""

    logits: torch.Tensor
    loss: torch.Tensor | None
    mems: list[torch.Tensor]
    aux_loss: torch.Tensor | None


def rel_shift(x_BHQK: torch.Tensor) -> torch.Tensor:
    """Align scores computed against positional rows ``m = 0..K-1`` (distance K-1-m) to keys:
    ``out[..., i, j] = x[..., i, j + Q - 1 - i]`` for ``j <= i + M`` (M = K - Q); entries of
    later keys (masked anyway) are other scores. The zero-pad trick of the authors' code."""
    B, H, Q, K = x_BHQK.shape
    padded = torch.cat([x_BHQK.new_zeros(B, H, Q, 1), x_BHQK], dim=-1)
    return padded.view(B, H, K + 1, Q)[:, :, 1:].reshape(B, H, Q, K)


def sinusoid(pos_K: torch.Tensor, d_model: int) -> torch.Tensor:
    """[K, D]: sin | cos of ``pos * 10000^(-2i/D)``."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, dtype=pos_K.dtype) / d_model))
    angles = pos_K[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class RelPartialLearnableAttention(nn.Module):
    """Multi-head attention over [memory | segment] with relative positions, post-LayerNorm."""

    def __init__(self, cfg: TransformerXLConfig) -> None:
        super().__init__()
        H, A, D = cfg.n_head, cfg.d_head, cfg.d_model
        self.n_head, self.d_head = H, A
        self.qkv = nn.Linear(D, 3 * H * A, bias=False)
        self.r_net = nn.Linear(D, H * A, bias=False)
        self.o_net = nn.Linear(H * A, D, bias=False)
        self.r_w_bias = nn.Parameter(torch.randn(H, A) * 0.02)  # u: content bias
        self.r_r_bias = nn.Parameter(torch.randn(H, A) * 0.02)  # v: position bias
        self.drop = nn.Dropout(cfg.dropout)
        self.dropatt = nn.Dropout(cfg.dropatt)
        self.norm = nn.LayerNorm(D)
        self.scale = 1.0 / math.sqrt(A)

    def forward(
        self,
        h_BQD: torch.Tensor,
        r_KD: torch.Tensor,
        mem_BMD: torch.Tensor | None,
        mask_QK: torch.Tensor,
    ) -> torch.Tensor:
        B, Q, _ = h_BQD.shape
        H, A = self.n_head, self.d_head
        cat_BKD = h_BQD if mem_BMD is None else torch.cat([mem_BMD, h_BQD], dim=1)
        K = cat_BKD.shape[1]
        q, k, v = self.qkv(cat_BKD).chunk(3, dim=-1)
        q_BQHA = q[:, -Q:].view(B, Q, H, A)
        k_BKHA, v_BKHA = k.view(B, K, H, A), v.view(B, K, H, A)
        r_KHA = self.r_net(r_KD).view(K, H, A)
        ac_BHQK = torch.einsum("bqha,bkha->bhqk", q_BQHA + self.r_w_bias, k_BKHA)
        bd_BHQK = rel_shift(torch.einsum("bqha,kha->bhqk", q_BQHA + self.r_r_bias, r_KHA))
        score = ((ac_BHQK + bd_BHQK) * self.scale).masked_fill(mask_QK, float("-inf"))
        prob = self.dropatt(score.softmax(dim=-1))
        vec_BQD = torch.einsum("bhqk,bkha->bqha", prob, v_BKHA).reshape(B, Q, H * A)
        return self.norm(h_BQD + self.drop(self.o_net(vec_BQD)))


class PositionwiseFF(nn.Module):
    """``norm(h + core(h))``; core = Linear -> ReLU -> dropout -> Linear -> dropout, or a
    ``MoEFFN`` (MoE -> dropout) when the block is a MoE block."""

    def __init__(self, cfg: TransformerXLConfig, core: nn.Module | None = None) -> None:
        super().__init__()
        self.core = core or nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_inner),
            nn.ReLU(),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.d_inner, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.core(h))


class TransformerXLBlock(nn.Module):
    def __init__(self, cfg: TransformerXLConfig, ff_core: nn.Module | None = None) -> None:
        super().__init__()
        self.attn = RelPartialLearnableAttention(cfg)
        self.ff = PositionwiseFF(cfg, ff_core)

    def forward(self, h, r_KD, mem_BMD, mask_QK) -> torch.Tensor:
        return self.ff(self.attn(h, r_KD, mem_BMD, mask_QK))


class TransformerXL(nn.Module):
    """``forward(input_ids [B, Q], mems=None, labels=None) -> TransformerXLOutput``.

    ``labels[b, i]`` is the target of position i (for next-token prediction pass the input
    shifted by one); ``mems`` is the previous segment's ``output.mems`` (same B).
    """

    def __init__(self, cfg: TransformerXLConfig, *, ep_rank: int = 0, ep_size: int = 1) -> None:
        """``ep_rank`` / ``ep_size``: build only the experts this rank of an expert-parallel
        group owns (the weights the full build from the same seed holds for them; then
        ``parallelize_moe`` each MoE layer)."""
        super().__init__()
        if not isinstance(cfg, TransformerXLConfig):
            raise TypeError(f"cfg must be a TransformerXLConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.drop = nn.Dropout(cfg.dropout)
        moe_blocks = set(select_layers(cfg.moe_layers, cfg.n_layer)) if cfg.moe else set()
        collector = attach_collector(self)
        blocks = []
        for i in range(cfg.n_layer):
            core = None
            if i in moe_blocks:
                core = MoEFFN(
                    MoE(cfg.moe, ep_rank=ep_rank, ep_size=ep_size),
                    name=f"blocks.{i}.ff.core",
                    collector=collector,
                    dropout=nn.Dropout(cfg.dropout),
                )
            blocks.append(TransformerXLBlock(cfg, core))
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
        if cfg.tie_weight:
            self.head.weight = self.embed.weight

    def _check(self, ids: torch.Tensor, mems: list[torch.Tensor] | None) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.int64:
            raise TypeError("input_ids must be an int64 tensor [batch, segment length]")
        if mems is None:
            return
        B, L = ids.shape[0], len(self.blocks)
        if len(mems) != L or any(m.dim() != 3 or m.shape[0] != B for m in mems):
            shapes = [tuple(m.shape) for m in mems]
            raise ValueError(
                f"mems must be {L} tensors [batch={B}, length, d_model] (the previous "
                f"segment's output.mems, same batch), got {shapes}; pass mems=None to start over"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        mems: list[torch.Tensor] | None = None,
        labels: torch.Tensor | None = None,
    ) -> TransformerXLOutput:
        self._check(input_ids, mems)
        cfg = self.config
        B, Q = input_ids.shape
        M = 0 if not mems else mems[0].shape[1]
        K = M + Q
        h = self.drop(self.embed(input_ids) * math.sqrt(cfg.d_model))
        # positional rows m = 0..K-1 stand for distances K-1 .. 0 (see rel_shift)
        pos_K = torch.arange(K - 1, -1, -1, device=h.device, dtype=h.dtype)
        r_KD = self.drop(sinusoid(pos_K, cfg.d_model))
        # query i (absolute M + i) sees keys j <= M + i
        mask_QK = torch.ones(Q, K, dtype=torch.bool, device=h.device).triu(1 + M)
        inputs = []
        for i, block in enumerate(self.blocks):
            inputs.append(h)
            h = block(h, r_KD, mems[i] if M else None, mask_QK)
        logits = self.head(self.drop(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1))
        return TransformerXLOutput(logits, loss, self._new_mems(inputs, mems), self._aux_loss())

    @torch.no_grad()
    def _new_mems(self, inputs: list[torch.Tensor], mems) -> list[torch.Tensor]:
        """Per layer: the last ``mem_len`` positions of [old memory | this segment's input],
        detached: the stop-gradient of segment-level recurrence."""
        L = self.config.mem_len
        out = []
        for i, h in enumerate(inputs):
            cat = h if not mems or mems[i].shape[1] == 0 else torch.cat([mems[i], h], dim=1)
            out.append(cat[:, cat.shape[1] - min(L, cat.shape[1]) :].detach())
        return out

    def _aux_loss(self) -> torch.Tensor | None:
        ffns = [m for m in self.modules() if isinstance(m, MoEFFN)]
        if not ffns:
            return None
        return torch.stack([f.aux.loss for f in ffns]).sum()
