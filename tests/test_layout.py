"""The package layout of docs/layout.md holds: the app's rooms import downwards only, each room
says what it owns, app/ keeps few modules of its own, and no module of app/ or cli/ grows past
450 lines."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "chatloom"
APP = PACKAGE / "app"
# Higher rank imports lower; equal ranks (generation and state; chat, batch and responses) do not
# import each other.
RANK = {"core": 0, "traffic": 1, "generation": 2, "state": 2, "files": 3, "tools": 4,
        "chat": 5, "batch": 5, "responses": 5, "api": 6}
ROOMS = sorted(room for room in RANK if (APP / room).is_dir())


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def upward_imports(app_dir: Path) -> list[str]:
    """'module -> import' for every import of a room at or above the importing room's rank."""
    bad = []
    for path in sorted(app_dir.rglob("*.py")):
        parts = path.relative_to(app_dir).parts
        room = parts[0] if len(parts) > 1 else None
        if room not in RANK:
            continue  # app/main.py and app/http_server.py sit above every room
        for name in sorted(imported_modules(path)):
            bits = name.split(".")
            if bits[:2] != ["chatloom", "app"]:
                continue
            target = bits[2] if len(bits) > 2 else ""
            if target == room:
                continue
            if target not in RANK or RANK[target] >= RANK[room]:
                bad.append(f"{path.relative_to(app_dir)} -> {name}")
    return bad


def test_app_rooms_import_downwards_only():
    assert upward_imports(APP) == []


def test_an_upward_import_is_caught(tmp_path):
    room = tmp_path / "traffic"
    room.mkdir()
    (room / "bad.py").write_text("from chatloom.app.chat.branches import Tree\n")
    assert upward_imports(tmp_path) == ["traffic/bad.py -> chatloom.app.chat.branches",
                                        "traffic/bad.py -> chatloom.app.chat.branches.Tree"]


@pytest.mark.parametrize("room", ROOMS)
def test_each_room_says_what_it_owns(room):
    init = APP / room / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    assert doc and len(doc) > 80, f"app/{room}/__init__.py needs a docstring saying what the room owns"


def test_app_keeps_few_modules_of_its_own():
    own = sorted(p.name for p in APP.glob("*.py"))
    assert len(own) <= 8, own


def test_no_module_of_app_or_cli_is_over_450_lines():
    long = {str(p.relative_to(PACKAGE)): n for d in (APP, PACKAGE / "cli") for p in d.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 450}
    assert long == {}


def test_every_command_lives_in_the_cli_package():
    stray = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*cli*.py")
                   if p.parent.name != "cli")
    assert stray == []
