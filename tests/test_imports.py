"""The package's import graph: kernels never import models, and no cycles.

Read from the source with ``ast`` (nothing is imported), so this runs in
well under a second. Cycles count only imports that run at import time: one
inside a function (data/fashion_mnist.py's of tfds_fashion_mnist, which
imports it back) runs when called and breaks no import order. The kernels
-> models check reads every import, function-level ones included.
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


def _imports(name: str, path: pathlib.Path, modules, top_level_only: bool) -> set[str]:
  """The darl_jax modules ``name`` imports (``from darl_jax.x import y``
  counts as darl_jax.x.y when that is a module, else darl_jax.x)."""
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


def test_kernels_never_import_models():
  modules = _modules()
  upward = {(name, target)
            for name, path in modules.items() if name.startswith("darl_jax.kernels")
            for target in _imports(name, path, modules, top_level_only=False)
            if target.startswith("darl_jax.models")}
  assert not upward, f"kernels import models (models may import kernels, not back): {upward}"


def test_no_import_cycles_among_package_modules():
  modules = _modules()
  graph = {name: _imports(name, path, modules, top_level_only=True)
           for name, path in modules.items()}
  assert graph["darl_jax.models.posenc"] >= {"darl_jax.kernels.rope"}   # the graph is read
  assert _cycles(graph) == set()


def test_cycle_finder_finds_a_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
  assert _cycles(graph) == {frozenset("abc")}
