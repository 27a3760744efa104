"""The layout rules import-linter cannot see (its contracts are in pyproject.toml, run by ``lint-imports``).

- Only the CUDA backend touches ``torch.cuda``: import-linter knows external packages by their root name
  (``torch``) and sees no attribute use, so ``torch.cuda.is_available()`` after ``import torch`` is invisible to it.
- The library never imports the CLI as ``fuyou.cli`` (the installed name of the top-level ``cli`` package, which
  import-linter cannot map back to ``cli``).
- The front-end contract's list of library packages names every package and module of ``fuyou`` but the front
  ends, so a new package cannot slip past it.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The modules allowed to use torch.cuda, as paths relative to the repository root.
CUDA_ALLOWED = {"fuyou/device/cuda.py"}
FRONT_ENDS = {"run", "integrations", "__main__"}
"""Front ends inside the package: ``python -m fuyou`` (``fuyou/__main__.py``) is the CLI itself."""


def _sources() -> list[Path]:
    return sorted([*(ROOT / "fuyou").rglob("*.py"), *(ROOT / "cli").rglob("*.py")])


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _torch_cuda_uses(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) for each ``import torch.cuda``, ``from torch import cuda``, ``from torch.cuda import …`` and
    attribute use ``torch.cuda`` (``torch`` under any name it was imported as)."""
    aliases = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" and a.asname:
                    aliases.add(a.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.cuda" or a.name.startswith("torch.cuda."):
                    yield node.lineno, f"import {a.name}"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "torch.cuda" or node.module.startswith("torch.cuda."):
                yield node.lineno, f"from {node.module} import ..."
            elif node.module == "torch" and any(a.name == "cuda" for a in node.names):
                yield node.lineno, "from torch import cuda"
        elif isinstance(node, ast.Attribute) and node.attr == "cuda":
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                yield node.lineno, f"{node.value.id}.cuda"


def test_only_the_cuda_backend_touches_torch_cuda() -> None:
    found = []
    for path in _sources():
        if _rel(path) in CUDA_ALLOWED:
            continue
        tree = ast.parse(path.read_text(), str(path))
        found += [f"{_rel(path)}:{line}: {what}" for line, what in _torch_cuda_uses(tree)]
    assert not found, "torch.cuda outside the CUDA backend (go through fuyou.device):\n" + "\n".join(found)


def test_checker_sees_each_spelling() -> None:
    code = (
        "import torch\nimport torch as th\nimport torch.cuda\nfrom torch import cuda\nfrom torch.cuda import Stream\n"
        "def f():\n    return torch.cuda.is_available(), th.cuda.device_count()\n"
        "x = torch.zeros(1).cuda()\n"  # a tensor's .cuda() is not the torch.cuda module
    )
    assert [line for line, _ in _torch_cuda_uses(ast.parse(code))] == [3, 4, 5, 7, 7]


def test_library_does_not_import_fuyou_cli() -> None:
    found = []
    for path in sorted((ROOT / "fuyou").rglob("*.py")):
        if Path(path.relative_to(ROOT / "fuyou").parts[0]).stem in FRONT_ENDS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + ([f"fuyou.{a.name}" for a in node.names] if node.module == "fuyou" else [])
            for name in names:
                if name == "fuyou.cli" or name.startswith("fuyou.cli."):
                    found.append(f"{_rel(path)}:{node.lineno}: {name}")
    assert not found, "the library imports the CLI:\n" + "\n".join(found)


def test_front_end_contract_lists_every_library_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if "fuyou.run" in c.get("forbidden_modules", ())]
    children = {p.stem for p in (ROOT / "fuyou").glob("*.py") if p.name != "__init__.py"}
    children |= {p.name for p in (ROOT / "fuyou").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    expected = {f"fuyou.{name}" for name in children - FRONT_ENDS}
    assert set(contract["source_modules"]) == expected, "list every library package in the contract's source_modules"
