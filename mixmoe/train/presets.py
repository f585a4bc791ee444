"""Model presets of ``mixmoe train``: ``gpt2 | bert | transformer-xl | mixtral | deepseek`` x
``tiny | base``,
built from configs with random init (nothing downloaded), byte-level (vocabulary 256; BERT 257
with id 256 the mask token), with mixmoe MoE FFNs on the chosen blocks.

Legend: B batch rows of this shard, L sequence length, V vocabulary, N global experts.

``deepseek`` is a GPT-2 (causal, byte-level) whose FFNs are DeepSeek-style MoE layers: fine-grained
SwiGLU experts (hidden d_ff / 4; tiny: 12 experts, top-4; base: 64 experts, d_ff / 8, top-6),
sigmoid scores with group-limited top-k (4 groups, 2 kept; base 8 groups, 4 kept; fewer when the
expert count does not divide), weights renormalised and scaled by 2.5, a float32 router, one shared
expert of the routed experts' size, aux-loss-free balancing (selection bias, rate
``bias_update_rate``, 1e-3; 0 turns it off) and a small sequence-wise balance loss
(``aux_loss_coef`` 1e-4). The attention is GPT-2's (no MLA).

``tiny`` runs on a CPU in seconds (2 blocks, d_model 64, 4 heads, FFN 128, sequence 64, no
dropout); ``base`` is the sizes of the original system's model benchmarks, for GPUs (12 blocks,
d_model 1024, 16 heads, FFN 4096, sequence 512, dropout 0.1).

Every model is driven through one task function, ``loss_sums(model, batch, mems)``, returning
``(task_loss_sum, aux_loss, mems)``: the SUM of the per-target cross entropies of the shard
(the loop divides by the global number of targets), the summed aux loss of every MoE layer of
this forward, and the recurrent memory to carry (Transformer-XL; None otherwise).

transformers (GPT-2, BERT, Mixtral) is imported lazily, with the install command on failure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from mixmoe.config import GateConfig, MoEConfig
from mixmoe.models.layer_selection import select_layers
from mixmoe.train.corpus import BYTE_VOCAB
from mixmoe.validation import check_int

MODELS = ("gpt2", "bert", "transformer-xl", "mixtral", "deepseek")
PRESETS = ("tiny", "base")
MASK_ID = BYTE_VOCAB  # BERT's [MASK]: one id past the bytes
IGNORE = -100  # target of a position that is not predicted (BERT: unmasked positions)


@dataclass(frozen=True)
class ModelSpec:
    """What is built: the family, its sizes and its MoE FFNs. ``num_experts`` is GLOBAL (N)."""

    model: str = "gpt2"
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    d_ff: int = 128
    seq_len: int = 64
    dropout: float = 0.0
    num_experts: int = 4
    top_k: int = 2
    moe_layers: str = "all"
    aux_loss_coef: float = 0.01
    dense: bool = False  # no MoE at all: the dense FFN model of the same dims (bench "naive")
    bias_update_rate: float = 1e-3  # deepseek: aux-loss-free balancing step (0: off)
    expert_dim: int | None = None  # deepseek: hidden size of one routed expert (None: d_ff)
    token_vocab: int = BYTE_VOCAB  # ids of the data (bytes: 256; BERT adds its mask id)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r} is unknown; use one of {', '.join(MODELS)}")
        for name in ("n_layer", "d_model", "n_head", "d_ff", "seq_len", "num_experts", "top_k",
                     "token_vocab"):  # fmt: skip
            check_int(name, getattr(self, name), 1)
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                "use a multiple of the head count"
            )
        if self.top_k > self.num_experts:
            raise ValueError(
                f"top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                "use top_k <= the number of experts"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        layers = select_layers(self.moe_layers, self.n_layer)  # out of range -> ValueError
        if self.model == "mixtral" and len(layers) != self.n_layer:
            raise ValueError(
                f"moe_layers={self.moe_layers!r}: every Mixtral block is a MoE block; "
                "use --moe-layers all with --model mixtral"
            )
        if self.expert_dim is not None:
            check_int("expert_dim", self.expert_dim, 1)
        if not 0.0 <= self.bias_update_rate < math.inf:
            raise ValueError(
                f"bias_update_rate must be finite and >= 0, got {self.bias_update_rate}"
            )
        if self.model == "deepseek":
            self._deepseek_moe_config()  # its own checks (groups, top-k) at construction
        if self.dense and self.model == "mixtral":
            raise ValueError("mixtral has no dense twin here; use gpt2, bert or transformer-xl")

    @property
    def vocab_size(self) -> int:
        return self.token_vocab + 1 if self.model == "bert" else self.token_vocab

    def moe_config(self) -> MoEConfig:
        """The MoE layers' config (Mixtral's come from its converted blocks instead)."""
        if self.model == "deepseek":
            return self._deepseek_moe_config()
        return MoEConfig(
            model_dim=self.d_model,
            hidden_dim=self.d_ff,
            num_experts=self.num_experts,
            top_k=self.top_k,
            activation="gelu",
            gate=GateConfig(type="topk"),
            aux_loss_coef=self.aux_loss_coef,
        )

    def _deepseek_moe_config(self) -> MoEConfig:
        N, K = self.num_experts, self.top_k
        hidden = self.expert_dim or self.d_ff
        n_groups = math.gcd(N, 8 if N >= 64 else 4)  # groups must divide N
        keep = max(1, n_groups // 2)
        per_group = N // n_groups
        if per_group < 2 or K > keep * per_group:  # too few experts for a group limit: none
            n_groups, keep = 1, None
        gate = GateConfig(
            type="topk",
            score="sigmoid",
            normalize="renorm",
            n_groups=n_groups,
            topk_groups=keep,
            route_scale=2.5,
            router_dtype="float32",
            expert_bias=self.bias_update_rate > 0,
            bias_update_rate=self.bias_update_rate,
        )
        return MoEConfig(
            model_dim=self.d_model,
            hidden_dim=hidden,
            num_experts=N,
            top_k=K,
            activation="swiglu",
            bias=False,
            gate=gate,
            aux_loss_coef=self.aux_loss_coef,
            balance_loss="sequence",
            shared_experts=1,
        )


_DEEPSEEK = {
    "tiny": {"num_experts": 12, "top_k": 4, "expert_dim": 32, "aux_loss_coef": 1e-4},
    "base": {"num_experts": 64, "top_k": 6, "expert_dim": 512, "aux_loss_coef": 1e-4},
}


def preset(model: str, size: str = "tiny", **overrides) -> ModelSpec:
    """The ``ModelSpec`` of ``model`` at ``size`` (``tiny`` | ``base``), fields overridden."""
    if model not in MODELS:
        raise ValueError(f"model {model!r} is unknown; use one of {', '.join(MODELS)}")
    if size not in PRESETS:
        raise ValueError(f"preset {size!r} is unknown; use one of {', '.join(PRESETS)}")
    spec = ModelSpec(model=model)
    if size == "base":
        spec = replace(spec, n_layer=12, d_model=1024, n_head=16, d_ff=4096, seq_len=512)
        spec = replace(spec, dropout=0.1)
    if model == "deepseek":
        spec = replace(spec, **_DEEPSEEK[size])
    return replace(spec, **overrides)


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "--model gpt2/bert/mixtral needs Hugging Face transformers (the optional 'models' "
            "extra): pip install 'mixmoe[models]'; --model transformer-xl needs nothing more"
        ) from e
    return transformers


def build_model(spec: ModelSpec, *, ep_rank: int = 0, ep_size: int = 1) -> nn.Module:
    """The model; seed the RNG first: every rank must build the same dense weights.
    ``ep_size`` 1: the single-device model with every expert. Otherwise only the experts rank
    ``ep_rank`` of the EP group owns are built (Mixtral: every expert, sliced later by
    ``parallelize_moe``), with the weights the full build holds for them."""
    if spec.model == "transformer-xl":
        from mixmoe.models.transformer_xl import TransformerXL, TransformerXLConfig

        cfg = TransformerXLConfig(
            vocab_size=spec.vocab_size,
            n_layer=spec.n_layer,
            d_model=spec.d_model,
            n_head=spec.n_head,
            d_head=spec.d_model // spec.n_head,
            d_inner=spec.d_ff,
            dropout=spec.dropout,
            tgt_len=spec.seq_len,
            mem_len=spec.seq_len,
            moe=None if spec.dense else spec.moe_config(),
            moe_layers=spec.moe_layers,
        )
        return TransformerXL(cfg, ep_rank=ep_rank, ep_size=ep_size)
    tf = _transformers()
    if spec.model == "mixtral":
        from mixmoe.hf.convert import convert_moe_model

        cfg = tf.MixtralConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.d_model,
            intermediate_size=spec.d_ff,
            num_hidden_layers=spec.n_layer,
            num_attention_heads=spec.n_head,
            num_key_value_heads=spec.n_head,
            num_local_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k,
            max_position_embeddings=spec.seq_len,
            attention_dropout=spec.dropout,
            router_aux_loss_coef=spec.aux_loss_coef,
        )
        model = tf.MixtralForCausalLM(cfg)
        convert_moe_model(model)
        for _, moe in moe_layers_of(model):  # mixmoe's balance loss at the preset's weight
            moe.config = replace(moe.config, aux_loss_coef=spec.aux_loss_coef)
        return model
    from mixmoe.models.moefy import moefy

    if spec.model in ("gpt2", "deepseek"):
        cfg = tf.GPT2Config(
            vocab_size=spec.vocab_size,
            n_positions=spec.seq_len,
            n_embd=spec.d_model,
            n_inner=spec.d_ff,
            n_layer=spec.n_layer,
            n_head=spec.n_head,
            activation_function="gelu",
            resid_pdrop=spec.dropout,
            embd_pdrop=spec.dropout,
            attn_pdrop=spec.dropout,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.BertConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.d_model,
            intermediate_size=spec.d_ff,
            num_hidden_layers=spec.n_layer,
            num_attention_heads=spec.n_head,
            hidden_act="gelu",
            hidden_dropout_prob=spec.dropout,
            attention_probs_dropout_prob=spec.dropout,
            max_position_embeddings=spec.seq_len,
        )
        model = tf.BertForMaskedLM(cfg)
    if spec.dense:
        return model
    return moefy(model, spec.moe_config(), layers=spec.moe_layers, ep_rank=ep_rank, ep_size=ep_size)


def moe_layers_of(model: nn.Module):
    """(qualified name, mixmoe ``MoE``) of every MoE layer of ``model``, in module order."""
    from mixmoe.models.moe_ffn import moe_layers

    return moe_layers(model)


def moe_auxes(model: nn.Module) -> list:
    """The ``MoEAux`` of every MoE layer of ``model``'s last forward, in module order."""
    from mixmoe.hf.convert import MoEBlock
    from mixmoe.models.moe_ffn import MoEFFN

    out = []
    for m in model.modules():
        aux = m.aux if isinstance(m, MoEFFN) else m.last_aux if isinstance(m, MoEBlock) else None
        if aux is not None:
            out.append(aux)
    return out


def _aux_sum(model: nn.Module, like: torch.Tensor) -> torch.Tensor:
    auxes = moe_auxes(model)
    if not auxes:
        return like.new_zeros(())
    return torch.stack([a.loss.to(like.dtype) for a in auxes]).sum()


def loss_sums(
    spec: ModelSpec,
    model: nn.Module,
    inputs_BL: torch.Tensor,
    targets_BL: torch.Tensor,
    mems: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
    """(sum of cross entropies over the targets != IGNORE, summed MoE aux loss, new mems)."""
    new_mems = None
    if spec.model == "transformer-xl":
        out = model(inputs_BL, mems=mems)
        logits, new_mems = out.logits, out.mems
    else:
        logits = model(input_ids=inputs_BL).logits
    ce = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1])
        if logits.dtype in (torch.bfloat16, torch.float16)
        else logits.reshape(-1, logits.shape[-1]),
        targets_BL.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return ce, _aux_sum(model, ce), new_mems
