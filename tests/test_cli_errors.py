"""Every command answers bad input with one ``error:`` line and the exit
status of darl_jax/cli.py: 2 for bad input (an unknown flag or config key, a
bad value, a --config file that does not exist or does not load), 1 for work
the command could not do. No traceback.

The commands run in this process (their ``cli(argv)``, flags parsed by absl
as on the command line); the study runner, whose flags clash with another
module's, and compile's ``python -m`` wiring run as subprocesses.
"""

import os
import pathlib
import signal
import subprocess
import sys

import pytest
from absl import flags

from darl_jax import cli as cli_lib
from darl_jax import compile as compile_lib
from darl_jax import export
from darl_jax import main as main_lib
from darl_jax import memory
from darl_jax.data import convert
from darl_jax.train.jobs import vtab

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "tiny_config.py")
SAMPLE = str(ROOT / "experiments" / "fashion_mnist_sample.py")
VTAB = str(ROOT / "experiments" / "vtab.py")


def _forget_overrides():
  # config_flags defines a flag per --config.<key> it parses; a second parse
  # of the same key in this process would find it defined.
  for name in [n for n in flags.FLAGS if n.startswith("config.")]:
    delattr(flags.FLAGS, name)


@pytest.fixture
def command(monkeypatch, capsys):
  """``command(cli, *args)``: runs ``cli(argv)`` as the command line
  ``prog *args`` would; returns (exit status, the one error line)."""
  handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

  def call(entry, *args, status):
    argv = ["prog", *args]
    monkeypatch.setattr(sys, "argv", argv)   # config_flags reads overrides there
    flags.FLAGS.unparse_flags()
    _forget_overrides()
    with pytest.raises(SystemExit) as exit_:
      entry(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == status, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]

  yield call
  flags.FLAGS.unparse_flags()
  _forget_overrides()
  for s, h in handlers.items():
    signal.signal(s, h)


def _main(argv):
  main_lib.cli()     # reads sys.argv, as the command does


# Each tuple: a command line and the status and words of its error line.
CONFIG_CASES = [
    (["--config.nonexistent=1"], "the config has no key 'nonexistent'"),
    (["--config.batch_size=abc"], "invalid literal for int"),
]


@pytest.mark.parametrize("config", [TINY, SAMPLE], ids=["main", "sample"])
@pytest.mark.parametrize("args,words", CONFIG_CASES)
def test_main_and_the_sampling_job(command, tmp_path, config, args, words):
  """The sampling job is the main command with a sampling config."""
  line = command(_main, f"--config={config}", f"--workdir={tmp_path}", *args,
                 status=cli_lib.USAGE)
  assert words in line


@pytest.mark.parametrize("args,words", [
    ([], "the --config file {missing} does not exist"),
    (["--config.total_steps=3"], "the --config file {missing} does not exist"),
])
def test_main_missing_config_file(command, tmp_path, args, words):
  missing = tmp_path / "missing.py"
  line = command(_main, f"--config={missing}", f"--workdir={tmp_path}", *args,
                 status=cli_lib.USAGE)
  assert words.format(missing=missing) in line
  assert not (tmp_path / "config.json").exists()


def test_main_config_that_fails_to_load_and_missing_flags(command, tmp_path):
  # config_flags folds the config's traceback into its message: the line
  # keeps the exception's own words.
  line = command(_main, f"--config={TINY}:nope=1", f"--workdir={tmp_path}",
                 status=cli_lib.USAGE)
  assert "cannot load --config" in line and "unknown config argument 'nope'" in line
  line = command(_main, f"--config={TINY}", status=cli_lib.USAGE)
  assert "--workdir is required" in line
  line = command(_main, f"--workdir={tmp_path}", "--bogus=1", status=cli_lib.USAGE)
  assert "bogus" in line


def test_compile(command):
  run = compile_lib.cli
  topology = "--topology=v5e:2x2"
  assert "no key 'nonexistent'" in command(run, f"--config={TINY}", "--config.nonexistent=1",
                                           topology, status=cli_lib.USAGE)
  assert "invalid literal" in command(run, f"--config={TINY}", "--config.batch_size=abc",
                                      topology, status=cli_lib.USAGE)
  # A value the config's checks refuse: 2, never 1 (1 is "does not fit").
  assert "config.batch_size must be a positive integer" in command(
      run, f"--config={TINY}", "--config.batch_size=0", topology, status=cli_lib.USAGE)
  assert "/missing.py does not exist" in command(run, "--config=/missing.py", topology,
                                                 status=cli_lib.USAGE)
  assert "--topology is required" in command(run, f"--config={TINY}", status=cli_lib.USAGE)
  assert "v9x:1x1" in command(run, f"--config={TINY}", "--topology=v9x:1x1",
                              status=cli_lib.USAGE)


def test_compile_as_a_command():
  """The issue's case, through ``python -m``: a traceback and status 1 before."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
  proc = subprocess.run([sys.executable, "-m", "darl_jax.compile", f"--config={TINY}",
                         "--config.nonexistent=1", "--topology=v5e:2x2"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == cli_lib.USAGE, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines()[-1].startswith("error: --config.nonexistent=1")
  assert "Traceback" not in proc.stderr


def test_vtab(command, tmp_path):
  wd = f"--workdir={tmp_path}"
  assert "no key 'nonexistent'" in command(vtab.cli, f"--config={VTAB}", "--config.nonexistent=1",
                                           wd, status=cli_lib.USAGE)
  assert "invalid literal" in command(vtab.cli, f"--config={VTAB}", "--config.batch_size=abc",
                                      wd, status=cli_lib.USAGE)
  assert "does not exist" in command(vtab.cli, f"--config={tmp_path}/missing.py", wd,
                                     status=cli_lib.USAGE)
  assert "are required" in command(vtab.cli, f"--config={VTAB}", status=cli_lib.USAGE)


def test_convert(command, tmp_path):
  dst = f"--dst={tmp_path}/out"
  assert "not a positive integer" in command(convert.cli, f"--src={tmp_path}", dst,
                                             "--shard_size=0", status=cli_lib.USAGE)
  assert "zip" in command(convert.cli, f"--src={tmp_path}", dst, "--format=zip",
                          status=cli_lib.USAGE)
  assert "bogus" in command(convert.cli, "--bogus=1", status=cli_lib.USAGE)
  assert "--src and --dst are required" in command(convert.cli, dst, status=cli_lib.USAGE)
  # A folder that is not there: the command's work fails, status 1.
  assert "is not a folder of images" in command(convert.cli, f"--src={tmp_path}/none", dst,
                                                status=cli_lib.FAILED)


def test_export(command, tmp_path):
  run = lambda argv: export.cli(argv[1:])
  need = [f"--checkpoint={tmp_path}", f"--out={tmp_path}/m.safetensors"]
  assert "--bogus" in command(run, *need, "--bogus", status=cli_lib.USAGE)
  assert "invalid int value: 'abc'" in command(run, *need, "--step=abc", status=cli_lib.USAGE)
  assert "--config_json file" in command(run, *need, f"--config_json={tmp_path}/c.json",
                                         status=cli_lib.USAGE)
  assert "required" in command(run, need[0], status=cli_lib.USAGE)
  assert "no DARL checkpoint" in command(run, f"--checkpoint={tmp_path}/none", need[1],
                                         status=cli_lib.FAILED)


def test_memory(command):
  run = lambda argv: memory.cli(argv[1:])
  assert "--bogus" in command(run, "--bogus", status=cli_lib.USAGE)
  assert "invalid int value" in command(run, "--batch_size=abc", status=cli_lib.USAGE)
  assert "bad mesh entry 'data:x'" in command(run, "--mesh=data:x", status=cli_lib.USAGE)
  assert "unknown model variant 'Q/3'" in command(run, "--variant=Q/3", status=cli_lib.USAGE)


def _studies(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "darl_jax.studies", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,status,words", [
    (["--study=readout", "--scale=huge", "--list"], cli_lib.USAGE, "--scale=huge"),
    (["--study=nope", "--scale=tiny", "--list"], cli_lib.USAGE, "unknown study 'nope'"),
    (["--study=readout", "--scale=tiny", "--list", "--runs=(("], cli_lib.USAGE,
     "not a regular expression"),
])
def test_studies(args, status, words):
  proc = _studies(*args)
  assert proc.returncode == status, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and words in lines[0], proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr


def test_an_unexpected_error_is_one_line_naming_its_traceback_file(capsys, tmp_path):
  def broken(argv):
    raise RuntimeError("a bug")
  with pytest.raises(SystemExit) as exit_:
    cli_lib.guarded(broken, [], workdir=lambda: str(tmp_path))
  err = capsys.readouterr().err
  assert exit_.value.code == cli_lib.FAILED
  assert err.strip() == f"error: RuntimeError: a bug (traceback in {tmp_path}/error.log)"
  assert "raise RuntimeError" in (tmp_path / "error.log").read_text()
