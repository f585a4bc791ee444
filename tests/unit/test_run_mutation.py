"""``make mutation``'s driver: the mutants mutmut leaves untested are tested one by one, and only
the fast tests' survivors pay for the wide tests (no mutmut process is started here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mutation" / "run_mutation.py"


@pytest.fixture
def driver(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("run_mutation_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LOGS", tmp_path / "logs")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    return module


def _fake(driver, monkeypatch, statuses: dict[int, str], after_run: dict[int, str]):
    """A cache of ``statuses``; the whole-group run turns them into ``after_run``; ``mutmut run
    ID`` marks ID killed. Returns the list of mutmut argument lists."""
    calls: list[list[str]] = []
    state = dict(statuses)

    def mutmut_run(args, tests, log):
        calls.append(list(args))
        if args[0].isdigit():
            state[int(args[0])] = driver.KILLED
        else:
            state.update(after_run)
        return 0

    monkeypatch.setattr(driver, "_mutmut_run", mutmut_run)
    monkeypatch.setattr(
        driver,
        "_mutants",
        lambda paths: [(m, "mixmoe/gating/x.py", m, "line", s) for m, s in sorted(state.items())],
    )
    return calls, state


def test_mutants_left_untested_by_the_run_are_tested_each(driver, monkeypatch) -> None:
    U, K, S = driver.UNTESTED, driver.KILLED, driver.SURVIVED
    calls, state = _fake(driver, monkeypatch, {1: U, 2: U, 3: U}, {1: K, 2: U, 3: S})
    assert driver.run_group("gating", [], fast_only=True) == 0
    assert calls == [
        ["--paths-to-mutate", "mixmoe/gating"],
        ["2", "--paths-to-mutate", "mixmoe/gating"],
    ]
    assert state == {1: K, 2: K, 3: S}


def test_survivors_of_the_fast_tests_are_retested_on_the_wide_ones(driver, monkeypatch) -> None:
    U, K, S = driver.UNTESTED, driver.KILLED, driver.SURVIVED
    calls, state = _fake(driver, monkeypatch, {1: U, 2: U}, {1: K, 2: S})
    assert driver.run_group("gating", []) == 0
    assert calls == [
        ["--paths-to-mutate", "mixmoe/gating"],
        ["2", "--paths-to-mutate", "mixmoe/gating"],
    ]
    assert state == {1: K, 2: K}
