"""The CLI contract (``mixmoe.cli``): every command, discovered from the parser, answers bad input
with one ``mixmoe: error: ...`` line and exit status 2, never a traceback (unless ``--debug``);
help shows defaults; a bug keeps its traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import mixmoe
from mixmoe import cli

MISSING = "/nonexistent-mixmoe-dir/missing-file.txt"
ROOT = Path(mixmoe.__file__).resolve().parent.parent


def _leaves(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(words, parser) of every runnable command in the tree, found by walking the subparsers."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield words, parser
        return
    for name, sub in subs[0].choices.items():
        yield from _leaves(sub, (*words, name))


LEAVES = dict(_leaves(cli.build_parser()))


def test_every_registered_command_is_in_the_parser():
    assert set(LEAVES) == set(cli.COMMANDS) and len(LEAVES) >= 6


def _bad_inputs(words: tuple[str, ...], parser: argparse.ArgumentParser) -> list[list[str]]:
    """Bad command lines derived from the parser: an unknown option, a non-number for every
    typed option, an unknown choice for every option with choices, a missing file for every
    positional argument."""
    positionals = [a for a in parser._actions if not a.option_strings]
    files = [MISSING] * len(positionals)
    cases = [[*words, *files, "--no-such-option"]]
    if positionals:
        cases.append([*words, *files])
    for a in parser._actions:
        if not a.option_strings or a.nargs == 0:
            continue
        if a.type is not None:
            cases.append([*words, *files, a.option_strings[-1], "not-a-number"])
        if a.choices is not None:
            cases.append([*words, *files, a.option_strings[-1], "no-such-choice"])
    return cases


def _assert_one_line_error(capsys, argv: list[str]) -> str:
    code = cli.main(argv)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, (argv, out.err)
    assert len(lines) == 1 and lines[0].startswith("mixmoe: error: "), (argv, out.err)
    assert "Traceback" not in out.err + out.out
    return lines[0]


@pytest.mark.parametrize("words", sorted(LEAVES), ids=" ".join)
def test_bad_input_gives_one_line_and_status_2(words, capsys):
    cases = _bad_inputs(words, LEAVES[words])
    assert len(cases) >= 2
    for argv in cases:
        _assert_one_line_error(capsys, argv)


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["bench", "layer", "--routing", "zipf:abc"], "routing 'zipf:abc' is not understood"),
        (["bench", "layer", "--tokens", "0"], "tokens must be >= 1, got 0"),
        (["bench", "layer", "--strategy", "foo"], "strategy 'foo' is unknown"),
        (["bench", "layer", "--top-k", "9", "--num-local-experts", "4"], "top_k=9 exceeds"),
        (["bench", "layer", "--device", "cuda:99"], "device 'cuda:99'"),
        (["bench", "layer", "--device", "tpu"], "device 'tpu'"),
        (["bench", "layer", "--world-size", "2", "--strategy", "local"], "runs on one rank"),
        (["bench", "kernels", "--device", "cpu", "--block-size", "48"], "block_size must be"),
        # 0 ranks: one line (bench layer / model ran on one rank; train spawned none)
        (["bench", "layer", "--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["bench", "model", "--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["train", "--world-size", "-2"], "--world-size must be >= 1, got -2"),
        (["bench", "hf", "--hot-bias", "nan"], "hot_bias must be a finite number, got nan"),
        (["simulate", "--fixed-ms", "inf"], "must be finite, got inf"),
        (["demo", "--steps", "0"], "steps must be >= 1"),
        (["report", "/nonexistent.log"], "/nonexistent.log: No such file or directory"),
        (["analyze", "trace", "/nonexistent.txt"], "/nonexistent.txt: No such file"),
        (["analyze", "trace", MISSING, "--stages", "0"], "--stages must be >= 1"),
        (["analyze", "profile", "/"], "/: Is a directory"),
        (["nope"], "invalid choice: 'nope'"),
        (["bench"], "bench: the following arguments are required"),
    ],
)
def test_issue_examples(argv, expected, capsys):
    assert expected in _assert_one_line_error(capsys, argv)


def test_a_file_that_is_not_the_format_names_it(tmp_path, capsys):
    bad = tmp_path / "not_a_trace.txt"
    bad.write_text("hello\n")
    assert f"{bad}: no 'rank:<R>:<op>(...)' lines" in _assert_one_line_error(
        capsys, ["analyze", "trace", str(bad)]
    )


def test_help_shows_defaults_for_every_option():
    for words, parser in LEAVES.items():
        formatter = parser._get_formatter()
        for a in parser._actions:
            if a.option_strings and a.default not in (None, False, argparse.SUPPRESS):
                assert "default" in formatter._get_help_string(a), (words, a.option_strings)
    assert "(default: 2048)" in LEAVES[("bench", "layer")].format_help().replace("\n", " ")


def test_help_exits_0(capsys):
    assert cli.main([]) == 0 and "bench" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    for words in LEAVES:
        assert cli.main([*words, "--help"]) == 0
        assert f"mixmoe {' '.join(words)}" in capsys.readouterr().out


@pytest.fixture
def fake_command(monkeypatch):
    """A command registered the way a later one would be: raise what ``fake_command.error`` is."""
    module = types.ModuleType("mixmoe_fake_command")
    module.error = None

    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--n", type=int, default=1, help="a number")

    def run(args: argparse.Namespace) -> int:
        raise module.error

    module.add_arguments, module.run = add_arguments, run
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, ("fake",), (module.__name__, "a later command"))
    return module


def test_a_later_command_follows_the_contract(fake_command, capsys):
    for error in (ValueError("n is bad; use 2"), FileNotFoundError(2, "No such file", "x.log")):
        fake_command.error = error
        assert cli.main(["fake"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("mixmoe: error: ")
    assert cli.main(["fake", "--n", "x"]) == 2
    fake_command.error = KeyboardInterrupt()
    assert cli.main(["fake"]) == 130


def test_a_bug_keeps_its_traceback_and_debug_shows_user_errors(fake_command, capsys):
    fake_command.error = KeyError("internal")
    with pytest.raises(KeyError):
        cli.main(["fake"])
    fake_command.error = ValueError("n is bad; use 2")
    assert cli.main(["fake", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("mixmoe: error: n is bad; use 2")


def test_out_of_memory_is_one_line_and_other_runtime_errors_are_bugs(fake_command, capsys):
    """Sizes too large for the machine (``simulate --world-size 100000``: a [10**5, 4 * 10**5]
    count matrix) fail in an allocation: one line naming the size, status 2; any other
    RuntimeError keeps its traceback."""
    alloc = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 320000000000 bytes. Error code 12"
    )
    for error, said in (
        (alloc, "tried to allocate 298.0 GiB"),
        (MemoryError(), "a Python allocation failed"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "CUDA out"),
    ):
        fake_command.error = error
        assert cli.main(["fake"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mixmoe: error: out of memory: "), err
        assert said in err[0] and "use smaller sizes" in err[0], err
    fake_command.error = RuntimeError("an index out of range deep in a kernel")
    with pytest.raises(RuntimeError, match="deep in a kernel"):
        cli.main(["fake"])


def test_real_process_prints_one_line():
    """The console path (``python -m mixmoe``): stderr is one line, no traceback, status 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "mixmoe", "bench", "layer", "--tokens", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["mixmoe: error: tokens must be >= 1, got 0"]


def test_bench_layer_plan_mode_reaches_the_layer_config():
    from mixmoe.commands import bench_layer

    parser = cli.build_parser()
    for argv, expected, ahead in (
        ([], None, False),
        (["--plan", "sync"], False, False),
        (["--plan", "async"], True, False),
        (["--plan", "ahead"], None, True),
    ):
        args = parser.parse_args(["bench", "layer", "--world-size", "2", *argv])
        cfg = bench_layer.config_from_args(args)
        assert cfg.plan_async is expected and cfg.plan_ahead is ahead
        assert cfg.moe_config("mix").plan_async is expected
        assert cfg.moe_config("mix").plan_ahead is ahead
