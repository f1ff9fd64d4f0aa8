"""Orbax checkpointing for DARL training: async saves, keep-N, resume, transfer.

Layout on disk (``directory`` is ``<workdir>/checkpoints``, local or ``gs://``)::

    <workdir>/checkpoints/
        <step>/state/   the training state pytree (Orbax StandardSave, OCDBT)
        <step>/meta/    a JSON dict: data position, rng seeds, config hash, ...
        <step>.orbax-checkpoint-tmp/   a save in flight, or one a kill cut short

Orbax writes every checkpoint into a temporary directory and only renames it to
``<step>`` (on GCS: writes ``commit_success.txt``) once everything is on disk, so
step listings never include a half-written checkpoint. Resuming therefore is
just ``restore(latest_step(), abstract_state)``.

Two entry points:

* :class:`Checkpointer` -- used by the training loop (every process of a
  multi-host job must call ``save``/``restore`` collectively; Orbax decides
  which host writes what).
* :func:`restore_params` -- used for transfer / fine-tuning and evaluation: it
  needs no model, mesh or abstract state and returns ``state["params"]`` as
  host numpy arrays.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

# Item names inside each step directory. Kept as constants because
# restore_params reads checkpoints written by (possibly older) training runs.
STATE_ITEM = "state"
META_ITEM = "meta"


def _item_handlers(state_handler: ocp.CheckpointHandler) -> dict[str, Any]:
  # Registering the handlers up front (instead of letting the first save/restore
  # infer them from the args) lets a fresh manager answer item_metadata()
  # for checkpoints written by another process.
  return {STATE_ITEM: state_handler, META_ITEM: ocp.JsonCheckpointHandler()}


def absolute_path(path) -> epath.Path:
  """Orbax needs absolute paths: local relative ones are resolved against the
  current directory; URLs such as gs://... are kept as given."""
  path = str(path)
  return epath.Path(path if "://" in path else os.path.abspath(path))


def _copy_json(meta: dict) -> dict:
  """Validates that ``meta`` is JSON-serialisable and returns a deep copy.

  With async saving the JSON is written on a background thread; validating here
  raises in the caller (with a useful traceback) instead of at the next
  ``wait()``, and the copy makes later mutation of the caller's dict harmless.
  """
  if not isinstance(meta, dict):
    raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
  try:
    return json.loads(json.dumps(meta))
  except (TypeError, ValueError) as e:
    raise TypeError(f"checkpoint meta is not JSON-serialisable: {e}") from e


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` with a state + JSON-meta item.

  Args:
    directory: checkpoint root, normally ``<workdir>/checkpoints``. Created if
      missing. May be a ``gs://`` path.
    max_to_keep: number of most recent checkpoints kept; older ones are deleted
      after each successful save.
    async_save: if True, ``save`` returns once the arrays are copied to host
      memory and the write to storage continues in a background thread (the
      train step can reuse/donate the device buffers right away). Call
      ``wait()`` before reading the checkpoint from another process and
      ``close()`` at the end of training.

  Temporary directories of saves that never finished (a killed or preempted
  run) are removed when the Checkpointer is created. Only the training job
  should therefore construct a Checkpointer on a directory; readers
  (evaluation, fine-tuning) use :func:`restore_params`, which never deletes.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3,
               async_save: bool = True):
    self._directory = absolute_path(directory)
    self._async = async_save
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        create=True,
        # Half-written "<step>.orbax-checkpoint-tmp" directories are ignored by
        # step listings anyway; removing them reclaims their (possibly large)
        # space and keeps the directory readable for humans.
        cleanup_tmp_directories=True,
    )
    self._manager = ocp.CheckpointManager(
        self._directory, options=options,
        item_handlers=_item_handlers(ocp.StandardCheckpointHandler()))

  @property
  def directory(self) -> epath.Path:
    return self._directory

  def all_steps(self) -> list[int]:
    """Steps of all checkpoints, oldest first (includes a save in flight)."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest checkpoint's step, or None if there is none.

    Half-written checkpoints of earlier (killed) runs are never reported. In the
    process that is saving, an async save in flight is reported as soon as
    ``save`` returns: it becomes readable after ``wait()`` (``restore`` waits
    by itself).
    """
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict, *,
           force: bool = False) -> bool:
    """Saves ``state`` (pytree of jax.Arrays, sharded allowed) and ``meta``.

    Returns True if a save was started, False if it was skipped: the step is
    already checkpointed (e.g. the final save at a step that was also a
    periodic save, or a resumed run reaching a step saved before the kill), or
    Orbax's policy declined (a step not newer than the latest, unless
    ``force``).
    """
    step = int(step)
    meta = _copy_json(meta)
    if step in self._manager.all_steps():
      logging.info("Checkpoint for step %d already exists in %s; not saving.",
                   step, self._directory)
      return False
    saved = self._manager.save(
        step,
        args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardSave(state),
            META_ITEM: ocp.args.JsonSave(meta),
        }),
        force=force)
    if saved:
      logging.info("Saving checkpoint for step %d to %s (async=%s).", step,
                   self._directory, self._async)
    return bool(saved)

  def _resolve_step(self, step: int | None) -> int:
    # Make a pending async save of this process visible before reading it.
    self._manager.wait_until_finished()
    if step is None:
      step = self._manager.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint found in {self._directory}")
    step = int(step)
    if step not in self._manager.all_steps():
      raise FileNotFoundError(
          f"no checkpoint for step {step} in {self._directory}; available: "
          f"{self.all_steps()}")
    return step

  def restore(self, step: int | None, abstract_state: Any) -> tuple[Any, dict]:
    """Restores ``(state, meta)`` of ``step`` (None: the latest checkpoint).

    ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` carrying the
    target ``.sharding`` (e.g. ``jax.eval_shape`` of the init function with
    shardings attached), so each process reads only its shards and arrays land
    directly on the mesh -- possibly a different mesh than the one that saved.
    Concrete jax.Arrays are accepted as well (their shardings are used). The
    returned state has ``abstract_state``'s tree structure (namedtuples of
    optax states included).
    """
    step = self._resolve_step(step)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.StandardRestore(abstract_state),
            META_ITEM: ocp.args.JsonRestore(),
        }))
    return restored[STATE_ITEM], dict(restored[META_ITEM])

  def restore_meta(self, step: int | None = None) -> dict:
    """Restores only the JSON metadata of ``step`` (None: latest)."""
    step = self._resolve_step(step)
    restored = self._manager.restore(
        step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))
    return dict(restored[META_ITEM])

  def wait(self) -> None:
    """Blocks until any async save has been fully committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _no_checkpoint_error(path: epath.Path, detail: str = "") -> FileNotFoundError:
  return FileNotFoundError(
      f"no DARL checkpoint found under {path}: expected {path}/checkpoints/"
      f"<step>/ (a training workdir), a checkpoints directory with <step>/ "
      f"subdirectories, or a step directory .../checkpoints/<step>/ containing "
      f"{STATE_ITEM}/ and {META_ITEM}/" + (f" ({detail})" if detail else ""))


def _resolve_checkpoint_dir(path: epath.Path,
                            step: int | None) -> tuple[epath.Path, int | None]:
  """Maps a workdir / checkpoints dir / step dir to (checkpoints dir, step)."""
  if not path.exists():
    raise _no_checkpoint_error(path, "path does not exist")
  if not path.is_dir():
    raise _no_checkpoint_error(path, "not a directory")
  if (path / "checkpoints").is_dir():
    return path / "checkpoints", step
  if path.name.isdigit() and (path / STATE_ITEM).is_dir():
    dir_step = int(path.name)
    if step is not None and int(step) != dir_step:
      raise ValueError(f"step={step} conflicts with step directory {path}")
    return path.parent, dir_step
  # Otherwise treat it as a checkpoints directory itself; the manager's step
  # listing (which skips temporary directories) decides whether it is one.
  return path, step


def restore_params(path_or_workdir: str, *,
                   step: int | None = None) -> tuple[Any, dict]:
  """Loads ``state["params"]`` of a DARL checkpoint onto host as numpy arrays.

  Args:
    path_or_workdir: a training workdir (``<workdir>/checkpoints`` is used), a
      checkpoints directory, or one step directory ``.../checkpoints/<step>``.
    step: which step to load from a workdir / checkpoints directory; None means
      the newest complete checkpoint.

  Returns:
    ``(params, meta)``: params as nested dicts of ``np.ndarray`` (dtypes as
    saved, e.g. bfloat16 stays bfloat16) and the checkpoint's JSON metadata.

  No model, mesh or abstract state is needed: the tree structure comes from the
  checkpoint's own metadata, arrays are read whole on every host regardless of
  the sharding they were saved with (so a checkpoint from an 8-GPU run loads
  on a laptop), and only the ``params`` subtree is read (optimizer moments,
  typically 2x the parameter bytes, are skipped).
  """
  path = absolute_path(path_or_workdir)
  ckpt_dir, step = _resolve_checkpoint_dir(path, step)
  # A plain (non read-only) manager with create=False writes nothing unless
  # asked to save, and unlike read_only=True it does not log warnings. It
  # must not clean up temporary directories: a run may be writing right now.
  manager = ocp.CheckpointManager(
      ckpt_dir,
      options=ocp.CheckpointManagerOptions(
          create=False, enable_async_checkpointing=False),
      item_handlers=_item_handlers(ocp.PyTreeCheckpointHandler()))
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise _no_checkpoint_error(path)
    if step is None:
      step = steps[-1]
    elif int(step) not in steps:
      raise _no_checkpoint_error(
          path, f"step {step} not found; available steps: {steps}")
    step = int(step)

    metadata = manager.item_metadata(step)[STATE_ITEM]
    if metadata is None:
      raise _no_checkpoint_error(path, f"step {step} has no {STATE_ITEM}/ item")
    # Orbax >= 0.11 wraps the tree in TreeMetadata; older versions return it.
    tree = getattr(metadata, "tree", metadata)
    if not isinstance(tree, dict) or "params" not in tree:
      keys = sorted(tree) if isinstance(tree, dict) else type(tree).__name__
      raise KeyError(f"checkpoint {ckpt_dir}/{step} has no 'params' in its "
                     f"state (top-level keys: {keys})")
    wanted = {"params": tree["params"]}
    restore_args = jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(**{
            STATE_ITEM: ocp.args.PyTreeRestore(
                item=wanted, restore_args=restore_args, partial_restore=True),
            META_ITEM: ocp.args.JsonRestore(),
        }))
  finally:
    manager.close()
  meta = restored[META_ITEM]
  return restored[STATE_ITEM]["params"], dict(meta) if meta is not None else {}
