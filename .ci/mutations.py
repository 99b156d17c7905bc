"""One mutation per layer (a sign, an index, a comparison): each must fail the tests that
cover that layer (issue 69: the suite still catches bugs after it was cut to minutes).

``make mutations`` runs it from the repository root: each mutation is applied, its layer's test
files run (``pytest -x -n 2 -m "not slow"``), and the file is put back whatever happens. Exits
non-zero when a mutation survives. Results: docs/results/suite.md, "Mutations".
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_THETA = '            theta, reason = self._exact_threshold(mags, k, comm), "periodic"\n'
_POOL = ('            for k in [k for k in now if k not in names and {}name.startswith("torch.")]'
         ':')

# (layer, file, the text, its mutation, the layer's test files)
M = [
    ("sparsegrad", "src/gradsync/sparsegrad.py",
     "            add_at(acc, local, v.to(dtype))",
     "            add_at(acc, local, -v.to(dtype))",
     ["tests/test_sparsegrad.py"]),
    ("sparsify (segments)", "src/gradsync/sparsify/segments.py",
     "    take = ranges(starts, [min(k, n) for k, n in zip(keep, lengths)], keys.device)",
     "    take = ranges(starts, [min(k, n) - (k > 1) for k, n in zip(keep, lengths)], "
     "keys.device)",
     ["tests/test_segments.py"]),
    ("feedback", "src/gradsync/feedback.py",
     "                residual.index_fill_(0, idx, 0)",
     "                residual.index_fill_(0, idx[1:], 0)",
     ["tests/test_feedback.py"]),
    ("formats", "src/gradsync/formats/densestream.py",
     "    starts = torch.cat([idx[:1], torch.index_select(idx, 0, at + 1)])",
     "    starts = torch.cat([idx[:1], torch.index_select(idx, 0, at)])",
     ["tests/test_formats.py"]),
    ("collectives (topka)", "src/gradsync/collectives/topka.py",
     "                dense[:m].add_(val[:m])",
     "                dense[:m].sub_(val[:m])",
     ["tests/test_collectives.py"]),
    ("collectives (oktopk)", "src/gradsync/collectives/oktopk.py",
     _THETA + "        mask = mags >= theta\n",
     _THETA + "        mask = mags > theta\n",
     ["tests/test_oktopk.py"]),
    ("schedule", "src/gradsync/schedule/plan.py",
     "            if t.density is not None and below_min_k(t.numel, t.density, min_k):",
     "            if t.density is not None and not below_min_k(t.numel, t.density, min_k):",
     ["tests/test_schedule.py", "tests/test_min_k.py"]),
    ("engine", "src/gradsync/engine/apply.py",
     "        avg = torch.div(result.dense, P, out=launched.storage)",
     "        avg = torch.div(result.dense, max(1, P - 1), out=launched.storage)",
     ["tests/test_engine.py"]),
    ("integrations (DDP hook)", "src/gradsync/integrations/ddp.py",
     "        return buf.div_(P)\n\n",
     "        return buf.div_(max(1, P - 1))\n\n",
     ["tests/test_ddp.py"]),
    ("testing (pool)", "src/gradsync/testing/pool.py",
     _POOL.format("not "),
     _POOL.format(""),
     ["tests/test_testing.py"]),
]


def main() -> int:
    only = sys.argv[1:]
    rows = []
    for layer, f, old, new, tests in M:
        if only and not any(o in layer for o in only):
            continue
        p = ROOT / f
        src = p.read_text()
        assert src.count(old) == 1, (layer, "mutation site not unique/found")
        p.write_text(src.replace(old, new))
        try:
            t0 = time.time()
            r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "2",
                                "-p", "no:cacheprovider", "-m", "not slow", *tests],
                               capture_output=True, text=True, timeout=1800, cwd=ROOT)
            last = [l for l in r.stdout.splitlines() if l.strip()][-1]
            rows.append((layer, f, r.returncode != 0, last, round(time.time() - t0)))
            print(f"{layer}: {'KILLED' if r.returncode else 'SURVIVED'} ({last})", flush=True)
        finally:
            p.write_text(src)
    return 0 if all(k for _, _, k, _, _ in rows) else 1

if __name__ == "__main__":
    sys.exit(main())
