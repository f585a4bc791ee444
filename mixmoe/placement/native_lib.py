"""The planner's compiled parts: one library built from ``native/*.cpp``, loaded by ctypes.

Each compiled part (``native/<part>.cpp``, its Python side ``native_<part>.py``) runs the same
integer and float operations in the same order as its Python twin, so it returns the same values
bit for bit (``native/common.h`` says how); the Python stays as the fallback and as the slow twin
its tests compare against. This module builds and loads the library and hands out its entry
points:

- the library is built on first use with the system C++ compiler (``$CXX``, else ``c++``,
  ``g++``, ``clang++``; a few seconds) into ``$MIXMOE_NATIVE_DIR`` (default
  ``~/.cache/mixmoe/native``; the temporary folder when that is not writable), named by a hash
  of the sources, the flags, the compiler and the platform; one compiler process per source
  at once, then one link; concurrent builds (the ranks of a job) take turns on a lock file
  (the first builds, the others then load its library) and write a temporary file renamed
  into place (atomic), so every process loads a whole library;
- with no compiler, a failed build or ``MIXMOE_NATIVE=0``, ``function`` returns None and the
  callers run their Python: same plans, slower. The first fallback for a missing or broken
  library warns once (``RuntimeWarning``, naming the reason);
- ``-ffp-contract=off``: no fused multiply-add (Python rounds every product).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from mixmoe.placement.cost_model import TOKEN_COLLECTIVES, WEIGHT_COLLECTIVES, StepModel

__all__ = ["available", "function", "model_args", "unavailable_reason"]

FOLDER = Path(__file__).with_name("native")
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
ENV_OFF, ENV_DIR = "MIXMOE_NATIVE", "MIXMOE_NATIVE_DIR"
BUILD_TIMEOUT_S = 300
STEM = "mixmoe_native"

_lock = threading.Lock()  # the planner may run on a background thread
_lib: ctypes.CDLL | None = None
_why: str | None = None  # why the library is unavailable (None: not tried yet, or loaded)
_warned = False

P = ctypes.c_void_p  # buffers pass as addresses (tensors' data_ptr, ctypes arrays)
I64, F64 = ctypes.c_int64, ctypes.c_double


def sources() -> list[Path]:
    """The library's C++ sources, by name (headers are hashed too: ``_build``)."""
    return sorted(FOLDER.glob("*.cpp"))


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cache_dir() -> Path:
    where = os.environ.get(ENV_DIR)
    return Path(where) if where else Path.home() / ".cache" / "mixmoe" / "native"


def _build(cxx: str) -> Path:
    """The library's path, built now unless a library of the same sources, flags and platform
    is there already. RuntimeError naming the compiler's message when the build fails."""
    texts = [p.name.encode() + b"\0" + p.read_bytes() for p in sorted(FOLDER.glob("*.[ch]*"))]
    key = hashlib.sha256(
        b"\0".join([*texts, " ".join(FLAGS).encode(), platform.platform().encode(), cxx.encode()])
    ).hexdigest()[:16]
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "mixmoe-native"):
        lib = folder / f"{STEM}-{key}.so"
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
    with _build_lock(folder / f"{lib.stem}.lock"):
        if not lib.exists():  # another process may have built it while this one waited
            _compile(cxx, lib)
    return lib


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """One builder at a time per library (the ranks of a job start together: the first builds,
    the others wait for it instead of compiling the same files); no lock where ``fcntl`` is
    missing (the atomic rename still keeps every library whole)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _compile(cxx: str, lib: Path) -> None:
    """Builds ``lib``: each source to an object file at once (one compiler process per file,
    up to the CPUs; the files take 0.7-3.3 s each on this project's 2-core VM), then one link;
    written to a temporary file and renamed (atomic: a process loading it sees the whole
    library). RuntimeError naming the compiler's message when a step fails."""
    with tempfile.TemporaryDirectory(prefix=lib.stem, dir=lib.parent) as work:
        objects = [Path(work) / f"{src.stem}.o" for src in sources()]
        jobs = [
            [cxx, *FLAGS, "-c", str(src), "-o", str(obj)]
            for src, obj in zip(sources(), objects, strict=True)
        ]
        _run_all(jobs, max(1, os.cpu_count() or 1))
        tmp = Path(work) / "lib.so"
        _run_all([[cxx, *FLAGS, "-o", str(tmp), *map(str, objects)]], 1)
        os.replace(tmp, lib)


def _run_all(commands: list[list[str]], at_once: int) -> None:
    """Runs ``commands``, ``at_once`` at a time; RuntimeError with the first failure's message
    (the others are still waited for: no compiler left running)."""
    failed: str | None = None
    pending = list(commands)
    running: list[subprocess.Popen] = []
    while pending or running:
        while pending and len(running) < at_once:
            running.append(
                subprocess.Popen(
                    pending.pop(0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        proc = running.pop(0)
        try:
            _, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err = f"timed out after {BUILD_TIMEOUT_S} s. {err}"
        if proc.returncode != 0 and failed is None:
            failed = f"{proc.args[0]} failed: {err.strip()[-400:]}"
    if failed is not None:
        raise RuntimeError(failed)


def _load() -> ctypes.CDLL | None:
    """The library, built and loaded once per process; None (reason in ``_why``) when
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
            _lib = ctypes.CDLL(str(_build(cxx)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            _why = f"building the planner's C++ ({FOLDER.name}/*.cpp) failed: {err}"
        return _lib


def available() -> bool:
    """Whether the compiled parts run here (builds them on first call; ``MIXMOE_NATIVE=0``:
    False)."""
    return os.environ.get(ENV_OFF, "1") != "0" and _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    if os.environ.get(ENV_OFF, "1") == "0":
        return f"{ENV_OFF}=0"
    return None if _load() is not None else _why


def function(name: str, restype: object, argtypes: list) -> ctypes._CFuncPtr | None:
    """The library's C entry point ``name`` with its types set, or None when the compiled parts
    are off (``MIXMOE_NATIVE=0``) or unavailable (warns once: module doc)."""
    if os.environ.get(ENV_OFF, "1") == "0":
        return None
    lib = _load()
    if lib is None:
        _warn_once()
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:  # first use: set once (ctypes keeps them on the function object)
        fn.restype, fn.argtypes = restype, argtypes
    return fn


def model_args(model: StepModel) -> tuple[list[int], list[float]] | None:
    """``common.h``'s ``Model`` terms of ``model``: ints [fpr, tbr, P, weight_collectives,
    overlap], reals [gf, bw, row_s, fixed_s, rep_s, TOKEN_COLLECTIVES * lat, lat]; None when a
    term is not of the type the exact products assume (ints: FLOPs and bytes per row, params
    bytes; floats: the rest), the caller then runs its Python."""
    ints = [model.flops_per_row, model.token_bytes_per_row, model.params_bytes]
    floats = [model.gemm_flops, model.bw, model.row_s, model.fixed_s, model.replica_s,
              TOKEN_COLLECTIVES * model.lat, model.lat]  # fmt: skip
    if any(type(v) is not int for v in ints) or any(type(v) is not float for v in floats):
        return None
    return [*ints, WEIGHT_COLLECTIVES, int(bool(model.overlap))], floats


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"mixmoe: the planner's compiled parts are unavailable ({_why}); planning runs in "
            "Python (same plans, slower). Set MIXMOE_NATIVE=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
