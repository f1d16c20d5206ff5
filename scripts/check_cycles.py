#!/usr/bin/env python3
"""Import cycles between the modules of each crate (flashattn, flashattn-cli, flashattn-py): a
module depends on another when its file names it through `crate::`, `super::` or a `use` of a
sibling module. Prints each strongly connected component of more than one module, and fails when
one is new or has grown against scripts/cycles_baseline.txt (the cycles that exist today: the
layering work removes them; nothing may add to them).

    python3 scripts/check_cycles.py            # check
    python3 scripts/check_cycles.py --update   # rewrite the baseline (only when a cycle shrank)
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CRATES = {"flashattn": "flashattn/src", "flashattn-cli": "flashattn-cli/src",
          "flashattn-py": "flashattn-py/src"}
BASELINE = ROOT / "scripts/cycles_baseline.txt"


def modules(src: pathlib.Path):
    """{module path ("" for the crate root, "cpu::decode"): file}."""
    mods = {}
    for f in sorted(src.rglob("*.rs")):
        rel = f.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] in ("mod", "lib", "main"):
            parts = parts[:-1]
        mods["::".join(parts)] = f
    return mods


def strip_comments(text: str) -> str:
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


DEF = r"\bpub(?:\([^)]*\))?\s+(?:struct|enum|fn|type|trait|const|static|unsafe fn|async fn)\s+{}\b"


def resolve(path: list[str], mods: set[str], texts: dict):
    """The module `path` names: its longest prefix that is a module, and when the next segment is
    an item that module only re-exports, the module under it that defines the item (so
    `crate::Result` is the error module, not the crate root that re-exports it)."""
    module, rest = "", path
    for n in range(len(path), 0, -1):
        cand = "::".join(path[:n])
        if cand in mods:
            module, rest = cand, path[n:]
            break
    if rest:
        item = re.compile(DEF.format(re.escape(rest[0])))
        if not item.search(texts[module]):
            prefix = module + "::" if module else ""
            owners = [m for m in mods if m.startswith(prefix) and m != module
                      and item.search(texts[m])]
            if len(owners) == 1:
                return owners[0]
    return module


def deps(mod: str, text: str, mods: set[str], texts: dict):
    out = set()
    here = mod.split("::") if mod else []
    for m in re.finditer(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)", text):
        names = m.group(2).split("::")[1:]
        if m.group(1) == "crate":
            base = []
        else:
            # `super` from a module file is its parent (a `mod.rs` or a leaf alike).
            base = here[:-1]
            while names and names[0] == "super":
                names, base = names[1:], base[:-1]
        target = resolve(base + names, mods, texts)
        if target is not None and target != mod:
            out.add(target)
    # `use a::b` of a child or sibling declared with `mod` (2018 paths without `crate::`).
    for m in re.finditer(r"\buse\s+([A-Za-z_][A-Za-z0-9_]*)::", text):
        first = m.group(1)
        for cand in ("::".join(here + [first]), "::".join(here[:-1] + [first])):
            if cand in mods and cand != mod:
                out.add(cand)
                break
    return out


def sccs(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def current():
    found = []
    for crate, src in CRATES.items():
        mods = modules(ROOT / src)
        texts = {m: strip_comments(f.read_text()) for m, f in mods.items()}
        graph = {m: deps(m, texts[m], set(mods), texts) for m in mods}
        for comp in sccs(graph):
            found.append((crate, [c or "(root)" for c in comp]))
    return found


def main():
    found = current()
    lines = sorted(f"{crate}: {' '.join(comp)}" for crate, comp in found)
    if "--update" in sys.argv:
        BASELINE.write_text("".join(l + "\n" for l in lines))
        print(f"wrote {BASELINE} ({len(lines)} cycles)")
        return 0
    base = [l.split(": ", 1) for l in BASELINE.read_text().splitlines() if l.strip()]
    base = [(c, set(m.split())) for c, m in base]
    bad = []
    for crate, comp in found:
        if not any(c == crate and set(comp) <= known for c, known in base):
            bad.append(f"{crate}: {' '.join(comp)}")
    for l in lines:
        print("cycle:", l)
    if bad:
        print("\nnew or grown import cycles (each module may import only the layers below it):")
        for b in bad:
            print("  ", b)
        return 1
    print(f"{len(lines)} import cycles, none new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
