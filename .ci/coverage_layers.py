"""Line coverage of ``src/gradsync`` per layer, from a combined coverage data file.

``make coverage`` runs the suite under coverage (rank processes included: coverage's
multiprocessing support follows them) and then this script, which prints one row per layer of
the import contract (pyproject.toml, ``[tool.importlinter]``), top to bottom, and the total
outside ``apps/`` (the figure issue 69 holds: it must not drop). ``--json PATH`` also writes
the rows; ``--against PATH`` (rows a previous run wrote: ``make coverage`` gives
``docs/results/coverage-0f2bd88.json``, the suite before issue 69) adds that run's percent per
layer and the change, and fails when a layer of the library dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gradsync"


def layers() -> list[list[str]]:
    """The layers of the import contract, top to bottom, each a list of module names."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in cfg["tool"]["importlinter"]["contracts"] if c["id"] == "layers")
    return [[m.strip() for m in layer.split("|")] for layer in contract["layers"]]


def layer_of(path: Path, order: list[list[str]]) -> str:
    rel = path.resolve().relative_to(PACKAGE)
    top = rel.parts[0].removesuffix(".py")
    for group in order:
        if top in group:
            return " | ".join(group)
    return "(package root)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--against", default=None, help="rows of an earlier run to compare with")
    a = p.parse_args(argv)
    cov = coverage.Coverage()
    cov.load()
    order = layers()
    per: dict[str, list[int]] = {}
    measured = {str(Path(f).resolve()) for f in cov.get_data().measured_files()}
    for path in sorted(PACKAGE.rglob("*.py")):  # a file no test imported counts as uncovered
        _, statements, _, missing, _ = cov.analysis2(str(path.resolve()))
        row = per.setdefault(layer_of(path, order), [0, 0])
        row[0] += len(statements)
        if str(path.resolve()) in measured:
            row[1] += len(statements) - len(missing)
    names = [" | ".join(g) for g in order] + ["(package root)"]
    rows = [{"layer": n, "statements": per[n][0], "covered": per[n][1],
             "percent": round(100.0 * per[n][1] / max(1, per[n][0]), 1)}
            for n in names if n in per]
    lib = [r for r in rows if r["layer"] not in ("apps", "__main__")]
    total = {"layer": "library (outside apps/)", "statements": sum(r["statements"] for r in lib),
             "covered": sum(r["covered"] for r in lib)}
    total["percent"] = round(100.0 * total["covered"] / max(1, total["statements"]), 1)
    before = {}
    if a.against:
        old = json.loads(Path(a.against).read_text())
        before = {r["layer"]: r["percent"] for r in [*old["rows"], old["library"]]}
    width = max(len(r["layer"]) for r in [*rows, total])
    extra = f"  {'before':>7}  {'change':>6}" if before else ""
    print(f"{'layer':<{width}}  statements  covered  percent{extra}")
    dropped = []
    for r in [*rows, total]:
        line = (f"{r['layer']:<{width}}  {r['statements']:>10}  {r['covered']:>7}  "
                f"{r['percent']:>6.1f}%")
        if r["layer"] in before:
            change = r["percent"] - before[r["layer"]]
            line += f"  {before[r['layer']]:>6.1f}%  {change:>+6.1f}"
            if change < 0 and r["layer"] not in ("apps", "__main__"):
                dropped.append(r["layer"])
        print(line)
    if dropped:
        print(f"coverage dropped in: {', '.join(dropped)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "library": total}, indent=2) + "\n")
    return 1 if dropped else 0


if __name__ == "__main__":
    sys.exit(main())
