"""The frame the benchmark commands share around their measurements: the parser of
``python -m gradsync bench <name>``, the table of a run's result rows, and the closing line that
names the files written (JSON, PNG, markdown; :mod:`gradsync.apps.common` writes them).

Private (``_harness``) so that ``python -m gradsync bench list`` does not offer it as a
benchmark.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from gradsync.apps.common import print_table

__all__ = ["add_output_args", "bench_parser", "print_rows", "print_written"]


def bench_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m gradsync bench <name>``, with ``doc`` (the benchmark module's
    docstring) as its description, line breaks kept."""
    return argparse.ArgumentParser(prog=f"python -m gradsync bench {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_output_args(p: argparse.ArgumentParser, name: str, timeout: float) -> None:
    """``--timeout`` (seconds per world size), ``--out`` (default ``bench-out/<name>``) and
    ``--write-docs`` (into ``docs/results/`` instead): the arguments of a benchmark that runs
    one job per world size and writes a page."""
    p.add_argument("--timeout", type=float, default=timeout, help="per world size, seconds")
    p.add_argument("--out", default=f"bench-out/{name}")
    p.add_argument("--write-docs", action="store_true", help="write into docs/results/")


def print_rows(title: str, rows: Sequence[Mapping[str, Any]],
               skip: Collection[str] = ()) -> None:
    """Print ``rows`` (the dicts a benchmark writes to its JSON) as a table: one column per key
    of the first row, in its order, but those in ``skip``."""
    columns = [c for c in rows[0] if c not in skip]
    print_table(title, columns, [[r[c] for c in columns] for r in rows])


def print_written(*paths: Path | None, lead: str = "") -> None:
    """Print ``<lead>wrote a, b and c``: the files a command wrote, in order; a ``None`` (the
    PNG of :func:`~gradsync.apps.common.write_outputs` without matplotlib) is left out."""
    names = [str(p) for p in paths if p is not None]
    listed = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
    print(f"{lead}wrote {listed}")
