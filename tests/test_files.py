"""Result files are written whole or not at all."""

import json

import pytest
from etils import epath

from darl_jax import files


def test_write_json_atomic_replaces_whole_and_leaves_no_temporaries(tmp_path):
  path = tmp_path / "sub" / "result.json"
  files.write_json_atomic(path, {"accuracy": 0.5})
  files.write_json_atomic(path, {"accuracy": 0.75}, indent=1)
  assert json.loads(path.read_text()) == {"accuracy": 0.75}
  assert [p.name for p in path.parent.iterdir()] == ["result.json"]


def test_a_writer_killed_before_the_rename_leaves_the_old_file(tmp_path, monkeypatch):
  path = tmp_path / "result.json"
  files.write_json_atomic(path, {"accuracy": 0.5})

  def killed(self, target):
    raise OSError("No space left on device")
  monkeypatch.setattr(type(epath.Path(tmp_path)), "replace", killed)
  with pytest.raises(OSError, match="No space"):
    files.write_json_atomic(path, {"accuracy": 0.9})
  assert json.loads(path.read_text()) == {"accuracy": 0.5}
  assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_read_json_or_none(tmp_path):
  assert files.read_json_or_none(tmp_path / "missing.json") is None
  (tmp_path / "torn.json").write_text('{"accur')
  assert files.read_json_or_none(tmp_path / "torn.json") is None
  files.write_json_atomic(tmp_path / "ok.json", [1, 2])
  assert files.read_json_or_none(tmp_path / "ok.json") == [1, 2]
