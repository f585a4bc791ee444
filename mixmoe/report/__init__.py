"""Readers and reports: CMD and Chrome traces, profiler tables, benchmark logs.

Readers are torch-free. Command modules (``analyze_trace``, ``analyze_profile``, ``report_cli``)
are loaded by ``mixmoe.cli`` only when their command runs; plots import matplotlib lazily.
"""
