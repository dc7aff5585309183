"""Imports run only downward: each room of the package (a subpackage or a top-level module) has a rank, and no
module imports one of a higher rank, at the top or inside a function. A new room needs a rank here."""

from __future__ import annotations

import ast
from pathlib import Path

import slotserve

# Lowest first. Rooms of one rank do not import each other.
RANKS: dict[str, int] = {
    "envs": 0,
    "faults": 1, "host_memory": 1, "parallel": 1,
    "config": 2,
    "sampling_params": 3, "pooling_params": 3, "outputs": 3,
    "structured_outputs": 4, "tokenizer": 4,
    "kernels": 5,
    "quantization": 6,
    "distributed": 7,
    "kv_cache": 8,
    "layers": 9,
    "multimodal": 10,
    "models": 11,
    "model_store": 12,
    "engine": 13,
    "entrypoints": 14,  # but the command line, which runs the benchmarks
    "bench": 15,
    "entrypoints.cli": 16,
    "": 17,  # the package itself: `from slotserve import LLM`
}
ROOT = Path(slotserve.__file__).parent


def _room(module: str) -> str:
    """The room of `slotserve.a.b...`: "entrypoints.cli" for the command line, else its first part."""
    parts = module.split(".")[1:]
    if parts[:2] == ["entrypoints", "cli"]:
        return "entrypoints.cli"
    return parts[0] if parts else ""


def _imports(path: Path) -> list[tuple[str, int]]:
    """The slotserve modules a file imports, each with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "slotserve":
                out += [(f"slotserve.{a.name}", node.lineno) for a in node.names]
            elif node.module.startswith("slotserve."):
                out.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("slotserve")]
    return out


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_room_has_a_rank():
    rooms = {_room(_module(p)) for p in ROOT.rglob("*.py")}
    assert rooms <= RANKS.keys(), f"rooms without a rank: {sorted(rooms - RANKS.keys())}"


def _edges() -> list[tuple[str, str, str, str]]:
    """Every import of one room by a module: (where, the importer's room, the module imported, its room)."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        me = _room(_module(path))
        for target, line in _imports(path):
            room = _room(target)
            room = room if room in RANKS else ""  # `from slotserve import LLM`: a name of the package itself
            out.append((f"{path.relative_to(ROOT)}:{line}", me, target, room))
    return out


def test_no_module_imports_a_higher_room():
    upward = [f"{where} ({me}) imports {target} ({room or 'slotserve'})"
              for where, me, target, room in _edges() if RANKS[room] > RANKS[me]]
    assert not upward, "\n".join(upward)


def test_rooms_of_one_rank_do_not_import_each_other():
    sideways = [f"{where} ({me}) imports {target}"
                for where, me, target, room in _edges() if room != me and RANKS[room] == RANKS[me]]
    assert not sideways, "\n".join(sideways)
