"""``python -m darl_jax.studies --study=<name>[,<name>...|all] --scale=fmnist``.

Runs what is missing of the studies, then writes each study's report
(``<out>/<study>/README.md`` with tables and plots). Rerun the same command
after a kill: finished stages are kept, the rest runs (a half-finished stage
resumes from its checkpoint).

  --scale     tiny (seconds on CPU) | fmnist (Fashion-MNIST, one GPU) | imagenet
  --out       results and reports (default reports/studies/<scale>)
  --work      stage workdirs: checkpoints, logs (default workdirs/studies/<scale>)
  --seeds     seeds per configuration (default: the scale's choice per study)
  --parallel  stages run at once as subprocesses (GPU: 6-8; CPU: 1)
  --stop_after_minutes  start no stage after this long (split a study over jobs)
  --runs      run only the runs whose name matches this regular expression
              (names as --list prints them: "init=DARL mse,protocol=fine-tune,...");
              the reports still cover every run
  --set       data.path=... and other settings that do not change results
  --rerun     run every stage of the --runs selection again, done or not (after
              a fix, or to read one execution of a chain throughout); the
              files they replace move to <out>/superseded/
  --list      print the runs and their stages' commands, run nothing
  --report_only  write the reports from the results there are

Every error is one ``error:`` line. Exit status (darl_jax/cli.py, as every
command): 0 every stage ran (or was done); 1 a stage failed (the line names
it and its log; an unexpected error names its traceback file); 2 bad input
(an unknown flag, a value of the wrong type, an unknown --scale or study, a
--runs that is not a regular expression, a --set key that changes results);
130 interrupted; 143 terminated (SIGTERM: the stages stop and resume on the
next run).
"""

from __future__ import annotations

import re
import signal
import sys

from absl import app, flags, logging

from darl_jax import cli as cli_lib
from darl_jax.studies import catalog
from darl_jax.studies import report as report_lib
from darl_jax.studies import runner as runner_lib
from darl_jax.studies import spec as S

_STUDY = flags.DEFINE_string("study", None, "Study names, comma-separated, or 'all'.")
_SCALE = flags.DEFINE_enum("scale", "fmnist", list(S.SCALES), "The studies' scale.")
_OUT = flags.DEFINE_string("out", None, "Results and reports folder.")
_WORK = flags.DEFINE_string("work", None, "Stage workdirs folder.")
_SEEDS = flags.DEFINE_integer("seeds", 0, "Seeds per configuration; 0 = the scale's default.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Stages at once (subprocesses when > 1).")
_STOP = flags.DEFINE_float("stop_after_minutes", 0.0, "Start no stage after this many minutes.")
_SET = flags.DEFINE_multi_string("set", [], "key=value for every stage (paths, not settings).")
_RUNS = flags.DEFINE_string("runs", None, "Regex: run only the runs whose name matches.")
_RERUN = flags.DEFINE_bool("rerun", False, "Run the --runs selection's stages again, "
                           "done or not; replaced files move to <out>/superseded/.")
_LIST = flags.DEFINE_bool("list", False, "Print runs and commands; run nothing.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only write the reports.")
_STAGE = flags.DEFINE_string("stage", None, "(internal) run this one stage id in-process.")


def studies(names: str, scale: S.Scale, seeds: int) -> list[S.Study]:
  if not names:
    raise ValueError(f"--study is required; valid: all, {', '.join(catalog.STUDIES)}")
  chosen = list(catalog.STUDIES) if names == "all" else names.split(",")
  return [catalog.get_study(n, scale, seeds) for n in chosen]


def selected(study: S.Study, pattern: str | None) -> list[S.Run]:
  """The study's runs whose name matches ``pattern`` (all when None)."""
  if not pattern:
    return list(study.runs)
  try:
    regex = re.compile(pattern)
  except re.error as e:
    raise ValueError(f"--runs {pattern!r} is not a regular expression: {e}") from None
  return [run for run in study.runs if regex.search(run.name)]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  scale = S.get_scale(_SCALE.value)
  out = _OUT.value or f"reports/studies/{scale.name}"
  work = _WORK.value or f"workdirs/studies/{scale.name}"
  try:   # what the flags name: bad input (status 2), as for every command
    chosen = studies(_STUDY.value, scale, _SEEDS.value)
    runner = runner_lib.Runner(out, work, S.parse_set(_SET.value))
    stages = S.distinct_stages([s for study in chosen for run in selected(study, _RUNS.value)
                                 for s in run.stages])
    if _RERUN.value and not _RUNS.value:
      raise ValueError("--rerun needs --runs=<regex>: the runs to execute again "
                       "(--list prints their names)")
  except ValueError as e:
    raise app.UsageError(str(e)) from None

  if _STAGE.value:
    by_id = {s.id: s for s in stages}
    if _STAGE.value not in by_id:
      raise ValueError(f"stage {_STAGE.value} is not part of --study={_STUDY.value}")
    _compilation_cache(runner)
    runner.run_stage(by_id[_STAGE.value])
    return

  if _LIST.value:
    for study in chosen:
      print(f"# {study.name}: {len(study.runs)} runs, {len(study.stages())} stages")
      for run in selected(study, _RUNS.value):
        print(f"{run.name}: {' -> '.join(s.id for s in run.stages)}")
    todo = runner.plan(stages, _RERUN.value)
    print(f"# {len(stages)} distinct stages; {len(todo)} to run "
          f"({S.training_images(todo)})")
    for s in todo:
      print(runner.command(s))
    return

  failed = []
  # A scheduler's SIGTERM (preemption, timeout) unwinds like Ctrl-C, so the
  # runner stops the stages it started; all of them resume on the next run.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  if not _REPORT_ONLY.value:
    _compilation_cache(runner)
    child_args = [f"--study={_STUDY.value}", f"--scale={scale.name}", f"--out={runner.out}",
                  f"--work={runner.work}", f"--seeds={_SEEDS.value}"]
    child_args += [f"--set={s}" for s in _SET.value]
    failed = runner.run(stages, parallel=_PARALLEL.value,
                        stop_after_minutes=_STOP.value, child_args=child_args,
                        rerun=_RERUN.value)
  for study in chosen:
    records, missing = runner_lib.records(runner, study)
    comparators, absent = runner_lib.comparator_records(runner, study)
    seeds = _SEEDS.value or scale.seeds.get(study.name, 1)
    commands = [runner.command(s, portable=True) for s in study.stages()]
    path = report_lib.write(study, records + comparators, runner.out / study.name,
                            scale=scale.name, seeds=seeds, missing=missing, commands=commands,
                            missing_comparators=absent)
    print(f"{study.name}: {len(records)}/{len(study.runs)} runs complete; report {path}")
  if failed:
    print(f"error: {len(failed)} stage(s) failed: {', '.join(failed)} (logs in {runner.work})",
          file=sys.stderr)
    sys.exit(1)


def _compilation_cache(runner) -> None:
  """One persistent XLA cache for all stages (repeated shapes compile once)."""
  import jax
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", str(runner.work / "jax_cache"))


def cli(argv=None):
  logging.set_verbosity(logging.INFO)
  cli_lib.run(main, argv=argv, workdir=lambda: _WORK.value, resumable=True)


if __name__ == "__main__":
  cli()
