"""A job never writes into another run's workdir (darl_jax/workdir.py): not into
the run it reads (``init_from``), not into a workdir of another job kind, not
through a link planted in it, not into a directory of another user."""

import json
import os
import pathlib
import runpy
import socket

import jax.numpy as jnp
import pytest

from darl_jax import checkpoint as checkpoint_lib
from darl_jax import metrics as metrics_lib
from darl_jax import workdir as workdir_lib
from darl_jax.train.trainers import attentive_probe
from darl_jax.train.jobs import fewshot
from darl_jax.train.trainers import finetune
from darl_jax.train.jobs import knn
from darl_jax.train.trainers import linear_probe
from darl_jax.train import loop
from darl_jax.train.jobs import sample
from darl_jax.train import trainers
from darl_jax.train.jobs import vtab

import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
METRICS = '{"step": 4, "loss": 0.5}\n{"step": 8, "loss": 0.25}\n'


def pretraining_run(workdir: pathlib.Path) -> pathlib.Path:
  """A pretraining run's files: config.json, metrics.jsonl and a checkpoint
  (its meta without the config, so readers take config.json)."""
  workdir.mkdir(parents=True)
  (workdir / "config.json").write_text(json.dumps(tiny_config.get_config().to_dict()))
  (workdir / "metrics.jsonl").write_text(METRICS)
  with checkpoint_lib.Checkpointer(str(workdir / "checkpoints"), async_save=False) as ckpt:
    ckpt.save(8, {"params": {"w": jnp.zeros(2)}, "step": jnp.asarray(8)}, {"step": 8})
  return workdir


def snapshot(workdir: pathlib.Path) -> dict:
  return {str(p.relative_to(workdir)): p.read_bytes() if p.is_file() else None
          for p in sorted(workdir.rglob("*"))}


def downstream_config(job: str, init_from: str):
  c = {"sample": sample.sample_config, "fewshot": fewshot.fewshot_config,
       "knn": knn.knn_config, "finetune": finetune.finetune_config,
       "linear_probe": linear_probe.linear_probe_config,
       "attentive_probe": attentive_probe.attentive_probe_config}[job]()
  c.init_from = init_from
  c.tensorboard = False
  return c


def run_job(job: str, config, workdir: str):
  if job in ("sample", "fewshot", "knn"):
    return {"sample": sample.run, "fewshot": fewshot.run, "knn": knn.run}[job](config, workdir)
  return loop.run(trainers.get_trainer(job)(config), config, workdir)


# ------------------------------------------------------ the run a job reads


@pytest.mark.parametrize("job", ["sample", "fewshot", "knn", "finetune", "linear_probe",
                                 "attentive_probe"])
def test_a_downstream_job_refuses_the_workdir_of_the_run_it_reads(tmp_path, job):
  pre = pretraining_run(tmp_path / "pre")
  before = snapshot(pre)
  config = downstream_config(job, str(pre))
  with pytest.raises(workdir_lib.WorkdirError) as e:
    run_job(job, config, str(pre))
  message = str(e.value)
  assert "\n" not in message
  assert f"--workdir {pre} is inside the run this job reads (init_from {pre})" in message
  assert f"pass a --workdir outside {pre}" in message
  assert snapshot(pre) == before       # metrics.jsonl, config.json: untouched; no lock


@pytest.mark.parametrize("init_from,workdir", [
    ("pre", "pre"),
    ("pre", "pre/eval"),
    ("pre/", "pre/./eval/../eval"),
    ("pre/checkpoints", "pre"),            # the run that holds the checkpoints
    ("pre/checkpoints/8", "pre/probe"),
    ("pre/checkpoints/8", "pre/checkpoints/8/out"),
    ("link", "pre/eval"),                  # resolved through a symbolic link
    ("pre", "link/eval"),
])
def test_a_workdir_in_the_run_it_reads_is_refused_before_anything_is_made(
    tmp_path, monkeypatch, init_from, workdir):
  monkeypatch.chdir(tmp_path)
  pretraining_run(tmp_path / "pre")
  (tmp_path / "link").symlink_to(tmp_path / "pre")
  before = snapshot(tmp_path / "pre")
  config = finetune.finetune_config()
  config.init_from = init_from
  with pytest.raises(workdir_lib.WorkdirError, match="pass a --workdir outside"):
    workdir_lib.prepare(workdir, config)
  assert snapshot(tmp_path / "pre") == before


@pytest.mark.parametrize("init_from,workdir", [
    ("pre", "pre2"),                       # a shared prefix is not containment
    ("pre/checkpoints/8", "runs/probe"),
    ("pre/eval", "pre"),                   # the parent of init_from is not inside it
    ("", "pre"),                           # a random backbone reads no run
])
def test_a_workdir_beside_the_run_it_reads_is_accepted(tmp_path, monkeypatch, init_from,
                                                        workdir):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "pre" / "eval").mkdir(parents=True)
  config = finetune.finetune_config()
  config.init_from = init_from
  assert str(workdir_lib.prepare(workdir, config)) == str(tmp_path / workdir)


def test_remote_paths_are_compared_as_strings():
  check = workdir_lib.check_not_in_source
  for workdir in ("gs://b/pre", "gs://b/pre/", "gs://b/pre/probe"):
    with pytest.raises(workdir_lib.WorkdirError, match="outside gs://b/pre"):
      check(workdir, "gs://b/pre")
  with pytest.raises(workdir_lib.WorkdirError, match="outside gs://b/pre"):
    check("gs://b/pre", "gs://b/pre/checkpoints/100")
  check("gs://b/pre2", "gs://b/pre")
  check("gs://c/pre", "gs://b/pre")
  check("/b/pre", "gs://b/pre")


def test_the_vtab_suite_refuses_a_folder_in_the_run_it_reads(tmp_path):
  pre = pretraining_run(tmp_path / "pre")
  before = snapshot(pre)
  c = runpy.run_path(str(ROOT / "experiments" / "vtab.py"))["get_config"](
      f"task=dtd,init={pre}")
  with pytest.raises(workdir_lib.WorkdirError, match=f"pass a --workdir outside {pre}"):
    vtab.run_suite(c, pre / "vtab", runner=lambda cfg, wd: pytest.fail("ran"))
  assert snapshot(pre) == before


# ------------------------------------------------------------- job kinds


def test_config_json_records_the_job_kind(tmp_path):
  with metrics_lib.MetricWriter(str(tmp_path), tensorboard=False) as writer:
    writer.start(None, {"trainer": "knn", "seed": 0})
  assert json.loads((tmp_path / "config.json").read_text())["job"] == "knn"
  assert workdir_lib.stored_job(tmp_path) == "knn"


@pytest.mark.parametrize("stored", [{"job": "pretrain", "trainer": "pretrain"},
                                    {"trainer": "pretrain"}])   # before the field
def test_a_job_of_another_kind_stops_naming_both_kinds(tmp_path, stored):
  (tmp_path / "config.json").write_text(json.dumps(stored))
  (tmp_path / "metrics.jsonl").write_text(METRICS)
  before = snapshot(tmp_path)
  config = finetune.finetune_config()
  config.tensorboard = False
  with pytest.raises(workdir_lib.WorkdirError) as e:
    loop.run(finetune.FinetuneTrainer(config), config, str(tmp_path))
  assert str(e.value) == (f"--workdir {tmp_path} holds a pretrain run (its config.json) and "
                          "this is a finetune job; a workdir holds one kind of job: use "
                          "another --workdir")
  assert snapshot(tmp_path) == before


@pytest.mark.parametrize("stored", [{"job": "finetune"}, {"trainer": "finetune"},
                                    {"seed": 0}])    # neither field: accepted
def test_the_same_kind_or_an_unknown_one_is_accepted(tmp_path, stored):
  (tmp_path / "config.json").write_text(json.dumps(stored))
  config = finetune.finetune_config()
  workdir_lib.prepare(tmp_path, config)


def test_a_config_json_that_is_not_a_config_is_refused(tmp_path):
  (tmp_path / "config.json").write_text("[1, 2")
  with pytest.raises(workdir_lib.WorkdirError, match="not a darl_jax config"):
    workdir_lib.prepare(tmp_path, finetune.finetune_config())


def test_the_vtab_suite_folder_is_a_workdir_of_its_own_kind(tmp_path):
  c = runpy.run_path(str(ROOT / "experiments" / "vtab.py"))["get_config"](
      "task=dtd,init=/ckpt")
  c.vtab.sweep.update(drop_path=[0.0], augment=["spatial"], weight_decay=[0.1], lr=[1e-3],
                      layer_decay=[0.8])
  runner = lambda cfg, wd: 0.5
  vtab.run_suite(c, tmp_path / "suite", runner=runner)
  assert json.loads((tmp_path / "suite" / "config.json").read_text())["job"] == "vtab"
  vtab.run_suite(c, tmp_path / "suite", runner=runner)          # a rerun resumes
  (tmp_path / "ft").mkdir()
  (tmp_path / "ft" / "config.json").write_text(json.dumps({"job": "finetune"}))
  with pytest.raises(workdir_lib.WorkdirError, match="holds a finetune run .* vtab job"):
    vtab.run_suite(c, tmp_path / "ft", runner=runner)
  config = finetune.finetune_config()
  with pytest.raises(workdir_lib.WorkdirError, match="holds a vtab run .* finetune job"):
    workdir_lib.prepare(tmp_path / "suite", config)


# ------------------------------------------------ links and other users


@pytest.mark.parametrize("use_flock", [True, False])
def test_a_link_planted_at_the_lock_is_not_followed(tmp_path, use_flock):
  victim = tmp_path / "victim.txt"
  victim.write_text("the user's file\n")
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / workdir_lib.LOCK_NAME).symlink_to(victim)
  with pytest.raises(workdir_lib.WorkdirError, match="is a symbolic link.*delete it"):
    workdir_lib.WorkdirLock(workdir, use_flock=use_flock).acquire()
  assert victim.read_text() == "the user's file\n"


def test_the_write_probe_follows_no_planted_link(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("the user's file\n")
  workdir = tmp_path / "run"
  workdir.mkdir()
  # The name a probe of this process had before its name was random.
  (workdir / f".write-test-{socket.gethostname()}-{os.getpid()}").symlink_to(victim)
  workdir_lib.prepare(workdir)
  assert victim.read_text() == "the user's file\n"


def test_a_workdir_of_another_user_is_refused(tmp_path, monkeypatch):
  workdir = tmp_path / "theirs"
  workdir.mkdir()
  owner = os.stat(workdir).st_uid
  monkeypatch.setattr(workdir_lib.os, "geteuid", lambda: owner + 1)
  with pytest.raises(workdir_lib.WorkdirError) as e:
    workdir_lib.prepare(workdir)
  assert "\n" not in str(e.value)
  assert f"--workdir {workdir} belongs to user " in str(e.value)
  assert "use a --workdir of your own" in str(e.value)
  # A directory it creates is its own.
  monkeypatch.undo()
  workdir_lib.prepare(tmp_path / "mine")
