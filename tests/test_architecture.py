"""The package's shape: no module uses another module's private names, and the import
contracts of pyproject.toml (layers, no cycles; docs/architecture.md) hold with no exceptions.

A private name is one with a leading underscore (dunders excepted). It may be used by its own
module and by the modules of the package whose ``__init__`` defines it; every other gradsync
module must go through public names. Checked on the source (AST), function-local imports
included: ``from gradsync.x import _name`` and ``module._name`` where ``module`` is a gradsync
module bound by an import. A private *module* with public names (``from gradsync._registry
import Registry``) is fine.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def private_uses(src: Path, root: str = "gradsync") -> list[str]:
    """``path:line: what`` for every use of another module's private name under ``src/root``."""
    modules = {_module_name(p, src): p for p in sorted((src / root).rglob("*.py"))}
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own = {name, package}  # the module itself and its package's __init__
        bound: dict[str, str] = {}  # local name -> gradsync module it is bound to

        def resolve(node: ast.ImportFrom, package: str = package) -> str:
            if node.level == 0:
                return node.module or ""
            base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
            return ".".join(base + ([node.module] if node.module else []))

        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = resolve(node)
                if target != root and not target.startswith(root + "."):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:  # a submodule, not a name defined in target
                        bound[alias.asname or alias.name] = sub
                    elif _private(alias.name) and target not in own:
                        found.append(f"{path.relative_to(src)}:{node.lineno}: "
                                     f"from {target} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == root or alias.name.startswith(root + "."):
                        if alias.asname:
                            bound[alias.asname] = alias.name
                        else:
                            bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not (isinstance(value, ast.Name) and value.id in bound):
                continue
            target = ".".join([bound[value.id], *reversed(chain)])
            if target in modules and target not in own and f"{target}.{node.attr}" not in modules:
                found.append(f"{path.relative_to(src)}:{node.lineno}: {target}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    uses = private_uses(SRC)
    assert not uses, "private names used across modules:\n" + "\n".join(uses)


def test_the_private_name_check_finds_what_it_should(tmp_path):
    pkg = tmp_path / "gradsync"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "_LAZY = 1\n",
        "_registry.py": "class Registry: ...\n",
        "a.py": "_helper = 1\nvalue = 2\n",
        "sub/__init__.py": "_shared = 1\n",
        "sub/b.py": (
            "from gradsync._registry import Registry\n"  # private module, public name: fine
            "from gradsync.sub import _shared\n"  # its own package's __init__: fine
            "from . import _shared as s\n"  # the same, relative: fine
            "from gradsync.a import value\n"  # public: fine
            "import gradsync.a as amod\n"
            "from gradsync import a\n"
            "def f():\n"
            "    from gradsync.a import _helper\n"  # function-local, private: found
            "    return amod._helper + a._helper + a.__name__\n"  # two attribute uses: found
            "from ..a import _helper as h\n"  # relative, private: found
            "from gradsync import _LAZY\n"  # the root package is not b's package: found
        ),
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    uses = private_uses(tmp_path)
    assert sorted(u.split(": ", 1)[1] for u in uses) == sorted([
        "from gradsync.a import _helper", "gradsync.a._helper", "gradsync.a._helper",
        "from gradsync.a import _helper", "from gradsync import _LAZY"])
    assert {u.split(":")[1] for u in uses} == {"8", "9", "10", "11"}


def test_import_contracts_hold_without_exceptions():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = config["contracts"]
    assert {c["type"] for c in contracts} >= {"layers", "acyclic_siblings"}
    assert all(not c.get("ignore_imports") for c in contracts), "contracts with exceptions"
    exe = Path(sys.executable).with_name("lint-imports")
    assert exe.exists(), f"import-linter (the dev extra) is not installed next to {sys.executable}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    r = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in r.stdout


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_library_function_is_longer_than_80_lines():
    """Issue 67: long functions split where their paper's steps split (apps/ aside)."""
    long = [f"{p.relative_to(SRC)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
            for p in sorted((SRC / "gradsync").rglob("*.py")) if "apps" not in p.parts
            for f in _functions(p) if f.end_lineno - f.lineno + 1 > 80]
    assert not long, "\n".join(long)


# What a step's pipeline does: the collectives, error feedback's accumulate/commit/discard and
# the finiteness checks. The DDP hook decides densities and jobs; engine.pipeline does these.
PIPELINE_CALLS = {"all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                  "accumulate", "accumulate_buffer", "commit", "discard_buffer", "all_finite",
                  "finite_flag", "settle_missing", "agreement_word", "select"}


def test_the_ddp_hook_runs_the_engine_pipeline_and_no_step_of_its_own():
    path = SRC / "gradsync" / "integrations" / "ddp.py"
    assert len(path.read_text().splitlines()) <= 350
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
              for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}
    assert not called & PIPELINE_CALLS, sorted(called & PIPELINE_CALLS)
    assert {"BufferPipeline", "sparse", "whole"} <= called
    # and the check sees such a call where there is one: the pipeline makes them all
    pipeline = SRC / "gradsync" / "engine" / "pipeline.py"
    made = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(ast.parse(pipeline.read_text())) if isinstance(n, ast.Call)}
    assert {"all_reduce", "accumulate", "commit", "discard_buffer", "settle_missing"} <= made
