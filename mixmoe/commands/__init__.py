"""The ``mixmoe`` commands, one module each, registered in ``mixmoe.cli.COMMANDS``.

A command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it parses flags into
a library configuration and prints, nothing more: the work is done by ``mixmoe.bench``
(benchmarks), ``mixmoe.report`` (analyses) and ``mixmoe.formats`` (files). User errors are raised
as ``ValueError``/``TypeError``/``OSError``; ``mixmoe.cli`` turns them into one
``mixmoe: error: ...`` line and exit status 2.
"""
