"""The training side's rooms (docs/ARCHITECTURE.md): the engine (darl_jax/train/*.py),
the trainers (train/trainers/) and the jobs (train/jobs/).

A trainer or a job imports the engine, never another trainer or job: what two of them
share (a base class, an evaluator, the probe grid) lives on the engine side, and the
registry (train/trainers/__init__.py) is the one place that names the trainers. The
engine imports no trainer or job, except the command that runs the VTAB job
(train/vtab.py). Read from the source with test_imports.py's graph, every import
counted, function-level ones included.
"""

from test_imports import _graph

ROOMS = ("darl_jax.train.trainers.", "darl_jax.train.jobs.")
REGISTRY = "darl_jax.train.trainers"
COMMANDS = {"darl_jax.train.vtab"}   # `python -m darl_jax.train.vtab` runs jobs/vtab.py


def _rooms(graph) -> set[str]:
  return {name for name in graph if name.startswith(ROOMS)}


def test_no_trainer_or_job_imports_another():
  graph = _graph()
  rooms = _rooms(graph)
  assert {"darl_jax.train.trainers.finetune", "darl_jax.train.trainers.supervised",
          "darl_jax.train.trainers.pretrain", "darl_jax.train.jobs.vtab"} <= rooms
  crossing = sorted((name, target) for name in rooms for target in graph[name]
                    if target in rooms)
  assert not crossing, ("a trainer or job imports another (move what they share to "
                        f"darl_jax/train/): {crossing}")


def test_the_engine_imports_no_trainer_or_job():
  graph = _graph()
  rooms = _rooms(graph)
  engine = {name for name in graph if name.startswith("darl_jax.train.")
            and name not in rooms and name not in (REGISTRY, "darl_jax.train.jobs")}
  assert {"darl_jax.train.backbone", "darl_jax.train.classifier", "darl_jax.train.probe",
          "darl_jax.train.evaluators", "darl_jax.train.probe_grid",
          "darl_jax.train.transfer"} <= engine
  upward = sorted((name, target) for name in engine - COMMANDS for target in graph[name]
                  if target in rooms or target == REGISTRY)
  assert not upward, f"the engine imports a trainer or job: {upward}"
