"""Every repository path and ``clef_local`` module that the project names exists.

Scanned: every Markdown file (README.md, docs/, benchmarks/README.md, clef_local/**/*.md, …) and the Python and shell
files of clef_local/, benchmarks/, scripts/ and tests/ (plus .ci/run), line by line, so docstrings, comments, string
literals and argparse help all count. Named are tokens such as ``docs/format.md#3-the-backbone-pass`` (the file must
exist, and for a Markdown file the anchor must be one of its headings, GitHub-style), ``clef_local.runtime.schema``
or ``clef_local.runtime.schema.Limits`` (a module or package, then at most one attribute defined in it), and, in
Markdown, relative link targets (``[x](hardware.md#threads)``). Tokens with ``*``, ``{`` or ``<`` are patterns or
placeholders and are skipped, as are paths inside other paths (URLs, ``/tmp/docs/...``, ``COMMIT:benchmarks/...``)
and lines marked ``named-paths: ignore`` (test data naming modules that must not exist).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a path token: one of the top-level folders, not inside a longer path, word, URL or `COMMIT:path`
PATH = re.compile(r"(?<![\w./~$:@-])(?:clef_local|docs|benchmarks|scripts|tests|\.ci)/[^\s`'\"()\[\],;|\\]*")
MODULE = re.compile(r"(?<![\w./-])clef_local(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PLACEHOLDER = re.compile(r"[*{}<>]")
IGNORE = "named-paths: ignore"  # on a line that names a path or module that is not meant to exist (test data)
MODULE_ATTRIBUTES = {"__file__", "__path__", "__name__", "__doc__", "__spec__", "__package__"}
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "build", "dist", "node_modules", ".pytest_cache", ".ruff_cache",
             ".mypy_cache", ".gpu"}


def scanned_files(root: Path = ROOT) -> list[Path]:
    """The Markdown files anywhere in the checkout and the code of the four code folders."""
    def walk(folder: Path) -> Iterator[Path]:
        for path in sorted(folder.iterdir()):
            if path.is_dir():
                if path.name not in SKIP_DIRS and not path.name.endswith(".egg-info") \
                        and (not path.name.startswith(".") or path.name == ".ci"):
                    yield from walk(path)
            else:
                yield path

    code = ("clef_local", "benchmarks", "scripts", "tests")
    files = [path for path in walk(root) if path != Path(__file__).resolve()  # this file names faults on purpose
             and (path.suffix == ".md" or (path.relative_to(root).parts[0] in code and path.suffix in (".py", ".sh")))]
    return [*files, root / ".ci" / "run"] if (root / ".ci" / "run").is_file() else files


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: links to their text, lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(markdown: Path) -> frozenset[str]:
    found: set[str] = set()
    in_code = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (heading := re.match(r"#{1,6} (.+)", line)):
            base = slug(heading.group(1))
            anchor, n = base, 0
            while anchor in found:  # GitHub numbers repeated headings: name, name-1, name-2
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return frozenset(found)


def target_problem(path: Path, anchor: str) -> str | None:
    """Why ``path#anchor`` does not resolve, or None."""
    if not path.exists():
        return "no such file"
    if anchor and path.suffix == ".md" and anchor not in anchors(path):
        return f"no heading #{anchor}"
    return None


def module_names(source: Path) -> frozenset[str]:
    """The names a module defines at its top level (also under ``if``/``try``), with ``__all__``."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    names: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                    names.update(n.value for n in ast.walk(node.value) if isinstance(n, ast.Constant))
            elif isinstance(node, ast.If | ast.With | ast.Try):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(tree.body)
    return frozenset(names)


def module_problem(name: str, root: Path) -> str | None:
    """Why the dotted ``clef_local.x.y[.attr]`` does not resolve: a package or module path, then one attribute of it
    (deeper attributes, a class's methods, are not checked)."""
    parts = name.split(".")
    path = root / parts[0]
    i = 1
    while i < len(parts) and path.is_dir():
        if (path / parts[i]).is_dir():
            path = path / parts[i]
        elif (path / f"{parts[i]}.py").is_file():
            path = path / f"{parts[i]}.py"
        else:
            break
        i += 1
    if i == len(parts):
        return None
    source = path / "__init__.py" if path.is_dir() else path
    if not source.is_file():
        return f"no module {'.'.join(parts[:i + 1])}"
    if parts[i] not in module_names(source) | MODULE_ATTRIBUTES:
        return f"{'.'.join(parts[:i])} has no {parts[i]}"
    return None


def problems_in(file: Path, root: Path = ROOT) -> Iterator[str]:
    """``file:line: token (why)`` for every named path or module in ``file`` that does not resolve."""
    where = file.relative_to(root) if file.is_relative_to(root) else file
    markdown = file.suffix == ".md"
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if IGNORE in line:
            continue
        named: list[tuple[str, Path, str]] = []  # (token, resolved path, anchor)
        for match in PATH.finditer(line):
            token = match.group().rstrip(".:")
            if not PLACEHOLDER.search(token):
                path, _, anchor = token.partition("#")
                named.append((token, root / path, anchor))
        if markdown:
            for match in LINK.finditer(line):
                target = match.group(1)
                if re.match(r"[a-z][a-z+.-]*:", target) or PLACEHOLDER.search(target):
                    continue  # a URL (https:, mailto:) or a placeholder
                path, _, anchor = target.partition("#")
                named.append((target, (file.parent / path) if path else file, anchor))
        found = [f"{token} ({why})" for token, path, anchor in named if (why := target_problem(path, anchor))]
        found += [f"{m.group()} ({why})" for m in MODULE.finditer(line) if (why := module_problem(m.group(), root))]
        for problem in dict.fromkeys(found):  # a link's target is also a path token: report it once
            yield f"{where}:{number}: {problem}"


def problems(files: Iterable[Path], root: Path = ROOT) -> list[str]:
    return [problem for file in files for problem in problems_in(file, root)]


def test_every_named_path_exists():
    files = scanned_files()
    assert any(f.name == "README.md" for f in files) and any(f.suffix == ".py" for f in files)
    missing = problems(files)
    assert not missing, f"{len(missing)} named paths do not exist:\n" + "\n".join(missing)


def test_a_seeded_fault_is_reported(tmp_path: Path):
    seeded = tmp_path / "seeded.md"
    seeded.write_text("See `clef_local/no_such_module.py`, [the format](docs/nope.md) and\n"
                      "`clef_local.runtime.no_such_module`; `docs/format.md#no-such-heading` too.\n"
                      "These exist: `clef_local/cli.py`, clef_local.runtime.schema.Limits, docs/format.md, and these\n"
                      "are skipped: `clef_local/training/*.py`, `docs/{name}.md`, https://example.com/docs/x.md.\n")
    found = problems([seeded])
    assert found == [
        f"{seeded}:1: clef_local/no_such_module.py (no such file)",
        f"{seeded}:1: docs/nope.md (no such file)",
        f"{seeded}:2: docs/format.md#no-such-heading (no heading #no-such-heading)",
        f"{seeded}:2: clef_local.runtime.no_such_module (clef_local.runtime has no no_such_module)",
    ], found
