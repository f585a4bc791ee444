"""The level fill compiled: ``native/level_fill.cpp``, built once per machine, called by ctypes.

Legend: W ranks, N experts; a ``RangeState``'s fields (``mixmoe.placement.range_state``).

``level_fill`` (``mixmoe.placement.level_fill``) is Python: ~75-85% of ``plan_mix``'s time on
skewed counts (W = 1024 zipf:1.2: ~0.4 s of ~0.5 s). The C++ file runs the same passes with the
same integer and float operations in the same order, so it leaves the state the Python fill
leaves, bit for bit (``tests/placement/test_native_fill.py`` compares every field, the Python fill
being the slow twin). ``fill(state, passes, stop, kept)`` runs it when it can and the Python fill
otherwise:

- the library is built on first use with the system C++ compiler (``$CXX``, else ``c++``,
  ``g++``, ``clang++``; ~2 s) into ``$MIXMOE_NATIVE_DIR`` (default ``~/.cache/mixmoe/native``),
  named by a hash of the source, the flags and the platform; concurrent builds (several ranks)
  each write a temporary file and rename it (atomic), so every process loads a whole library;
- with no compiler, a failed build, ``MIXMOE_NATIVE=0``, a ``distance`` other than
  ``relay.nodes_of``'s, or a model whose terms are not Python ints and floats (the exact-product
  rule below), the Python fill runs: same plans, slower. The first fallback for a missing or
  broken library warns once (``RuntimeWarning``, naming the reason);
- ``-ffp-contract=off``: no fused multiply-add (Python rounds every product). Python's ``int *
  int`` is exact, so the C++ forms those products in 128 bits and rounds once, as Python's
  ``int / float`` does.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from mixmoe.placement import level_fill as py_fill
from mixmoe.placement.cost_model import TOKEN_COLLECTIVES, WEIGHT_COLLECTIVES, StepModel
from mixmoe.placement.range_state import RangeState, start_relay, stream_rows

__all__ = ["available", "filled", "unavailable_reason"]

SOURCE = Path(__file__).with_name("native") / "level_fill.cpp"
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
OFFERED = 4  # native/level_fill.cpp's OFFERED (level_fill.OFFERED: a test checks they agree)
ENV_OFF, ENV_DIR = "MIXMOE_NATIVE", "MIXMOE_NATIVE_DIR"
BUILD_TIMEOUT_S = 300

_lock = threading.Lock()  # the planner may run on a background thread
_lib: ctypes.CDLL | None = None
_why: str | None = None  # why the library is unavailable (None: not tried yet, or loaded)
_warned = False

_I64P = ctypes.POINTER(ctypes.c_int64)
_F64P = ctypes.POINTER(ctypes.c_double)
_I64 = ctypes.c_int64
_ARGTYPES = [_I64P, _I64, _I64, _I64, _I64, _I64, _I64, _I64P, _F64P, _F64P, _I64P, _I64P,
             _I64P, _I64, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _I64P, _F64P, _F64P,
             _I64P, _I64P, _I64, _F64P, _I64, _I64P]  # fmt: skip


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    where = os.environ.get(ENV_DIR)
    return Path(where) if where else Path.home() / ".cache" / "mixmoe" / "native"


def _build(cxx: str) -> Path:
    """The library's path, built now unless a library of the same source, flags and platform
    is there already. RuntimeError naming the compiler's message when the build fails."""
    src = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([src, " ".join(FLAGS).encode(), platform.platform().encode(), cxx.encode()])
    ).hexdigest()[:16]
    folder = _cache_dir()
    lib = folder / f"level_fill-{key}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.stem, suffix=".so.tmp", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run(
            [cxx, *FLAGS, "-o", tmp, str(SOURCE)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-400:]}")
        os.replace(tmp, lib)  # atomic: a process loading it sees the whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load() -> ctypes.CDLL | None:
    """The library, built and loaded once per process; None (reason in ``_why``) when off or
    unavailable."""
    global _lib, _why
    with _lock:
        if _lib is not None or _why is not None:
            return _lib
        cxx = _compiler()
        if cxx is None:
            _why = "no C++ compiler found ($CXX, c++, g++, clang++)"
            return None
        try:
            lib = ctypes.CDLL(str(_build(cxx)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _why = f"building {SOURCE.name} failed: {err}"
            return None
        fn = lib.mixmoe_level_fill
        fn.restype = ctypes.c_int64
        fn.argtypes = _ARGTYPES
        _lib = lib
        return _lib


def available() -> bool:
    """Whether the compiled fill runs here (builds it on first call; ``MIXMOE_NATIVE=0``: False)."""
    return os.environ.get(ENV_OFF, "1") != "0" and _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    if os.environ.get(ENV_OFF, "1") == "0":
        return f"{ENV_OFF}=0"
    return None if _load() is not None else _why


def _ptr(t: torch.Tensor, kind: type) -> ctypes._Pointer:
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(kind))


def _model_terms(model: object) -> tuple[list[int], list[float]] | None:
    """The model's terms for ``total`` (cost_model.StepModel.total_fn), or None when one is not
    of the type the exact products assume (ints: FLOPs and bytes per row, params bytes; floats:
    the rest)."""
    ints = [model.flops_per_row, model.token_bytes_per_row, model.params_bytes]
    floats = [model.gemm_flops, model.bw, model.row_s, model.fixed_s, model.replica_s,
              TOKEN_COLLECTIVES * model.lat, model.lat]  # fmt: skip
    if any(type(v) is not int for v in ints) or any(type(v) is not float for v in floats):
        return None
    return [*ints, WEIGHT_COLLECTIVES, int(bool(model.overlap))], floats


def filled(
    model: StepModel,
    C_WN: torch.Tensor,
    E: int,
    start_holders: dict[int, tuple[int, ...]],
    slots: int,
    block_size: int,
    distance: Callable[[int, int], int] | None,
    colsum_N: torch.Tensor,
    any_remote: bool,
    loads_4W: torch.Tensor,
    passes: int,
    stop: float,
    kept: bool = False,
) -> RangeState | None:
    """``RangeState(model, ..., loads_4W)`` after ``level_fill.level_fill(state, passes, stop,
    kept)`` (its ``moves``: the pieces), compiled: the same state bit for bit; None when the
    compiled fill cannot run here or for these arguments (module doc). The start fields are
    handed over as tensors (no Python lists in, the results read back once)."""
    if os.environ.get(ENV_OFF, "1") == "0":
        return None
    lib = _load()
    if lib is None:
        _warn_once()
        return None
    per_node = 0
    if distance is not None:
        per_node = getattr(distance, "ranks_per_node", None)
        if type(per_node) is not int or per_node < 1:
            return None  # a distance callable of its own: only the Python fill groups it
    terms = _model_terms(model)
    if terms is None:
        return None
    W = C_WN.shape[0]
    i64, f64 = torch.int64, torch.float64
    C = C_WN if C_WN.dtype == i64 and C_WN.is_contiguous() else C_WN.to(i64).contiguous()
    holders = {g: sorted(h) for g, h in start_holders.items() if h}
    start = [(g, y) for g in sorted(holders) for y in holders[g]]
    held = [0] * W
    for _, y in start:
        held[y] += 1
    owner_rows, own_N, others = stream_rows(C, E, holders, colsum_N)
    _, rounds = start_relay(holders, E, distance)
    compute_W, comm_W = model.seconds_W(loads_4W, any_remote, rounds)
    per_n = torch.stack([owner_rows, own_N, others, torch.zeros_like(own_N)]).to(i64)  # own, taken
    per_w = torch.cat([torch.tensor(held, dtype=i64), loads_4W[:3].to(i64).reshape(-1)])
    per_wf = torch.stack([loads_4W[3], compute_W + comm_W]).to(f64)  # replica, totals
    cap = len(start) + W * slots  # holders at the end (each rank holds at most ``slots`` new)
    out_i, out_d = torch.empty(12 * cap + 16, dtype=i64), torch.empty(2 * cap + 16, dtype=f64)
    small = torch.tensor([rounds, 0, 0, 0, 0], dtype=i64)  # rounds, then the 4 counts out
    overshot = torch.zeros(W, dtype=i64)
    model_i, model_d = terms
    model_it, model_dt = torch.tensor(model_i, dtype=i64), torch.tensor(model_d, dtype=f64)
    a = model.flops_per_row / model.gemm_flops + model.row_s  # level_fill's rates, its expressions
    t = model.token_bytes_per_row / model.bw if any_remote else 0.0
    hide = a if model.overlap else 0.0
    copy = 2.0 * (model.params_bytes / model.bw + model.replica_s)
    lat = TOKEN_COLLECTIVES * model.lat
    params_d = torch.tensor([a, t, hide, copy, lat, stop, py_fill.MIN_GAIN], dtype=f64)
    params_i = torch.tensor([passes, py_fill.TENSOR_POINTS, int(kept)], dtype=i64)
    start_t = torch.tensor(start or [(0, 0)], dtype=i64)
    I, F = ctypes.c_int64, ctypes.c_double
    p_w, p_n = per_w.data_ptr(), per_n.data_ptr()
    pieces = lib.mixmoe_level_fill(
        _ptr(C, I), W, E, slots, block_size, per_node, int(any_remote),
        _ptr(model_it, I), _ptr(model_dt, F), _ptr(params_d, F), _ptr(params_i, I),
        _ptr(small, I), _ptr(start_t, I), len(start),
        _at(p_w, 0), _at(p_n, 0), _at(p_n, W * E), _at(p_n, 2 * W * E), _at(p_n, 3 * W * E),
        _at(p_w, W), _at(p_w, 2 * W), _at(p_w, 3 * W),
        _ptr(per_wf[0], F), _ptr(per_wf[1], F), _ptr(overshot, I),
        _ptr(out_i, I), out_i.numel(), _ptr(out_d, F), out_d.numel(), _at(small.data_ptr(), 1),
    )  # fmt: skip
    if pieces < 0:  # cannot happen with the capacities above (the C++ counts before writing)
        raise RuntimeError("native level fill: output buffers too small")
    state = object.__new__(RangeState)  # the fields RangeState.__init__ sets, then the fill's
    state.model, state.C_WN, state.E, state.W = model, C_WN, E, W
    state.slots, state.block, state.distance = slots, block_size, distance
    state.any_remote, state._total_fns, state.moves = any_remote, {}, int(pieces)
    _read_back(state, per_w.view(4, W), per_n, per_wf, small, overshot, out_i, out_d)
    return state


def _at(address: int, index: int) -> ctypes._Pointer:
    """A pointer to the index-th int64 from ``address`` (a row of a stacked tensor)."""
    return ctypes.cast(address + 8 * index, _I64P)


def _read_back(state, per_w, per_n, per_wf, small, overshot, out_i, out_d) -> None:  # noqa: ANN001
    """The C++ results into the state's Python fields (RangeState's types: lists, dicts)."""
    state.rounds, nh, na, nk, nd = small.tolist()
    state.held, state.rows, state.local, state.remote = per_w.tolist()
    state.owner_rows, state.own, state.others, state.taken = per_n.tolist()
    state.replica, state.totals = per_wf.tolist()
    state.overshot = {r for r, x in enumerate(overshot.tolist()) if x}
    flat = out_i[: 2 * nh + 3 * na + 3 * nk + 2 * nd].tolist()
    holders: dict[int, list[int]] = {}
    for i in range(0, 2 * nh, 2):
        holders.setdefault(flat[i], []).append(flat[i + 1])
    state.holders = holders
    amounts: dict[int, dict[int, int]] = {}
    helped: dict[int, dict[int, int]] = {}
    base = 2 * nh
    for i in range(base, base + 3 * na, 3):
        g, y, n = flat[i : i + 3]
        amounts.setdefault(g, {})[y] = n
        helped.setdefault(y, {})[g] = n
    state.amounts, state.helped = amounts, helped
    kept: dict[int, dict[int, int]] = {}
    base += 3 * na
    for i in range(base, base + 3 * nk, 3):
        g, y, n = flat[i : i + 3]
        kept.setdefault(g, {})[y] = n
    state.kept = kept
    degrees: dict[int, dict[int, float]] = {}
    base += 3 * nk
    copies = out_d[:nd].tolist()
    for j, i in enumerate(range(base, base + 2 * nd, 2)):
        degrees.setdefault(flat[i], {})[flat[i + 1]] = copies[j]
    state.degrees = degrees


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"mixmoe: the compiled level fill is unavailable ({_why}); planning uses the Python "
            "fill (same plans, slower). Set MIXMOE_NATIVE=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
