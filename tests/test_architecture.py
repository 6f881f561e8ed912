"""The house rules CI keeps beside lint-imports (ARCHITECTURE.md): one class per public name, every
folder of the package a package, and function-local imports of resihp only to defer start-up work."""

import ast
from collections import defaultdict
from pathlib import Path

import resihp

ROOT = Path(resihp.__file__).parent


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        if "data" not in path.relative_to(ROOT).parts:
            yield path, ast.parse(path.read_text())


def _verbs(path: Path) -> bool:
    """The CLI and the modules that register its verbs."""
    return path.name == "cli.py" or path.name.endswith("commands.py")


def test_no_two_public_classes_share_a_name():
    where = defaultdict(list)
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(str(path.relative_to(ROOT)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}


def test_every_folder_of_the_package_is_a_package():
    folders = {p.parent for p in ROOT.rglob("*.py") if "data" not in p.relative_to(ROOT).parts}
    assert [str(f) for f in sorted(folders) if not (f / "__init__.py").exists()] == []


def test_function_local_imports_of_resihp_are_commented_start_up_deferrals():
    """Verbs (``cli.py``, ``*commands.py``) defer their work's imports (start-up of ``resihp``);
    anywhere else a function-local import of resihp says why on the lines just above it."""
    bad = []
    for path, tree in _modules():
        lines = path.read_text().splitlines()
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or id(node) in top:
                continue
            if not (node.module or "").startswith("resihp") or _verbs(path):
                continue
            context = " ".join(lines[max(0, node.lineno - 4): node.lineno]).lower()
            if "deferred" not in context and "lazy" not in context:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []
