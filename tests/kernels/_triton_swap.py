"""Run every ``mixmoe::`` op's Triton implementation on CPU tensors (the interpreter), so whole
forward/backward passes exercise the GPU code path on a machine without one. Shared by the kernel
tier's conftest and by spawned gloo ranks (which cannot import a conftest reliably)."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from unittest import mock

import torch

# op name -> (module, name of its Triton implementation, takes a tile config)
TRITON_IMPLS = {
    "grouped_linear": ("mixmoe.ops.grouped_linear", "grouped_linear_triton", True),
    "grouped_weight_grad": ("mixmoe.ops.grouped_linear", "grouped_weight_grad_triton", True),
    "gather_grouped_linear": ("mixmoe.ops.fused_linear", "gather_grouped_linear_triton", True),
    "grouped_linear_combine": ("mixmoe.ops.fused_linear", "grouped_linear_combine_triton", True),
    "scaled_gather_grouped_linear": (
        "mixmoe.ops.fused_linear",
        "scaled_gather_grouped_linear_triton",
        True,
    ),
    "gathered_weight_grad": ("mixmoe.ops.fused_linear", "gathered_weight_grad_triton", True),
    "combine_weights_grad": ("mixmoe.ops.fused_linear", "combine_weights_grad_triton", False),
}


@contextlib.contextmanager
def triton_impls_on_cpu(
    config, wrap: Callable[[str, Callable], Callable] | None = None
) -> Iterator[None]:
    """Within the block every ``mixmoe::`` op runs its Triton implementation (tile ``config``) on
    CPU tensors; ``wrap(op, fn)`` may wrap each (e.g. to count calls). The CPU kernels come back
    on exit. Needs ``torch.library._scoped_library``.

    ``token_expert_mlp``'s CPU body (``mixmoe.ops.cpu_expert_mlp``) bypasses the ops on CPU
    tensors, so it is switched off inside the block: the ops, hence the Triton kernels, run."""
    tem = importlib.import_module("mixmoe.ops.token_expert_mlp")
    with (
        torch.library._scoped_library("mixmoe", "IMPL") as lib,
        mock.patch.object(tem, "cpu_path_applies", lambda *args: False),
    ):
        for op, (module, name, takes_config) in TRITON_IMPLS.items():
            fn = getattr(importlib.import_module(module), name)
            # lib.impl accepts a name no op has (the CPU kernel would silently stay): look it up
            getattr(torch.ops.mixmoe, op)
            fn = functools.partial(fn, config=config) if takes_config else fn
            lib.impl(op, wrap(op, fn) if wrap else fn, "CPU")
        yield
