"""Folders import one way only: the folder graph of hpcrl/ has no two-way pair and no cycle.

Each import of an hpcrl module (at module level, inside a function or under ``TYPE_CHECKING``: each ties
the two folders together) is an arrow from the importing module's folder to the imported one's. A
component's schema (``<folder>/config.py``: algo, data, rewards, rollout, trainer) and its backend table
beside it (``<folder>/backends.py``: rollout, trainer; torch-free specs the planner reads) count as the config
layer, where ``config/schema.py`` composes it: the README places each schema next to its component, below
the component's own code. The failure names the pair, or the cycle, and every importing line.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

from tests.project.test_layout import find_cycle

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "hpcrl"

KNOWN_TWO_WAY: dict[frozenset[str], str] = {}
"""Pairs that remain, each with why. A pair that disappears must leave this list (the test says so)."""

Arrows = dict[tuple[str, str], list[str]]


def layer(module: str) -> str:
    """The folder ``module`` (``hpcrl.<folder>.<...>``) belongs to; top-level modules are ``(top)``."""
    parts = module.split(".")
    if len(parts) == 3 and parts[2] in ("config", "backends"):
        return "config"
    return parts[1] if len(parts) > 1 and (PKG / parts[1]).is_dir() else "(top)"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*up, base] if base else up)
    return [f"{base}.{a.name}" if base == "hpcrl" else base for a in node.names]


def folder_arrows() -> Arrows:
    arrows: Arrows = defaultdict(list)
    for path in sorted(PKG.rglob("*.py")):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        source = layer(name if path.name != "__init__.py" else f"{name}.__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            for target in imported(node, package):
                if not target.startswith("hpcrl."):
                    continue
                dest = layer(target)
                if "(top)" not in (source, dest) and dest != source:
                    where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)} imports {target}"
                    if where not in arrows[(source, dest)]:
                        arrows[(source, dest)].append(where)
    return dict(arrows)


def two_way_pairs(arrows: Arrows) -> dict[frozenset[str], list[str]]:
    pairs: dict[frozenset[str], list[str]] = {}
    for a, b in arrows:
        if (b, a) in arrows and a < b:
            pairs[frozenset({a, b})] = arrows[(a, b)] + arrows[(b, a)]
    return pairs


def test_the_scan_sees_the_layers() -> None:
    arrows = folder_arrows()
    assert ("plan", "config") in arrows and ("run", "trainer") in arrows
    assert ("trainer", "core") in arrows  # megatron takes the degree record from the ground


def test_no_new_two_way_folder_pair() -> None:
    pairs = two_way_pairs(folder_arrows())
    new = {pair: lines for pair, lines in pairs.items() if pair not in KNOWN_TWO_WAY}
    text = "\n".join(
        f"{' <-> '.join(sorted(pair))}:\n  " + "\n  ".join(lines)
        for pair, lines in sorted(new.items(), key=str)
    )
    assert not new, f"folders that import each other (move the shared piece down, e.g. into core/):\n{text}"
    gone = sorted(" <-> ".join(sorted(p)) for p in KNOWN_TWO_WAY if p not in pairs)
    assert not gone, f"no longer two-way, take them out of KNOWN_TWO_WAY: {gone}"


def test_no_folder_cycle() -> None:
    arrows = {k: v for k, v in folder_arrows().items() if frozenset(k) not in KNOWN_TWO_WAY}
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in arrows:
        graph[a].add(b)
    cycle = find_cycle(graph)
    if cycle:
        lines = [line for a, b in itertools.pairwise(cycle) for line in arrows[(a, b)]]
        raise AssertionError("folder import cycle: " + " -> ".join(cycle) + "\n  " + "\n  ".join(lines))


def test_the_ground_imports_nothing_above_it() -> None:
    above = {k: v for k, v in folder_arrows().items() if k[0] == "core"}
    assert not above, f"core/ is the ground (errors only): {above}"
