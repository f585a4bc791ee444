"""Convert between the two checkpoint forms of ``mixmoe train``, in one process:
``consolidate`` a sharded checkpoint directory (``mixmoe.train.sharded``) into one file of the
``--save`` form (``mixmoe.train.checkpoint``: every expert tensor [N, ...]), and ``shard`` such
a file back into a sharded directory. Either resumes at any world size; the consolidated file
holds the whole model, so this is for models that fit one host's memory.

Legend: N global experts, g a global expert.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from mixmoe.comm.dcp import load_flat, save_flat, stored_keys
from mixmoe.train import checkpoint as ckpt_io
from mixmoe.train import sharded
from mixmoe.train.presets import ModelSpec, build_model

_EXPERT = re.compile(r"^(.*)@expert(\d+)$")


def _stack_experts(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"X@expert<g>": row}`` -> ``{"X": [N, ...]}`` (rows in g order); other keys kept."""
    out: dict[str, torch.Tensor] = {}
    rows: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in flat.items():
        m = _EXPERT.match(key)
        if m:
            rows.setdefault(m.group(1), {})[int(m.group(2))] = value
        else:
            out[key] = value
    for key, by_g in rows.items():
        if sorted(by_g) != list(range(len(by_g))):
            raise ValueError(
                f"{key}: experts {sorted(by_g)} are not 0..N-1; the checkpoint is damaged"
            )
        out[key] = torch.stack([by_g[g] for g in range(len(by_g))])
    return out


def consolidated(directory: str | os.PathLike[str]) -> dict:
    """The sharded checkpoint ``directory`` as the ``--save`` form's payload (in memory)."""
    if not sharded.is_sharded_checkpoint(directory):
        raise ValueError(f"{directory} is not a complete sharded checkpoint (no {sharded.MARKER})")
    with open(os.path.join(directory, sharded.MARKER)) as f:
        info = json.load(f)
    state = {
        k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in stored_keys(directory).items()
    }
    load_flat(state, directory, None)
    full = _stack_experts(state)
    model = {k[len("model/") :]: v for k, v in full.items() if k.startswith("model/")}
    opt: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in full.items():
        if key.startswith("optim/"):
            name, _, sub = key[len("optim/") :].rpartition("/")
            opt.setdefault(name, {})[sub] = value
    mems_keys = sorted((k for k in full if k.startswith("mems/")), key=lambda k: int(k[5:]))
    payload = {
        "format": ckpt_io.FORMAT,
        "version": ckpt_io.FORMAT_VERSION,
        "spec": info["spec"],
        "step": int(info["step"]),
        "model": model,
        "optimizer": {"state": opt},
        "mems": [full[k] for k in mems_keys] or None,
        "config": info.get("config", {}),
    }
    return payload


def consolidate(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """The sharded checkpoint ``directory`` as one ``--save``-form file ``out``."""
    payload = consolidated(directory)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def export_transformers(checkpoint: str | os.PathLike[str], out_dir: str | os.PathLike[str]):
    """A ``--model mixtral`` checkpoint (either form) as a transformers Mixtral saved with
    ``save_pretrained`` (safetensors) in ``out_dir``; returns the exported model."""
    from mixmoe.hf.export import export_moe_model
    from mixmoe.parallel import load_full_state_dict

    if os.path.isdir(checkpoint):
        payload = consolidated(checkpoint)
    else:
        raw = torch.load(checkpoint, map_location="cpu", weights_only=True)
        if not isinstance(raw, dict) or "spec" not in raw:
            raise ValueError(f"{checkpoint} is not a mixmoe train checkpoint")
        payload = ckpt_io.check_checkpoint(str(checkpoint), ModelSpec(**raw["spec"]))
    spec = ModelSpec(**payload["spec"])
    if spec.model != "mixtral":
        raise ValueError(
            f"{checkpoint} holds a {spec.model} model with mixmoe FFNs, which transformers has no "
            "MoE class for; export works for --model mixtral (converted transformers blocks)"
        )
    model = build_model(spec)
    dtype = next(iter(payload["model"].values())).dtype
    model = model.to(dtype=dtype)
    load_full_state_dict(model, payload["model"])
    exported = export_moe_model(model)
    exported.save_pretrained(out_dir)
    return exported


def shard(file: str | os.PathLike[str], save_dir: str | os.PathLike[str]) -> Path:
    """The ``--save``-form checkpoint ``file`` as a sharded checkpoint ``save_dir/step-N``
    (experts split into per-expert keys, as W ranks would have written it)."""
    if not os.path.isfile(file):
        raise ValueError(f"checkpoint {str(file)!r} does not exist; pass a file --save wrote")
    raw = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(raw, dict) or "spec" not in raw:
        raise ValueError(f"{file} is not a mixmoe train checkpoint")
    spec = ModelSpec(**raw["spec"])
    ckpt = ckpt_io.check_checkpoint(str(file), spec)
    with torch.device("meta"):  # only the names and expert counts: nothing is allocated
        owners = ckpt_io.expert_owners(build_model(spec))
    N = spec.num_experts
    state: dict[str, torch.Tensor] = {}
    for name, value in ckpt["model"].items():
        if name in owners:
            if value.shape[0] != N:
                raise ValueError(f"{file}: {name} holds {value.shape[0]} experts, the spec {N}")
            for g in range(N):  # row g = global expert g
                state[f"model/{name}@expert{g}"] = value[g]
        else:
            state[f"model/{name}"] = value
    for name, entry in ckpt["optimizer"]["state"].items():
        for key, value in entry.items():
            if name in owners and value.dim() and value.shape[0] == N:  # not the scalar step
                for g in range(N):
                    state[f"optim/{name}/{key}@expert{g}"] = value[g]
            else:
                state[f"optim/{name}/{key}"] = value
    for b, mem in enumerate(ckpt.get("mems") or []):
        state[f"mems/{b}"] = mem
    root = Path(save_dir)
    root.mkdir(parents=True, exist_ok=True)
    step = int(ckpt["step"])
    final = root / sharded.checkpoint_name(step)
    tmp = root / f".{final.name}.tmp"
    save_flat(state, tmp, None)
    info = {
        "format": sharded.FORMAT,
        "version": sharded.FORMAT_VERSION,
        "step": step,
        "spec": raw["spec"],
        "world_size": 1,
        "ep_size": 1,
        "config": ckpt.get("config", {}),
    }
    sharded.commit(tmp, final, info)
    return final
