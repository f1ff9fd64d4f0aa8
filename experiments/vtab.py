"""VTAB-1k transfer of a DARL-pretrained ViT (appendix "VTAB").

Run (TFDS datasets prepared under --config.data.tfds_data_dir; nothing is
downloaded at run time):
  python -m darl_jax.train.vtab --config=experiments/vtab.py:task=all,init=gs://<bucket>/darl_vit_l16_diff \
      --workdir=gs://<bucket>/darl_vit_l16_diff_vtab
One task: task=cifar100 (names in darl_jax/data/sources/vtab_tasks.py); several:
--config.vtab.tasks=dtd,svhn. Rerunning the command resumes: finished
sub-runs are skipped, unfinished ones resume from their checkpoints.

Args: task (all | a task name), init (pretraining workdir), variant (L/16),
sweep (paper: the 108-point grid of the appendix table; single: one point,
drop path 0.1, spatial, weight decay 0.1, lr 1e-3, layer decay 0.8, for a
quick look), source (tfds; synthetic: random images with each task's class
count and split sizes, no datasets needed, to try the suite's programs and
speed, not its accuracy).

Programs: every task runs one head size (397 outputs, the classes a task
lacks masked), so all tasks share the train and evaluation steps of a sweep
point; they are compiled by the first run and loaded from JAX's persistent
compilation cache (compilation_cache_dir) by every later run and rerun.
Each task's result and vtab_results.md say how many programs were compiled.

Recipe per run: causal attention, last-token read-out, 224x224, label
smoothing 0.1, AdamW (0.9, 0.95), batch 256, cosine, 3000 warm-up steps,
20000 steps. Pick on val200 after training on train800, retrain on
train800val200, test. Writes <workdir>/vtab_results.md (per task, per group,
mean).

Expect (paper Table "Top-1 Accuracy on VTAB Benchmark", ViT-L/16 diffusion):
natural 88.7, specialized 92.2, structured 64.7.
"""

from darl_jax import config_lib
from darl_jax.models import vit as vit_lib
from darl_jax.train.jobs import vtab


def get_config(arg=None):
  args = config_lib.parse_arg(arg, task="all", init="", variant="L/16", sweep="paper",
                              source="tfds")
  c = vtab.vtab_config()
  c.init_from = args.init
  c.vtab.tasks = args.task
  c.data.vtab_source = args.source
  c.model.update(variant=args.variant, dtype="bfloat16", posenc="rope2d")
  c.optim.num_layers = vit_lib.parse_variant(args.variant)[0].depth
  if args.sweep == "single":
    c.vtab.sweep.update(drop_path=[0.1], augment=["spatial"], weight_decay=[0.1], lr=[1e-3],
                        layer_decay=[0.8])
  elif args.sweep != "paper":
    raise ValueError(f"sweep must be paper or single, got {args.sweep!r}")
  return c
