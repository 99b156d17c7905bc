"""The environment ``make install`` builds (issue 12, "Set-up").

The real training clients import cleanly with nothing of gradsync imported first; gradsync
never imports torchvision (its ResNet/VGG/ViT are its own definitions); the extras and the
Makefile install what the integration tests use and no torchvision.
"""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import gradsync

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(gradsync.__file__).resolve().parent


def _python(code: str, tmp_path: Path, timeout: int = 300) -> str:
    """Run ``code`` in a fresh interpreter of this environment; its stdout (fails on error)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_clients_import_without_gradsync_first(tmp_path):
    # Before issue 12 this crashed: the PyPI torchvision that `make install` put there is
    # CUDA-linked, and torchmetrics (so Lightning) imports it: "operator torchvision::nms does
    # not exist". transformers' model classes import torchvision too when it is installed.
    out = _python("""
        import importlib.util, sys
        import pytorch_lightning, torchmetrics, accelerate, transformers
        from transformers import BertForMaskedLM, GPT2LMHeadModel, ViTForImageClassification
        import lightning_fabric
        if importlib.util.find_spec("torchvision") is not None:  # any torchvision must work
            import torchvision.models
        assert not any(m.split(".")[0] == "gradsync" for m in sys.modules), "gradsync imported"
        print(pytorch_lightning.__version__, accelerate.__version__)
    """, tmp_path)
    assert out.split() == ["2.6.6", "1.15.0"]


def test_gradsync_never_imports_torchvision(tmp_path):
    # A finder ahead of all others records (and refuses) every attempt to import torchvision,
    # so an attempt inside a try/except ImportError is seen too.
    out = _python("""
        import sys
        tried = []

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "torchvision":
                    tried.append(name)
                    raise ImportError(name + " refused")
                return None

        sys.meta_path.insert(0, Refuse())
        import gradsync
        from gradsync.apps import models, report
        tensors = {}
        for name in ("resnet18", "resnet50", "resnet152", "vgg16", "vgg19", "vit", "vit_large"):
            tensors[name] = report.census_of(models.reference(name, device="meta"))["tensors"]
            if name != "resnet18":
                models.build(name, device="meta")
        import torch
        net = models.build("resnet50")
        assert net(torch.randn(2, 1, 28, 28)).shape == (2, 10)
        assert not tried, tried
        assert not any(m.split(".")[0] == "torchvision" for m in sys.modules)
        print(tensors["resnet152"], tensors["vit_large"])
    """, tmp_path)
    assert out.split() == ["467", "296"]


def test_census_runs_without_torchvision(tmp_path):
    out = _python(f"""
        import runpy, sys
        sys.argv = ["gradsync", "report", "census", "--quick", "--out", {str(tmp_path)!r}]
        try:
            runpy.run_module("gradsync", run_name="__main__")
        except SystemExit as e:
            assert not e.code, e.code
        assert not any(m.split(".")[0] == "torchvision" for m in sys.modules)
        print("census-done")
    """, tmp_path)
    assert "ResNet-152" in out and "GPT2-large" in out and out.split()[-1] == "census-done"
    assert (tmp_path / "report_census.json").exists()


def _imports_torchvision(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        if any(n.split(".")[0] == "torchvision" for n in names):
            lines.append(node.lineno)
    return lines


def test_no_module_imports_torchvision():
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        lines = _imports_torchvision(ast.parse(path.read_text(), str(path)))
        if lines:
            offenders[str(path.relative_to(SRC))] = lines
    assert offenders == {}
    # The check itself finds each form of import.
    probe = ast.parse("import torchvision\nfrom torchvision.models import vgg16\n"
                      "importlib.import_module('torchvision.models')\nimport torchaudio\n")
    assert _imports_torchvision(probe) == [1, 2, 3]


def test_extras_and_makefile_install_the_clients_and_no_torchvision():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    # the clients come with the integrations extra, which dev pulls in; their releases are
    # pinned in constraints.txt, which every pip install of the set-up passes
    assert {r.split(">")[0] for r in extras["integrations"]} >= {"pytorch-lightning",
                                                                 "accelerate", "transformers"}
    assert any("integrations" in r for r in extras["dev"] if r.startswith("gradsync["))
    pins = (ROOT / "constraints.txt").read_text().split()
    assert "pytorch-lightning==2.6.6" in pins and "accelerate==1.15.0" in pins
    every = [r for reqs in extras.values() for r in reqs] + project["dependencies"]
    assert not [r for r in every if r.lower().startswith("torchvision")]
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("$(STAMP): pyproject.toml"):makefile.index("@touch $(STAMP)")]
    installs = [line for line in recipe.splitlines() if "pip install" in line]
    assert installs and not [line for line in installs if "torchvision" in line]
    assert all("-c constraints.txt" in line for line in installs if "install -q --upgrade pip"
               not in line)
    assert "uninstall -q -y torchvision" in recipe  # an older set-up's wheel is removed
    # What this environment has installed is what the extras say.
    assert importlib.metadata.version("pytorch-lightning") == "2.6.6"
    assert importlib.metadata.version("accelerate") == "1.15.0"
