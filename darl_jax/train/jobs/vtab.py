"""VTAB-1k: per task, sweep on train800/val200, retrain the best on 1000, test.

Protocol (appendix "VTAB", following Zhai et al.): for each task, fine-tune
with every point of the sweep on ``train800`` and evaluate on ``val200``; pick
the best validation accuracy (ties: the first point in sweep order); retrain
that point on ``train800val200`` and report top-1 on ``test``. Every run is
an ordinary fine-tuning run (``FinetuneTrainer`` on the shared loop) in its
own sub-workdir::

    <workdir>/<task>/sweep/<point>/   metrics.jsonl, checkpoints, result.json
    <workdir>/<task>/final/           the retrain on 1000 examples, tested
    <workdir>/<task>/result.json      the sweep's scores, the pick, the test accuracy
    <workdir>/vtab_results.md|json    the table: tasks, group means, mean

A sub-run with a ``result.json`` is finished and is skipped when the command
is run again; an unfinished one resumes from its newest checkpoint (the
loop's contract), so the whole suite is resumable at any point. Result files
are written whole or not at all (``files.write_json_atomic``), so a kill
never leaves a marker that claims a run finished or cannot be read.

Programs. The tasks share their compiled programs: the head has
``vtab_tasks.MAX_CLASSES`` outputs for every task (``head.num_classes``),
the classes a task lacks masked (models/heads.py; the masked head trains as
an unpadded one), so the train and evaluation steps of every task at one
input resolution and batch are the same program, which JAX's persistent
compilation cache (``compilation_cache_dir``, on by default) hands from the
first run to the next, in this process and in a rerun. The learning rate and
weight decay are inputs of the step; a sweep point's drop path,
augmentation (mixup) and layer decay are constants of its train step, so the
paper's grid has 3 x 2 x 3 = 18 train steps per resolution and batch, each
shared by all tasks (evaluation: one). Each run's ``result.json``, each
task's result and the suite's table say how many programs were compiled
(train/compile_count.py); the driver logs it at the end.

Fixed recipe (table "Hyperparameters for VTAB Experiments"): label smoothing
0.1, AdamW (0.9, 0.95), batch 256, cosine, 20000 steps, causal attention.
The table's "Warm-up epochs 3000" can only be steps (20000 steps of 256 are
5120 epochs of 1000 examples; 3000 epochs would never end the warm-up), so we
use 3000 warm-up steps. The sweep: drop path {0, 0.1, 0.2} x augmentation
{spatial, RandAug(9, 0.5) + mixup 0.8 + cutmix 1.0} x weight decay {0.1,
0.3} x lr {1e-3, 1e-2, 1e-1} x layer decay {0.7, 0.8, 0.9} = 108 runs per
task.

Run: ``python -m darl_jax.train.vtab --config=experiments/vtab.py:task=all,init=<dir>
--workdir=<dir>`` (main.py's trainers are single loops; this driver runs many).
Every error is one ``error:`` line, with darl_jax/cli.py's exit statuses
(``cli``'s docstring): 2 bad input, 1 a run that could not do its work.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Callable

import ml_collections
from absl import app, flags, logging
from etils import epath

from darl_jax import cli as cli_lib
from darl_jax import files
from darl_jax import metrics as metrics_lib
from darl_jax import workdir as workdir_lib
from darl_jax.data.sources import vtab_tasks
from darl_jax.train import classifier
from darl_jax.train import compile_count
from darl_jax.train import trainers as trainers_lib

PAPER_SWEEP = {
    "drop_path": [0.0, 0.1, 0.2],
    "augment": ["spatial", "randaug_mixup"],
    "weight_decay": [0.1, 0.3],
    "lr": [1e-3, 1e-2, 1e-1],
    "layer_decay": [0.7, 0.8, 0.9],
}
AUGMENTS = ("spatial", "randaug_mixup")
JOB = "vtab"      # the suite folder's job kind (its config.json)


def vtab_config() -> ml_collections.ConfigDict:
  """``finetune_config`` re-set to the VTAB table, plus ``vtab.{tasks, sweep}``."""
  c = classifier.finetune_config()
  c.batch_size = 256
  c.total_steps = 20_000
  c.log_every_steps = 100
  c.eval_every_steps = 0        # the driver evaluates once, at the end of each run
  c.checkpoint_every_steps = 2000
  c.keep_checkpoints = 1
  c.data.update(name="vtab", image_size=224, channels=3, augment="spatial",
                train_split="train800", eval_split="val200")
  c.data.vtab_task = "cifar100"
  c.data.vtab_source = "tfds"     # or "synthetic" (vtab_tasks: random images, no TFDS)
  c.data.vtab_train_examples = vtab_tasks.TRAIN_EXAMPLES
  c.data.vtab_val_examples = vtab_tasks.VAL_EXAMPLES
  c.model.update(causal=True, image_size=224, reference_image_size=224, channels=3)
  c.label_smoothing = 0.1
  # One head size for every task: their programs are the same (module docstring).
  c.head.num_classes = vtab_tasks.MAX_CLASSES
  c.optim.update(name="adamw", b1=0.9, b2=0.95, lr_scaling=False, warmup_steps=3000,
                 warmup_epochs=0.0, schedule="cosine")
  c.vtab = ml_collections.ConfigDict({
      "tasks": "all",                      # "all", or comma-separated task names
      "sweep": ml_collections.ConfigDict({k: list(v) for k, v in PAPER_SWEEP.items()}),
  })
  return c


# ------------------------------------------------------------------ sweep


def sweep_points(grid) -> list[dict]:
  """Cartesian product of ``{key: [values]}`` in key order (deterministic)."""
  keys = list(PAPER_SWEEP)
  unknown = set(grid.keys()) - set(keys)
  if unknown:
    raise ValueError(f"unknown vtab.sweep keys {sorted(unknown)}; valid: {keys}")
  values = [list(grid[k]) for k in keys]
  return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def point_name(point: dict) -> str:
  return (f"dp{point['drop_path']:g}_{point['augment']}_wd{point['weight_decay']:g}"
          f"_lr{point['lr']:g}_ld{point['layer_decay']:g}")


def apply_point(config, point: dict, *, task: str, train_split: str, eval_split: str):
  """A copy of ``config`` for one run: the task, its splits and the sweep point."""
  c = ml_collections.ConfigDict(config.to_dict())
  del c["vtab"]
  c.data.update(vtab_task=task, train_split=train_split, eval_split=eval_split)
  c.model.drop_path = float(point["drop_path"])
  if point["augment"] not in AUGMENTS:
    raise ValueError(f"unknown VTAB augment {point['augment']!r}; valid: {AUGMENTS}")
  heavy = point["augment"] == "randaug_mixup"
  c.data.augment = "spatial"
  c.randaugment.num_ops = 2 if heavy else 0
  c.mixup.update(mixup_alpha=0.8 if heavy else 0.0, cutmix_alpha=1.0 if heavy else 0.0)
  c.optim.update(weight_decay=float(point["weight_decay"]), base_lr=float(point["lr"]),
                 layer_decay=float(point["layer_decay"]))
  c.eval_every_steps = c.total_steps       # one evaluation, at the end
  return c


def run_one(config, workdir: epath.Path) -> float:
  """Trains one fine-tuning run (resumable) -> its final ``val_accuracy``."""
  from darl_jax.train import loop  # pylint: disable=g-import-not-at-top
  done = files.read_json_or_none(workdir / "result.json")
  if done is not None and "accuracy" in done:
    return float(done["accuracy"])
  # Not marked finished (or the marker is unreadable): the loop resumes from
  # the run's last checkpoint. A run killed after its last step but before
  # the marker has nothing left to train; its final evaluation is then the
  # last val_accuracy in its metrics.jsonl.
  count = compile_count.Count()
  last = loop.run(trainers_lib.get_trainer("finetune")(config), config, str(workdir))
  if "val_accuracy" not in last:
    last = metrics_lib.final_metrics(str(workdir))
    if last.get("val_accuracy") is None:
      raise RuntimeError(f"{workdir} finished training but logged no val_accuracy; "
                         f"delete the folder to rerun it")
  acc = float(last["val_accuracy"])
  files.write_json_atomic(workdir / "result.json",
                          {"accuracy": acc, "eval_split": config.data.eval_split,
                           "programs": count.report()})
  return acc


def run_task(config, workdir, task: str, runner: Callable = run_one) -> dict:
  """Sweep, pick, retrain, test one task; writes and returns ``<task>/result.json``."""
  info = vtab_tasks.get_task(task)
  root = epath.Path(workdir) / task
  count = compile_count.Count()
  scores = {}
  points = sweep_points(config.vtab.sweep)
  for point in points:
    name = point_name(point)
    cfg = apply_point(config, point, task=task, train_split="train800", eval_split="val200")
    scores[name] = runner(cfg, root / "sweep" / name)
    logging.info("vtab %s %s: val %.4f", task, name, scores[name])
  best = max(points, key=lambda p: scores[point_name(p)])   # first of equals wins
  cfg = apply_point(config, best, task=task, train_split="train800val200",
                    eval_split="test")
  test = runner(cfg, root / "final")
  result = {"task": task, "group": info.group, "val_accuracy": scores,
            "best": point_name(best), "best_point": best, "test_accuracy": test,
            "programs": count.report()}   # this process's work on the task
  files.write_json_atomic(root / "result.json", result, indent=1)
  logging.info("vtab %s: best %s, test %.4f", task, point_name(best), test)
  logging.info("%s", count.line(f"vtab {task}"))
  return result


def task_names(spec: str) -> list[str]:
  if spec == "all":
    return list(vtab_tasks.TASKS)
  names = [s.strip() for s in spec.split(",") if s.strip()]
  for n in names:
    vtab_tasks.get_task(n)
  return names


def results_table(results: list[dict], programs_line: str = "") -> str:
  """Markdown: one row per task (group order), group means, the mean over
  tasks, and ``programs_line`` (what the suite compiled) below them."""
  by_group = {g: [r for r in results if r["group"] == g] for g in vtab_tasks.GROUPS}
  lines = ["| group | task | best sweep point | test top-1 (%) |", "|---|---|---|---|"]
  for group, rows in by_group.items():
    for r in rows:
      lines.append(f"| {group} | {r['task']} | {r['best']} | {100 * r['test_accuracy']:.1f} |")
  lines += ["", "| group | tasks | mean top-1 (%) |", "|---|---|---|"]
  for group, rows in by_group.items():
    if rows:
      mean = 100 * sum(r["test_accuracy"] for r in rows) / len(rows)
      lines.append(f"| {group} | {len(rows)} | {mean:.1f} |")
  if results:
    mean = 100 * sum(r["test_accuracy"] for r in results) / len(results)
    lines.append(f"| all | {len(results)} | {mean:.1f} |")
  if programs_line:
    lines += ["", programs_line]
  return "\n".join(lines) + "\n"


def run_suite(config, workdir, runner: Callable = run_one) -> list[dict]:
  """Runs ``config.vtab.tasks``; writes ``vtab_results.md`` and ``.json`` in ``workdir``.

  The suite's folder is checked as a run's workdir is (darl_jax/workdir.py):
  never inside the pretraining run it reads (``init_from``), never a
  workdir of another job kind; its ``config.json`` records the kind ``vtab``.
  """
  workdir_lib.check_not_in_source(str(workdir), config.get("init_from", ""))
  workdir = workdir_lib.prepare(workdir)
  workdir_lib.check_job(workdir, JOB)
  files.write_text_atomic(workdir / workdir_lib.CONFIG_NAME, json.dumps(
      {**config.to_dict(), workdir_lib.JOB_KEY: JOB}, indent=2, sort_keys=True,
      default=str) + "\n")
  if not config.get("compilation_cache_dir") and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    logging.warning("compilation_cache_dir is empty: every VTAB run compiles its own "
                    "programs; set it (e.g. ~/.cache/darl_jax/jax) to share them")
  count = compile_count.Count()
  results = []
  for task in task_names(config.vtab.tasks):
    results.append(run_task(config, workdir, task, runner))
    line = "Programs (this process): " + count.line("the suite")
    files.write_json_atomic(workdir / "vtab_results.json", results, indent=1)
    files.write_text_atomic(workdir / "vtab_results.md", results_table(results, line))
  logging.info("%s", count.line(f"vtab ({len(results)} tasks)"))
  return results


def main(argv, config, workdir):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if config is None or not workdir:
    raise app.UsageError("--config=experiments/vtab.py:task=... and --workdir are required")
  run_suite(config, workdir)


def cli(argv=None):
  """The command. Every error is one ``error:`` line; exit status
  (darl_jax/cli.py, as every command): 0 done; 1 a run could not do its
  work (data, a checkpoint, a refused resume; an unexpected error names its
  traceback file); 2 bad input (an unknown flag or config key, a bad value,
  a --config file that does not exist or does not load); 130 interrupted;
  143 terminated. A rerun resumes."""
  # Flags are defined here, not at import, and once (cli_lib), so that tests
  # and main.py can import this module without a clash over --config/--workdir.
  cli_lib.define_config_flag("experiments/vtab.py[:args]")
  if "workdir" not in flags.FLAGS:
    flags.DEFINE_string("workdir", None, "Root directory of the suite's runs.")
  logging.set_verbosity(logging.INFO)
  cli_lib.run(lambda argv: main(argv, cli_lib.loaded_config(), flags.FLAGS.workdir),
              argv=argv, workdir=lambda: flags.FLAGS.workdir, resumable=True)


if __name__ == "__main__":
  cli()
