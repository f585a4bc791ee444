"""``make mutation``: mutation testing of the core modules with mutmut (pinned in the dev extra).

Each group mutates one core package and runs every mutant against the package's fast tests
(``-x`` stops at the first failure, so a killed mutant costs seconds); a survivor of those is
re-run against the group's wide tests (the unit or distributed tier), so only survivors pay for
the slow nets. ``--only FILE`` and ``--defs NAME`` restrict a run to some modules or top-level
definitions when a whole package would take too long; ``--fast-only`` skips the wide re-run.
mutmut edits the source files in place, one mutant at a time, and restores them: do not edit
the tree while it runs (or run it in a copy of the tree). Results accumulate in ``.mutmut-cache`` (a rerun only tests mutants not yet tested;
delete the file to start over). Mutants that no test can catch by design (error-message and
log/trace text) are skipped by ``mutmut_config.py``; known equivalent survivors are explained in
``docs/mutation-log.md``.

    python scripts/mutation/run_mutation.py               # every group (hours on 2 CPU cores)
    python scripts/mutation/run_mutation.py gating ops    # some groups
    python scripts/mutation/run_mutation.py --report      # kill rates and survivors, no run
    python scripts/mutation/run_mutation.py placement --only mixmoe/placement/cost_model.py \
        --defs StepModel rank_loads                     # a module's core

mutmut's own progress goes to ``.mutmut-logs/GROUP.log`` (``tail -f`` it to watch); the driver
prints one summary line per group when the group ends (``gating: 98 mutants: 82 killed,
16 survived, 0 timeout, 0 suspicious, 0 skipped, 0 untested; kill rate 83.7%``), then a table
of all the groups asked for and the survivors.

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
LOGS = ROOT / ".mutmut-logs"

# group -> (packages to mutate, fast tests, wide tests). Every mutant runs the fast tests: the
# package's own tests, a few seconds with ``-x`` (a killed mutant costs up to its first failure).
# A mutant that survives them is re-run against the wide tests (the unit tier, the distributed
# tests that see a wrong plan, split or replica: test_strategies runs every strategy against the
# single-rank layer, test_gradient_accumulation the cached replica gradients), so only survivors
# pay for the slow nets and a mutant counts as killed if any test of either list catches it.
# the one-process test folders (the former tests/unit): the wide net of several groups
ONE_PROCESS = [
    f"tests/{d}"
    for d in ("gating", "dispatch", "layers", "ops", "schedule", "comm", "parallel", "hf")
    + ("bench", "project")
]
GROUPS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "gating": (
        ["mixmoe/gating"],
        ["tests/gating/test_gating.py", "tests/layers/test_layer_vs_reference.py"],
        ONE_PROCESS,
    ),
    "schedule": (
        ["mixmoe/schedule"],
        ["tests/schedule/test_schedule.py"],
        ONE_PROCESS,
    ),
    "placement": (  # a wrong cost changes which plan is picked, not the layer's numbers
        ["mixmoe/placement"],
        [  # the search forms against each other and against the spelled-out greedy first
            "tests/placement/test_placement_planner.py::test_every_search_path_decides_alike",
            "tests/placement/test_placement_planner.py::"
            "test_rescan_planner_matches_its_spelled_out_greedy",
            "tests/placement",
        ],
        [
            "tests/dispatch/test_step_plan.py",
            "tests/bench/test_bench_planner.py",
            "tests/distributed/test_strategies.py",  # the plan accessors the dispatch uses
        ],
    ),
    "fill": (  # the level fill's Python twin: a wrong step breaks the twin tests at once
        ["mixmoe/placement/range_state.py", "mixmoe/placement/level_fill.py"],
        [
            "tests/placement/test_native_fill.py",  # the C++ fill against it, random fills
            "tests/placement/test_placement_level_fill.py",
            "tests/placement/test_placement_thinned.py",
        ],
        ["tests/placement"],
    ),
    "ops": (
        ["mixmoe/ops"],
        [
            "tests/kernels/test_cpu_expert_mlp.py",  # the CPU fused expert MLP: 10 s
            "tests/kernels/test_fused_ops.py",  # the fused ops: torch impls first, then Triton's
            "tests/ops/test_ops.py",
            "tests/kernels/test_grouped_mm_expert_mlp.py",
        ],
        [*ONE_PROCESS, "tests/kernels"],
    ),
    "parallel": (
        ["mixmoe/parallel"],
        [
            "tests/parallel/test_parallel_state.py",  # load, slice, marks: one process
            "tests/parallel/test_sharded_build.py",  # layers built for a rank: one process
            "tests/distributed/test_checkpoint_and_failures.py::"
            "test_gathered_checkpoint_is_the_unsharded_layer",
            "tests/distributed/test_ddp_and_expert_data_parallel.py",
        ],
        [
            "tests/distributed/test_checkpoint_and_failures.py",
            "tests/distributed/test_dropin_parallel.py",
            "tests/parallel/test_sharded_build.py",
            "tests/distributed/test_strategies.py",
        ],
    ),
    "comm": (
        ["mixmoe/comm"],
        [
            "tests/comm/test_process_group.py",  # init, groups' layout, FSDP version: one process
            "tests/distributed/test_comm.py::test_local_communicator_is_a_world_of_one",
            "tests/distributed/test_gradient_accumulation.py",  # every all_to_all, 2 ranks
            "tests/distributed/test_comm.py",  # each collective on 3 ranks, uneven splits
            "tests/distributed/test_strategies.py::test_strategies_match_single_rank[2]",
            "tests/distributed/test_ddp_and_expert_data_parallel.py",  # new_expert_groups
        ],
        [
            "tests/distributed/test_strategies.py",
            "tests/distributed/test_checkpoint_and_failures.py",  # timeouts, all_gather_rows
        ],
    ),
    "dispatch": (  # the expert-parallel engine: 2 ranks, every strategy, cached replicas first
        ["mixmoe/dispatch"],
        [
            "tests/dispatch/test_step_layout.py",  # the layout's contract, no process
            "tests/dispatch/test_replicas.py",
            "tests/dispatch/test_ep_world_of_one.py",  # the engine with nothing to move
            "tests/dispatch/test_ep_planner_inputs.py",  # the planner's shape, the handshake
            "tests/dispatch/test_ep_dispatch_step.py",  # own rows handed over once, stats
            "tests/dispatch/test_plan_background.py",  # the async plan, plans_async
            "tests/dispatch/test_step_records.py",  # frozen records, the strategy registry
            "tests/dispatch/test_step_plan.py",
            "tests/schedule/test_schedule.py",  # expert_row_layout
            "tests/distributed/test_gradient_accumulation.py",  # 2 ranks, every strategy
            "tests/distributed/test_strategies.py::test_strategies_match_single_rank[2]",
            "tests/distributed/test_count_exchange.py",
        ],
        [
            "tests/layers/test_layer_vs_reference.py",  # the local dispatcher
            "tests/dispatch/test_plan_background.py",  # the async plan, the own rows' span
            "tests/distributed/test_strategies.py",
            "tests/distributed/test_training.py",  # replica cache invalidated by a step
            "tests/distributed/test_strategy_agreement.py",
            "tests/distributed/test_async_plan_ranks.py",
            "tests/distributed/test_dropin_parallel.py",
        ],
    ),
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
    """The command mutmut runs per mutant (split with shlex, no shell; its timeout kills that
    process, so pytest runs inside it). ``--hypothesis-profile=mutation`` (tests/conftest.py): no
    example database and fixed examples, so a failing example one mutant saved cannot fail every
    later mutant (it did: false kills) and every mutant meets the same examples. Exit 1 for any
    failure: mutmut 2.5.1 counts only exit code 1 as failing tests, so a mutant that broke
    collection or an import (pytest exits 2) was counted as survived (and an unmutated tree that
    does not collect fails the baseline now instead of passing it)."""
    seen = list(dict.fromkeys(tests))  # a file named before its folder is collected once
    main = "import sys, pytest; sys.exit(0 if pytest.main(sys.argv[1:]) == 0 else 1)"
    args = "-x -q -p no:cacheprovider --hypothesis-profile=mutation"
    return f"{sys.executable} -c '{main}' {args} " + " ".join(seen)


def _forget_baseline() -> None:
    """Make the next ``mutmut run`` time its runner on the unmutated tree again. mutmut caches one
    baseline time per test-file hash, whatever the runner, and stops a mutant's tests at 10 x that
    time as a "timeout" (counted as caught): a baseline left over from a faster runner would turn
    slow, passing test runs into false kills. Re-timing also checks that the runner passes."""
    cache = ROOT / ".mutmut-cache"
    if cache.exists():
        with sqlite3.connect(cache) as db:
            db.execute("DELETE FROM MiscData WHERE key = 'baseline_time_elapsed'")


def _reset_skipped() -> None:
    """Retest the mutants a previous run skipped: a ``--defs`` restriction is per run (the text
    skips of ``mutmut_config.py`` are cheap to redo)."""
    cache = ROOT / ".mutmut-cache"
    if cache.exists():
        with sqlite3.connect(cache) as db:
            db.execute(f"UPDATE Mutant SET status = '{UNTESTED}' WHERE status = '{SKIPPED}'")


def _mutmut_run(args: list[str], tests: list[str], log: Path) -> int:
    """``mutmut run ARGS`` with ``tests`` as the runner, appending to ``log``; its exit code."""
    cmd = [sys.executable, "-m", "mutmut", "run", *args, "--runner", _runner(tests)]
    cmd += ["--tests-dir", "tests", "--simple-output"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(log, "a") as out:
        return subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        ).returncode


def _retest(ids: list[int], paths: list[str], tests: list[str], log: Path) -> int:
    """``mutmut run ID`` for each of ``ids`` (one mutant, whatever its cached status) against
    ``tests``; 1 if mutmut failed for any."""
    fatal = 0
    for mid in ids:
        fatal |= _mutmut_run([str(mid), "--paths-to-mutate", ",".join(paths)], tests, log) & 1
    return fatal


def run_group(name: str, only: list[str], fast_only: bool = False) -> int:
    """Mutate group ``name`` (restricted to the files or folders ``only`` when given) against its
    fast tests, then (unless ``fast_only``) re-run each survivor against its wide tests.
    Returns 1 if mutmut failed."""
    packages, fast, wide = GROUPS[name]
    paths = [p for p in only if p.startswith(tuple(packages))] if only else packages
    if not paths:
        return 0
    log = LOGS / f"{name}.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text("")
    print(f"== {name}: mutating {', '.join(paths)}; tests: {_runner(fast)}", flush=True)
    if not fast_only:
        print(f"   survivors then: {_runner(wide)}", flush=True)
    print(f"   progress: tail -f {log.relative_to(ROOT)}", flush=True)
    _forget_baseline()
    _reset_skipped()
    code = _mutmut_run(["--paths-to-mutate", ",".join(paths)], fast, log)
    fatal = code & 1  # mutmut: 1 fatal; 2/4/8 survivors, timeouts, suspicious
    # mutmut 2.5.1 ends a run with the mutants of a line whose text occurs earlier in the same
    # file still "untested" (its progress counts them as done; 53 of planner.py's 302 in the
    # seventeenth run): ``mutmut run ID`` tests each on its own
    left = [r[0] for r in _mutants(paths) if r[4] == UNTESTED]
    if left and not fatal:
        print(f"   {len(left)} mutants left untested by the run: testing each", flush=True)
        fatal |= _retest(left, paths, fast, log)
    survivors = [r[0] for r in _mutants(paths) if r[4] == SURVIVED]
    if survivors and wide and not fatal and not fast_only:
        print(f"   {len(survivors)} survivors of the fast tests: re-running them", flush=True)
        _forget_baseline()  # the first survivor's run times the wide tests, the rest reuse it
        fatal |= _retest(survivors, paths, wide, log)
    if fatal:
        tail = log.read_text(errors="replace")[-2000:]
        print(f"   mutmut failed; end of {log.name}:\n{tail}", flush=True)
    print(summary(name), flush=True)
    return fatal


def _counts(rows: list[tuple[int, str, int, str, str]]) -> dict[str, int]:
    return {
        s: sum(r[4] == s for r in rows)
        for s in (KILLED, SURVIVED, TIMEOUT, SUSPICIOUS, SKIPPED, UNTESTED)
    }


def _rate(c: dict[str, int]) -> str:
    # mutmut's "suspicious" is a mutant the tests DID kill, only slowly (ok_suspicious)
    caught = c[KILLED] + c[TIMEOUT] + c[SUSPICIOUS]
    judged = caught + c[SURVIVED]
    return f"{100 * caught / judged:.1f}%" if judged else "-"


def summary(name: str) -> str:
    """One line: the cached results of group ``name``."""
    rows = _mutants(GROUPS[name][0])
    c = _counts(rows)
    return (
        f"{name}: {len(rows)} mutants: {c[KILLED]} killed, {c[SURVIVED]} survived, "
        f"{c[TIMEOUT]} timeout, {c[SUSPICIOUS]} suspicious, {c[SKIPPED]} skipped, "
        f"{c[UNTESTED]} untested; kill rate {_rate(c)}"
    )


def _mutants(paths: list[str]) -> list[tuple[int, str, int, str, str]]:
    """(id, file, 0-based line number, source line, status) of every cached mutant in ``paths``."""
    cache = ROOT / ".mutmut-cache"
    if not cache.exists():
        return []
    with sqlite3.connect(cache) as db:
        rows = db.execute(
            "SELECT m.id, f.filename, l.line_number, l.line, m.status FROM mutant m "
            "JOIN line l ON m.line = l.id JOIN sourcefile f ON l.sourcefile = f.id "
            'ORDER BY f.filename, l.line_number, m."index"'
        ).fetchall()
    paths = [p.rstrip("/") for p in paths]  # folders or files
    return [r for r in rows if any(r[1] == p or r[1].startswith(p + "/") for p in paths)]


def report(names: list[str], show_diffs: bool) -> None:
    total: dict[str, int] = {}
    print(
        f"\n{'group':<10} {'mutants':>8} {'killed':>7} {'survived':>9} {'timeout':>8} "
        f"{'suspicious':>11} {'skipped':>8} {'untested':>9} {'kill rate':>10}"
    )
    survivors = []
    for name in names:
        rows = _mutants(GROUPS[name][0])
        counts = _counts(rows)
        for s, n in counts.items():
            total[s] = total.get(s, 0) + n
        survivors += [r for r in rows if r[4] == SURVIVED]
        print(_line(name, len(rows), counts))
    print(_line("all", sum(total.values()), total))
    print(
        "kill rate = (killed + timeout + suspicious) / (those + survived); suspicious = killed, "
        "slowly; skipped = message/log text (mutmut_config.py)"
    )
    if survivors:
        print(f"\nsurvivors ({len(survivors)}):")
        for mid, filename, line_no, line, _ in survivors:
            print(f"  #{mid} {filename}:{line_no + 1}: {line.strip()}")  # mutmut counts from 0
            if show_diffs:
                diff = subprocess.run(
                    [sys.executable, "-m", "mutmut", "show", str(mid)],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                ).stdout
                print("    " + "\n    ".join(diff.strip().splitlines()[2:]))


def _line(name: str, n: int, c: dict[str, int]) -> str:
    return (
        f"{name:<10} {n:>8} {c[KILLED]:>7} {c[SURVIVED]:>9} {c[TIMEOUT]:>8} "
        f"{c[SUSPICIOUS]:>11} {c[SKIPPED]:>8} {c[UNTESTED]:>9} {_rate(c):>10}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "groups", nargs="*", help=f"groups to run (default: all): {', '.join(GROUPS)}"
    )
    parser.add_argument("--report", action="store_true", help="only print the cached results")
    parser.add_argument("--no-diffs", action="store_true", help="survivors without their diffs")
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="PATH",
        help="mutate only these files or folders of the groups (e.g. mixmoe/placement/profile.py)",
    )
    parser.add_argument(
        "--fast-only",
        action="store_true",
        help="do not re-run the fast tests' survivors against the wide tests",
    )
    parser.add_argument(
        "--defs",
        nargs="+",
        default=[],
        metavar="NAME",
        help="mutate only these top-level functions / classes or Class.method (others are reported "
        "as skipped)",
    )
    args = parser.parse_args()
    names = args.groups or list(GROUPS)
    if args.defs:
        os.environ["MUTATION_DEFS"] = ",".join(args.defs)  # read by mutmut_config.py
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {unknown}; choose from {', '.join(GROUPS)}")
    failed = 0
    if not args.report:
        for name in names:
            failed |= run_group(name, args.only, args.fast_only)
    report(names, show_diffs=not args.no_diffs)
    return failed


if __name__ == "__main__":
    sys.exit(main())
