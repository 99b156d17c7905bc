"""Command line: ``python -m gradsync <command> …``.

``bench <name> [args]`` runs the benchmark module ``gradsync.apps.bench.<name>`` (each owns its
arguments: ``python -m gradsync bench <name> --help``); ``bench list`` lists them.
``demo`` runs the short comparison that ``make demo`` shows; ``profile`` measures and prints
the cost model (backward, sparsification and collective times) the planners consume;
``profile-cluster`` measures on this machine's GPU a cluster profile for ``report cluster``;
``train`` trains a model with a scheme on local workers or under torchrun; ``report``
reproduces the papers' tables; ``simulate`` predicts iteration time at large P.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import gradsync.apps.bench


def bench_names() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(gradsync.apps.bench.__path__)
        if not m.name.startswith("_")
    )


def _bench(argv: list[str]) -> int:
    names = bench_names()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print("usage: python -m gradsync bench <name> [options]\n\nbenchmarks: " + ", ".join(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    return int(importlib.import_module(f"gradsync.apps.bench.{name}").main(rest) or 0)


def _module_main(module: str):
    """A command that runs ``<module>.main(argv)`` (imported only when used)."""

    def run(argv: list[str]) -> int:
        return int(importlib.import_module(module).main(argv) or 0)

    return run


COMMANDS = {
    "bench": _bench,
    "demo": _module_main("gradsync.apps.demo"),
    "profile": _module_main("gradsync.apps.profile"),
    "profile-cluster": _module_main("gradsync.apps.profile_cluster"),
    "train": _module_main("gradsync.apps.train"),
    "report": _module_main("gradsync.apps.report"),
    "simulate": _module_main("gradsync.apps.sim.simulate"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m gradsync",
        description="gradsync: sparsified gradient synchronization for PyTorch.",
    )
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.parse_args(argv[:1])  # prints the error and exits 2
    return COMMANDS[argv[0]](argv[1:])
