"""The layering of infra/__init__.py: method files on top, then infra's modules above common.py, then common.py,
then infra.BELOW_COMMON; every import (module level or inside a function) points down, and no modules import each
other in a circle, within a layer too (engine.py and vllm_engine.py once did). Read from the source (ast), so an
import that only runs on some path counts too."""
import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import infra  # noqa: E402
import infra.cli  # noqa: E402

INFRA = sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "infra")) if name.endswith(".py"))
MODULES = {"common": "common.py", **{f"infra.{name}" if name != "__init__" else "infra": f"infra/{name}.py"
                                     for name in INFRA}}
BELOW = {"infra"} | {f"infra.{name}" for name in infra.BELOW_COMMON}
TRAINERS = set(infra.cli.trainers())


def imports(path):
    """The project modules a file imports: `import infra.x`, `from infra import x` and `from infra.x import y` give
    infra.x; `import common`, `from common import y` give common; trainer files by name."""
    with open(os.path.join(ROOT, path)) as handle:
        tree = ast.parse(handle.read())
    found = set()
    for node in ast.walk(tree):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        if isinstance(node, ast.ImportFrom) and node.module == "infra":
            names += [f"infra.{alias.name}" for alias in node.names if alias.name in INFRA]
        found |= {name for name in names if name in MODULES or name.split(".")[0] in TRAINERS}
    return found


def import_graph():
    """{module: the project modules it imports} for common.py, every infra module and every trainer."""
    files = {**MODULES, **{name: f"{name}.py" for name in TRAINERS}}
    return {module: imports(path) - {module} for module, path in files.items()}


def circles(graph):
    """Each import circle of `graph` ({module: modules it imports}) once, as [a, b, ..., a], in a stable order."""
    found, done = [], set()

    def visit(module, path):
        if module in path:
            circle = path[path.index(module):]
            start = circle.index(min(circle))
            circle = circle[start:] + circle[:start]
            if circle + [circle[0]] not in found:
                found.append(circle + [circle[0]])
            return
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def test_no_import_circle():
    assert circles(import_graph()) == [], "import circles: " + "; ".join(" -> ".join(c) for c in
                                                                         circles(import_graph()))


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"infra.engine": {"infra.vllm_engine"}, "infra.vllm_engine": {"infra.engine", "common"},
                    "common": set()}) == [["infra.engine", "infra.vllm_engine", "infra.engine"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []  # shared imports are no circle


def layer(module):
    return 0 if module in BELOW else 1 if module == "common" else 3 if module in TRAINERS else 2


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    wrong = sorted(name for name in imports(MODULES[module]) if name != module and (
        layer(name) > layer(module) or layer(name) == layer(module) == 1))
    names = {0: "below common.py", 1: "common.py", 2: "above common.py", 3: "a method file"}
    assert not wrong, f"{module} ({names[layer(module)]}) imports " + ", ".join(
        f"{name} ({names[layer(name)]})" for name in wrong)


def test_the_layers_are_what_the_docstring_says():
    assert set(infra.BELOW_COMMON) <= set(INFRA) and "common" not in BELOW
    assert all(name in infra.__doc__ for name in infra.BELOW_COMMON)
    assert imports("common.py") & BELOW  # common.py does build on the layer below
    assert any("common" in imports(path) for module, path in MODULES.items() if layer(module) == 2)


def test_the_reader_finds_a_wrong_import(tmp_path, monkeypatch):
    # an import inside a function counts: hub.py importing common.py lazily is a circle all the same
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    (tmp_path / "hub.py").write_text("def f():\n    from common import resolve_model_name\n    import infra.tiny\n")
    assert imports("hub.py") == {"common", "infra.tiny"}
    # engine.py's lazy import of vllm_engine.py and a lazy import back: the circle issue 41 found
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "engine.py").write_text("def f():\n    from infra.vllm_engine import VLLMGenerator\n")
    (tmp_path / "infra" / "vllm_engine.py").write_text("class V:\n    def __init__(self):\n"
                                                       "        from infra.engine import stop_token_ids\n")
    graph = {f"infra.{name}": imports(f"infra/{name}.py") for name in ("engine", "vllm_engine")}
    assert circles(graph) == [["infra.engine", "infra.vllm_engine", "infra.engine"]]
