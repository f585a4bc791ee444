"""``make mutation``: mutation testing of the core modules with mutmut (pinned in the dev extra).

Each group mutates one core package and runs only the tests that can catch its mutants (fast
ones first; ``-x`` stops at the first failure, so a killed mutant costs little). mutmut edits
the source files in place, one mutant at a time, and restores them: do not edit the tree while
it runs. Results accumulate in ``.mutmut-cache`` (a rerun only tests mutants not yet tested;
delete the file to start over). Mutants that no test can catch by design (error-message and
log/trace text) are skipped by ``mutmut_config.py``; known equivalent survivors are explained in
``tests/MUTATION.md``.

    python tests/mutation/run_mutation.py               # every group (hours on 2 CPU cores)
    python tests/mutation/run_mutation.py gating ops    # some groups
    python tests/mutation/run_mutation.py --report      # kill rates and survivors, no run

While a run is in progress, read its results only with ``--report --no-diffs``: the diffs come
from ``mutmut show``, which re-syncs the cache with the (mutated) sources and breaks the run.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# group -> (packages to mutate, tests that guard them; fastest first)
GROUPS: dict[str, tuple[list[str], list[str]]] = {
    "gating": (
        ["mixmoe/gating"],
        ["tests/unit/test_gating.py", "tests/unit/test_layer_vs_reference.py"],
    ),
    "schedule": (["mixmoe/schedule"], ["tests/unit/test_schedule.py", "tests/unit"]),
    "placement": (["mixmoe/placement"], ["tests/placement", "tests/unit"]),
    "ops": (
        ["mixmoe/ops"],
        ["tests/unit/test_ops.py", "tests/unit", "tests/kernels/test_fused_ops.py"],
    ),
    "parallel": (
        ["mixmoe/parallel"],
        [
            "tests/distributed/test_checkpoint_and_failures.py",
            "tests/distributed/test_dropin_parallel.py",
            "tests/distributed/test_ddp_and_expert_data_parallel.py",
        ],
    ),
    "comm": (["mixmoe/comm"], ["tests/distributed"]),
    "dispatch": (["mixmoe/dispatch"], ["tests/unit", "tests/distributed"]),
}

KILLED, SURVIVED, TIMEOUT, SUSPICIOUS, SKIPPED, UNTESTED = (
    "ok_killed",
    "bad_survived",
    "bad_timeout",
    "ok_suspicious",
    "skipped",
    "untested",
)


def _runner(tests: list[str]) -> str:
    seen = list(dict.fromkeys(tests))  # pytest runs a path given twice twice
    return f"{sys.executable} -m pytest -x -q -p no:cacheprovider " + " ".join(seen)


def run_group(name: str) -> int:
    paths, tests = GROUPS[name]
    cmd = [
        sys.executable,
        "-m",
        "mutmut",
        "run",
        "--paths-to-mutate",
        ",".join(paths),
        "--runner",
        _runner(tests),
        "--tests-dir",
        "tests",
        "--simple-output",
    ]
    print(f"== {name}: mutating {', '.join(paths)}; tests: {_runner(tests)}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    return code & 1  # mutmut: 1 fatal; 2/4/8 survivors, timeouts, suspicious


def _mutants(paths: list[str]) -> list[tuple[int, str, int, str, str]]:
    """(id, file, line number, source line, status) of every cached mutant under ``paths``."""
    cache = ROOT / ".mutmut-cache"
    if not cache.exists():
        return []
    with sqlite3.connect(cache) as db:
        rows = db.execute(
            "SELECT m.id, f.filename, l.line_number, l.line, m.status FROM mutant m "
            "JOIN line l ON m.line = l.id JOIN sourcefile f ON l.sourcefile = f.id "
            'ORDER BY f.filename, l.line_number, m."index"'
        ).fetchall()
    prefixes = tuple(p.rstrip("/") + "/" for p in paths)
    return [r for r in rows if r[1].startswith(prefixes)]


def report(names: list[str], show_diffs: bool) -> None:
    total: dict[str, int] = {}
    print(
        f"\n{'group':<10} {'mutants':>8} {'killed':>7} {'survived':>9} {'timeout':>8} "
        f"{'skipped':>8} {'untested':>9} {'kill rate':>10}"
    )
    survivors = []
    for name in names:
        rows = _mutants(GROUPS[name][0])
        counts = {
            s: sum(r[4] == s for r in rows)
            for s in (KILLED, SURVIVED, TIMEOUT, SUSPICIOUS, SKIPPED, UNTESTED)
        }
        for s, n in counts.items():
            total[s] = total.get(s, 0) + n
        survivors += [r for r in rows if r[4] == SURVIVED]
        print(_line(name, len(rows), counts))
    print(_line("all", sum(total.values()), total))
    print(
        "kill rate = (killed + timeout) / (killed + timeout + survived + suspicious); "
        "skipped = message/log text (mutmut_config.py)"
    )
    if survivors:
        print(f"\nsurvivors ({len(survivors)}):")
        for mid, filename, line_no, line, _ in survivors:
            print(f"  #{mid} {filename}:{line_no}: {line.strip()}")
            if show_diffs:
                diff = subprocess.run(
                    [sys.executable, "-m", "mutmut", "show", str(mid)],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                ).stdout
                print("    " + "\n    ".join(diff.strip().splitlines()[2:]))


def _line(name: str, n: int, c: dict[str, int]) -> str:
    caught = c[KILLED] + c[TIMEOUT]
    judged = caught + c[SURVIVED] + c[SUSPICIOUS]
    rate = f"{100 * caught / judged:.1f}%" if judged else "-"
    return (
        f"{name:<10} {n:>8} {c[KILLED]:>7} {c[SURVIVED]:>9} {c[TIMEOUT]:>8} "
        f"{c[SKIPPED]:>8} {c[UNTESTED]:>9} {rate:>10}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "groups", nargs="*", help=f"groups to run (default: all): {', '.join(GROUPS)}"
    )
    parser.add_argument("--report", action="store_true", help="only print the cached results")
    parser.add_argument("--no-diffs", action="store_true", help="survivors without their diffs")
    args = parser.parse_args()
    names = args.groups or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {unknown}; choose from {', '.join(GROUPS)}")
    failed = 0
    if not args.report:
        for name in names:
            failed |= run_group(name)
    report(names, show_diffs=not args.no_diffs)
    return failed


if __name__ == "__main__":
    sys.exit(main())
