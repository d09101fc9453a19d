"""scripts/code_shape.py: module lines, functions over the limit, and import cycles, module-level
ones apart from those that only lazy imports close; on a made-up package whose answers are known
by construction."""

from __future__ import annotations

from helpers import load_script


def write(folder, name: str, text: str) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_lines_long_functions_and_both_kinds_of_cycle(tmp_path):
    shape = load_script("code_shape")
    package = tmp_path / "toy"
    write(package, "__init__.py", "")
    # a <-> b at module level (b reaches a through `from toy import a`); c -> d at module level
    # and d -> c only inside a function: a cycle of the second kind alone.
    write(package, "a.py", "from toy.b import helper\n")
    write(package, "b.py", "from toy import a\n\ndef helper():\n    return 1\n")
    write(package, "c.py", "from .sub import d\n\nclass Box:\n    def long(self):\n" + "        x = 1\n" * 70)
    write(package, "sub/__init__.py", "")
    write(package, "sub/d.py", "import os\n\ndef late():\n    from toy import c\n    return c\n")
    modules = {module.name: module for module in shape.read_package(package, 60)}

    assert set(modules) == {"toy", "toy.a", "toy.b", "toy.c", "toy.sub", "toy.sub.d"}
    assert modules["toy.c"].lines == 4 + 70
    assert modules["toy.c"].long_functions == [("Box.long", 71)]
    assert modules["toy.sub.d"].top_level_imports == set()  # os is not ours
    assert modules["toy.sub.d"].all_imports == {"toy.c"}
    assert modules["toy.c"].top_level_imports == {"toy.sub.d"}  # relative import resolved
    top = shape.cycles({name: module.top_level_imports for name, module in modules.items()})
    every = shape.cycles({name: module.all_imports for name, module in modules.items()})
    assert top == [["toy.a", "toy.b"]]
    assert every == [["toy.a", "toy.b"], ["toy.c", "toy.sub.d"]]

    text = shape.report(list(modules.values()), 60)
    assert "functions over 60 lines: 1\n    71  toy.c.Box.long" in text
    assert "import cycles (module-level imports): 1\n  toy.a <-> toy.b" in text
    assert "import cycles (all imports, lazy ones too): 2" in text


def test_runs_on_this_package(capsys):
    shape = load_script("code_shape")
    assert shape.main([]) == 0
    out = capsys.readouterr().out
    assert "grpo_cli.pipeline" in out and "in " in out and "import cycles" in out
