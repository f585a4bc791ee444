"""Kernel tests: compiled on CUDA when a GPU is present, else under the Triton CPU interpreter.

The interpreter is chosen when a kernel is *decorated* (``@triton.jit`` reads TRITON_INTERPRET at
import of ``mixmoe.kernels``), so it is set here, before any test module imports the kernels. If
the kernels were already imported compiled in this process on a machine without CUDA (they could
not run there anyway), they are dropped and re-imported interpreted.

Tiers (see docs/kernels.md):
- small shapes, every kernel vs a torch reference, fp32 and bf16: on CUDA if present, else on CPU
  through the interpreter (CI);
- ``@pytest.mark.gpu``: real sizes, the autotuned launch path, the whole layer forward/backward vs
  the CPU reference. Skipped (with the reason) without CUDA: ``pytest tests/kernels -m gpu``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" or not HAS_CUDA

if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

    def _compiled_kernels_loaded() -> bool:
        module = sys.modules.get("mixmoe.kernels.grouped_gemm")
        if module is None:
            return False
        from triton.runtime.interpreter import InterpretedFunction

        return not isinstance(module._grouped_gemm_kernel, InterpretedFunction)

    if _compiled_kernels_loaded():
        for name in [
            m for m in sys.modules if m == "mixmoe.kernels" or m.startswith("mixmoe.kernels.")
        ]:
            del sys.modules[name]
        import mixmoe

        if hasattr(mixmoe, "kernels"):
            delattr(mixmoe, "kernels")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA device with compiled Triton kernels "
        + ("(TRITON_INTERPRET=1 is set)" if HAS_CUDA else "(none found)")
        + "; run `pytest tests/kernels -m gpu` on a GPU machine"
    )
    for item in items:  # this hook sees the whole session: touch only tests/kernels
        mine = os.path.abspath(str(item.fspath)).startswith(here + os.sep)
        if mine and "gpu" in item.keywords and (INTERPRET or not HAS_CUDA):
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    """Where the small-shape kernel tests run: CUDA (compiled) or CPU (interpreted)."""
    return torch.device("cpu" if INTERPRET else "cuda")


@pytest.fixture
def gen() -> torch.Generator:
    """Fresh random inputs per run; the seed is printed, so a failure shows how to replay it
    (``MIXMOE_TEST_SEED=<seed> pytest ...``)."""
    seed = int(os.environ.get("MIXMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"generator seed = {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def make_layout():
    return random_layout


def random_layout(
    seg_counts: list[int],
    seg_slots: list[int],
    num_tokens: int,
    top_k: int,
    block_size: int,
    gen: torch.Generator,
    device: torch.device | str = "cpu",
):
    """A block schedule over arbitrary segments (slots may repeat and be out of order, as under
    the mixed strategy) plus a random assignment of its rows to (token, choice) pairs:

    returns (schedule, token_P, pos_TK, tk_P) where ``tk_P`` is the choice row ``t*K + k`` of
    each padded row (T*K for padding) and choices without a row are dropped (``pos == P``).
    """
    from mixmoe.schedule.blocks import build_block_schedule

    counts = torch.tensor(seg_counts, dtype=torch.int64)
    schedule = build_block_schedule(counts, torch.tensor(seg_slots), block_size=block_size)
    R, T, K = int(counts.sum()), num_tokens, top_k
    assert R <= T * K, "more rows than (token, choice) pairs"
    P = schedule.num_padded_rows
    tk_R = torch.randperm(T * K, generator=gen)[:R]
    pos = torch.full((T * K,), P, dtype=torch.int64)
    pos[tk_R] = schedule.padded_position_R()
    src_P = schedule.src_P
    tk_P = torch.where(src_P >= 0, tk_R[src_P.clamp(min=0)], T * K)
    token_P = torch.where(src_P >= 0, tk_P // K, T)
    move = {f: getattr(schedule, f) for f in schedule.__dataclass_fields__}
    schedule = type(schedule)(
        **{f: v.to(device) if isinstance(v, torch.Tensor) else v for f, v in move.items()}
    )
    return schedule, token_P.to(device), pos.view(T, K).to(device), tk_P.to(device)


# Layout cases: (segment counts, segment slots, tokens, top-k, block size). They cover empty
# segments, single-row segments, partial and full blocks, slots repeated / out of order, slots
# with no block at all, K = 1 and K = 2 (with dropped choices), and the default 64-row block.
LAYOUTS = {
    "k1-partial": ([5, 0, 17, 1], [2, 0, 2, 1], 24, 1, 16),
    "k2-mixed-slots": ([16, 3, 0, 1, 33], [1, 3, 0, 1, 0], 30, 2, 16),
    "k2-dropped": ([1, 1, 20], [0, 2, 3], 20, 2, 16),
    "k2-block64": ([70, 0, 1], [0, 1, 2], 40, 2, 64),
}


@pytest.fixture(params=sorted(LAYOUTS))
def layout_case(request) -> tuple:
    """(segment counts, segment slots, tokens, top-k, block size) of one layout case."""
    return LAYOUTS[request.param]


@contextlib.contextmanager
def triton_ops_on_cpu(config):
    """Within the block, every ``mixmoe::`` op runs its CUDA (Triton) implementation on CPU
    tensors too (interpreted), so whole forward/backward passes exercise the GPU code path on a
    machine without one. The CPU kernels come back on exit."""
    if getattr(torch.library, "_scoped_library", None) is None:
        pytest.skip("this torch has no torch.library._scoped_library to swap CPU kernels")
    from _triton_swap import triton_impls_on_cpu

    with triton_impls_on_cpu(config):
        yield


@pytest.fixture
def triton_backend(device):
    """A context manager under which the ops take their Triton path on ``device``."""
    pytest.importorskip(
        "triton", reason="the kernel tier needs triton: pip install 'mixmoe[triton]'"
    )
    from mixmoe.kernels import TileConfig

    if device.type == "cuda":
        return contextlib.nullcontext
    tiny = TileConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
    return functools.partial(triton_ops_on_cpu, tiny)
