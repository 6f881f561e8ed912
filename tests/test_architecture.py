"""The house rules CI keeps beside lint-imports (ARCHITECTURE.md): one class per public name, every
folder of the package a package, function-local imports of resihp only to defer start-up work, and
docs that match the code's floors and link to what exists."""

import ast
import re
from collections import defaultdict
from pathlib import Path

import resihp

ROOT = Path(resihp.__file__).parent
REPO = ROOT.parent
DOCS = [REPO / "ARCHITECTURE.md", REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


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
            context = " ".join(lines[max(0, node.lineno - 4) : node.lineno]).lower()
            if "deferred" not in context and "lazy" not in context:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []


def _pyproject_layers() -> list[str]:
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^layers = \[(.*?)^\]", text, re.S | re.M).group(1)
    return [" ".join(name.split()) for name in re.findall(r'"([^"]+)"', block)]


def _documented_floors() -> list[str]:
    """The first column of ARCHITECTURE.md's floor diagram (the code block under its heading)."""
    text = (REPO / "ARCHITECTURE.md").read_text()
    section = text.split("## Package floors", 1)[1]
    block = section.split("```", 2)[1]
    # a floor's line starts one space in; its description follows two or more spaces later, and
    # a description's further lines start deeper
    return [
        " ".join(re.split(r"\s{2,}", line.strip())[0].split())
        for line in block.splitlines()
        if re.match(r" \S", line)
    ]


def test_the_documented_floors_are_import_linters():
    assert _documented_floors() == _pyproject_layers()


def test_architecture_stays_short_and_its_lines_and_the_readmes_within_100():
    assert len((REPO / "ARCHITECTURE.md").read_text()) <= 15_000
    long = [
        f"{doc.name}:{n}"
        for doc in DOCS[:2]
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if len(line) > 100
    ]
    assert long == []


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_local_link_in_the_docs_reaches_a_file_and_heading():
    bad = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.name}: {target}")
            elif anchor and dest.is_file():
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    bad.append(f"{doc.name}: {target}")
    assert bad == []


def test_the_readme_keeps_the_set_up_commands_ci_and_users_run():
    readme = (REPO / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install -e . && resihp demo" in readme
    assert "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q" in readme


# packages whose docstrings keep the two rules below ("": the modules at the top of resihp); it
# grows as packages are brought to them
DOCSTRING_PACKAGES = (
    "",
    "ckpt",
    "control",
    "detect",
    "ft",
    "launch",
    "model",
    "perf",
    "plan",
    "replay",
    "train",
    "workload",
)


def _public_defs(tree: ast.Module):
    """Public classes and functions, methods included, with their dotted names (none nested in a
    function, none inside a private class)."""
    todo = [(tree, "")]
    while todo:
        node, prefix = todo.pop()
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if child.name.startswith("_"):
                continue
            yield f"{prefix}{child.name}", child
            if isinstance(child, ast.ClassDef):
                todo.append((child, f"{prefix}{child.name}."))


def _parameters(fn: ast.FunctionDef) -> list[str]:
    """A function's parameters, ``self``/``cls`` left out."""
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    names += [p.arg for p in a.kwonlyargs]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return names


def _args_section(doc: str) -> set[str]:
    """The parameter names an ``Args:`` section lists (``name:`` lines, ``*``/``**`` allowed)."""
    section = re.search(r"^Args:\n((?:[ \t]+\S.*\n?|[ \t]*\n)*)", doc, re.M)
    if section is None:
        return set()
    return set(re.findall(r"^[ \t]+\**(\w+)(?: \([^)]*\))?:", section.group(1), re.M))


def _opens_with_one_short_sentence(doc: str) -> bool:
    """The first paragraph (ended by a blank line, or click's ``\\f`` in a CLI verb) is one
    sentence of at most 100 characters."""
    first = " ".join(re.split(r"\n\s*\n|\f", doc.strip(), maxsplit=1)[0].split())
    return 0 < len(first) <= 100 and not re.search(r"(?<!e\.g)(?<!i\.e)[.!?] +[A-Z`(]", first)


def _docstring_packages():
    for path, tree in _modules():
        parts = path.relative_to(ROOT).parts
        if (parts[0] if len(parts) > 1 else "") in DOCSTRING_PACKAGES:
            yield path, tree


def test_public_functions_of_more_than_two_parameters_list_them_under_args():
    bad = []
    for path, tree in _docstring_packages():
        for name, node in _public_defs(tree):
            if isinstance(node, ast.ClassDef) or len(_parameters(node)) <= 2:
                continue
            missing = set(_parameters(node)) - _args_section(ast.get_docstring(node) or "")
            if missing:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}: {sorted(missing)}")
    assert bad == []


def test_public_docstrings_open_with_one_short_sentence():
    bad = []
    for path, tree in _docstring_packages():
        public_module = not path.name.startswith("_") or path.name == "__init__.py"
        docs = [("<module>", tree)] if public_module else []
        for name, node in [*docs, *_public_defs(tree)]:
            doc = ast.get_docstring(node)
            if doc and not _opens_with_one_short_sentence(doc):
                bad.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)} {name}")
    assert bad == []
