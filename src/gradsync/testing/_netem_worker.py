"""One rank of :func:`gradsync.testing.netem.run_shaped`, started inside its network namespace.

``python -m gradsync.testing._netem_worker <spec.pkl>``: the spec holds a header (the parent's
``sys.path``, rank, world size, rendezvous, timeout, result path) followed by the pickled
``(fn, args, kwargs)``, which is unpickled only after ``sys.path`` is restored so that ``fn``
resolves by reference. The outcome — ``(True, return value)`` or ``(False, traceback)`` — is
written with ``torch.save`` to a temporary file and renamed into place, so the parent never
reads half a result.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import traceback
from datetime import timedelta


def _write(path: str, outcome: tuple) -> None:
    import torch

    tmp = f"{path}.tmp"
    torch.save(outcome, tmp)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m gradsync.testing._netem_worker <spec.pkl>", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        head = pickle.load(f)
        sys.path[:0] = [p for p in head["sys_path"] if p not in sys.path]
        result = head["result"]
        try:
            from gradsync.testing.distributed import join_group, watch_launcher

            watch_launcher(head["launcher"])  # a SIGKILLed launcher leaves no orphan behind
            import torch
            import torch.distributed as dist

            fn, args, kwargs = pickle.load(f)
            torch.set_num_threads(head["threads"])
            join_group("gloo", head["init_method"], head["rank"], head["world_size"],
                       timedelta(seconds=head["timeout"]))
            out = fn(head["rank"], head["world_size"], *args, **kwargs)
            outcome: tuple = (True, out)
        except BaseException:  # everything, SystemExit included, must reach the parent
            outcome = (False, traceback.format_exc())
    try:
        _write(result, outcome)
    except BaseException:  # e.g. an unpicklable return value
        _write(result, (False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
