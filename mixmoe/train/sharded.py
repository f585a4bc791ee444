"""Sharded, atomic training checkpoints (``torch.distributed.checkpoint`` through
``mixmoe.comm.dcp``): every rank writes its own experts and their AdamW states, nothing is
gathered on one rank, and a checkpoint is visible only once complete.

Legend: N global experts, E experts of this rank, g a global expert, G rows of the global
batch, M memory length, D model dim.

Layout under the save directory::

    step-00000040/          a COMPLETE checkpoint (40 steps done): DCP files + .metadata + mixmoe.json
    .step-00000060.tmp/     a save in progress (or one that crashed): never read

Keys (one flat dict; each rank passes the keys it holds)::

    model/<name>                  a dense parameter or buffer (every rank: written once)
    model/<name>@expert<g>        row g of an expert tensor [N, ...] (its owner only)
    optim/<name>/<key>            AdamW state of a dense parameter (and every ``step``)
    optim/<name>/<key>@expert<g>  AdamW state row of expert g (its owner only)
    mems/<block>                  Transformer-XL memory of the global batch [G, M, D]
    rng/rank<r>                   rank r's torch RNG state (restored at the same world size)

Per-expert keys make resharding a matter of asking for other keys: a run on W' ranks (any EP
size dividing N) reads the rows of the experts it owns. ``mixmoe.json`` (the format, the model
spec, the step, the world and EP sizes) is written into the temporary directory after every
rank's files and DCP's metadata are complete; then ONE rename makes the checkpoint visible. A
crash anywhere before the rename leaves a ``.tmp`` directory that nothing reads, so ``--resume
auto`` takes the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixmoe.comm.dcp import load_flat, save_flat, stored_keys
from mixmoe.train.checkpoint import expert_owners, spec_mismatch
from mixmoe.train.presets import ModelSpec

FORMAT = "mixmoe-sharded-checkpoint"
FORMAT_VERSION = 1
MARKER = "mixmoe.json"
_NAME = re.compile(r"^step-(\d{8})$")
_EXPERT = re.compile(r"^(.*)@expert(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def complete_checkpoints(save_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``save_dir``, oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _NAME.match(child.name)
        if m and (child / MARKER).is_file():
            out.append((int(m.group(1)), child))
    return sorted(out)


def latest_checkpoint(save_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``save_dir`` (``--resume auto``), or None."""
    found = complete_checkpoints(save_dir)
    return found[-1][1] if found else None


# ------------------------------------------------------------------------------ flat state


def _row(t: torch.Tensor, e: int) -> torch.Tensor:
    """Row ``e`` of ``t``, sharing its memory. DCP copies a tensor whose storage is larger than
    itself before writing it, and holds those copies until the save ends (measured: a save of
    E rows as plain views costs a second copy of all E); a CPU row wrapped through numpy owns a
    storage of exactly its size, so it is written in place. Elsewhere (CUDA, bfloat16) a view."""
    row = t.detach()[e]
    if row.device.type == "cpu" and row.is_contiguous() and row.dtype != torch.bfloat16:
        return torch.from_numpy(row.numpy())
    return row


def rank_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's keys (see the module docstring), as views of the live tensors: DCP writes
    them as they are, and a load fills them in place."""
    owners = expert_owners(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key in owners:
            mod = owners[key]
            for e in range(mod.num_experts):  # row e of this rank = global expert first + e
                out[f"model/{key}@expert{mod.first_expert + e}"] = _row(value, e)
        else:
            out[f"model/{key}"] = value
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            for key, value in optimizer.state.get(p, {}).items():
                if not torch.is_tensor(value):
                    raise TypeError(f"optimizer state {name}/{key} is not a tensor ({value!r})")
                if name in owners and value.shape == p.shape:
                    mod = owners[name]
                    for e in range(mod.num_experts):
                        out[f"optim/{name}/{key}@expert{mod.first_expert + e}"] = _row(value, e)
                else:
                    out[f"optim/{name}/{key}"] = value
    return out


def _allocate_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, stored: dict, path: str
) -> None:
    """Empty AdamW state tensors of this rank's shapes for every state key the checkpoint
    holds (a load then fills them)."""
    params = dict(model.named_parameters())
    keys: dict[str, set[str]] = {}
    for key in stored:
        if key.startswith("optim/"):
            name, _, rest = key[len("optim/") :].rpartition("/")
            m = _EXPERT.match(rest)
            keys.setdefault(name, set()).add(m.group(1) if m else rest)
    for name, p in params.items():
        if name not in keys:
            continue
        state = {}
        for k in sorted(keys[name]):
            whole = stored.get(f"optim/{name}/{k}")
            if whole is None:  # per-expert rows: this rank's [E, ...] tensor
                state[k] = torch.empty_like(p, memory_format=torch.contiguous_format)
            elif tuple(whole[0]) == tuple(p.shape):
                state[k] = torch.empty_like(p, dtype=whole[1])
            else:  # AdamW's scalar step (CPU)
                state[k] = torch.empty(whole[0], dtype=whole[1])
        optimizer.state[p] = state
    missing = [n for n, p in params.items() if p.requires_grad and n not in keys]
    if keys and missing:
        raise ValueError(f"checkpoint {path} has no optimizer state for {missing[0]!r}")


@dataclass(frozen=True)
class Loaded:
    """What a load returns besides the tensors it filled: steps done, the global
    Transformer-XL memory (per block, or None) and the marker's fields."""

    step: int
    mems: list[torch.Tensor] | None
    info: dict[str, Any]


def read_marker(path: str | os.PathLike[str], spec: ModelSpec) -> dict[str, Any]:
    """The checked ``mixmoe.json`` of the checkpoint at ``path`` (ValueError naming the
    problem)."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise ValueError(
            f"{path} is not a complete mixmoe checkpoint (no {MARKER}); pass a step-* "
            "directory written by --save-dir, or --resume auto"
        )
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{marker} is not readable ({e}); the checkpoint is corrupt") from None
    if info.get("format") != FORMAT or info.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} holds format {info.get('format')!r} version {info.get('version')!r}; "
            f"this mixmoe reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    spec_mismatch(str(path), info.get("spec") or {}, spec)
    return info


# ------------------------------------------------------------------------------ save / load


def save_sharded(
    save_dir: str | os.PathLike[str],
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    spec: ModelSpec,
    mems_global: list[torch.Tensor] | None,
    config: dict[str, Any],
    world,
    ep_size: int,
    keep: int | None = None,
) -> Path:
    """Collective over ``world``: write checkpoint ``step`` under ``save_dir`` and make it
    visible atomically; then (rank 0) drop all but the newest ``keep`` complete checkpoints
    and the temporary directories of failed saves. Returns the checkpoint's path."""
    root = Path(save_dir)
    final = root / checkpoint_name(step)
    tmp = root / f".{checkpoint_name(step)}.tmp"
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a failed earlier try of this step
    world.barrier()
    state = rank_state(model, optimizer)
    for b, mem in enumerate(mems_global or []):
        state[f"mems/{b}"] = mem
    state[f"rng/rank{world.rank}"] = torch.get_rng_state()
    save_flat(state, tmp, world)
    if world.rank == 0:
        info = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": int(step),
            "spec": asdict(spec),
            "world_size": world.world_size,
            "ep_size": ep_size,
            "config": config,
        }
        commit(tmp, final, info)
        _prune(root, step, keep)
    world.barrier()
    return final


def commit(tmp: Path, final: Path, info: dict[str, Any]) -> None:
    """Write ``mixmoe.json`` into the complete directory ``tmp``, then rename it to ``final``
    (replacing an older ``final``): the one step that makes a checkpoint visible."""
    with open(tmp / MARKER, "w") as f:
        json.dump(info, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the same step saved again (a resumed run): replace it
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)  # THE commit: the checkpoint is visible from here on


def _prune(root: Path, step: int, keep: int | None) -> None:
    if keep is not None:
        for _, path in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    for child in root.iterdir():  # temporary directories of failed saves of earlier steps
        m = re.match(r"^\.step-(\d{8})\.tmp$", child.name)
        if m and int(m.group(1)) < step:
            shutil.rmtree(child, ignore_errors=True)


def load_sharded(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    spec: ModelSpec,
    world,
) -> Loaded:
    """Collective over ``world``: fill this rank's model and AdamW state from the checkpoint
    at ``path`` (written at any world and EP size): each rank reads the rows of the experts it
    owns. The ranks agree on the verdict first, so a bad checkpoint raises the same ValueError
    on every rank and nobody waits in a collective."""
    from mixmoe.train.checkpoint import agree

    info: dict[str, Any] = {}
    stored: dict = {}

    def check() -> None:
        nonlocal info, stored
        info = read_marker(path, spec)
        stored = stored_keys(path)

    agree(check, world, str(path))
    _allocate_optimizer_state(model, optimizer, stored, str(path))
    state = rank_state(model, optimizer)
    missing = [k for k in state if k not in stored]
    mems_keys = sorted((k for k in stored if k.startswith("mems/")), key=lambda k: int(k[5:]))
    for key in mems_keys:
        shape, dtype = stored[key]
        state[key] = torch.empty(shape, dtype=dtype)
    rng_key = f"rng/rank{world.rank}"
    same_world = info.get("world_size") == world.world_size and rng_key in stored
    if same_world:
        state[rng_key] = torch.empty(stored[rng_key][0], dtype=stored[rng_key][1])

    def check_keys() -> None:
        if missing:
            raise ValueError(
                f"checkpoint {path} does not fit this model: it has no {missing[0]!r} "
                f"({len(missing)} keys missing)"
            )

    agree(check_keys, world, str(path))
    load_flat(state, path, world)
    if same_world:
        torch.set_rng_state(state[rng_key])
    mems = [state[k] for k in mems_keys] or None
    return Loaded(step=int(info["step"]), mems=mems, info=info)


def invalidate_replica_caches(model: nn.Module) -> None:
    """Forget every MoE layer's cached replicas (their weights were just overwritten)."""
    for mod in model.modules():
        dispatcher = getattr(mod, "dispatcher", None)
        if dispatcher is not None and hasattr(dispatcher, "invalidate_replicas"):
            dispatcher.invalidate_replicas()
