"""The command line dispatcher."""

from __future__ import annotations

import subprocess
import sys

from gradsync.apps import cli


def test_help_and_bench_list(capsys):
    assert cli.main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out
    assert cli.main(["bench", "list"]) == 0
    out = capsys.readouterr().out
    for name in cli.bench_names():
        assert name in out
    # every benchmark module, and nothing that is not one (the shared output lives in apps/)
    assert cli.bench_names() == ["anatomy", "check", "collectives", "convergence", "formats",
                                 "fsdp", "overhead", "rounds", "schemes", "sketch", "soak",
                                 "sparsify", "syncs"]


def test_unknown_bench_is_an_error(capsys):
    assert cli.main(["bench", "no-such-bench"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "gradsync", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "gradsync" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "gradsync", "nope"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2
