"""The rooms of the code keep their shape: imports run one way between them, the engine never
imports a UI, each room says what it owns, and no top folder grows into a flat heap again
(docs/design-notes.md, "Rooms")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"zipage.engine": ROOT / "engine", "zipage.cli": ROOT / "zipage_cli", "zipage.kernels": ROOT / "zipage_kernels"}
# Higher rooms may import lower ones (and their own), never the other way. The shared modules at the
# engine's top (config, sequence, events, latency) sit below every room.
ENGINE_LAYERS = ["api", "core", "execution", "scheduling", "kv", "loading", ""]
# The products of the command line stand side by side: none imports another; main.py joins them.
CLI_PRODUCTS = {"console", "serve", "eval"}
UI_LIBRARIES = ("textual", "rich", "typer", "prompt_toolkit", "zipage.cli")
MAX_TOP_MODULES = 8


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package,) + parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module this one imports, anywhere in it (lazy imports in functions included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
    return found


def engine_layer(name: str) -> int:
    parts = name.split(".")
    room = parts[2] if len(parts) > 3 else ""  # zipage.engine.<room>.<module>; top modules have no room
    return ENGINE_LAYERS.index(room if room in ENGINE_LAYERS else "")


KNOWN = modules()
GRAPH = {name: imports_of(name, path, KNOWN) for name, path in KNOWN.items()}


def test_the_rooms_this_test_knows_are_the_rooms_on_disk():
    rooms = {n.split(".")[2] for n in KNOWN if n.startswith("zipage.engine.") and (ROOT / "engine" / n.split(".")[2]).is_dir()}
    assert rooms == set(ENGINE_LAYERS) - {""}
    cli_rooms = {p.name for p in (ROOT / "zipage_cli").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert cli_rooms == CLI_PRODUCTS


@pytest.mark.parametrize("name", sorted(n for n in KNOWN if n.startswith("zipage.engine")))
def test_engine_imports_run_downward(name):
    mine = engine_layer(name)
    for target in GRAPH[name]:
        assert not target.startswith(UI_LIBRARIES), f"{name} imports the UI module {target}"
        if target.startswith("zipage.engine.") and target in KNOWN and engine_layer(target) != len(ENGINE_LAYERS) - 1:
            assert engine_layer(target) >= mine, f"{name} reaches up into {target}"
        if mine == len(ENGINE_LAYERS) - 1 and target in KNOWN and target.startswith("zipage.engine."):
            # The shared modules import only one another (the package's own __init__ imports lazily).
            assert engine_layer(target) == mine or name == "zipage.engine", f"shared module {name} imports {target}"


@pytest.mark.parametrize("name", sorted(n for n in KNOWN if n.startswith("zipage.kernels")))
def test_kernels_import_no_engine_and_no_ui(name):
    assert not any(t.startswith(("zipage.engine", "zipage.cli") + UI_LIBRARIES[:-1]) for t in GRAPH[name])


@pytest.mark.parametrize("product", sorted(CLI_PRODUCTS))
def test_the_command_line_products_stand_apart(product):
    others = tuple(f"zipage.cli.{p}" for p in CLI_PRODUCTS - {product})
    for name in (n for n in KNOWN if n.startswith(f"zipage.cli.{product}")):
        assert not [t for t in GRAPH[name] if t.startswith(others)], f"{name} imports another product"
        assert "zipage.cli.main" not in GRAPH[name]


def test_no_import_cycles_between_modules():
    inside = {n: {t for t in GRAPH[n] if t in KNOWN and t != n and not n.startswith(t + ".")} for n in KNOWN}
    state: dict[str, int] = {}

    def visit(node, trail):
        state[node] = 1
        for target in inside[node]:
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(target):] + [target]))
            if target not in state:
                visit(target, trail + [target])
        state[node] = 2

    for node in sorted(inside):
        if node not in state:
            visit(node, [node])


@pytest.mark.parametrize("folder", sorted(FOLDERS.values()), ids=lambda p: p.name)
def test_each_top_folder_holds_few_modules_and_every_room_says_what_it_owns(folder):
    top_modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
    assert len(top_modules) <= MAX_TOP_MODULES, sorted(p.name for p in top_modules)
    for init in folder.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(ROOT)} has no docstring"
