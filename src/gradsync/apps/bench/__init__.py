"""Benchmarks: ``python -m gradsync bench <name>``. Each prints a table, writes JSON and a PNG."""
