"""Training checkpoints independent of the world size: save from rank 0 with every expert
gathered (parameters AND AdamW states), resume at any world size whose EP size divides the
number of experts.

Legend: N global experts, E experts of this rank, G rows of the global batch, M memory length,
D model dim.

File (``torch.save`` of plain dicts, tensors, numbers and strings; read with
``weights_only=True``)::

    format   "mixmoe-train-checkpoint"      version  FORMAT_VERSION
    spec     the ModelSpec fields (what was built)
    step     steps done (the data position: the next step reads batch ``step``)
    model    full state dict (every expert tensor [N, ...], ``gather_full_state_dict``)
    optimizer  {"state": {param name: {"step", "exp_avg" [N, ...] or dense shape, ...}}}
    mems     Transformer-XL memory of the global batch, one [G, M, D] per block, or None
    config   the TrainConfig fields (informational)

Loading: every rank reads and checks the same file, then the ranks agree on a verdict with one
all_reduce, so a corrupt file or a checkpoint of another model raises the same ValueError on
every rank and nobody waits in a collective.
"""

from __future__ import annotations

import os
from dataclasses import asdict, fields
from typing import Any

import torch
from torch import nn

from mixmoe.comm import Communicator
from mixmoe.layers.experts import Experts
from mixmoe.parallel import gather_full_state_dict, load_full_state_dict
from mixmoe.train.presets import ModelSpec

FORMAT = "mixmoe-train-checkpoint"
FORMAT_VERSION = 1
# ModelSpec fields that do not change what is stored (a resume may change them)
FREE_FIELDS = ("dropout", "aux_loss_coef")


def expert_owners(model: nn.Module) -> dict[str, Experts]:
    out = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, Experts):
            for name, _ in mod.named_expert_parameters():
                out[f"{mod_name}.{name}" if mod_name else name] = mod
    return out


def _gather_rows(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    """[E, ...] on every rank of ``comm`` -> [W*E, ...] in rank order."""
    if comm.world_size == 1:
        return x.detach().clone()
    every = comm.all_gather_rows(x.detach().contiguous().reshape(-1))
    return every.reshape((comm.world_size * x.shape[0],) + tuple(x.shape[1:]))


def global_mems(mems_shards: list | None, world) -> list[torch.Tensor] | None:
    """Collective: the Transformer-XL memory of the global batch, one [G, M, D] per block
    (this rank's micro-batches in shard order, ranks in rank order), or None."""
    if mems_shards is None or not mems_shards or not mems_shards[0]:
        return None
    mems = []
    for layer in range(len(mems_shards[0])):
        local = torch.cat([shard[layer] for shard in mems_shards], dim=0)
        mems.append(_gather_rows(world, local).cpu())
    return mems


def save_checkpoint(
    path: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    spec: ModelSpec,
    step: int,
    mems_shards: list[list[torch.Tensor]] | None,
    config: dict[str, Any],
    world,
    ep,
) -> None:
    """Collective over ``world`` (every rank calls it); world rank 0 writes ``path``.

    ``mems_shards``: this rank's Transformer-XL memory per micro-batch (in shard order), or None.
    """
    full_model = gather_full_state_dict(model, ep)
    owners = expert_owners(model)
    names = {id(p): n for n, p in model.named_parameters()}
    opt_state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            state = optimizer.state.get(p, {})
            entry = {}
            for key, value in sorted(state.items()):
                if name in owners and torch.is_tensor(value) and value.shape == p.shape:
                    value = _gather_rows(ep, value)
                entry[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value
            opt_state[name] = entry
    mems = global_mems(mems_shards, world)
    if world.rank != 0:
        return
    payload = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "spec": asdict(spec),
        "step": int(step),
        "model": {k: v.cpu() for k, v in full_model.items()},
        "optimizer": {"state": opt_state},
        "mems": mems,
        "config": config,
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(payload, tmp)
    os.replace(tmp, path)


def check_checkpoint(path: str, spec: ModelSpec) -> dict[str, Any]:
    """The checkpoint at ``path`` checked against ``spec`` (ValueError naming the problem)."""
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {path!r} does not exist; pass the file --save wrote")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's bad input
        raise ValueError(
            f"checkpoint {path!r} is not readable ({type(e).__name__}: {str(e)[:120]}); "
            "it is corrupt or not a mixmoe train checkpoint"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path!r} is not a mixmoe train checkpoint")
    if ckpt.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path!r} has format version {ckpt.get('version')!r}; this mixmoe "
            f"reads version {FORMAT_VERSION}"
        )
    spec_mismatch(path, ckpt.get("spec") or {}, spec)
    return ckpt


def spec_mismatch(path: str, saved: dict[str, Any], spec: ModelSpec) -> None:
    """ValueError naming every field of the saved spec that differs from ``spec`` (the fields
    of ``FREE_FIELDS`` may differ)."""
    want = asdict(spec)
    diff = [
        f"{f.name}={saved.get(f.name)!r} (this run: {want[f.name]!r})"
        for f in fields(ModelSpec)
        if f.name not in FREE_FIELDS and saved.get(f.name, want[f.name]) != want[f.name]
    ]
    if diff:
        raise ValueError(
            f"checkpoint {path!r} holds another model: {', '.join(diff)}; resume with the "
            "flags it was trained with (--model, --preset, --num-experts, --top-k, "
            "--moe-layers, --seq-len)"
        )


def agree(check, world, path: str) -> None:
    """Collective: run ``check()`` on every rank; if it raised ValueError on any rank, raise on
    every rank (the rank's own error, or one pointing to the other rank's), so nobody is left
    waiting in a later collective."""
    error: ValueError | None = None
    try:
        check()
    except ValueError as e:
        error = e
    ok = torch.tensor([0.0 if error else 1.0])
    if world.world_size > 1:
        if world.backend == "nccl":
            ok = ok.cuda()
        world.all_reduce(ok, "min")
    if error is not None:
        raise error
    if float(ok) < 1.0:
        raise ValueError(f"checkpoint {path!r} could not be read on another rank; see its error")


def read_checkpoint(path: str, spec: ModelSpec, world) -> dict[str, Any]:
    """Collective: every rank reads and checks ``path``; all raise the same kind of ValueError
    if any rank failed (one all_reduce of the verdict), otherwise all return the payload."""
    ckpt: dict[str, Any] = {}

    def check() -> None:
        ckpt.update(check_checkpoint(path, spec))

    agree(check, world, path)
    return ckpt


def load_into(ckpt: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the full model and optimizer states into this rank's (possibly sharded) model: each
    ``Experts`` takes its slice of every expert tensor, parameters and AdamW states alike."""
    try:
        load_full_state_dict(model, ckpt["model"])
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"checkpoint does not fit this model: {str(e).splitlines()[0]}") from None
    owners = expert_owners(model)
    params = dict(model.named_parameters())
    saved = ckpt["optimizer"]["state"]
    for name, p in params.items():
        entry = saved.get(name)
        if entry is None:
            raise ValueError(f"checkpoint has no optimizer state for {name!r}")
        if not entry:
            continue
        state = {}
        for key, value in entry.items():
            if torch.is_tensor(value):
                if name in owners and value.dim() and value.shape[1:] == p.shape[1:]:
                    mod = owners[name]
                    value = value[mod.first_expert : mod.first_expert + mod.num_experts]
                if key != "step":
                    value = value.to(device=p.device, dtype=p.dtype)
                state[key] = value.clone()
            else:
                state[key] = value
        optimizer.state[p] = state


def mems_for_shard(
    ckpt: dict[str, Any], index: int, count: int, device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor] | None:
    """Shard ``index`` of ``count`` of the saved global Transformer-XL memory, or None."""
    mems = ckpt.get("mems")
    if not mems:
        return None
    b = mems[0].shape[0] // count
    return [m[index * b : (index + 1) * b].to(device=device, dtype=dtype) for m in mems]
