"""Benchmarks: one shared harness (named strategies/providers, controllable skew, correctness
before timing, warm-up excluded, results written with their environment)."""
