"""Output shared by the commands (train, demo, report, simulate, the benchmarks): a rich table
on stdout, JSON and a PNG in the output folder, and the median timer.

Benchmarks are commands, never timed tests. Times on shared machines are noisy, so every
benchmark reports medians and ratios measured in the same run.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["add_common_args", "code_revision", "median_time", "out_dir", "print_table", "pyplot",
           "write_outputs"]


def add_common_args(parser, name: str) -> None:
    """``--out`` (default bench-out/<name>) and ``--repeats``."""
    parser.add_argument("--out", default=f"bench-out/{name}", help="folder for JSON and PNG")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (median)")


def out_dir(path: str | Path) -> Path:
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    return p


def median_time(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
                device: torch.device | str | None = None) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs; on a CUDA
    ``device`` each run is bracketed by synchronisations, so it times the kernels too."""
    cuda = device is not None and torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print ``rows`` under ``columns`` as a rich table (plain text when not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(str(c), justify="right")
    cells = [[_fmt(v) for v in r] for r in rows]
    for r in cells:
        table.add_row(*r)
    # wide enough that no header or cell wraps (3 characters of padding and rule per column)
    widest = sum(max([len(str(c))] + [len(r[i]) for r in cells if i < len(r)]) + 3
                 for i, c in enumerate(columns)) + 1
    Console(width=max(100, 14 * len(columns), widest)).print(table)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def cpu_description() -> str:
    """The CPU's model name and the kernels torch picked for it, e.g. ``"AMD EPYC; torch CPU
    kernels AVX2"``. Float results are bit for bit reproducible only on the same kernels: the
    same code and seed rounded differently on another host (docs/results/accuracy-history.md,
    "Reproducible on the same kernels only")."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}; torch CPU kernels {torch.backends.cpu.get_cpu_capability()}"


def code_revision() -> str | None:
    """The git commit gradsync runs from (short hash, ``+dirty`` with uncommitted changes in
    the package), or ``None`` outside a checkout: results kept across invocations say which
    code made them."""
    src = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=7", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


_PLOT_NOTE_SHOWN = False


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` (with a one-time note) when
    matplotlib is not installed: plots are the ``gradsync[apps]`` extra, and every command
    still prints its table and writes its JSON without them."""
    global _PLOT_NOTE_SHOWN
    try:
        import matplotlib
    except ModuleNotFoundError:
        if not _PLOT_NOTE_SHOWN:
            print("note: matplotlib is not installed, so no plots are drawn "
                  "(pip install 'gradsync[apps]')")
            _PLOT_NOTE_SHOWN = True
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax: Any, rows: Sequence[dict[str, Any]], group: str, category: str,
                 value: Callable[[dict[str, Any]], float | None],
                 label: Callable[[Any], str] = str, rotation: int = 45) -> list[Any]:
    """One bar per ``rows`` entry on ``ax``: categories (``row[category]``, in first-seen
    order) along x, one bar of each group (``row[group]``) side by side within a category,
    height ``value(row)`` (``None``: no bar). Returns the categories; their tick is at index
    ``+ 0.4 − width / 2``, where :func:`grouped_tick` puts a marker."""
    groups = list(dict.fromkeys(r[group] for r in rows))
    cats = list(dict.fromkeys(r[category] for r in rows))
    width = 0.8 / max(1, len(groups))
    for i, g in enumerate(groups):
        by = {r[category]: value(r) for r in rows if r[group] == g}
        ys = [float("nan") if by.get(c) is None else by[c] for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], ys, width, label=label(g))
    ax.set_xticks([grouped_tick(j, len(groups)) for j in range(len(cats))], cats,
                  rotation=rotation, ha="right", fontsize=7)
    return cats


def grouped_tick(index: int, groups: int) -> float:
    """The x of category ``index``'s tick in :func:`grouped_bars` with ``groups`` groups."""
    return index + 0.4 - 0.4 / max(1, groups)


def write_outputs(
    name: str,
    rows: list[dict[str, Any]],
    out: str | Path,
    plot: Callable[[Any], None] | None = None,
    meta: dict[str, Any] | None = None,
) -> tuple[Path, Path | None]:
    """Write ``<out>/<name>.json`` (rows + environment) and, with ``plot(ax)``, a PNG."""
    d = out_dir(out)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    jpath = d / f"{name}.json"
    jpath.write_text(json.dumps({"benchmark": name, "env": env, "meta": meta or {},
                                 "rows": rows}, indent=2, default=str))
    ppath = None
    plt = pyplot() if plot is not None else None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        plot(ax)
        fig.tight_layout()
        ppath = d / f"{name}.png"
        fig.savefig(ppath, dpi=120)
        plt.close(fig)
    return jpath, ppath
