"""The code's shape, kept (issue 58): no import cycle anywhere, no runtime file a reader cannot take
in at one sitting, and no new attribute probe for the model kind.

- Cycles: every module of the packages, the tools included, over its `import` statements as `ast`
  reads them (lazy imports inside functions count: a cycle through one still means neither module
  can be read without the other). import-linter's contracts (tests/test_layers.py) keep the layers;
  this finds a cycle inside one package that no contract names (specdec_tools had two).
- Size: a runtime file (specdec/, coordinator/, target_service/, draft_service/) over MAX_LINES
  lines holds more than one idea; split it by idea (docs/architecture.md, "Where the code is").
  The generated protobuf modules are not read by people and do not count.
- Probes: `getattr(lm, "static", False)` and its kin told the model's kind by poking at it, so the
  code that did it sat above every backend. Issue 58 item 1 (one model Protocol, chosen once at
  load) removed them all; the check stays, so that none comes back.
- Hand assembly: specdec/model/assembly.py `load_lm` is the one way to serve a model (load, pack,
  choose the forward). The benchmarks and the tools once built theirs by hand (gemm.apply, then
  CausalLM), and each copy could drift from what the services run; none may again, bar the few
  listed with their reasons.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("protos", "specdec", "coordinator", "draft_service", "target_service", "specdec_tools")
RUNTIME = ("specdec", "coordinator", "target_service", "draft_service")
MAX_LINES = 500


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ours `name` imports: `import a.b`, `from a import b` (b a module or a name in
    a), relative imports resolved; each to the deepest module of ours it names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    out = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_import_cycles_anywhere():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (move what both sides share into a module of its own): " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_has_teeth():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    modules = _modules()
    assert "specdec_tools.distill_training" in _imports("specdec_tools.distill_feature", modules["specdec_tools.distill_feature"], modules)


def _runtime_files():
    for package in RUNTIME:
        for path in sorted((REPO / package).rglob("*.py")):
            if "_pb2" not in path.name:
                yield path


def test_no_runtime_file_over_500_lines():
    long = [f"{path.relative_to(REPO)}: {n} lines" for path in _runtime_files()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"runtime files over {MAX_LINES} lines (split by idea, not by line count):\n" + "\n".join(long)


# -- attribute probes for the model's kind --------------------------------------------------------------

# The objects a probe pokes at: a model (`model`, `self.model`, `lm.model`) or an LM (`lm`, `self.lm`).
PROBED = {"lm", "model"}

# The probes left, by file and call, each with how often it occurs: none since issue 58 item 1 (the
# LanguageModel protocol in specdec/model/interface.py, one implementation per backend, chosen once by
# specdec/model/assembly.py `load_lm`). Never add one; give the protocol what the new code needs to know instead.
KNOWN_PROBES: dict[tuple[str, str], int] = {}


def _probes(path: pathlib.Path) -> list[str]:
    """`getattr(x, "name", ...)` and `hasattr(x, "name")` calls in a file whose `x` is a model or an LM."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            continue
        target = node.args[0]
        name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else None
        if name in PROBED:
            found.append(ast.unparse(node))
    return found


def test_no_new_attribute_probes_for_the_model_kind():
    """The probes found are exactly the known ones: a new probe fails, and so does a known one that
    is gone and still listed (the list only shrinks)."""
    files = [*_runtime_files(), *sorted((REPO / "specdec_tools").rglob("*.py"))]
    found = collections.Counter((path.relative_to(REPO).as_posix(), probe) for path in files for probe in _probes(path))
    _exactly_known(found, KNOWN_PROBES, "attribute probes for the model's kind (give the model interface what the code "
                   "needs to know; issue 58 item 1)", "KNOWN_PROBES")


def _exactly_known(found: collections.Counter, known: dict, what: str, listed_in: str) -> None:
    """found (file, finding) counts are exactly `known`'s: a new finding fails, and so does a known
    one that is gone and still listed, so a list of exceptions can only shrink."""
    new = sorted(f"{where}: {finding} (x{count})" for (where, finding), count in (found - collections.Counter(known)).items())
    assert not new, f"{what}:\n" + "\n".join(new)
    gone = sorted(f"{where}: {finding}" for (where, finding), count in (collections.Counter(known) - found).items())
    assert not gone, f"gone from the code: remove them from {listed_in} too:\n" + "\n".join(gone)


def test_the_probe_check_has_teeth(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(lm, self, cfg):\n    a = getattr(lm, 'static', False)\n    b = hasattr(self.model, 'x')\n"
                      "    c = getattr(cfg, 'static', False)\n    d = getattr(lm, name)\n")
    assert _probes(sample) == ["getattr(lm, 'static', False)", "hasattr(self.model, 'x')"]


# -- models assembled by hand ------------------------------------------------------------------------

# The calls that assemble a served model, which only specdec/model/assembly.py (load_lm) and the
# services it serves should make: packing (gemm.apply, pack_linears) and choosing the forward (CausalLM,
# StaticLM). Checked in the scripts and tools, which serve models through load_lm(LMOptions(...)).
ASSEMBLY_CALLS = {"gemm.apply", "pack_linears", "CausalLM", "StaticLM"}
ASSEMBLED_IN = ("benchmarks", "specdec_tools")
# A run's own scripts, kept beside its figures as what was run then (benchmarks/results/<run>/): a record, not a tool.
RECORDS = REPO / "benchmarks" / "results"

# The calls left, by file and call, with how often each occurs. Each is not a served model:
KNOWN_ASSEMBLY: dict[tuple[str, str], int] = {
    # the exact fixed-shape passes against transformers' forward over one in-memory model of a real
    # shape with random weights (tinymodels.real_shape: no spec for load_lm to load), StaticLM on the
    # CPU too (how its code path is tested), where exact_lm would choose CausalLM; and once without
    # its CUDA graph, for the profile of the kernels the graph replays
    ("benchmarks/cuda_step.py", "CausalLM"): 3,
    ("benchmarks/cuda_step.py", "StaticLM"): 2,
    # on a GPU, the numerics=fast comparison row over the very model load_lm served with fixed-shape
    # passes: a second load_lm would hold the weights twice
    ("specdec_tools/bench.py", "CausalLM"): 1,
    # a feature draft (load_feature_draft), which load_lm does not load: packed as the draft service
    # packs one (draft_service/loading.py, _packed)
    ("specdec_tools/distill_feature.py", "gemm.apply"): 1,
}


def _assembly_calls(path: pathlib.Path) -> list[str]:
    """The ASSEMBLY_CALLS a file makes: `gemm.apply(...)`, and `X(...)` or `module.X(...)` for the others."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in ASSEMBLY_CALLS:
            found.append(func.id)
        elif isinstance(func, ast.Attribute):
            dotted = f"{func.value.id}.{func.attr}" if isinstance(func.value, ast.Name) else None
            if dotted in ASSEMBLY_CALLS:
                found.append(dotted)
            elif func.attr in ASSEMBLY_CALLS:
                found.append(func.attr)
    return found


def test_no_model_assembled_by_hand_outside_load_lm():
    """The hand assemblies found are exactly the known ones: a new one fails (serve the model through
    load_lm(LMOptions(...)), or give LMOptions what it lacks), and so does a known one that is gone."""
    files = [path for folder in ASSEMBLED_IN for path in sorted((REPO / folder).rglob("*.py")) if not path.is_relative_to(RECORDS)]
    found = collections.Counter((path.relative_to(REPO).as_posix(), call) for path in files for call in _assembly_calls(path))
    _exactly_known(found, KNOWN_ASSEMBLY, "models assembled by hand (use specdec.model.assembly.load_lm, the one way the "
                   "services serve a model; issue 58 item 1)", "KNOWN_ASSEMBLY")


def test_the_assembly_check_has_teeth(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(loaded, m):\n    gemm.apply(m, 1, 2, 3, 4)\n    lm = CausalLM(m, 'cpu')\n"
                      "    g = cpu.gemm.pack_linears(m, 8, 1)\n    s = static.StaticLM(m, 'cuda')\n"
                      "    other.apply(m)\n    load_lm(options)\n")
    assert _assembly_calls(sample) == ["gemm.apply", "CausalLM", "pack_linears", "StaticLM"]
