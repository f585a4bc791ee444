"""The level fill compiled: ``native/level_fill.cpp``, built once per machine, called by ctypes.

Legend: W ranks, N experts; a ``RangeState``'s fields (``mixmoe.placement.range_state``).

``level_fill`` (``mixmoe.placement.level_fill``) is Python: ~75-85% of ``plan_mix``'s time on
skewed counts (W = 1024 zipf:1.2: ~0.4 s of ~0.5 s). The C++ file runs the same passes with the
same integer and float operations in the same order, so it leaves the state the Python fill
leaves, bit for bit (``tests/placement/test_native_fill.py`` compares every field, the Python fill
being the slow twin). ``fill(state, passes, stop, kept)`` runs it when it can and the Python fill
otherwise:

- the library is built on first use with the system C++ compiler (``$CXX``, else ``c++``,
  ``g++``, ``clang++``; a few seconds) into ``$MIXMOE_NATIVE_DIR`` (default
  ``~/.cache/mixmoe/native``; the temporary folder when that is not writable),
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
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from mixmoe.placement import level_fill as py_fill
from mixmoe.placement.cost_model import TOKEN_COLLECTIVES, WEIGHT_COLLECTIVES, StepModel
from mixmoe.placement.range_state import RangeState

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

_P = ctypes.c_void_p  # buffers pass as addresses (tensors' data_ptr, ctypes arrays)
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.c_int64, _P, ctypes.c_int64, _P]


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
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "mixmoe-native"):
        lib = folder / f"level_fill-{key}.so"
        if lib.exists():
            return lib
        try:  # a read-only home (a cluster's): the temporary folder instead
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:
            continue
    else:
        raise RuntimeError(f"no writable folder for the library ({_cache_dir()}, the temp dir)")
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
    compiled fill cannot run here or for these arguments (module doc), or when the start is
    level already (``level_fill``'s first test stops it: no pass, no move; the caller's Python
    state costs less than the compiled set-up, ~1 ms at W = 1024). The C++ builds the start
    state itself (``RangeState.__init__``'s arithmetic) from the tensors; of the state, what
    the planner reads after a fill is read back at once, the rest when first read."""
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
    N = W * E
    i64, f64 = torch.int64, torch.float64
    C = C_WN if C_WN.dtype == i64 and C_WN.is_contiguous() else C_WN.to(i64).contiguous()
    colsum = colsum_N.to(i64).contiguous()
    loads = loads_4W[:4].to(f64).contiguous()
    start = [x for g in sorted(start_holders) for y in start_holders[g] for x in (g, y)]
    model_i, model_d = terms
    a = model.flops_per_row / model.gemm_flops + model.row_s  # level_fill's rates, its expressions
    t = model.token_bytes_per_row / model.bw if any_remote else 0.0
    hide = a if model.overlap else 0.0
    copy = 2.0 * (model.params_bytes / model.bw + model.replica_s)
    ints = [W, E, slots, block_size, per_node, int(any_remote), passes, py_fill.TENSOR_POINTS,
            int(kept), *model_i, len(start) // 2]  # fmt: skip
    reals = [*model_d, a, t, hide, copy, TOKEN_COLLECTIVES * model.lat, stop, py_fill.MIN_GAIN]
    cap = len(start) // 2 + W * slots  # holders at the end (each rank holds at most ``slots``)
    out_w, out_wf = torch.empty(5 * W, dtype=i64), torch.empty(2 * W, dtype=f64)
    out_n = torch.empty(4 * N, dtype=i64)
    out_i, out_d = torch.empty(16 * cap + 16, dtype=i64), torch.empty(2 * cap + 16, dtype=f64)
    counts = (ctypes.c_int64 * 5)()
    pieces = lib.mixmoe_level_fill(
        C.data_ptr(), colsum.data_ptr(), loads.data_ptr(), (ctypes.c_int64 * len(start))(*start),
        (ctypes.c_int64 * len(ints))(*ints), (ctypes.c_double * len(reals))(*reals),
        out_w.data_ptr(), out_wf.data_ptr(), out_n.data_ptr(), out_i.data_ptr(),
        out_i.numel(), out_d.data_ptr(), out_d.numel(), counts,
    )  # fmt: skip
    if pieces == -2:  # the start is level: no pass runs, the Python state is the cheaper one
        return None
    if pieces < 0:  # cannot happen with the capacities above (the C++ counts before writing)
        raise RuntimeError("native level fill: output buffers too small")
    state = object.__new__(FilledState)  # RangeState.__init__'s fields, the fill's values
    state.model, state.C_WN, state.E, state.W = model, C_WN, E, W
    state.slots, state.block, state.distance = slots, block_size, distance
    state.any_remote, state._total_fns, state.moves = any_remote, {}, int(pieces)
    state.rounds, nh, na, nk, nd = counts  # the sections' lengths in out_i (C++ doc)
    per_w = out_w.view(5, W)
    state.rows, state.local, state.remote, overshot = per_w[1:].tolist()
    state.replica, state.totals = out_wf.view(2, W).tolist()
    state.overshot = {r for r, x in enumerate(overshot) if x}
    flat = out_i[: nh + na + nk].tolist()
    state.holders = dict(_groups(flat, 0, nh))
    state.amounts = {
        g: dict(zip(v[::2], v[1::2], strict=True)) for g, v in _groups(flat, nh, na, 2)
    }
    state.kept = {
        g: dict(zip(v[::2], v[1::2], strict=True)) for g, v in _groups(flat, nh + na, nk, 2)
    }
    at = nh + na + nk  # the degrees stay raw until read (FilledState)
    state._raw = (per_w[0], out_n.view(4, N), out_i[at : at + nd])
    state._copies = out_d
    return state


def _groups(flat: list[int], at: int, length: int, width: int = 1) -> Iterator[tuple[int, list]]:
    """(g, values) of each group [g, k, values...] of the section ``flat[at : at + length]``:
    k values each ``width`` ints long (1: ranks; 2: (rank, rows) pairs, flat)."""
    end = at + length
    while at < end:
        g, k = flat[at], flat[at + 1]
        yield g, flat[at + 2 : at + 2 + width * k]
        at += 2 + width * k


class FilledState(RangeState):
    """A ``RangeState`` the compiled fill left. The planner reads holders, amounts, kept, the
    loads, totals and overshot after a fill; the other fields (held, owner_rows, own, others,
    taken, helped, degrees) are built from the C++ output on first read (``__getattr__`` runs
    only for a field not set yet), so a fill pays no Python work for them."""

    def __getattr__(self, name: str) -> object:
        if name not in _LAZY or "_raw" not in self.__dict__:
            raise AttributeError(name)
        held, per_n, degree_groups = self._raw
        self.held = held.tolist()
        self.owner_rows, self.own, self.others, self.taken = per_n.tolist()
        self.helped = {}
        for g, amounts in self.amounts.items():
            for y, n in amounts.items():
                self.helped.setdefault(y, {})[g] = n
        flat, copies = degree_groups.tolist(), iter(self._copies.tolist())
        self.degrees = {
            g: {r: next(copies) for r in ranks} for g, ranks in _groups(flat, 0, len(flat))
        }
        del self._copies
        del self._raw
        return self.__dict__[name]


_LAZY = frozenset(("held", "owner_rows", "own", "others", "taken", "helped", "degrees"))


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
