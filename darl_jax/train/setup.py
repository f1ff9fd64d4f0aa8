"""Set-up: what a run trains with, built without touching the workdir.

``setup`` builds, in order: the mesh -> the data sources -> the model and
optimizer -> the sharded state's shapes (``jax.eval_shape``; the state
itself is built under jit, never on the host) -> the jitted steps. The loop
(train/loop.py) and the benchmarks call it. ``job`` is what a job without a
training loop (sampling, few-shot, kNN) shares with the loop; the
compilation cache is set here for both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from absl import logging

from darl_jax import config_lib
from darl_jax import fp8
from darl_jax import metrics as metrics_lib
from darl_jax import ops
from darl_jax import optim
from darl_jax import sharding as sharding_lib
from darl_jax import workdir as workdir_lib
from darl_jax.train import aot
from darl_jax.train import fit
from darl_jax.train import state as state_lib
from darl_jax.train import step as step_lib
from darl_jax.train.trainer import Context
from darl_jax.train.trainer import Trainer


@contextlib.contextmanager
def job(config, workdir, model_dtype: str):
  """What a job that runs no training loop (sampling, few-shot) shares with
  the loop: the workdir checked and locked (darl_jax/workdir.py), the metric
  writer, the compilation cache and the kernel choice for the model's dtype.
  Yields ``(workdir, writer, is_main)``."""
  workdir = workdir_lib.prepare(workdir, config)
  is_main = jax.process_index() == 0
  with workdir_lib.hold(workdir, is_main=is_main), metrics_lib.MetricWriter(
      str(workdir), is_main_process=is_main,
      tensorboard=config.get("tensorboard", True)) as writer:
    enable_compilation_cache(config)
    fp8.check_backend(config.get("precision", "bf16"))
    ops.configure(config.get("kernels"), model_dtype, config.get("precision", "bf16"))
    yield workdir, writer, is_main


def enable_compilation_cache(config) -> None:
  """JAX's persistent compilation cache at ``config.compilation_cache_dir``
  ("" = off; a JAX_COMPILATION_CACHE_DIR environment variable wins)."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  path = config.get("compilation_cache_dir", "")
  if not path:
    return
  if "://" not in path:
    path = os.path.expanduser(path)
  jax.config.update("jax_compilation_cache_dir", path)
  # Only programs that take a while to compile are worth a cache entry.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


@dataclasses.dataclass
class Setup:
  """Everything a run trains with, built by ``setup`` without touching the
  workdir: the loop (``run``) adds checkpoints, logging and the loop itself;
  the benchmarks time ``train_step`` as the loop runs it."""
  ctx: Context
  model: Any
  mesh: jax.sharding.Mesh
  batch_sharding: Any
  steps_per_epoch: int
  tx: Any
  schedule: Callable             # the lr schedule, traceable (optim.make_schedule)
  hyperparams: Any               # optim.Hyperparams: the per-step values the step reads
  base_rng: jax.Array
  abstract_state: Any            # ShapeDtypeStructs carrying the state's shardings
  state_shardings: Any
  # jitted (state, batch, hyper) -> (state, metrics), state donated; hyper =
  # self.hyper(state["step"]); None with microbatch_size=-1 (see train_step).
  step_at_config: Callable | None
  eval_step: Callable            # jitted (params, model_state, batch) -> metric sums
  init_state_fn: Callable        # rng -> state (unjitted)
  eval_view: Callable            # state -> the state evaluation sees (state.eval_view)
  make_step: Callable            # num_microbatches -> a jitted train step like train_step
  abstract_batch: Any            # the training batch as ShapeDtypeStructs (aot.abstract_batch)
  batch_shards: int              # data x fsdp: the devices a batch is split over
  abstract_hyper: Any            # the step's hyper argument as (replicated) ShapeDtypeStructs
  init_step: Callable = None     # jitted init_state_fn (rng -> state), out on the state's shardings

  @property
  def train_step(self) -> Callable:
    """The jitted train step at ``config.microbatch_size``. With -1 the
    microbatch depends on the device's memory and is decided at start-up
    (startup.compile_programs, whose ``train_step`` runs it)."""
    if self.step_at_config is None:
      raise config_lib.ConfigError(
          "microbatch_size=-1 is decided when the programs compile: use "
          "startup.compile_programs(built, config).train_step, or set "
          "--config.microbatch_size to a size")
    return self.step_at_config

  def hyper(self, step: int) -> dict:
    """The train step's ``hyper`` argument for the update from step counter
    ``step`` to ``step + 1`` (host values, optim.Hyperparams.values)."""
    return self.hyperparams.values(step)

  def init_rng(self) -> jax.Array:
    """The key a fresh state is drawn from, replicated over the mesh."""
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return jax.device_put(jax.random.fold_in(self.base_rng, -1 % (2**31)), replicated)

  def abstract_init_rng(self) -> jax.ShapeDtypeStruct:
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return jax.ShapeDtypeStruct(self.base_rng.shape, self.base_rng.dtype, sharding=replicated)

  def init_state(self, compiled=None) -> dict:
    """A fresh state, built on the mesh (never on the host), by ``compiled``
    (``init_step`` compiled at start-up) or else ``init_step``."""
    return (compiled or self.init_step)(self.init_rng())


def setup(trainer: Trainer, config, *, workdir=None, writer=None, devices=None) -> Setup:
  """Mesh, data sources, model, optimizer, state shardings and the jitted
  steps of ``trainer`` under ``config``, in that order. ``devices``: the
  mesh's devices (default: all)."""
  # ------------------------------------------------------------ mesh and data
  mesh = sharding_lib.make_mesh(config.mesh, devices=devices)
  # How the model's ops run, set once for everything traced from here on.
  if "model" in config:
    precision = config.get("precision", "bf16")
    fp8.check_backend(precision, mesh.devices.flat[0])   # a TPU topology's, when compiling
    kernels = ops.configure(config.get("kernels"), config.model.get("dtype", "float32"),
                            precision)
    logging.info("%s", ops.describe(config.get("kernels"), kernels, precision))
  warning = sharding_lib.kernel_mesh_warning(config, mesh)
  if warning:
    logging.warning(warning)
  batch_sharding = sharding_lib.batch_sharding(mesh)
  if config.batch_size % jax.process_count():
    raise ValueError(f"batch_size {config.batch_size} must be divisible by the number "
                     f"of processes ({jax.process_count()})")
  batch_shards = sharding_lib.batch_shards(mesh)
  if config.batch_size % batch_shards:
    raise ValueError(f"batch_size {config.batch_size} must be divisible by the data x fsdp "
                     f"mesh size {batch_shards}")
  train_source = trainer.make_source(config, config.data.train_split, train=True)
  eval_source = trainer.make_source(config, config.data.eval_split, train=False)
  if config.batch_size > train_source.num_examples:
    # The sources would fill each batch by wrapping around the split: the
    # same images several times in one batch, silently.
    raise config_lib.ConfigError(
        f"config.batch_size {config.batch_size} is larger than the training split "
        f"({train_source.num_examples} examples of {config.data.name!r} "
        f"{config.data.train_split!r}): set --config.batch_size to at most "
        f"{train_source.num_examples}")
  steps_per_epoch = max(train_source.num_examples // config.batch_size, 1)
  total_steps = config_lib.resolve_total_steps(config, steps_per_epoch)
  ctx = Context(config, workdir, mesh, train_source, eval_source, writer, total_steps)

  # ---------------------------------------------------- model and optimizer
  model = trainer.build_model(ctx)
  base_rng = jax.random.PRNGKey(config.seed)
  h, w, c = train_source.image_shape
  init_batch = {"image": jnp.zeros((1, h, w, c), jnp.float32),
                "label": jnp.zeros((1,), jnp.int32)}

  def init_params_fn(module, rng):
    return trainer.init_variables(module, rng, init_batch)

  abstract_vars = jax.eval_shape(functools.partial(init_params_fn, model), base_rng)
  tx, hyperparams = optim.make_train_optimizer(config.optim, abstract_vars["params"],
                                               total_steps=total_steps,
                                               steps_per_epoch=steps_per_epoch,
                                               batch_size=config.batch_size)

  ema_decay = float(config.get("ema_decay", 0.0) or 0.0)
  init_state = state_lib.init_state_fn(
      trainer, model, tx, init_batch, ema_decay,
      init_model=state_lib.initialising_model(init_params_fn, model, abstract_vars),
      layout=abstract_vars)

  # ----------------------------------------------------------- sharded state
  abstract_state = jax.eval_shape(init_state, base_rng)
  rules = sharding_lib.check_rules(config.get("sharding", "replicated"))
  state_shardings = sharding_lib.tree_shardings(abstract_state, mesh, rules)
  if "ema" in state_shardings:          # the average lies where its parameters do
    state_shardings["ema"]["params"] = state_shardings["params"]
  abstract_state = jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract_state, state_shardings)

  # --------------------------------------------------------------- the steps
  # The step's learning rate and weight decay (optim.Hyperparams), on every device.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def make_step(num_microbatches: int):
    step = step_lib.make_train_step(trainer, model, tx, hyperparams, base_rng, mesh, ema_decay,
                                    num_microbatches)
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding, replicated),
                   out_shardings=(state_shardings, None), donate_argnums=(0,))

  # The step at the config's microbatch (fit.resolve); the automatic one is
  # decided from the device's memory at start-up (startup.compile_programs,
  # which makes that step).
  train_step = (None if fit.automatic(config) else make_step(
      fit.resolve(config, batch_shards=batch_shards).num_microbatches(config.batch_size)))
  eval_step = jax.jit(step_lib.make_eval_step(trainer, model, base_rng, mesh))
  return Setup(ctx=ctx, model=model, mesh=mesh, batch_sharding=batch_sharding,
               steps_per_epoch=steps_per_epoch, tx=tx, schedule=hyperparams.schedule,
               hyperparams=hyperparams, base_rng=base_rng,
               abstract_state=abstract_state, state_shardings=state_shardings,
               step_at_config=train_step, eval_step=eval_step,
               init_state_fn=init_state, eval_view=state_lib.eval_view(config, state_shardings),
               make_step=make_step, batch_shards=batch_shards,
               abstract_batch=aot.abstract_batch(train_source.image_shape, config.batch_size,
                                                 batch_sharding),
               abstract_hyper=hyperparams.abstract(replicated),
               init_step=jax.jit(init_state, out_shardings=state_shardings))
