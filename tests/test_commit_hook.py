""".githooks/commit-msg: the commit message rules of CONTRIBUTING.md."""

import os
import pathlib
import subprocess

import pytest

HOOK = pathlib.Path(__file__).resolve().parents[1] / ".githooks" / "commit-msg"


def check(tmp_path, message: str) -> subprocess.CompletedProcess:
  path = tmp_path / "COMMIT_EDITMSG"
  path.write_text(message, encoding="utf-8")
  # Under the C locale too: the hook counts characters whatever the caller's.
  env = {k: v for k, v in os.environ.items() if not k.startswith("LC_")}
  env["LANG"] = "C"
  return subprocess.run(["bash", str(HOOK), str(path)], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("message", [
    "x" * 72 + "\n\nbody\n",
    "subject alone\n",
    "é" * 72 + "\n",                                   # characters, not bytes
    "subject\n\nbody\n# a comment line git strips, " + "y" * 80 + "\n",
])
def test_the_hook_takes_a_subject_of_72_characters_and_a_blank_line(tmp_path, message):
  done = check(tmp_path, message)
  assert done.returncode == 0, done.stderr


def test_the_hook_refuses_a_long_subject_and_names_its_length(tmp_path):
  done = check(tmp_path, "x" * 73 + "\n\nbody\n")
  assert done.returncode == 1 and "the subject is 73 characters" in done.stderr


def test_the_hook_refuses_a_body_that_starts_on_the_second_line(tmp_path):
  done = check(tmp_path, "subject\nbody right under it\n")
  assert done.returncode == 1 and "second line blank" in done.stderr
