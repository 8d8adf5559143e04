#!/usr/bin/env python3
"""Module import cycles in the kvpack crate.

Builds a graph of the crate's modules (one node per file under src/, the
binary excluded) with an edge A -> B for every `crate::B...` / `super::...`
path used in A, then prints every strongly connected component with more
than one module (a cycle) and exits 1 when there is one.

A module's uses of its own descendants are not edges (a parent declares and
re-exports its children); uses of siblings, cousins and ancestors are, so
`gpu::spec` using `gpu::codecs` and `gpu::codecs` using `gpu::spec` is
reported. Paths written without `crate::`/`super::` name a module's own
children or other crates and are not edges either.

Usage: python3 tools/module_cycles.py [--edges]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "src"


def module_of(path: Path) -> tuple[str, ...]:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return tuple(parts)


def modules() -> dict[tuple[str, ...], Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.rs")):
        if "bin" in p.relative_to(ROOT).parts:
            continue
        out[module_of(p)] = p
    return out


PATH = re.compile(r"\b(crate|super)((?:::\w+)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super)((?:::\w+)*)::\{([^;]*)\};", re.S)


def resolve(mods, here: tuple[str, ...], base: str, tail: list[str]) -> tuple[str, ...] | None:
    """The longest known module prefix of a path written in module `here`."""
    if base == "crate":
        cur: list[str] = []
    else:
        cur = list(here)
        # `super` of a file module is its parent.
        cur = cur[:-1]
        while tail and tail[0] == "super":
            cur = cur[:-1]
            tail = tail[1:]
    best = None
    probe = list(cur)
    if tuple(probe) in mods:
        best = tuple(probe)
    for seg in tail:
        probe.append(seg)
        if tuple(probe) in mods:
            best = tuple(probe)
        else:
            break
    return best


def edges(mods) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    g: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in mods}
    for m, path in mods.items():
        text = path.read_text()
        # Comments dropped.
        text = re.sub(r"//[^\n]*", "", text)
        # Unit-test modules (`#[cfg(test)] mod ...`, last in a file by the
        # crate's convention) may use anything: cut them.
        cut = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
        if cut:
            text = text[: cut.start()]
        refs: list[tuple[str, list[str]]] = []
        for base, head, group in USE_GROUP.findall(text):
            h = [s for s in head.split("::") if s]
            for item in re.split(r",", group):
                item = item.strip().split(" as ")[0].strip()
                if not item:
                    continue
                first = item.split("::")[0].strip("{} ")
                refs.append((base, h + [first]))
        for base, tail in PATH.findall(text):
            refs.append((base, [s for s in tail.split("::") if s]))
        for base, tail in refs:
            t = resolve(mods, m, base, tail)
            if t is None or t == m:
                continue
            # A module using its own descendants is how Rust modules are
            # built (declarations, re-exports): not counted.
            if t[: len(m)] == m:
                continue
            g[m].add(t)
    return g


def sccs(g):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in g:
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) or "crate"


def main() -> int:
    mods = modules()
    g = edges(mods)
    if "--edges" in sys.argv:
        for m in sorted(g):
            print(name(m), "->", ", ".join(sorted(name(t) for t in g[m])))
    cycles = [sorted(c) for c in sccs(g) if len(c) > 1]
    n_edges = sum(len(v) for v in g.values())
    print(f"{len(mods)} modules, {n_edges} edges, {len(cycles)} cycles")
    for c in sorted(cycles):
        members = set(c)
        print("cycle:", " <-> ".join(name(m) for m in c))
        for m in c:
            for t in sorted(g[m] & members):
                print(f"    {name(m)} -> {name(t)}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
