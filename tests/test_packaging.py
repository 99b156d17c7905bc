"""gradsync as users install it: the wheel's requirements, the public modules, the extras.

A user installs gradsync into a training environment that already has its own (CUDA) torch,
so the wheel asks for ``torch>=2.11`` with no upper bound and keeps plots (matplotlib), the
model zoo (transformers) and the training clients as extras; this repository's exact test
releases live in ``constraints.txt``. Every public name the README shows is a real module
(``from gradsync.lightning import GradSyncStrategy``), and ``import gradsync`` imports none of
the heavy optional packages.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("matplotlib", "transformers", "pytorch_lightning", "lightning", "accelerate")

# Every public module the README names, with one name imported from it.
PUBLIC = {"gradsync.ddp": "register", "gradsync.fsdp": "compress",
          "gradsync.checkpoint": "save", "gradsync.lightning": "GradSyncStrategy",
          "gradsync.accelerate": "register", "gradsync.transformers": "GradSyncCallback"}


def _python(code: str, cwd: Path, exe: str = sys.executable, env: dict | None = None) -> str:
    proc = subprocess.run([exe, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def fresh_imports(tmp_path_factory) -> dict[str, str]:
    """Each public module imported first thing in its own process: a process that has imported
    torch alone (what every gradsync import starts with) forks one child per module, so torch
    is imported once, not six times. Per module, what the child printed or its error."""
    out = _python(f"""
        import os, sys, traceback
        import torch
        for module, name in {sorted(PUBLIC.items())!r}:
            r, w = os.pipe()
            if os.fork() == 0:
                os.close(r)
                try:
                    m = __import__(module, fromlist=[name])
                    import gradsync
                    assert getattr(gradsync, module.split(".")[1]) is m  # attribute == module
                    msg = getattr(m, name).__module__
                except BaseException:
                    msg = "error " + traceback.format_exc()
                os.write(w, msg.encode())
                os._exit(0)
            os.close(w)
            with os.fdopen(r) as f:
                got = f.read()
            os.wait()
            print(module, got.replace("\\n", " | ").replace(chr(10), " | "))
    """, tmp_path_factory.mktemp("fresh"))
    return dict(line.split(" ", 1) for line in out.splitlines())


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_each_public_module_imports_in_a_fresh_process(module, fresh_imports):
    assert fresh_imports[module].startswith("gradsync."), fresh_imports[module]


def test_import_gradsync_and_help_need_no_optional_package(tmp_path):
    # A finder ahead of all others refuses the optional packages, as if they were not
    # installed: the package, its config and engine, and `python -m gradsync --help` work.
    out = _python(f"""
        import runpy, sys
        refused = {OPTIONAL!r}

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in refused:
                    raise ModuleNotFoundError(name + " refused", name=name)
                return None

        sys.meta_path.insert(0, Refuse())
        import torch, gradsync
        import gradsync.ddp, gradsync.fsdp, gradsync.checkpoint, gradsync.accelerate
        sync = gradsync.GradSync(torch.nn.Linear(4, 2), gradsync.Config(scheme="topka"))
        sys.argv = ["gradsync", "--help"]
        try:
            runpy.run_module("gradsync", run_name="__main__")
        except SystemExit as e:
            assert not e.code, e.code
        try:
            import gradsync.lightning
        except ModuleNotFoundError as e:
            print("LIGHTNING:", e)
        from gradsync.apps.common import pyplot
        assert pyplot() is None
        print("ok")
    """, tmp_path)
    assert out.split()[-1] == "ok"
    assert "pip install pytorch-lightning" in out
    assert "pip install 'gradsync[apps]'" in out


def test_import_gradsync_imports_no_optional_package(tmp_path):
    out = _python(f"""
        import sys, gradsync
        from gradsync import Config, GradSync, sparsify, collectives
        print(sorted({{m.split(".")[0] for m in sys.modules}} & set({OPTIONAL!r})))
    """, tmp_path)
    assert out.strip() == "[]"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    src = tmp_path_factory.mktemp("src") / "gradsync"
    # build from a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "bench-out", "*.egg-info", "__pycache__", "build", "dist", "docs"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (whl,) = out.glob("gradsync-*.whl")
    return whl


def _metadata(whl: Path) -> email.message.Message:
    with zipfile.ZipFile(whl) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


def test_wheel_requires_a_torch_range_and_keeps_plots_optional(wheel):
    meta = _metadata(wheel)
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    base = {r.name: r for r in reqs if r.marker is None}
    assert set(base) == {"torch", "numpy", "rich"}
    torch_spec = base["torch"].specifier
    # any torch from 2.11 on, the GPU machines' 2.11 and future releases alike, and no pin
    assert torch_spec.contains("2.11.0") and torch_spec.contains("2.15.0")
    assert torch_spec.contains("3.0.0") and not torch_spec.contains("2.10.0")
    assert not [s for s in torch_spec if s.operator in ("==", "<", "<=", "~=", "===")]
    extras: dict[str, set[str]] = {}
    for r in reqs:
        if r.marker is not None:
            extras.setdefault(r.name, set()).add(str(r.marker))
    assert extras["matplotlib"] == {'extra == "apps"'}
    assert 'extra == "models"' in extras["transformers"]
    assert set(meta.get_all("Provides-Extra")) >= {"apps", "models", "integrations", "dev"}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for module in PUBLIC:
        assert module.replace(".", "/") + ".py" in names
    assert "gradsync/apps/cluster_profile.json" in names


@pytest.mark.slow
def test_installing_the_wheel_keeps_another_torch(wheel, tmp_path):
    """Into a fresh venv holding another torch (2.14.1 here, a CUDA build that runs on the
    CPU), ``pip install <wheel>`` installs gradsync's own requirements but keeps that torch;
    gradsync then imports and trains a step there. Several GB: slow."""
    import torch

    spec = "torch==2.14.1"
    assert not torch.__version__.startswith(spec.split("==")[1])
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, spec], check=True, timeout=3000)
    subprocess.run([*pip, str(wheel)], check=True, timeout=600)
    out = _python("""
        import torch, gradsync
        from gradsync.ddp import register
        from gradsync.checkpoint import save
        m = torch.nn.Linear(8, 2)
        # one process: compress_single_rank, else the step would not run the engine at all
        sync = gradsync.GradSync(m, gradsync.Config(scheme="topka", density=0.5,
                                                    compress_single_rank=True))
        m(torch.randn(4, 8)).sum().backward()
        sync.synchronize()
        print(torch.__version__)
    """, tmp_path, exe=py, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.strip().startswith("2.14.1")
