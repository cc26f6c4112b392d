"""The import graph of pgs: no cycles, layers that never point up, one home per environment read.

The graph is read from the source (``ast``), every ``import`` counted wherever it is written
(module level or inside a function: a lazy import still ties two modules together), except
the ones under ``if TYPE_CHECKING:`` (never executed).  ``from a.b import c`` is an edge to the
module ``a.b.c`` when it exists, else to ``a.b``.  docs/architecture.md (*Layers*) states the
same rules in prose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Bottom to top: a module may import modules of its own layer or of a lower one.  A layer is a
#: list of module prefixes (a package names all its modules); ``PLACED`` names the modules that
#: sit in another layer than their package.
LAYERS: list[tuple[str, ...]] = [
    ("pgs.errors",),
    ("pgs.func",),  # pure: torch and attrs only, never pgs.runtime
    ("pgs.runtime.common", "pgs.runtime.process", "pgs.runtime.pinned", "pgs.runtime.triton_gate",
     "pgs.runtime.output", "pgs.runtime.userpath", "pgs.runtime.documents"),
    ("pgs.runtime.data",),
    ("pgs.runtime.model",),
    ("pgs.runtime.dist",),
    ("pgs.runtime.optim",),
    ("pgs.runtime.store",),
    ("pgs.runtime.loop",),
    ("pgs.runtime.spec",),  # the composition of every component's config (sections, load, chain)
    ("pgs.runtime.prepare",),
    ("pgs.runtime.tools",),
    ("driver",),  # what runs a whole run: preflight, setup, the loop, the launcher
    ("pgs.runtime", "pgs.cli", "pgs.__main__", "pgs"),  # entry points and package surfaces
]
#: Modules whose layer is not their package's: four leaves every layer may use (the configs'
#: field checks, content digests, the linear-attention layers' boundaries) and the resume check
#: of the driver; the preflight asks the resource estimates
#: (``tools.resources``, which ``pgs profile`` prints too) and the trackers; the loop driver runs
#: the preflight; the launcher re-executes ``pgs run`` under torchrun after the preflight; the
#: supervisor relaunches ``pgs run`` and reads the launcher's halt code.
PLACED = {
    "pgs.runtime.spec.fields": "pgs.runtime.common",  # the field checks every component's config uses
    "pgs.runtime.store.digest": "pgs.runtime.common",  # content digests (checkpoints, the data's fingerprint)
    "pgs.runtime.model.linear_attention": "pgs.runtime.common",  # a leaf: data's packing verdict asks it
    "pgs.runtime.loop.resume": "driver",  # compares a checkpoint's saved spec with the run's
    "pgs.runtime.spec.preflight": "pgs.runtime.tools",
    "pgs.runtime.loop.train": "driver",
    "pgs.runtime.dist.launch": "driver",
    "pgs.runtime.tools.supervise": "driver",
}

#: Private names (``_x``) imported from another module, each with its reason.  Nothing else may.
#: All four are names the tests reach on their module (a monkeypatch, a cache reset, a direct
#: call): they keep their names until those tests are rewritten.
PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {
    ("pgs.func.adam8bit", "pgs.func.kernels.fused_transform", "_hp_cached"):
        "the hyperparameter cache of fused transforms; tests/test_deferred_kernels.py clears it",
    ("pgs.func.kernels.small", "pgs.func.kernels", "_launch"):
        "the cached Triton launcher; tests/test_kernels_interpret.py patches it on the package",
    ("pgs.func.losses.sequence", "pgs.func.losses.chunked", "_Plan"):
        "the chunked loss's plan, shared with sequence log-probs; tests/test_preference_losses.py builds one",
    ("pgs.func.losses.sequence", "pgs.func.losses.chunked", "_use_kernels"):
        "the chunked loss's kernel choice, shared with sequence log-probs; two tests call it",
}

#: The only files that read ``os.environ`` / ``os.getenv``: the process layout and the named
#: variables of the runtime, the Triton gate of the kernels, the command line.
ENV_FILES = {"pgs/runtime/process.py", "pgs/func/kernels/kernel_config.py", "pgs/cli.py"}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted((ROOT / "pgs").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def _graph():
    """``(edges, private, env)``: module -> imported pgs modules; (importer, module, name) of
    private names imported; files that read the environment."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[tuple[str, str, str]] = []
    env: set[str] = set()
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = resolve(alias.name) if alias.name.startswith("pgs") else None
                    if target and target != mod:
                        edges[mod].add(target)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                if not full.startswith("pgs"):
                    continue
                for alias in node.names:
                    sub = f"{full}.{alias.name}"
                    target = sub if sub in mods else resolve(full)
                    if target and target != mod:
                        edges[mod].add(target)
                    if target != sub and alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append((mod, full, alias.name))
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                  and node.attr in ("environ", "getenv", "putenv", "unsetenv")):
                env.add(path.relative_to(ROOT).as_posix())
    return edges, private, env


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> int:
    place = PLACED.get(module)
    best, level = -1, None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            name = place or module
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level is not None, f"{module}: in no layer of tests/unit/test_layers.py LAYERS"
    return level


@pytest.fixture(scope="module")
def graph():
    return _graph()


def test_no_import_cycle(graph):
    edges, _, _ = graph
    assert _cycles(edges) == []


def test_layers_never_point_up(graph):
    edges, _, _ = graph
    up = sorted(f"{a} -> {b}" for a in edges for b in edges[a] if layer_of(b) > layer_of(a))
    assert up == []


def test_func_never_imports_runtime(graph):
    edges, _, _ = graph
    bad = sorted(f"{a} -> {b}" for a in edges if a.startswith("pgs.func") for b in edges[a]
                 if not (b.startswith("pgs.func") or b == "pgs.errors"))
    assert bad == []


def test_private_names_stay_in_their_module(graph):
    _, private, _ = graph
    assert sorted(set(private) - set(PRIVATE_IMPORTS)) == []
    assert len(PRIVATE_IMPORTS) <= 5


def test_environment_read_in_few_files(graph):
    _, _, env = graph
    assert env <= ENV_FILES, sorted(env - ENV_FILES)
    assert len(ENV_FILES) <= 4


def test_graph_sees_function_level_imports():
    """The reader counts an import inside a function, and a cycle through one."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    tree_edges, _, _ = _graph()
    # tools.resources imports tools.profile only inside a function
    assert "pgs.runtime.tools.profile" in tree_edges["pgs.runtime.tools.resources"]


def test_cli_imports_no_torch():
    """``pgs --help`` stays light: the command line imports what a command needs when it runs."""
    import subprocess
    import sys

    code = "import sys, pgs.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def _function_lengths() -> list[tuple[int, str, str]]:
    """``(lines, file, name)`` of every function in pgs, docstrings included, longest first."""
    rows = []
    for path in sorted((ROOT / "pgs").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                rows.append((node.end_lineno - node.lineno + 1, str(path.relative_to(ROOT)), node.name))
    return sorted(rows, reverse=True)


def test_functions_read_on_one_screen_or_two():
    """No function in pgs over 120 lines; the training loop's module under 80 a function (it reads
    top to bottom: each service's cadence is the service's own)."""
    rows = _function_lengths()
    assert [r for r in rows if r[0] > 120] == []
    assert [r for r in rows if r[1] == "pgs/runtime/loop/train.py" and r[0] > 80] == []
