"""Tables and plots of a study's results.

The input is one record per run: its labels and its metrics, named
``<stage kind>/<metric>`` (``pretrain/val_loss``, ``finetune/val_accuracy``)
plus ``last/<metric>`` for the run's last stage (so supervised and fine-tuned
runs share one column). Runs that differ only in ``seed`` are averaged: a
cell reads ``mean ± std (n)``, the sample standard deviation over seeds.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

import numpy as np

SEED = "seed"


@dataclasses.dataclass(frozen=True)
class Table:
  """Rows by ``rows`` labels; columns by the values of label ``cols``, or one
  column per metric when ``cols`` is None. ``best_over`` labels are maximised
  over (after the seed mean): "the best (a, b) for each patch size"."""
  title: str
  rows: tuple
  cols: str | None
  metrics: tuple
  where: dict = dataclasses.field(default_factory=dict)
  best_over: tuple = ()


@dataclasses.dataclass(frozen=True)
class Choices:
  """What each run's last stage chose (its record's ``choice``, made by
  runner.choice): one row per run, seeds apart, with the block, its eval
  accuracy and, for a grid, the held-out accuracy and the setting (learning
  rate, weight decay, pooling) chosen on held-out training rows. A grid's
  block is its held-out choice too; a single-setting probe's or kNN's is
  the eval split's best."""
  title: str
  rows: tuple
  where: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Heatmap:
  """``metric`` over labels ``x`` and ``y``, one panel per value of ``facet``."""
  title: str
  x: str
  y: str
  metric: str
  facet: str | None = None
  where: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Lines:
  """``metric`` against label ``x`` (numeric), one line per ``series`` label value."""
  title: str
  x: str
  series: str
  metric: str
  where: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Scatter:
  """One point per run: ``x_metric`` against ``y_metric``, coloured by
  ``series``; the report gives Pearson and Spearman correlations per series."""
  title: str
  x_metric: str
  y_metric: str
  series: str
  where: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class DepthCurves:
  """Per-block metrics (``<prefix>00``, ``<prefix>01``, ...) against the block's
  relative depth, one curve per combination of ``series`` labels."""
  title: str
  prefix: str
  series: tuple
  where: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One of the paper's claims as a difference of means: the runs matching
  ``a`` against those matching ``b`` (both within ``where``) on ``metric``.
  A label's value may be a frozenset, "any of these"; the runs a selector
  matches are pooled, seeds and any label it leaves open alike. The report
  gives the difference with its standard error (Welch: the root of the
  summed variances of the two means) and reads it with ``verdict``."""
  claim: str
  a: dict
  b: dict
  metric: str = "last/val_accuracy"
  where: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------- helpers


def _matches(labels: dict, where: dict) -> bool:
  """Every key of ``where`` has its value in ``labels`` (a frozenset value:
  one of its members)."""
  return all(labels.get(k) in v if isinstance(v, frozenset) else labels.get(k) == v
             for k, v in where.items())


def _ordered(values) -> list:
  out = []
  for v in values:
    if v not in out:
      out.append(v)
  return out


def _unit(metric: str) -> float:
  """Accuracies are shown in %, other metrics as they are."""
  return 100.0 if "accuracy" in metric else 1.0


def fmt(metric: str, values: list[float]) -> str:
  """``84.5 ± 0.3 (2)`` for accuracies (in %), 4 decimals otherwise."""
  if not values:
    return "—"
  scale, digits = _unit(metric), (1 if "accuracy" in metric else 4)
  mean = scale * float(np.mean(values))
  if len(values) == 1:
    return f"{mean:.{digits}f}"
  std = scale * float(np.std(values, ddof=1))
  return f"{mean:.{digits}f} ± {std:.{digits}f} ({len(values)})"


def grouped(records: list[dict], keys: tuple, metric: str, where: dict) -> dict:
  """label-values tuple -> list of the metric over matching runs (seeds)."""
  out: dict = {}
  for r in records:
    if _matches(r["labels"], where) and r["metrics"].get(metric) is not None:
      out.setdefault(tuple(r["labels"].get(k) for k in keys), []).append(
          float(r["metrics"][metric]))
  return out


def _best(groups: dict, n_keys: int) -> dict:
  """Keys of length n_keys + len(best_over) -> best (by mean) per first n_keys."""
  out: dict = {}
  for key, values in groups.items():
    head, tail = key[:n_keys], key[n_keys:]
    if head not in out or np.mean(values) > np.mean(out[head][0]):
      out[head] = (values, tail)
  return out


def table_markdown(table: Table, records: list[dict]) -> str:
  rows_of = [r for r in records if _matches(r["labels"], table.where)]
  row_keys = _ordered(tuple(r["labels"].get(k) for k in table.rows) for r in rows_of)
  lines = [f"**{table.title}**", ""]
  if table.cols is None:
    header = list(table.rows) + list(table.metrics)
    cells = {}
    for m in table.metrics:
      g = grouped(records, table.rows + table.best_over, m, table.where)
      cells[m] = ({k: v for k, (v, _) in _best(g, len(table.rows)).items()}
                  if table.best_over else g)
    body = [[*map(str, rk)] + [fmt(m, cells[m].get(rk, [])) for m in table.metrics]
            for rk in row_keys]
  else:
    (metric,) = table.metrics
    col_vals = _ordered(r["labels"].get(table.cols) for r in rows_of)
    g = grouped(records, table.rows + (table.cols,) + table.best_over, metric, table.where)
    best = _best(g, len(table.rows) + 1) if table.best_over else {
        k: (v, ()) for k, v in g.items()}
    header = list(table.rows) + [f"{table.cols}={c}" for c in col_vals]
    body = []
    for rk in row_keys:
      row = [*map(str, rk)]
      for c in col_vals:
        values, where_best = best.get(rk + (c,), ([], ()))
        cell = fmt(metric, values)
        if values and any(v != "-" for v in where_best):
          cell += " @ " + ",".join(f"{k}={v}" for k, v in zip(table.best_over, where_best))
        row.append(cell)
      body.append(row)
    lines[0] += f" ({metric})"
  lines.append("| " + " | ".join(header) + " |")
  lines.append("|" + "---|" * len(header))
  lines += ["| " + " | ".join(row) + " |" for row in body]
  return "\n".join(lines)


# A choice's fields, in the order and under the names its table shows them.
CHOICE_COLUMNS = (("block", "block"), ("accuracy", "accuracy (%)"),
                  ("holdout_accuracy", "held-out accuracy (%)"),
                  ("learning_rate", "learning rate"), ("weight_decay", "weight decay"),
                  ("pooling", "pooling"))


def choices_markdown(spec: Choices, records: list[dict]) -> str:
  """``spec``'s table: a row per matching run with a choice, ordered by its
  labels as they first appear, then by seed; columns only for the fields
  some row has."""
  rows_of = [r for r in records if _matches(r["labels"], spec.where) and "choice" in r]
  order = _ordered(tuple(r["labels"].get(k) for k in spec.rows) for r in rows_of)
  rows_of.sort(key=lambda r: (order.index(tuple(r["labels"].get(k) for k in spec.rows)),
                              r["labels"].get(SEED, 0)))
  fields = [(k, name) for k, name in CHOICE_COLUMNS
            if any(r["choice"].get(k) is not None for r in rows_of)]

  def cell(key, value):
    if value is None:
      return "—"
    if key.endswith("accuracy"):
      return f"{100 * value:.2f}"
    return f"{value:g}" if isinstance(value, float) else str(value)

  header = list(spec.rows) + [SEED] + [name for _, name in fields]
  lines = [f"**{spec.title}**", "", "| " + " | ".join(header) + " |",
           "|" + "---|" * len(header)]
  for r in rows_of:
    row = [str(r["labels"].get(k)) for k in spec.rows + (SEED,)]
    row += [cell(k, r["choice"].get(k)) for k, _ in fields]
    lines.append("| " + " | ".join(row) + " |")
  return "\n".join(lines)


def difference(a: list[float], b: list[float]) -> tuple[float, float] | None:
  """``(mean(a) - mean(b), its standard error)`` by Welch; None when a side
  has fewer than two values (no spread to compare against)."""
  if len(a) < 2 or len(b) < 2:
    return None
  se = float(np.sqrt(np.var(a, ddof=1) / len(a) + np.var(b, ddof=1) / len(b)))
  return float(np.mean(a) - np.mean(b)), se


def standard_errors(diff: float, se: float) -> float:
  """``|diff| / se``, rounded down to a tenth: the figure the report prints
  and ``verdict`` reads, so that a printed 3.0 is never "suggestive"."""
  if se <= 0:
    return 0.0 if diff == 0 else float("inf")
  return math.floor(10 * abs(diff) / se) / 10


def verdict(diff: float, se: float) -> str:
  """At least three standard errors: beyond noise; two: suggestive; less:
  within noise. (With 3 seeds a side, two standard errors is roughly the 5%
  level of a t-test; three leaves room for the many claims read at once.)"""
  ratio = standard_errors(diff, se)
  return "beyond noise" if ratio >= 3 else "suggestive" if ratio >= 2 else "within noise"


def comparisons_markdown(comparisons, records: list[dict]) -> str:
  lines = ["**Comparisons** (difference of means ± its standard error; runs pooled "
           "over seeds and over the labels a claim leaves open)", "",
           "| claim | metric | a | b | a - b | reading |", "|---|---|---|---|---|---|"]
  for c in comparisons:
    a, b = (grouped(records, (), c.metric, {**c.where, **side}).get((), [])
            for side in (c.a, c.b))
    d = difference(a, b)
    scale, digits = _unit(c.metric), (2 if "accuracy" in c.metric else 4)
    if d is None:
      diff, reading = "—", "too few runs (two a side needed)"
    else:
      diff = (f"{scale * d[0]:+.{digits}f} ± {scale * d[1]:.{digits}f} "
              f"({standard_errors(*d):.1f} SE)")
      reading = verdict(*d)
    lines.append(f"| {c.claim} | {c.metric} | {fmt(c.metric, a)} | {fmt(c.metric, b)} | "
                 f"{diff} | {reading} |")
  return "\n".join(lines)


def provenance_markdown(records: list[dict]) -> list[str]:
  """Which rows read an earlier execution of a stage than its stage file
  holds, and which leave stages out because the execution they started
  from is not recorded (studies/runner.py, "Provenance"); nothing when
  every row reads the stage files' executions."""
  older = [r for r in records if r.get("superseded")]
  unrecorded = [r for r in records if r.get("unrecorded")]
  if not older and not unrecorded:
    return []
  parts = ["## Which executions the rows read", ""]
  if older:
    parts += ["These runs read an execution that a later rerun of the same stage replaced "
              "in `stages/`; their rows take it from `superseded/`:", ""]
    parts += [f"- {r['run']}: {', '.join(r['superseded'])}" for r in older] + [""]
  if unrecorded:
    parts += ["These runs started from an execution that is not recorded (a rerun "
              "replaced it before it was kept); their rows leave out those stages' "
              "metrics, such as the pretraining loss:", ""]
    parts += [f"- {r['run']}: {', '.join(r['unrecorded'])}" for r in unrecorded] + [""]
  return parts


def slug(title: str) -> str:
  return re.sub(r"[^a-z0-9]+", "_", title.lower()).strip("_")


# ------------------------------------------------------------------ plots


def plot(spec, records: list[dict], path: pathlib.Path) -> str:
  """Draws ``spec`` into ``path`` (PNG); returns markdown to put under it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  note = ""
  if isinstance(spec, Heatmap):
    facets = _ordered(r["labels"].get(spec.facet) for r in records
                      if _matches(r["labels"], spec.where)) if spec.facet else [None]
    fig, axes = plt.subplots(1, len(facets), figsize=(4.2 * len(facets), 3.8), squeeze=False)
    for ax, facet in zip(axes[0], facets):
      where = dict(spec.where, **({spec.facet: facet} if spec.facet else {}))
      g = grouped(records, (spec.x, spec.y), spec.metric, where)
      xs = sorted({k[0] for k in g})
      ys = sorted({k[1] for k in g})
      grid = np.full((len(ys), len(xs)), np.nan)
      for (x, y), v in g.items():
        grid[ys.index(y), xs.index(x)] = np.mean(v)
      scale = _unit(spec.metric)
      im = ax.imshow(grid * scale, origin="lower", cmap="viridis")
      for i in range(len(ys)):
        for j in range(len(xs)):
          if np.isfinite(grid[i, j]):
            ax.text(j, i, f"{grid[i, j] * scale:.1f}", ha="center", va="center",
                    color="w", fontsize=8)
      ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
      ax.set_yticks(range(len(ys)), [f"{y:g}" for y in ys])
      ax.set_xlabel(spec.x)
      ax.set_ylabel(spec.y)
      ax.set_title(f"{spec.facet}={facet}" if spec.facet else spec.metric)
      fig.colorbar(im, ax=ax, fraction=0.046)
  elif isinstance(spec, Lines):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    g = grouped(records, (spec.series, spec.x), spec.metric, spec.where)
    for s in _ordered(k[0] for k in g):
      pts = sorted((k[1], v) for k, v in g.items() if k[0] == s)
      xs = [p[0] for p in pts]
      means = [np.mean(p[1]) for p in pts]
      errs = [np.std(p[1], ddof=1) if len(p[1]) > 1 else 0.0 for p in pts]
      ax.errorbar(xs, means, yerr=errs, marker="o", capsize=3, label=str(s))
    ax.set_xscale("log")
    ax.set_xlabel(spec.x)
    ax.set_ylabel(spec.metric)
    ax.legend()
  elif isinstance(spec, Scatter):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    notes = []
    for s in _ordered(r["labels"].get(spec.series) for r in records
                      if _matches(r["labels"], spec.where)):
      pts = [(r["metrics"][spec.x_metric], r["metrics"][spec.y_metric]) for r in records
             if _matches(r["labels"], dict(spec.where, **{spec.series: s}))
             and r["metrics"].get(spec.x_metric) is not None
             and r["metrics"].get(spec.y_metric) is not None]
      if not pts:
        continue
      x, y = np.asarray(pts, np.float64).T
      ax.scatter(x, y, label=str(s))
      notes.append(f"{spec.series}={s}: {correlations(x, y)}")
    ax.set_xlabel(spec.x_metric)
    ax.set_ylabel(spec.y_metric)
    ax.legend()
    note = "; ".join(notes)
  elif isinstance(spec, DepthCurves):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for r in records:
      if not _matches(r["labels"], spec.where):
        continue
      blocks = sorted((k, v) for k, v in r["metrics"].items()
                      if k.startswith(spec.prefix) and v is not None)
      if not blocks:
        continue
      depth = np.arange(1, len(blocks) + 1) / len(blocks)
      ax.plot(depth, [100 * v for _, v in blocks], marker="o",
              label=", ".join(f"{k}={r['labels'].get(k)}" for k in spec.series))
    ax.set_xlabel("relative depth of the block")
    ax.set_ylabel("probe accuracy (%)")
    ax.legend(fontsize=7)
  else:
    raise TypeError(f"unknown plot spec {type(spec).__name__}")
  fig.suptitle(spec.title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return note


def correlations(x, y) -> str:
  """Pearson and Spearman correlation of two samples, as text."""
  if len(x) < 3:
    return f"n={len(x)} (too few points for a correlation)"
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if np.ptp(x) == 0 or np.ptp(y) == 0:
    return f"n={len(x)} (constant values)"
  from scipy import stats
  pearson = stats.pearsonr(x, y)[0]
  spearman = stats.spearmanr(x, y)[0]
  return f"n={len(x)}, Pearson r={pearson:.2f}, Spearman rho={spearman:.2f}"


# ----------------------------------------------------------------- report


def write(study, records: list[dict], folder: pathlib.Path, *, scale: str, seeds: int,
          missing: list[str], commands: list[str],
          missing_comparators: list[str] = ()) -> pathlib.Path:
  """``<folder>/README.md`` with the tables and plots of ``study``; ``records``
  include the comparators' rows (``missing_comparators``: the commands of
  those without a result file)."""
  folder.mkdir(parents=True, exist_ok=True)
  parts = [f"# {study.title}", "", f"Study `{study.name}`, scale `{scale}`, {seeds} seed(s); "
           f"{len(study.runs) - len(missing)} of {len(study.runs)} runs complete. Made by "
           f"`python -m darl_jax.studies --study={study.name} --scale={scale}`.", "",
           "## The paper", "", study.paper.strip(), "", "## Results", ""]
  for table in study.tables:
    render = choices_markdown if isinstance(table, Choices) else table_markdown
    parts += [render(table, records), ""]
  if study.comparisons:
    parts += [comparisons_markdown(study.comparisons, records), ""]
  for spec in study.plots:
    name = slug(spec.title) + ".png"
    note = plot(spec, records, folder / name)
    parts += [f"![{spec.title}]({name})", ""]
    if note:
      parts += [note, ""]
  parts += provenance_markdown(records)
  if missing or missing_comparators:
    parts += ["## Missing runs", ""] + [f"- {m}" for m in (*missing, *missing_comparators)]
    parts += [""]
  parts += ["## Stages", "", "Each distinct stage as a command (the runner executes the same "
            "config in-process; `<work>` is the study's work folder):", "", "```"]
  parts += commands + ["```", ""]
  path = folder / "README.md"
  path.write_text("\n".join(parts))
  return path
