"""Analyses of traces, profiler tables and benchmark logs; torch-free (plots load matplotlib lazily).

- ``trace_summary``: where the time goes in CMD traces (phases, gaps, bubble, collectives, load).
- ``profile_breakdown``: the MoE layer's stages in a torch.profiler table.
- ``run_stats``: statistics over benchmark runs (steady steps, medians, speedups) and their table.
- ``timeline_plot``, ``bench_plots``: PNGs (matplotlib via ``matplotlib_agg``).
- ``text_table``: the one plain-text / Markdown table renderer of mixmoe.

The files themselves are read by ``mixmoe.formats``; the commands that print these analyses live
in ``mixmoe.commands``.
"""
