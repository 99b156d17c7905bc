"""The collectives' own CPU per call, measured on the group (issue 14, simulator fidelity).

The micro-benchmarks of :class:`~gradsync.schedule.costmodel.ComputeCost` price what a
collective's merges and codec cost (``index_add_``, ``pack_entries``/``unpack_entries``): 0.06–0.21
ms per call at n = 421 642, d = 1 %. One call of the real collective costs each rank 10–50 times
more CPU (Python, dozens of small torch ops, dispatch, the validation of wire data, gloo's
threads): timed on loopback at P = 2, 4, 8, 1.6–10 ms for TopkA, 4–20 ms for Ok-Topk, 5–19 ms
for DenseStream. That software cost grows with P (more steps) and hardly with the entries.

So it is measured, not assembled: :func:`profile_collective_cpu` runs the collective a scheme
uses, at the job's P and n, on each rank's own top-m selection of a real gradient for a few
sizes m (default k/4, k/2, k), and records the *process CPU seconds* per call (every thread of
the rank: the interpreter, torch's ops, gloo's I/O threads). CPU time, not wall time: a rank
that waits for the link or for a peer to be scheduled uses no CPU, so the figure is the same on
a shaped link, on loopback and with P ranks time-sharing the cores, and it does not count the
link time the α-β pattern already prices. The per-call medians (maximum over ranks: a
synchronous step waits for the slowest) are fitted affine in the entries per rank,
``t_c(m) = c0 + c1·m`` (:func:`fit_collective_cpu`, least squares with c0, c1 ≥ 0).

:class:`CollectiveCPU` holds the fits per P and collective; it travels in the profile JSON
under ``"collective_cpu"`` (:meth:`CollectiveCPU.to_dict`, read back with a clear error for bad
values). :func:`gradsync.apps.sim.predict.predict` (``collective_cpu=``) uses it:

* as the collective's compute, a floor over the merge and codec micro terms: compute =
  message·rounds + max(merges + codec, t_c(m)) — the per-message price is latency (the wire's
  and gloo's wake-ups), which CPU time does not contain, so it stays;
* in the contention work floor (:mod:`gradsync.apps.sim.contention`): t_c(m) replaces the
  merges and codec in the work W and the per-call CPU of the torch.distributed calls it
  already contains (it is CPU already, not scaled by the profile's core share σ).

A fit exists only for the P it was measured at; other P keep the micro terms.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradsync.apps.sim import patterns
from gradsync.schedule.costmodel import AffineFit, fit_affine

__all__ = ["CollectiveCPU", "fit_collective_cpu", "profile_collective_cpu"]


def _positive_int(x: Any, what: str) -> int:
    v: int | None = None
    integral = isinstance(x, (int, float)) and not isinstance(x, bool) and float(x).is_integer()
    if integral or (isinstance(x, str) and x.strip().isdigit()):
        v = int(x)
    if v is None or v < 1:
        raise ValueError(f"{what} must be a positive integer, got {x!r}")
    return v


def _seconds(x: Any, what: str) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {x!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {x!r}")
    return v


def fit_collective_cpu(samples: Sequence[Sequence[float]]) -> AffineFit:
    """``t(m) = c0 + c1·m`` from ``(entries, cpu_s, …)`` samples (least squares, c0, c1 ≥ 0;
    :func:`~gradsync.schedule.costmodel.fit_affine`). Needs ≥ 2 distinct sizes for a slope."""
    if not samples:
        raise ValueError("fit_collective_cpu needs at least one (entries, cpu_s) sample")
    xs = [_seconds(s[0], "entries") for s in samples]
    ts = [_seconds(s[1], "cpu_s") for s in samples]
    return fit_affine(xs, ts)


@dataclass(frozen=True)
class CollectiveCPU:
    """Process CPU seconds one rank spends per call of a collective, per P (module docs).

    ``fits[P][name]``: ``t(m) = a + b·m`` for m entries per rank; ``samples[P][name]``: the
    measured ``[entries, cpu_s, wall_s]`` points (provenance; the wall includes the link)."""

    fits: Mapping[int, Mapping[str, AffineFit]]
    samples: Mapping[int, Mapping[str, list[list[float]]]] = field(default_factory=dict)

    @classmethod
    def from_samples(cls, P: int, samples: Mapping[str, Sequence[Sequence[float]]]
                     ) -> CollectiveCPU:
        """The fits of one P's measurements (:func:`profile_collective_cpu`'s result)."""
        P = _positive_int(P, "P")
        fits = {name: fit_collective_cpu(pts) for name, pts in samples.items()}
        return cls({P: fits}, {P: {n: [list(map(float, s)) for s in pts]
                                   for n, pts in samples.items()}})

    def fit(self, name: str, P: int) -> AffineFit | None:
        """The fit of collective ``name`` at P ranks, None when not measured there."""
        return self.fits.get(int(P), {}).get(name)

    def seconds(self, name: str, P: int, entries: float) -> float | None:
        """CPU seconds of one call with ``entries`` per rank; None when not measured at P."""
        f = self.fit(name, P)
        return None if f is None else f(entries)

    def merged(self, other: CollectiveCPU) -> CollectiveCPU:
        """This table with ``other``'s P added (``other`` wins where both have one)."""
        fits = {P: dict(v) for P, v in self.fits.items()}
        samples = {P: dict(v) for P, v in self.samples.items()}
        for P, v in other.fits.items():
            fits.setdefault(P, {}).update(v)
        for P, v in other.samples.items():
            samples.setdefault(P, {}).update(v)
        return CollectiveCPU(fits, samples)

    def to_dict(self) -> dict[str, Any]:
        """``{"<P>": {"<collective>": {"a": s, "b": s/entry, "samples": [[m, cpu_s, wall_s],
        …]}}}`` (JSON keys are strings)."""
        out: dict[str, Any] = {}
        for P, fits in sorted(self.fits.items()):
            out[str(P)] = {name: {"a": f.a, "b": f.b,
                                  "samples": self.samples.get(P, {}).get(name, [])}
                           for name, f in sorted(fits.items())}
        return out

    @classmethod
    def from_dict(cls, d: Any) -> CollectiveCPU:
        """Read :meth:`to_dict`'s form back; any bad value raises ``ValueError`` naming it."""
        if not isinstance(d, Mapping):
            raise ValueError(f"collective_cpu must be a mapping P -> collective -> fit, got "
                             f"{type(d).__name__}")
        fits: dict[int, dict[str, AffineFit]] = {}
        samples: dict[int, dict[str, list[list[float]]]] = {}
        for key, per in d.items():
            P = _positive_int(key, f"collective_cpu key {key!r} (P)")
            if not isinstance(per, Mapping):
                raise ValueError(f"collective_cpu[{key!r}] must be a mapping collective -> fit")
            for name, f in per.items():
                where = f"collective_cpu[{key!r}][{name!r}]"
                if not isinstance(f, Mapping) or "a" not in f or "b" not in f:
                    raise ValueError(f"{where} must have 'a' (s per call) and 'b' (s per entry)")
                a, b = _seconds(f["a"], f"{where}.a"), _seconds(f["b"], f"{where}.b")
                pts = f.get("samples", [])
                if not isinstance(pts, list) or any(
                        not isinstance(s, (list, tuple)) or len(s) < 2 for s in pts):
                    raise ValueError(f"{where}.samples must be a list of [entries, cpu_s, …]")
                fits.setdefault(P, {})[str(name)] = AffineFit(a, b)
                samples.setdefault(P, {})[str(name)] = [
                    [_seconds(x, f"{where}.samples") for x in s] for s in pts]
        return cls(fits, samples)

    def describe(self, P: int) -> str:
        """One line per P: each collective's fit and its measured points."""
        parts = []
        for name, f in sorted(self.fits.get(int(P), {}).items()):
            pts = self.samples.get(int(P), {}).get(name, [])
            meas = ", ".join(f"m={s[0]:.0f}: {s[1] * 1e3:.2f}"
                             + (f" (wall {s[2] * 1e3:.1f})" if len(s) > 2 else "")
                             for s in pts)
            parts.append(f"{name} {f.a * 1e3:.2f} ms + {f.b * 1e9:.1f} ns/entry [{meas} ms]")
        return "; ".join(parts) or "none"


def profile_collective_cpu(schemes: Sequence[str], flat: Any, density: float, *,
                           fractions: Sequence[float] = (0.25, 0.5, 1.0), repeats: int = 10,
                           group: Any = None) -> dict[str, list[list[float]]]:
    """Per call of each sparse scheme's collective: ``[entries, cpu_s, wall_s]`` for m =
    fraction·k entries per rank (k of ``density``), the medians over ``repeats`` calls (steps
    1 … repeats, after one call at step 0 that makes the collective's first evaluations —
    Ok-Topk's threshold and regions, DenseStream's regions — which the patterns price as
    amortised start-ups), each call after a barrier; the maximum over ranks. ``flat``: this
    rank's flat gradient (its top-m magnitudes are the selection, as a top-k sparsifier's).
    Every rank must call it; collectives named by no sparse scheme are skipped.

    The collective and its options are the scheme's (``Scheme.collective``, a ``density``
    option set to m/n as the engine sets it), called as the engine calls it: the ranks agree
    on the selection's description once (``check_shapes="changes"``), and a selection has a
    capacity where the scheme's sparsifier keeps at most k. Keyed by the pattern of the
    scheme's collective (:func:`~gradsync.apps.sim.patterns.collective_of`)."""
    import torch
    import torch.distributed as dist

    from gradsync import collectives
    from gradsync.schedule import entries
    from gradsync.schedule import schemes as table
    from gradsync.sparsegrad import SparseGrad

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    colls: dict[str, tuple[str, bool, bool]] = {}  # pattern → collective, density, capacity
    for s in schemes:
        sch = table.get(s)
        if sch.sparse:
            key = patterns.collective_of(s)
            takes = colls[key][1] if key in colls else False
            colls[key] = (sch.collective, takes or "density" in sch.collective_options,
                          patterns.fixed_capacity(s))
    n = int(flat.numel())
    k = entries(n, density)
    sizes = sorted({max(1, min(n, round(f * k))) for f in fractions})
    mags = flat.detach().abs().float()
    out: dict[str, list[list[float]]] = {}
    for name, (collective, takes_density, capped) in colls.items():
        rows = []
        for m in sizes:
            idx = torch.topk(mags, m, sorted=False).indices.sort().values
            sel = SparseGrad(idx, flat.detach()[idx].clone(), n, capacity=m if capped else None)
            coll = collectives.get(collective, check_shapes="changes",
                                   **({"density": m / n} if takes_density else {}))
            coll(sel, group, 0)
            cpu, wall = [], []
            for step in range(1, repeats + 1):
                dist.barrier(group)
                c0, w0 = time.process_time(), time.perf_counter()
                coll(sel, group, step)
                cpu.append(time.process_time() - c0)
                wall.append(time.perf_counter() - w0)
            rows.append([statistics.median(cpu), statistics.median(wall)])
        t = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        out[name] = [[float(m), float(c), float(w)] for m, (c, w) in zip(sizes, t.tolist())]
    return out
