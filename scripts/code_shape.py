"""The shape of a Python package, read from its source (nothing is imported): each module's
lines, each function longer than a limit, and the import cycles between its modules.

    python scripts/code_shape.py                      # src/grpo_cli, functions over 60 lines
    python scripts/code_shape.py --package PATH --max-function-lines 40

Two kinds of import count, reported apart:
- module level (`import x` / `from x import y` outside any function): a cycle here is one the
  interpreter must resolve at import time, and one that a reader must hold in their head;
- all imports, those inside functions too (the lazy ones): a cycle here works at run time, but
  the two modules still depend on each other.

`from package import name` counts as an import of `package.name` when that is a module, else of
`package` (its __init__). Exits 0; the output is for reading and for before/after notes.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PACKAGE = Path(__file__).resolve().parents[1] / "src" / "grpo_cli"


@dataclass
class Module:
    name: str  # dotted, e.g. grpo_cli.sampling.fast
    path: Path
    lines: int
    long_functions: list[tuple[str, int]] = field(default_factory=list)  # (qualified name, lines)
    top_level_imports: set[str] = field(default_factory=set)  # modules of the package
    all_imports: set[str] = field(default_factory=set)


def module_name(path: Path, package_dir: Path) -> str:
    """src/grpo_cli/sampling/fast.py -> grpo_cli.sampling.fast; .../__init__.py -> its package."""
    parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(node: ast.ImportFrom, current: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against `current`)."""
    if not node.level:
        return node.module or ""
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(node: ast.AST, current: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that one Import / ImportFrom statement reaches."""
    found = set()
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        source = resolve(node, current, is_package)
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source for alias in node.names]
    else:
        return found
    for name in names:
        while name and name not in known:  # `import a.b.c` where only a.b is a module of ours
            name = name.rpartition(".")[0]
        if name and name != current:
            found.add(name)
    return found


def read_module(path: Path, package_dir: Path, known: set[str], max_function_lines: int) -> Module:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    name = module_name(path, package_dir)
    module = Module(name, path, len(text.splitlines()))
    is_package = path.name == "__init__.py"

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                reached = imported_modules(child, name, is_package, known)
                module.all_imports |= reached
                if not in_function:
                    module.top_level_imports |= reached
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = child.end_lineno - child.lineno + 1
                if length > max_function_lines:
                    module.long_functions.append((".".join([*scope, child.name]), length))
                visit(child, [*scope, child.name], True)
            elif isinstance(child, ast.ClassDef):
                visit(child, [*scope, child.name], in_function)
            else:
                visit(child, scope, in_function)

    visit(tree, [], False)
    return module


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm), each
    sorted; a module that imports itself does not count."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = lowest[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                lowest[node] = min(lowest[node], lowest[target])
            elif target in on_stack:
                lowest[node] = min(lowest[node], index[target])
        if lowest[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def read_package(package_dir: Path, max_function_lines: int) -> list[Module]:
    paths = sorted(package_dir.rglob("*.py"))
    known = {module_name(path, package_dir) for path in paths}
    return [read_module(path, package_dir, known, max_function_lines) for path in paths]


def report(modules: list[Module], max_function_lines: int) -> str:
    lines = [f"{'lines':>6}  module"]
    lines += [f"{module.lines:>6}  {module.name}" for module in sorted(modules, key=lambda m: -m.lines)]
    lines.append(f"{sum(module.lines for module in modules):>6}  in {len(modules)} modules")
    long_functions = sorted(
        ((length, f"{module.name}.{function}") for module in modules for function, length in module.long_functions),
        reverse=True,
    )
    lines.append(f"\nfunctions over {max_function_lines} lines: {len(long_functions)}")
    lines += [f"{length:>6}  {function}" for length, function in long_functions]
    for kind, attribute in (
        ("module-level imports", "top_level_imports"),
        ("all imports, lazy ones too", "all_imports"),
    ):
        found = cycles({module.name: getattr(module, attribute) for module in modules})
        lines.append(f"\nimport cycles ({kind}): {len(found)}")
        lines += ["  " + " <-> ".join(component) for component in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", type=Path, default=DEFAULT_PACKAGE, help="the package's folder")
    parser.add_argument("--max-function-lines", type=int, default=60)
    args = parser.parse_args(argv)
    print(report(read_package(args.package, args.max_function_lines), args.max_function_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
