"""The package's import graph runs one way: no cycles, and kernels/ imports
nothing of the package outside kernels/.

Read from the source with ``ast`` (nothing is imported), so this runs in
well under a second. Every import counts, function-level ones included: an
import inside a function (kept for a heavy optional dependency such as
TensorFlow, or to load Pallas's GPU backends only when a kernel runs) still
makes the importing module depend on the imported one, so it must not close
a circle either.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "darl_jax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _import_time_nodes(tree):
  """Every node that runs when the module is imported: all but function
  bodies (module-level ``if``/``try`` blocks and class bodies included)."""
  todo = [tree]
  while todo:
    node = todo.pop()
    yield node
    todo.extend(child for child in ast.iter_child_nodes(node)
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _imports(name: str, path: pathlib.Path, modules, top_level_only: bool = False) -> set[str]:
  """The darl_jax modules ``name`` imports (``from darl_jax.x import y``
  counts as darl_jax.x.y when that is a module, else darl_jax.x), in
  function bodies too unless ``top_level_only``."""
  tree = ast.parse(path.read_text(), str(path))
  nodes = _import_time_nodes(tree) if top_level_only else ast.walk(tree)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:   # relative: resolve against this module's package
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    else:
      continue
    for target in targets:
      while target and target not in modules:   # darl_jax.x.attr -> darl_jax.x
        target = target.rpartition(".")[0]
      if target.startswith("darl_jax") and target != name:
        found.add(target)
  return found


def _cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), set()

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1:
        out.add(frozenset(component))

  for v in graph:
    if v not in index:
      visit(v)
  return out


def _graph(top_level_only: bool = False) -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(name, path, modules, top_level_only)
          for name, path in modules.items()}


def test_the_graph_reads_every_import():
  graph, top_level = _graph(), _graph(top_level_only=True)
  assert graph["darl_jax.models.posenc"] >= {"darl_jax.kernels.rope"}   # module level
  # inside functions: the Pallas kernels where ops first runs them, TFDS's builder
  assert "darl_jax.kernels.layer_norm" in graph["darl_jax.ops"] - top_level["darl_jax.ops"]
  assert "darl_jax.data.sources.tfds_fashion_mnist" in graph["darl_jax.data.sources.fashion_mnist"]


def test_kernels_import_nothing_outside_kernels():
  """Models call ops, ops call kernels, and kernels know nothing above them
  (ops hands the fused stack its ops and per_shard the batch axes)."""
  upward = {(name, target) for name, targets in _graph().items()
            if name.startswith("darl_jax.kernels")
            for target in targets if not target.startswith("darl_jax.kernels")}
  assert not upward, f"kernels import the package above them: {upward}"


def test_ops_never_import_models():
  graph = _graph()
  upward = {t for t in graph["darl_jax.ops"] if t.startswith("darl_jax.models")}
  assert not upward, f"ops import models (models call ops, not back): {upward}"


def test_no_import_cycles_among_package_modules():
  assert _cycles(_graph()) == set()


def test_cycle_finder_finds_a_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
  assert _cycles(graph) == {frozenset("abc")}
