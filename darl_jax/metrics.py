"""Metric writers (metrics.jsonl + TensorBoard) and the console progress line.

``<workdir>/metrics.jsonl`` is the source of truth: one JSON object per
``write_scalars`` call, flushed immediately, so a killed run keeps everything it
logged and analysis scripts need nothing but ``json``. A resumed run first
drops the records past the step it resumes from (``MetricWriter.start``), so
after any number of kills every logged step appears once. TensorBoard is a
convenience view of the same numbers, written through the first backend that
imports:

1. ``clu.metric_writers.SummaryWriter`` (TensorFlow + the ``tensorboard``
   package);
2. ``torch.utils.tensorboard.SummaryWriter`` or ``tensorboardX.SummaryWriter``
   (same API) -- the GPU machines have no TensorFlow;
3. none: JSON lines only, with one absl warning saying why.

Non-finite values (a diverged loss) are written to the jsonl as ``null``:
``NaN``/``Infinity`` are not valid JSON and would break strict parsers, and
strings like ``"nan"`` would break numeric columns. ``read_metrics`` returns
them as ``None``. TensorBoard receives the actual float (it plots NaN fine).
"""

from __future__ import annotations

import importlib
import json
import math
import numbers
import time
from typing import Any, Callable, Mapping

import numpy as np
from absl import logging
from etils import epath

from darl_jax import files
from darl_jax import workdir as workdir_lib


def _to_json_number(name: str, value: Any) -> int | float | None:
  """Converts a python/numpy/jax scalar to a JSON-safe number (None if non-finite)."""
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if isinstance(value, (numbers.Integral, np.integer)):
    return int(value)
  try:
    arr = np.asarray(value)  # also pulls jax scalars to host
  except Exception as e:  # pylint: disable=broad-except
    raise TypeError(f"metric {name!r}: cannot convert {type(value).__name__}") from e
  # Kind "V" covers ml_dtypes floats (bfloat16, float8) that float() accepts;
  # strings, objects, complex and datetimes are rejected.
  if arr.size != 1 or arr.dtype.kind in "OSUcmM":
    raise TypeError(f"metric {name!r} must be a real scalar, got "
                    f"{arr.dtype} array of shape {arr.shape}")
  if arr.dtype.kind in "biu":
    return int(arr.reshape(()))
  f = float(arr.reshape(()))
  return f if math.isfinite(f) else None


class _CluBackend:
  """TensorBoard via clu (TensorFlow summary ops)."""

  name = "clu"

  def __init__(self, logdir: str):
    metric_writers = importlib.import_module("clu.metric_writers")
    tf = importlib.import_module("tensorflow")
    # TensorFlow is only used for writing summaries: keep it off the GPUs so it
    # does not reserve memory that JAX needs (a no-op with tensorflow-cpu).
    try:
      tf.config.set_visible_devices([], "GPU")
    except Exception:  # pylint: disable=broad-except
      pass  # Already initialised; nothing to do.
    self._writer = metric_writers.SummaryWriter(logdir)

  def scalars(self, step, scalars):
    self._writer.write_scalars(step, scalars)

  def images(self, step, images):
    self._writer.write_images(step, images)

  def text(self, step, tag, text):
    self._writer.write_texts(step, {tag: text})

  def flush(self):
    self._writer.flush()

  def close(self):
    self._writer.close()


class _TorchStyleBackend:
  """TensorBoard via a torch.utils.tensorboard-style SummaryWriter."""

  def __init__(self, module_name: str, logdir: str):
    module = importlib.import_module(module_name)
    self.name = module_name
    self._writer = module.SummaryWriter(log_dir=logdir)

  def scalars(self, step, scalars):
    for key, value in scalars.items():
      self._writer.add_scalar(key, value, global_step=step)

  def images(self, step, images):
    for key, value in images.items():
      self._writer.add_images(key, value, global_step=step, dataformats="NHWC")

  def text(self, step, tag, text):
    self._writer.add_text(tag, text, global_step=step)

  def flush(self):
    self._writer.flush()

  def close(self):
    self._writer.close()


def _make_tensorboard_backend(logdir: str):
  """Returns the first TensorBoard backend that works, or None (with a warning)."""
  attempts = [
      ("clu.metric_writers", lambda: _CluBackend(logdir)),
      ("torch.utils.tensorboard",
       lambda: _TorchStyleBackend("torch.utils.tensorboard", logdir)),
      ("tensorboardX", lambda: _TorchStyleBackend("tensorboardX", logdir)),
  ]
  reasons = []
  for name, make in attempts:
    try:
      return make()
    except Exception as e:  # pylint: disable=broad-except
      # ImportError is the usual case, but e.g. torch without the
      # `tensorboard` package raises it lazily from SummaryWriter(); any
      # failure just moves on to the next backend.
      reasons.append(f"{name}: {type(e).__name__}: {e}")
  logging.warning(
      "TensorBoard logging disabled, writing metrics.jsonl only (install "
      "`tensorboard` with tensorflow+clu, or torch/tensorboardX, to enable "
      "it). Backends tried: %s", "; ".join(reasons))
  return None


class MetricWriter:
  """Writes scalars to ``<workdir>/metrics.jsonl`` and TensorBoard.

  Args:
    workdir: run directory (local path; the jsonl is appended to, which object
      stores such as GCS do not support).
    is_main_process: only the main process (``jax.process_index() == 0``)
      writes; on other processes every method is a no-op, so callers need no
      guards.
    tensorboard: also write TensorBoard events under ``<workdir>/tensorboard``.
  """

  def __init__(self, workdir: str, *, is_main_process: bool = True,
               tensorboard: bool = True):
    self._workdir = epath.Path(workdir)
    self._enabled = is_main_process
    self._tensorboard = tensorboard
    self._file = None
    self._tb = None
    # Nothing touches the disk before the first write or ``start``: a run
    # refused at start-up (a resume check, a bad value) leaves the workdir as
    # it was.

  def _open(self) -> None:
    if not self._enabled or self._file is not None:
      return
    self._workdir.mkdir(parents=True, exist_ok=True)
    # Append: a resumed run continues the same file (``start`` first drops
    # the records a killed run logged past its last checkpoint).
    self._file = (self._workdir / "metrics.jsonl").open("a")
    if self._tensorboard:
      logdir = self._workdir / "tensorboard"
      logdir.mkdir(parents=True, exist_ok=True)
      self._tb = _make_tensorboard_backend(str(logdir))

  def start(self, step: int | None, config_dict: Mapping[str, Any] | None = None, *,
            finished: bool = False) -> None:
    """Begins writing for a run that (re)starts after ``step``: drops the
    records of later steps from metrics.jsonl (a killed run's steps past its
    last checkpoint, which this run logs again; None drops every record),
    writes ``config.json`` (if given) and opens the writers.

    ``finished``: the run was already complete at ``step`` (a rerun of a
    finished run, which trains nothing): metrics.jsonl, config.json and the
    TensorBoard events stay as they are, and every later write is dropped,
    so the trainer's closing pictures and reports (``finalize``) go to their
    own files only instead of logging the same step a second time."""
    if not self._enabled:
      return
    if self._file is not None:
      raise RuntimeError("MetricWriter.start must come before the first write")
    if finished:
      logging.info("the run was finished at step %s: metrics.jsonl, config.json and the "
                   "TensorBoard events are left as they are", step)
      self._enabled = False
      return
    drop_records_after(self._workdir, step)
    self._open()
    if config_dict is not None:
      self.write_config(config_dict)

  @property
  def tensorboard_backend(self) -> str | None:
    """Name of the TensorBoard backend in use, None if there is none (opens
    the writers, as a first write would)."""
    self._open()
    return self._tb.name if self._tb is not None else None

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Appends ``{"step": step, **scalars}`` to metrics.jsonl and TensorBoard."""
    if not self._enabled:
      return
    self._open()
    step = int(step)
    record = {"step": step}
    for key, value in scalars.items():
      record[str(key)] = _to_json_number(key, value)
    # allow_nan=False: fail loudly should a non-finite value ever slip through.
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    self._file.flush()
    if self._tb is not None:
      # TensorBoard gets floats, non-finite values included.
      self._tb.scalars(step, {str(k): float(np.asarray(v))
                              for k, v in scalars.items()})

  def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
    """Writes images ``[N, H, W, C]`` (or ``[H, W, C]``) to TensorBoard.

    Accepts uint8, or floats in [0, 1] (clipped). C is 1 or 3. A no-op when no
    TensorBoard backend is available.
    """
    if not self._enabled:
      return
    self._open()
    if self._tb is None:
      return
    prepared = {}
    for key, value in images.items():
      arr = np.asarray(value)
      if arr.ndim == 3:
        arr = arr[None]
      if arr.ndim != 4:
        raise ValueError(f"image {key!r} must be [N, H, W, C], got {arr.shape}")
      if arr.dtype != np.uint8:
        # Convert floats to uint8 ourselves so every backend sees the same
        # unambiguous format (torch would rescale floats differently).
        arr = np.round(np.clip(arr.astype(np.float32), 0.0, 1.0) * 255.0)
        arr = arr.astype(np.uint8)
      prepared[str(key)] = arr
    self._tb.images(int(step), prepared)

  def write_config(self, config_dict: Mapping[str, Any]) -> None:
    """Writes ``<workdir>/config.json`` (indent 2, sorted keys) + TB text.

    Atomically (temporary file + rename): a run killed while writing leaves
    the previous file, never a torn one. The loop calls it only once every
    resume check has passed; readers of a checkpoint take the config stored
    in the checkpoint itself, so this file is for humans and old checkpoints.
    It records the job kind under ``job`` (the config's ``trainer`` unless
    given), which darl_jax/workdir.py checks before another job uses the
    workdir.
    """
    if not self._enabled:
      return
    config_dict = dict(config_dict)
    if workdir_lib.JOB_KEY not in config_dict and config_dict.get("trainer"):
      config_dict[workdir_lib.JOB_KEY] = config_dict["trainer"]
    # default=str keeps odd values (tuples become lists anyway; dtypes, paths,
    # callables) from aborting a run at startup just to log its config.
    text = json.dumps(config_dict, indent=2, sort_keys=True, default=str)
    files.write_text_atomic(self._workdir / "config.json", text + "\n")
    if self._tb is not None:
      # TensorBoard renders text as markdown: indent to get a code block.
      self._tb.text(0, "config", "\n".join("    " + l for l in text.splitlines()))

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes and closes; further writes are ignored."""
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    self._enabled = False

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_metrics(workdir: str) -> list[dict]:
  """Parses ``<workdir>/metrics.jsonl`` into a list of dicts (file order).

  Non-finite values come back as None (see module docstring). A truncated last
  line (the process died mid-write) is skipped; a missing file gives [].
  """
  path = epath.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  records = []
  lines = path.read_text().splitlines()
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      if i == len(lines) - 1:
        logging.warning("Skipping truncated last line of %s", path)
        continue
      raise
  return records


def drop_records_after(workdir, step: int | None) -> int:
  """Rewrites ``<workdir>/metrics.jsonl`` without the records of steps after
  ``step`` (None: without any record), atomically; returns how many were
  dropped. A torn last line (a writer killed mid-line) goes too."""
  path = epath.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return 0
  kept, dropped = [], 0
  for line in path.read_text().splitlines():
    if not line.strip():
      continue
    try:
      record_step = json.loads(line).get("step")
    except (ValueError, AttributeError):
      dropped += 1
      continue
    if step is None or (isinstance(record_step, (int, float)) and record_step > step):
      dropped += 1
    else:
      kept.append(line)
  if dropped:
    logging.info("metrics.jsonl: dropped %d record(s) after step %s, which this run "
                 "logs again", dropped, step)
    files.write_text_atomic(path, "".join(l + "\n" for l in kept))
  return dropped


def window_mean(history: list[dict], carry: dict | None = None) -> dict:
  """The mean of each scalar metric over a log window.

  ``history``: the window's per-step metric dicts (host values). ``carry``:
  the part of the window that a resumed run did not see (``window_carry`` of
  the steps before the checkpoint, stored in its meta), so that the first
  window after a resume averages the same steps as in an uninterrupted run.
  NaNs are left out of the mean; a metric with no finite value in the window
  reports its last value.
  """
  carry = window_carry(history, carry)
  return {k: (total / count if finite and count else last)
          for k, (total, count, last, finite) in carry.items()}


def window_carry(history: list[dict], carry: dict | None = None) -> dict:
  """A log window so far, JSON-safe (``window_mean``'s ``carry``): per metric
  ``[sum of the non-NaN values, their count, the last value, whether any
  value was finite]`` (the sum may be infinite: Python's json keeps it)."""
  out = {k: list(v) for k, v in (carry or {}).items()}
  for k in (history[0] if history else {}):
    vals = np.asarray([m[k] for m in history], np.float64)
    if vals.ndim != 1:
      continue
    total, count, _, finite = out.get(k, (0.0, 0, None, False))
    real = vals[~np.isnan(vals)]
    with np.errstate(all="ignore"):
      total = float(total + real.sum())
    out[k] = [total, int(count + real.size), float(vals[-1]),
              bool(finite or np.isfinite(vals).any())]
  return out


def final_metrics(workdir: str) -> dict:
  """The last logged value of the training loss and of every ``val_*`` metric
  in ``<workdir>/metrics.jsonl`` (what a finished run reports)."""
  out = {}
  for record in read_metrics(workdir):
    for key, value in record.items():
      if key.startswith("val_") or key == "loss":
        out[key] = value
  return out


def format_duration(seconds: float) -> str:
  """``45s``, ``3m12s``, ``2h05m07s``; ``?`` if unknown."""
  if seconds is None or not math.isfinite(seconds) or seconds < 0:
    return "?"
  s = int(round(seconds))
  h, rem = divmod(s, 3600)
  m, s = divmod(rem, 60)
  if h:
    return f"{h}h{m:02d}m{s:02d}s"
  if m:
    return f"{m}m{s:02d}s"
  return f"{s}s"


def _format_value(value: Any) -> str:
  try:
    v = float(np.asarray(value))
  except (TypeError, ValueError):
    return str(value)
  if v == 0 or (math.isfinite(v) and 1e-3 <= abs(v) < 1e5):
    return f"{v:.4f}"
  return f"{v:.3e}" if math.isfinite(v) else str(v)


class Progress:
  """Console progress line and throughput.

  ``update`` logs e.g. ``step 120/1000 | loss 0.1234 | 850.2 img/s | ETA
  3m12s`` via absl logging. Throughput is measured over the wall time since
  the previous ``update`` (or construction), so it reflects the current speed;
  the first interval includes compilation and is therefore low. The ETA
  extrapolates the current speed over the remaining steps.

  Args:
    total_steps: the step count at which training ends.
    batch_size: global batch size (images per step).
    start_step: the step training (re)starts from.
    time_fn: clock, injectable for tests.
  """

  def __init__(self, total_steps: int, batch_size: int, start_step: int = 0, *,
               time_fn: Callable[[], float] = time.perf_counter):
    self.total_steps = int(total_steps)
    self.batch_size = int(batch_size)
    self._time_fn = time_fn
    self._last_step = int(start_step)
    self._last_time = time_fn()
    self.last_line = ""  # The most recent console line (for tests/callers).

  def update(self, step: int, scalars: Mapping[str, Any] | None = None) -> dict:
    """Logs the progress line; returns ``{"img_per_sec", "steps_per_sec"}``."""
    now = self._time_fn()
    step = int(step)
    dt = now - self._last_time
    dsteps = step - self._last_step
    if dt > 0 and dsteps > 0:
      steps_per_sec = dsteps / dt
    else:
      steps_per_sec = float("nan")  # No progress or no time: rate unknown.
    img_per_sec = steps_per_sec * self.batch_size
    self._last_time, self._last_step = now, step

    remaining = max(self.total_steps - step, 0)
    eta = remaining / steps_per_sec if steps_per_sec > 0 else None
    parts = [f"step {step}/{self.total_steps}"]
    parts += [f"{k} {_format_value(v)}" for k, v in (scalars or {}).items()]
    parts.append(f"{img_per_sec:.1f} img/s" if math.isfinite(img_per_sec)
                 else "? img/s")
    parts.append(f"ETA {format_duration(eta)}")
    self.last_line = " | ".join(parts)
    logging.info("%s", self.last_line)
    return {"img_per_sec": img_per_sec, "steps_per_sec": steps_per_sec}
