"""Studies: sweep expansion, shared stages, resume-only-missing, reports."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from darl_jax import config_lib
from darl_jax.data import pipeline
from darl_jax.models import vit as vit_lib
from darl_jax.studies import catalog
from darl_jax.studies import report as R
from darl_jax.studies import runner as runner_lib
from darl_jax.studies import spec as S

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = S.get_scale("tiny")


# ------------------------------------------------------------------ expansion


@pytest.mark.parametrize("scale", sorted(S.SCALES))
def test_every_study_expands_to_valid_configs(scale):
  sc = S.get_scale(scale)
  for name in catalog.STUDIES:
    study = catalog.get_study(name, sc)
    assert study.runs and study.tables
    for stage in study.stages():
      config = S.load_config(stage)            # unknown override keys raise here
      config_lib.validate(config)              # what main.py checks before it runs
      assert config.trainer == {"pretrain": "pretrain", "finetune": "finetune",
                                "probe": "linear_probe", "attentive_probe": "attentive_probe",
                                "supervised": "supervised", "knn": "knn"}[stage.kind]
      vit_lib.vit_from_config(config.model)    # patch size divides the image, ...
      if stage.parent is not None:
        parent = S.load_config(stage.parent)
        for key in ("width", "depth", "num_heads", "mlp_dim", "variant", "posenc"):
          assert config.model[key] == parent.model[key], (name, key)


def test_noise_schedule_sweep_is_the_grid_for_each_patch_size():
  study = catalog.get_study("noise_schedule", TINY)
  grid = TINY.beta_grid
  assert len(study.runs) == len(TINY.patch_sizes) * (1 + len(grid) ** 2)
  seen = set()
  for run in study.runs:
    pre, ft = run.stages
    assert ft.parent is pre and ft.kind == "finetune"
    c = S.load_config(pre)
    assert c.model.variant == f"Ti/{run.labels['patch']}"
    if run.labels["objective"] == "diffusion":
      assert (c.loss.kind, c.loss.noise_a, c.loss.noise_b) == (
          "diffusion", run.labels["a"], run.labels["b"])
      seen.add((run.labels["patch"], run.labels["a"], run.labels["b"]))
    else:
      assert c.loss.kind == "mse"
  assert len(seen) == len(TINY.patch_sizes) * len(grid) ** 2


def test_downstream_study_has_its_comparators_at_the_stated_budgets():
  long = S.get_scale("fmnist_long")
  study = catalog.get_study("downstream", long, seeds=1)
  by = {(r.labels["init"], r.labels["protocol"]): r for r in study.runs}
  # A random backbone under the same probes: no parent, no checkpoint.
  for protocol in ("linear probe", "attentive probe block 3+4+5"):
    (stage,) = by[("random", protocol)].stages
    assert stage.parent is None and not S.load_config(stage).init_from
  # Probes read the DARL checkpoint of their row.
  pre, lin = by[("DARL diffusion", "linear probe")].stages
  assert lin.parent is pre and S.load_config(pre).loss.kind == "diffusion"
  assert S.load_config(lin).optim.base_lr == 32.0               # linear only
  _, att = by[("DARL diffusion", "attentive probe block 3+4+5")].stages
  assert tuple(S.load_config(att).probe.blocks) == (3, 4, 5)
  assert S.load_config(att).optim.base_lr == 1e-3
  # Supervised from scratch at the fine-tuning budget, and at pretraining +
  # fine-tuning in images seen: 4300 steps of 512 = 8600 of 256, + 4300.
  ft = S.load_config(by[("DARL diffusion", "fine-tune")].stages[1])
  (budget,) = by[("scratch (supervised)", "fine-tune budget")].stages
  (both,) = by[("scratch (supervised)", "pretraining + fine-tuning budget")].stages
  assert S.load_config(budget).total_steps == ft.total_steps == 4300
  assert S.load_config(both).total_steps == 4300 + 8600
  assert S.load_config(budget).batch_size == ft.batch_size == 256
  assert ft.model.depth == 6 and ft.optim.num_layers == 6
  # A scale whose supervised stages have their own length (fmnist: 900 steps)
  # still gets a comparator at the fine-tuning budget.
  short = catalog.get_study("downstream", S.get_scale("fmnist"), seeds=1)
  by = {(r.labels["init"], r.labels["protocol"]): r.stages[-1] for r in short.runs}
  budget = S.load_config(by[("scratch (supervised)", "fine-tune budget")])
  both = S.load_config(by[("scratch (supervised)", "pretraining + fine-tuning budget")])
  assert (budget.total_steps, both.total_steps) == (300, 900)
  assert S.load_config(by[("DARL diffusion", "fine-tune")]).total_steps == 300


def test_best_block_accuracy_is_derived_from_the_per_block_accuracies():
  metrics = {"val_accuracy_block_00": 0.7, "val_accuracy_block_01": 0.9,
             "val_best_accuracy": 0.1, "val_loss": 0.3}
  assert runner_lib.derived(metrics)["best_block_accuracy"] == 0.9
  assert "best_block_accuracy" not in runner_lib.derived({"val_accuracy": 0.8})


def _grid_metrics(held: dict, test: dict) -> dict:
  """A linear probe grid's recorded metrics from ``{(block, pooling, lr):
  accuracy}`` on the held-out rows and the eval split, with its per-block
  choice made as train/probe_grid.choose makes it (grid order: lr, then
  pooling; the first on ties)."""
  out = {}
  for (block, pooling, lr), acc in test.items():
    out[f"val_grid_accuracy_block_0{block}_{pooling}_lr_{lr:g}_wd_0"] = acc
    out[f"val_holdout_grid_accuracy_block_0{block}_{pooling}_lr_{lr:g}_wd_0"] = held[
        (block, pooling, lr)]
  for block in sorted({b for b, _, _ in test}):
    cands = sorted((k for k in test if k[0] == block),
                   key=lambda k: (k[2], ("mean", "last").index(k[1])))
    best = max(cands, key=lambda k: held[k])          # first of the maxima
    out.update({f"val_accuracy_block_0{block}": test[best],
                f"val_holdout_accuracy_block_0{block}": held[best],
                f"val_chosen_learning_rate_block_0{block}": float(best[2]),
                f"val_chosen_weight_decay_block_0{block}": 0.0,
                f"val_chosen_pooling_block_0{block}": ("mean", "last").index(best[1])})
  return out


def test_a_linear_grid_is_read_at_its_held_out_choice_overall_and_per_pooling():
  held = {(0, "mean", 8): 0.80, (0, "mean", 16): 0.84, (0, "last", 8): 0.84,
          (0, "last", 16): 0.70,
          (1, "mean", 8): 0.86, (1, "mean", 16): 0.86, (1, "last", 8): 0.75,
          (1, "last", 16): 0.86}
  test = {(0, "mean", 8): 0.79, (0, "mean", 16): 0.83, (0, "last", 8): 0.85,
          (0, "last", 16): 0.90,
          (1, "mean", 8): 0.81, (1, "mean", 16): 0.88, (1, "last", 8): 0.74,
          (1, "last", 16): 0.87}
  metrics = _grid_metrics(held, test)
  out = runner_lib.derived(metrics)
  # Block 1 has the best held-out accuracy (0.86); on its three-way tie the
  # grid took lr 8, mean pooling: 0.81 on the eval split, though the eval
  # split's best block and the best cell (0.90) are elsewhere.
  assert out["chosen_block_accuracy"] == 0.81
  assert out["best_block_accuracy"] == 0.85
  # Among the mean pool's candidates: block 1 again, lr 8 (tie -> the smaller).
  assert out["chosen_block_accuracy_mean"] == 0.81
  # Among the last token's: block 1 at lr 16 (0.86 held out), not block 0.
  assert out["chosen_block_accuracy_last"] == 0.87
  assert runner_lib.grid_choice(metrics, "last") == {
      "block": "block_01", "learning_rate": 16.0, "weight_decay": 0.0, "accuracy": 0.87,
      "holdout_accuracy": 0.86}
  with pytest.raises(ValueError, match="pooling 'cls'"):
    runner_lib.grid_choice(metrics, "cls")
  # Single-setting probes get neither.
  assert "chosen_block_accuracy" not in runner_lib.derived({"val_accuracy_block_00": 0.5})


def test_knn_best_block_per_k_and_pooling():
  metrics = {"val_knn_accuracy_mean_k10_block_00": 0.6, "val_knn_accuracy_mean_k10_block_01": 0.7,
             "val_knn_accuracy_mean_k20_block_00": 0.65, "val_knn_accuracy_mean_k20_block_01": 0.5,
             "val_knn_accuracy_last_k20_block_00": 0.4, "val_accuracy_block_00": 0.65}
  out = runner_lib.derived(metrics)
  assert (out["best_block_accuracy_mean_k10"], out["best_block_accuracy_mean_k20"],
          out["best_block_accuracy_last_k20"]) == (0.7, 0.65, 0.4)


def test_choices_name_each_seeds_block_and_setting():
  held = {(b, p, lr): 0.5 + 0.1 * b + (0.01 if p == "last" else 0) + 0.001 * lr
          for b in (0, 1) for p in ("mean", "last") for lr in (8, 16)}
  grid_stage = S.stage("probe", "experiments/fashion_mnist_linear_probe.py",
                       {"probe.poolings": ("mean", "last"), "probe.learning_rates": (8, 16)})
  linear = runner_lib.choice(grid_stage, _grid_metrics(held, held))
  assert linear == {"block": "1", "accuracy": held[(1, "last", 16)],
                    "holdout_accuracy": held[(1, "last", 16)], "learning_rate": 16.0,
                    "weight_decay": 0.0, "pooling": "last"}
  attentive = runner_lib.choice(
      S.stage("attentive_probe", "experiments/fashion_mnist_attentive_probe.py",
              {"probe.blocks": (3, 4, 5)}),
      {"val_accuracy": 0.91, "val_holdout_accuracy": 0.92, "val_chosen_learning_rate": 0.003,
       "val_chosen_weight_decay": 0.3})
  assert attentive == {"block": "3+4+5", "accuracy": 0.91, "holdout_accuracy": 0.92,
                       "learning_rate": 0.003, "weight_decay": 0.3}
  # kNN / one setting: the eval split's best block (the lower on ties).
  knn = runner_lib.choice(S.stage("knn", "experiments/fashion_mnist_knn.py"),
                          {"val_accuracy_block_00": 0.7, "val_accuracy_block_01": 0.8,
                           "val_accuracy_block_02": 0.8})
  assert knn == {"block": "1", "accuracy": 0.8}
  assert runner_lib.choice(grid_stage, {"val_accuracy": 0.5}) is None

  recs = [{"labels": {"init": init, "seed": seed}, "choice": {**linear, "accuracy": acc}}
          for init, seed, acc in (("b", 1, 0.8), ("a", 0, 0.7), ("b", 0, 0.9))]
  recs.append({"labels": {"init": "pixels", "seed": 0}})          # no choice: no row
  md = R.choices_markdown(R.Choices("C", ("init",)), recs)
  assert md.splitlines()[2:] == [
      "| init | seed | block | accuracy (%) | held-out accuracy (%) | learning rate | "
      "weight decay | pooling |", "|---|---|---|---|---|---|---|---|",
      "| b | 0 | 1 | 90.00 | 62.60 | 16 | 0 | last |",
      "| b | 1 | 1 | 80.00 | 62.60 | 16 | 0 | last |",
      "| a | 0 | 1 | 70.00 | 62.60 | 16 | 0 | last |"]
  knn_md = R.choices_markdown(R.Choices("K", ("init",)),
                              [{"labels": {"init": "x", "seed": 0}, "choice": knn}])
  assert knn_md.splitlines()[2] == "| init | seed | block | accuracy (%) |"


def test_readout_and_prefix_read_their_checkpoints_with_the_probe_grid_at_fmnist_long():
  long = S.get_scale("fmnist_long")
  downstream = catalog.get_study("downstream", long)
  mse_grid = {r.labels["seed"]: r.stages[-1].id for r in downstream.runs
              if r.labels["init"] == "DARL mse" and r.labels["family"] == "linear grid"}
  linear_grid = catalog.PROBE_GRIDS["fmnist_long"][0]
  for name, per_seed in (("readout", 2), ("prefix", 4)):
    study = catalog.get_study(name, long)
    grid = [r for r in study.runs if r.labels.get("protocol") == "linear probe grid"]
    assert len(grid) == 3 * per_seed, name
    for run in grid:
      pre, probe = run.stages
      assert probe.parent == pre and probe.kind == "probe"
      config = S.load_config(probe)
      mask = run.labels.get("masking", run.labels.get("probing"))
      assert config.model.causal == (mask == "causal")
      assert tuple(config.probe.learning_rates) == linear_grid["probe.learning_rates"]
      assert tuple(config.probe.poolings) == ("mean", "last")
      if mask == "causal" and run.labels.get("pretraining", "causal") == "causal":
        # The downstream study's MSE grid stage: already run, not run twice.
        assert probe.id == mse_grid[run.labels["seed"]]
    # The fine-tuning table keeps to the fine-tuned runs.
    recs = [{"labels": r.labels, "metrics": {"last/val_accuracy": 0.9,
                                             "last/chosen_block_accuracy": 0.8}}
            for r in study.runs]
    assert "None" not in R.table_markdown(study.tables[0], recs)
    assert "| 80.0 ± 0.0 (3) |" in R.table_markdown(study.tables[1], recs)
  # The prefix study also gives the mask gap within each pretraining: full
  # attention against causal reading of the same pretraining's grid rows.
  prefix = catalog.get_study("prefix", long)
  recs = [{"labels": r.labels, "metrics": {"last/chosen_block_accuracy":
          0.86 - (0.03 if r.labels["pretraining"] == "causal" and r.labels["probing"] == "full"
                  else 0.0) + 0.002 * r.labels["seed"]}}
          for r in prefix.runs if r.labels.get("protocol") == "linear probe grid"]
  rows = {line.split(" | ")[0][2:]: line for line in
          R.comparisons_markdown(prefix.comparisons, recs).splitlines()}
  causal_gap = rows["linear probe grid, causal pretraining: full attention against causal reading"]
  prefix_gap = rows["linear probe grid, prefix-causal pretraining: full attention against "
                    "causal reading"]
  assert "| -3.00 ± 0.16 (18.3 SE) | beyond noise |" in causal_gap
  assert "| +0.00 ± 0.16 (0.0 SE) | within noise |" in prefix_gap
  for scale in ("tiny", "fmnist"):       # the runner's test study stays as it is
    for name in ("readout", "prefix"):
      study = catalog.get_study(name, S.get_scale(scale), seeds=1)
      assert all(s.kind != "probe" for s in study.stages()), (scale, name)


def test_precision_study_runs_each_arm_at_its_precision_and_reuses_the_recorded_chains():
  """fmnist_long, three seeds: the scale's own arm is the downstream study's
  diffusion chains (already run, the same stage ids); the bf16 and fp8 arms
  run every stage (pretraining, fine-tuning, the probe grid) at their
  precision; the report compares fp8 with bf16 on the pretraining loss and
  both accuracies."""
  long = S.get_scale("fmnist_long")
  study = catalog.get_study("precision", long)
  downstream = {(r.labels["protocol"], r.labels["seed"]): r.stages for r in
                catalog.get_study("downstream", long).runs
                if r.labels["init"] == "DARL diffusion"}
  arms = {}
  for run in study.runs:
    arms.setdefault(run.labels["precision"], []).append(run)
    pre, last = run.stages
    assert last.parent == pre and pre.kind == "pretrain"
    for stage in run.stages:
      config = S.load_config(stage)
      assert (config.model.dtype, config.precision) == {
          "scale's own": ("float32", "bf16"), "bf16": ("bfloat16", "bf16"),
          "fp8": ("bfloat16", "fp8")}[run.labels["precision"]], stage.id
    if run.labels["precision"] == "scale's own":
      assert [s.id for s in run.stages] == [
          s.id for s in downstream[(run.labels["protocol"], run.labels["seed"])]]
  assert {k: len(v) for k, v in arms.items()} == {"scale's own": 6, "bf16": 6, "fp8": 6}
  assert len({s.id for s in study.stages()}) == 3 * 3 * 3     # 3 arms x 3 seeds x 3 stages
  claims = [c.claim for c in study.comparisons]
  assert claims[:4] == ["pretraining loss: fp8 against bf16",
                        "pretraining validation loss: fp8 against bf16",
                        "fine-tuned accuracy: fp8 against bf16",
                        "linear probe grid: fp8 against bf16"]
  recs = [{"labels": r.labels, "metrics": {"pretrain/loss": 0.03, "pretrain/val_loss": 0.05,
                                           "last/val_accuracy": 0.9,
                                           "last/chosen_block_accuracy": 0.8}}
          for r in study.runs]
  assert "| fp8 | 90.0 ± 0.0 (3) |" in R.table_markdown(study.tables[1], recs)


def test_downstream_linear_table_carries_the_raw_pixel_classifier(tmp_path):
  study = catalog.get_study("downstream", TINY, seeds=1)
  runner = runner_lib.Runner(tmp_path / "out", tmp_path / "work")
  rows, missing = runner_lib.comparator_records(runner, study)
  assert rows == [] and "python -m darl_jax.studies.pixels" in missing[0]
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "pixels.json").write_text(json.dumps(
      {"logistic": {"val_accuracy": 0.859}, "ridge": {"val_accuracy": 0.827}}))
  rows, missing = runner_lib.comparator_records(runner, study)
  assert not missing
  tables = [t for t in study.tables if isinstance(t, R.Table)]
  linear = [t for t in tables if t.where.get("family") == "linear"
            and "best_block" in t.metrics[0]][0]
  table = R.table_markdown(linear, rows)
  assert "| raw pixels, logistic regression | 85.9 |" in table
  assert "| raw pixels, ridge regression | 82.7 |" in table
  # Not a row of the tables it has no number for.
  loss = [t for t in tables if t.metrics == ("pretrain/val_loss",)][0]
  assert "raw pixels" not in R.table_markdown(loss, rows)
  knn = [t for t in tables if t.where.get("family") == "knn"]
  assert all("raw pixels" not in R.table_markdown(t, rows) for t in knn)
  # The pixels' kNN, where the file has it: a row of the kNN tables, its
  # k = 20 the headline beside the stages' best block.
  (tmp_path / "out" / "pixels.json").write_text(json.dumps(
      {"logistic": {"val_accuracy": 0.859}, "ridge": {"val_accuracy": 0.827},
       "knn": {"val_accuracy": {"10": 0.859, "20": 0.849, "100": 0.817, "200": 0.8}}}))
  rows, _ = runner_lib.comparator_records(runner, study)
  assert "| raw pixels, kNN | 84.9 |" in R.table_markdown(knn[0], rows)
  assert "| raw pixels, kNN | 85.9 | 84.9 | 81.7 | 80.0 |" in R.table_markdown(knn[1], rows)
  assert "raw pixels, kNN" not in R.table_markdown(linear, rows)


def test_seeds_multiply_runs_and_reach_every_stage():
  one = catalog.get_study("readout", TINY, seeds=1)
  two = catalog.get_study("readout", TINY, seeds=2)
  assert len(two.runs) == 2 * len(one.runs)
  assert {S.load_config(s).seed for s in two.stages()} == {0, 1}


def test_equal_configs_share_one_stage_across_runs_and_studies():
  readout = catalog.get_study("readout", TINY)
  assert len(readout.runs) == 4 and len(readout.stages()) == 5   # one pretraining
  posenc = catalog.get_study("positional_encoding", TINY)
  darl_rope2d = [r for r in posenc.runs if r.labels["posenc"] == "rope2d"
                 and r.labels["protocol"].startswith("DARL")][0]
  # rope2d is the config's default: written or not, the same stage.
  assert darl_rope2d.stages[0].id == readout.runs[0].stages[0].id
  other = catalog.pretrain(TINY, "mse", 0, {"model.posenc": "rope1d"})
  assert other.id != darl_rope2d.stages[0].id


def test_recorded_stage_ids_survive_config_keys_added_since():
  """The stage files in reports/ are found by id: a config key added after
  they were recorded re-keys them all (and a rerun repeats hours of GPU work)
  unless spec.KEYS_ADDED names its old-behaviour value. If this fails after
  adding a config key, add the key there."""
  long = S.get_scale("fmnist_long")
  downstream = catalog.get_study("downstream", long, seeds=1)
  by = {(r.labels["init"], r.labels["protocol"]): r for r in downstream.runs}
  pre, probe = by[("DARL diffusion", "linear probe")].stages
  assert (pre.id, probe.id) == ("pretrain-e109c8499e", "probe-3aeaeb4880")
  # The fmnist scale's stages, recorded before config.kernels, the EMA, the
  # few-shot evaluator, prefix-causal pretraining and data.crop_scale.
  readout = catalog.get_study("readout", S.get_scale("fmnist"), seeds=1)
  assert [s.id for s in readout.runs[0].stages] == ["pretrain-e75dfccd73",
                                                    "finetune-e412eaf674"]
  for stage in (pre, probe, *readout.runs[0].stages):
    scale = "fmnist_long" if stage in (pre, probe) else "fmnist"
    assert (ROOT / "reports/studies" / scale / "stages" / f"{stage.id}.json").exists()
  # At the old behaviour a key is not part of the id; at any other value it is.
  for key, value in (("data.crop_scale", (0.5, 1.0)), ("model.prefix", "uniform"),
                     ("ema_decay", 0.999), ("fewshot_eval.enabled", True)):
    assert key in S.KEYS_ADDED or key.split(".")[0] in S.KEYS_ADDED
    other = S.stage(pre.kind, pre.config, pre.override_dict(), {key: value})
    assert other.id != pre.id, key
  same = S.stage(pre.kind, pre.config, pre.override_dict(), {"data.crop_scale": (0.2, 1.0)})
  assert same.id == pre.id


def test_how_a_stage_runs_is_not_part_of_its_id():
  pre = catalog.pretrain(TINY, "mse", 0)
  for key, value in (("data.num_workers", 0), ("kernels.attention", "xla"),
                     ("compilation_cache_dir", ""), ("tensorboard", True)):
    assert S.stage(pre.kind, pre.config, pre.override_dict(), {key: value}).id == pre.id, key
  assert S.stage(pre.kind, pre.config, pre.override_dict(), {"seed": 7}).id != pre.id


def test_finetune_recipe_study_sweeps_augmentation_and_length_for_both_inits():
  long = S.get_scale("fmnist_long")
  study = catalog.get_study("finetune_recipe", long)
  by = {(r.labels["init"], r.labels["augmentation"], r.labels["length"]): r
        for r in study.runs}
  paper = "paper: crop 0.2-1, RandAugment, mixup, cutmix"
  recipes = {"none", paper} | {f"crop {c:g}-1" for c in long.recipe_crop_scales}
  assert {k[1] for k in by} == recipes
  none = S.load_config(by[("DARL diffusion", "none", "x1")].stages[1])
  assert none.data.augment == "none"
  pre, ft = by[("DARL diffusion", "crop 0.5-1", "x2")].stages
  c = S.load_config(ft)
  assert (c.data.augment, tuple(c.data.crop_scale)) == ("spatial", (0.5, 1.0))
  assert (c.randaugment.num_ops, c.mixup.mixup_alpha, c.mixup.cutmix_alpha) == (0, 0.0, 0.0)
  assert (c.total_steps, c.optim.warmup_steps) == (8600, 860)
  # The paper's recipe: RandAugment(9, 0.5), mixup 0.8, cutmix 1.0, at the base length.
  for init in ("DARL diffusion", "scratch (supervised)"):
    c = S.load_config(by[(init, paper, "x1")].stages[-1])
    assert (c.randaugment.num_ops, c.randaugment.magnitude, c.mixup.mixup_alpha,
            c.mixup.cutmix_alpha, c.total_steps) == (2, 9.0, 0.8, 1.0, 4300)
  assert (("DARL diffusion", paper, "x2") not in by
          and ("scratch (supervised)", "crop 0.5-1", "x2") not in by)
  (sup,) = by[("scratch (supervised)", "crop 0.8-1", "x1")].stages
  assert tuple(S.load_config(sup).data.crop_scale) == (0.8, 1.0)
  # The scale's chosen recipe is one of the sweep's cells: the downstream
  # study's fine-tune and supervised stages are the same jobs.
  downstream = catalog.get_study("downstream", long, seeds=1)
  ds = {(r.labels["init"], r.labels["protocol"]): r for r in downstream.runs}
  low = long.downstream["data.crop_scale"][0]
  assert (ds[("DARL diffusion", "fine-tune")].stages[1].id
          == by[("DARL diffusion", f"crop {low:g}-1", "x1")].stages[1].id)
  assert (ds[("scratch (supervised)", "fine-tune budget")].stages[0].id
          == by[("scratch (supervised)", f"crop {low:g}-1", "x1")].stages[0].id)
  assert pre.id == ds[("DARL diffusion", "fine-tune")].stages[0].id


def test_unknown_names_and_keys_fail_with_the_valid_ones():
  with pytest.raises(ValueError, match="valid: positional_encoding, patch_decoder"):
    catalog.get_study("posenc", TINY)
  with pytest.raises(ValueError, match="valid: tiny, fmnist, imagenet"):
    S.get_scale("huge")
  bad = S.stage("pretrain", TINY.pretrain_mse, {"model.posenk": "none"})
  with pytest.raises(ValueError, match="model has no key 'posenk'.*posenc"):
    S.load_config(bad)
  with pytest.raises(ValueError, match="only data.path"):
    S.parse_set(["batch_size=8"])
  assert S.parse_set(["data.path=/d", "eval_batch_size=64"]) == {
      "data.path": "/d", "eval_batch_size": 64}


# ------------------------------------------------------------------ execution


def _spy(monkeypatch):
  ran = []
  original = runner_lib.Runner.run_stage

  def run_stage(self, stage):
    ran.append(stage.id)
    return original(self, stage)

  monkeypatch.setattr(runner_lib.Runner, "run_stage", run_stage)
  return ran


def test_study_runs_resumes_only_what_is_missing_and_reports(tmp_path, monkeypatch):
  study = catalog.get_study("readout", TINY)
  stages = study.stages()
  pre = stages[0]
  runner = runner_lib.Runner(tmp_path / "out", tmp_path / "work")
  ran = _spy(monkeypatch)
  assert runner.run(stages) == []
  assert ran == [s.id for s in stages] and pre.kind == "pretrain"
  for s in stages:
    result = runner.result(s)
    assert 0.0 <= result["metrics"]["val_accuracy" if s.kind == "finetune" else "val_loss"]
    assert "<work>/" in result["command"] and str(tmp_path) not in result["command"]
  assert runner.has_checkpoint(pre)                             # kept for later stages
  assert not any(runner.has_checkpoint(s) for s in stages[1:])  # downstream: deleted

  # Everything done: nothing runs.
  ran.clear()
  assert runner.run(stages) == [] and ran == []

  # A lost result reruns that stage alone; the others are untouched.
  before = {s.id: runner.result_path(s).stat().st_mtime_ns for s in stages}
  runner.result_path(stages[2]).unlink()
  runner.run(stages)
  assert ran == [stages[2].id]
  assert all(runner.result_path(s).stat().st_mtime_ns == before[s.id]
             for s in stages if s is not stages[2])

  # A missing stage whose parent's checkpoint is gone reruns the parent first.
  ran.clear()
  runner.result_path(stages[3]).unlink()
  import shutil
  shutil.rmtree(runner.workdir(pre) / "checkpoints")
  assert [s.id for s in runner.plan(stages)] == [pre.id, stages[3].id]
  runner.run(stages)
  assert ran == [pre.id, stages[3].id]

  # The rerun is another execution of the pretraining: the one it replaced
  # moves to superseded/, and each stage names the execution it started from.
  executions = runner.executions(pre)
  first, second = sorted(executions)
  assert runner.result(pre)["finished"] == second
  assert (tmp_path / "out" / "superseded" / f"{pre.id}.{first.replace(':', '')}.json").exists()
  read = {s.id: runner.result(s)["parent_finished"] for s in stages[1:]}
  assert read == {s.id: second if s is stages[3] else first for s in stages[1:]}
  # Each run's record reads its chain as its last stage read it. (Marked, since
  # CPU reruns repeat the numbers bit for bit.)
  marked = dict(executions[first], metrics={**executions[first]["metrics"], "val_loss": 123.0})
  runner_lib._write_json(runner.superseded_path(marked), marked)
  records, _ = runner_lib.records(runner, study)
  for run in study.runs:
    record = next(r for r in records if r["run"] == run.name)
    if run.stages[-1] is stages[3]:
      assert record["metrics"]["pretrain/val_loss"] == executions[second]["metrics"]["val_loss"]
      assert "superseded" not in record
    else:
      assert record["metrics"]["pretrain/val_loss"] == 123.0
      assert record["superseded"] == [f"{pre.id}@{first}"]
  # An execution that is not recorded: those rows leave the pretraining out.
  runner.superseded_path(marked).unlink()
  records, missing = runner_lib.records(runner, study)
  assert missing == []
  for record in records:
    reads_first = record["run"] != next(r.name for r in study.runs
                                        if r.stages[-1] is stages[3])
    assert ("pretrain/val_loss" in record["metrics"]) is not reads_first
    assert record.get("unrecorded") == ([pre.id] if reads_first else None)
  runner_lib._write_json(runner.superseded_path(executions[first]), executions[first])

  # The report: one row per mask, one column per read-out, the runs' numbers.
  records, missing = runner_lib.records(runner, study)
  assert missing == [] and len(records) == 4
  path = R.write(study, records, tmp_path / "out" / study.name, scale="tiny", seeds=1,
                 missing=missing, commands=[runner.command(s, portable=True) for s in stages])
  text = path.read_text()
  assert "| masking | readout=mean | readout=last |" in text
  full_last = [r for r in records if r["labels"]["masking"] == "full"
               and r["labels"]["readout"] == "last"][0]
  value = 100 * full_last["metrics"]["last/val_accuracy"]
  assert f"| full | " in text and f"{value:.1f} |" in text
  assert text.count("python -m darl_jax.main") == len(stages)


def test_rerun_executes_the_runs_again_and_keeps_what_it_replaces(tmp_path, monkeypatch):
  stages = list(catalog.get_study("readout", TINY).runs[0].stages)
  runner = runner_lib.Runner(tmp_path / "out", tmp_path / "work")
  ran = _spy(monkeypatch)
  assert runner.run(stages) == []
  first = {s.id: runner.result(s)["finished"] for s in stages}
  ran.clear()
  assert runner.plan(stages) == [] and runner.plan(stages, rerun=True) == stages
  left = runner.workdir(stages[0]) / "left_over"
  left.write_text("")   # the pretraining's workdir (its checkpoint) does not carry over
  assert runner.run(stages, rerun=True) == [] and ran == [s.id for s in stages]
  assert not left.exists() and runner.has_checkpoint(stages[0])
  for s in stages:
    assert sorted(runner.executions(s)) == [first[s.id], runner.result(s)["finished"]]
  pre, child = stages
  assert runner.result(child)["parent_finished"] == runner.result(pre)["finished"]


def test_a_stage_file_without_its_parents_execution_reads_the_one_before_it_started():
  """Stage files written before ``parent_finished`` was recorded: the
  parent's last execution finished before the child started (stamps cut to
  the second, hence a second's slack); none if every recorded one is later."""
  a, b = {"id": "p", "finished": "2026-01-01T00:00:00"}, {"id": "p",
                                                          "finished": "2026-01-01T00:10:00"}
  executions = {r["finished"]: r for r in (a, b)}
  child = lambda finished, seconds: {"finished": finished, "seconds": seconds}
  assert runner_lib.parent_execution(executions, child("2026-01-01T00:08:00", 60)) is a
  assert runner_lib.parent_execution(executions, child("2026-01-01T00:20:00", 60)) is b
  assert runner_lib.parent_execution(executions, child("2026-01-01T00:11:00", 60.5)) is b
  assert runner_lib.parent_execution(executions, child("2026-01-01T00:11:00", 62)) is a
  assert runner_lib.parent_execution(executions, child("2026-01-01T00:05:00", 600)) is None
  # A stage file that names its parent's execution is read by that name only.
  named = {"finished": "2026-01-01T00:20:00", "seconds": 60}
  assert runner_lib.parent_execution(executions, {**named, "parent_finished": a["finished"]}) is a
  assert runner_lib.parent_execution(executions, {**named, "parent_finished": "x"}) is None


def test_cli_runs_missing_stages_in_parallel_subprocesses(tmp_path):
  out, work = tmp_path / "out", tmp_path / "work"
  args = [sys.executable, "-m", "darl_jax.studies", "--study=readout", "--scale=tiny",
          f"--out={out}", f"--work={work}"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  listed = subprocess.run(args + ["--list"], capture_output=True, text=True, cwd=ROOT,
                          env=env, check=True).stdout
  # 3 pretraining steps and 4 x 2 fine-tuning steps of 16 images.
  assert "# 5 distinct stages; 5 to run (176 training images" in listed
  # --runs: only the runs whose name matches (and the stages they need).
  some = subprocess.run(args + ["--list", "--runs=^masking=causal"], capture_output=True,
                        text=True, cwd=ROOT, env=env, check=True).stdout
  assert "# 3 distinct stages; 3 to run" in some and "masking=full" not in some
  bad = subprocess.run(args + ["--list", "--runs=(("], capture_output=True, text=True,
                       cwd=ROOT, env=env)
  assert bad.returncode == 2 and "not a regular expression" in bad.stderr
  everything = subprocess.run(args + ["--list", "--rerun"], capture_output=True, text=True,
                              cwd=ROOT, env=env)
  assert everything.returncode == 2 and "--rerun needs --runs" in everything.stderr
  # The pretraining and two fine-tunings done: two fine-tunings left, run at once.
  study = catalog.get_study("readout", TINY)
  stages = study.stages()
  runner = runner_lib.Runner(out, work)
  for s in stages[:3]:
    runner.run_stage(s)
  done = subprocess.run(args + ["--parallel=2"], capture_output=True, text=True, cwd=ROOT,
                        env=env)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "readout: 4/4 runs complete" in done.stdout
  assert sorted(p.name for p in work.glob("*.log")) == sorted(
      f"{s.id}.log" for s in stages[3:])
  assert (out / "readout" / "README.md").exists()


def test_parallel_stages_split_the_hosts_cores_between_their_data_workers(tmp_path,
                                                                          monkeypatch):
  seen = {}

  class FakePopen:
    def __init__(self, args, env, **kwargs):
      seen.update(env)

  monkeypatch.setattr(runner_lib.subprocess, "Popen", FakePopen)
  monkeypatch.delenv("DARL_PROCESSES_PER_HOST", raising=False)
  runner = runner_lib.Runner(tmp_path / "out", tmp_path / "work")
  stage = catalog.get_study("readout", TINY).stages()[0]
  _, log, _ = runner._spawn(stage, 7, [])
  log.close()
  assert seen["DARL_PROCESSES_PER_HOST"] == "7"
  monkeypatch.setenv("DARL_PROCESSES_PER_HOST", "7")
  monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: set(range(16)),
                      raising=False)
  assert pipeline.resolve_num_workers(-1) == 2     # 16 cores / 7 stages


def test_a_failed_parent_fails_its_children_and_the_rest_goes_on(tmp_path, monkeypatch):
  study = catalog.get_study("ordering", TINY)
  bad_parent = S.stage("pretrain", TINY.pretrain_mse, TINY.common, TINY.pretrain,
                       {"model.variant": "Ti/5"})      # 28 is not divisible by 5
  child = catalog.finetune(TINY, bad_parent, 0)
  good = study.stages()[:1]
  runner = runner_lib.Runner(tmp_path / "out", tmp_path / "work")
  failed = runner.run([bad_parent, child] + good)
  assert failed == [bad_parent.id, child.id]
  assert runner.result(good[0]) is not None


# --------------------------------------------------------------------- report


def _records():
  out = []
  for seed, (x0, x1) in enumerate([(0.80, 0.90), (0.82, 0.86)]):
    for a, acc, loss in (("a1", x0, 0.3), ("a2", x1, 0.2)):
      out.append({"labels": {"kind": "k", "a": a, "steps": 10 * (1 + seed), "seed": seed},
                  "metrics": {"last/val_accuracy": acc, "pretrain/val_loss": loss + seed,
                              "probe/val_accuracy_block_00": acc - 0.1,
                              "probe/val_accuracy_block_01": acc}})
  return out


def test_tables_average_seeds_and_take_the_best_over_labels():
  recs = _records()
  t = R.table_markdown(R.Table("T", ("kind",), "a", ("last/val_accuracy",)), recs)
  assert "| k | 81.0 ± 1.4 (2) | 88.0 ± 2.8 (2) |" in t
  best = R.table_markdown(R.Table("B", ("kind",), None, ("last/val_accuracy",),
                                  best_over=("a",)), recs)
  assert "| k | 88.0 ± 2.8 (2) |" in best
  missing = R.table_markdown(R.Table("M", ("kind",), "a", ("last/val_accuracy",),
                                     where={"seed": 5}), recs)
  assert missing.endswith("| kind |\n|---|")   # no matching runs: no rows, no columns
  assert R.fmt("pretrain/val_loss", [0.25]) == "0.2500"
  assert R.fmt("x/val_accuracy", []) == "—"


def test_comparisons_give_the_welch_difference_and_read_it():
  recs = [{"labels": {"arm": arm, "cell": cell, "seed": seed},
           "metrics": {"last/val_accuracy": acc}}
          for arm, cell, seed, acc in [("x", 1, 0, 0.80), ("x", 1, 1, 0.82), ("x", 2, 0, 0.84),
                                       ("y", 1, 0, 0.70), ("y", 1, 1, 0.71),
                                       ("z", 1, 0, 0.60)]]
  md = R.comparisons_markdown((
      # x pools both cells (3 runs) against y's 2: (0.82 - 0.705) / SE
      R.Comparison("x against y", {"arm": "x"}, {"arm": "y"}),
      R.Comparison("x cell 1 against x or y cell 1", {"arm": "x"},
                   {"arm": frozenset({"x", "y"})}, where={"cell": 1}),
      R.Comparison("x against z", {"arm": "x"}, {"arm": "z"})), recs)
  rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in md.splitlines()
          if line.startswith("| x")}
  se = np.sqrt(np.var([0.80, 0.82, 0.84], ddof=1) / 3 + np.var([0.70, 0.71], ddof=1) / 2)
  assert rows["x against y"][4] == f"+11.50 ± {100 * se:.2f} ({int(1.15 / se) / 10:.1f} SE)"
  assert rows["x against y"][5].startswith("beyond noise")
  assert rows["x cell 1 against x or y cell 1"][3] == "75.8 ± 6.1 (4)"
  assert rows["x against z"][5].startswith("too few runs")
  assert R.verdict(2.5, 1.0) == "suggestive" and R.verdict(-1.0, 1.0) == "within noise"
  assert R.verdict(0.31, 0.1) == "beyond noise" and R.difference([1.0], [2.0, 3.0]) is None
  # A printed 3.0 is read as 3.0: 2.999 standard errors print as 2.9.
  assert R.standard_errors(0.2999, 0.1) == 2.9 and R.verdict(0.2999, 0.1) == "suggestive"


@pytest.mark.parametrize("scale", sorted(S.SCALES))
def test_every_comparison_selects_runs_on_both_sides(scale):
  for name in catalog.STUDIES:
    study = catalog.get_study(name, S.get_scale(scale), seeds=1)
    for c in study.comparisons:
      a = [r.name for r in study.runs if R._matches(r.labels, {**c.where, **c.a})]
      b = [r.name for r in study.runs if R._matches(r.labels, {**c.where, **c.b})]
      assert a and b and not set(a) & set(b), (scale, name, c.claim)


def test_a_study_report_carries_its_comparisons(tmp_path):
  study = catalog.get_study("readout", TINY, seeds=2)
  recs = [{"labels": r.labels, "metrics": {"last/val_accuracy": 0.5 + 0.1 * r.labels["seed"]
                                          + (0.2 if r.labels["readout"] == "last" else 0)}}
          for r in study.runs]
  text = R.write(study, recs, tmp_path, scale="tiny", seeds=2, missing=[],
                 commands=[]).read_text()
  assert "| causal: last token against mean pool | last/val_accuracy |" in text
  assert "+20.00 ± 7.07 (2.8 SE) | suggestive |" in text


def test_every_plot_kind_writes_a_png(tmp_path):
  recs = _records()
  specs = [R.Heatmap("H", "steps", "steps", "last/val_accuracy", facet="a"),
           R.Lines("L", "steps", "a", "last/val_accuracy"),
           R.Scatter("S", "pretrain/val_loss", "last/val_accuracy", "kind"),
           R.DepthCurves("D", "probe/val_accuracy_block_", ("a", "seed"))]
  for spec in specs:
    path = tmp_path / f"{R.slug(spec.title)}.png"
    note = R.plot(spec, recs, path)
    assert path.stat().st_size > 1000
    if isinstance(spec, R.Scatter):
      assert note.startswith("kind=k: n=4, Pearson r=")
  assert R.correlations([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]).endswith("r=-1.00, Spearman rho=-1.00")
  assert R.correlations([1.0, 2.0, 3.0], [5.0, 5.0, 5.0]) == "n=3 (constant values)"
  assert R.correlations([1.0, 2.0], [1.0, 2.0]).startswith("n=2 (too few")


def _processes_mentioning(text: str) -> list[int]:
  out = []
  for proc in pathlib.Path("/proc").iterdir():
    try:
      if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="ignore"):
        out.append(int(proc.name))
    except OSError:
      pass
  return out


def test_sigterm_stops_the_running_stages_and_a_rerun_finishes(tmp_path):
  import signal
  import time
  out, work = tmp_path / "out", tmp_path / "work"
  args = [sys.executable, "-m", "darl_jax.studies", "--study=readout", "--scale=tiny",
          f"--out={out}", f"--work={work}", "--parallel=2"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  parent = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while len(list(work.glob("finetune-*.log"))) < 2 and time.time() < deadline:
    time.sleep(0.2)                       # the pretraining is done, fine-tunings started
  assert len(_processes_mentioning(f"--work={work}")) >= 2     # the runner and its stages
  parent.send_signal(signal.SIGTERM)
  assert parent.wait(timeout=60) == 143
  assert _processes_mentioning(f"--work={work}") == []          # no orphaned stages
  assert len(list((out / "stages").glob("finetune-*.json"))) < 4
  done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
  assert done.returncode == 0 and "readout: 4/4 runs complete" in done.stdout


# A study runner whose stages are stand-ins (a Python sleeping 120 s; the
# runner's command line is replaced at Popen) and which sends itself SIGTERM
# at one point of the spawn path per round, as the CLI is set up (a handler
# that exits with 143). Hook points: before the fork, right after it (the
# child exists, Popen has not returned), after Popen returned (the runner has
# not recorded the process yet), and in the runner's polls. After each round
# every stand-in must be gone: one still running is a stage the runner would
# leave without a parent.
_SPAWN_DRIVER = r"""
import json, os, pathlib, signal, subprocess, sys, time
from darl_jax.studies import runner as runner_lib
from darl_jax.studies import spec as S

work = pathlib.Path(sys.argv[1])
rounds = json.loads(sys.argv[2])
TINY = S.get_scale("tiny")
stages = [S.stage("pretrain", TINY.pretrain_mse, TINY.common, TINY.pretrain, {"seed": i})
          for i in range(3)]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # as the CLI's
real_popen, real_fork_exec = subprocess.Popen, subprocess._fork_exec
state = {}

def hit(where):
  state["counts"][where] = state["counts"].get(where, 0) + 1
  if [where, state["counts"][where]] in state["at"]:
    if state["ready"]:        # the stand-ins ignore SIGTERM: wait until they do
      while not all(os.path.exists(f) for f in state["ready"]):
        time.sleep(0.01)
    state["sent"] += 1
    os.kill(os.getpid(), signal.SIGTERM)

def fork_exec(*args):
  pid = real_fork_exec(*args)
  state["children"].append(pid)
  hit("after_fork")
  return pid

class Popen(real_popen):
  def __init__(self, args, **kwargs):
    hit("before_spawn")
    n = len(state["children"])
    ready = str(work / f"ready-{state['round']}-{n}")
    code = ("import signal, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if state["stubborn"] else "")
            + f"open({ready!r}, 'w').close()\ntime.sleep(120)")
    if state["stubborn"]:
      state["ready"].append(ready)
    super().__init__([sys.executable, "-c", code], **kwargs)
    hit("after_spawn")

  def poll(self):
    hit("poll")
    return super().poll()

subprocess._fork_exec, subprocess.Popen = fork_exec, Popen
for i, (at, stubborn) in enumerate(rounds):
  state.update(round=i, at=at, stubborn=stubborn, counts={}, children=[], ready=[], sent=0)
  runner = runner_lib.Runner(work / f"out{i}", work / f"work{i}")
  start, status = time.time(), None
  try:
    runner.run(stages, parallel=2)
  except SystemExit as e:
    status = e.code
  alive = []
  for pid in state["children"]:
    try:
      if os.waitpid(pid, os.WNOHANG) == (0, 0):    # still running: nobody stopped it
        alive.append(pid)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except ChildProcessError:
      pass                                           # reaped by the runner
  print(json.dumps({"at": at, "status": status, "sent": state["sent"],
                    "started": len(state["children"]), "alive": alive,
                    "seconds": round(time.time() - start, 2)}), flush=True)
"""


def _spawn_rounds(tmp_path, rounds):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", _SPAWN_DRIVER, str(tmp_path), json.dumps(rounds)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  return [json.loads(line) for line in done.stdout.splitlines()]


def test_a_signal_anywhere_in_a_spawn_leaves_no_stage_running(tmp_path):
  # parallel=2 over three parentless stages: two spawns, then polls.
  points = [[where, n] for where in ("before_spawn", "after_fork", "after_spawn")
            for n in (1, 2)] + [["poll", 1], ["poll", 2]]
  rounds = _spawn_rounds(tmp_path, [([p], False) for p in points])
  assert [r["at"] for r in rounds] == [[p] for p in points]
  for r in rounds:
    assert r["sent"] == 1, r                    # the hook point was reached
    assert r["status"] == 143, r                # the CLI's SIGTERM exit, after the stop
    assert r["alive"] == [], r                  # no stage left without its runner
    assert r["seconds"] < 60, r                 # stopped, not waited out
  # The spawn a signal lands in completes (and is stopped); no other starts.
  started = {tuple(r["at"][0]): r["started"] for r in rounds}
  assert [started[(w, 1)] for w in ("before_spawn", "after_fork", "after_spawn")] == [1, 1, 1]
  assert [started[(w, 2)] for w in ("before_spawn", "after_fork", "after_spawn")] == [2, 2, 2]


def test_a_second_signal_kills_stages_that_do_not_stop(tmp_path):
  # Stand-ins that ignore SIGTERM: the first signal's terminate leaves them
  # running; a second one, while the runner waits for them, kills them.
  [r] = _spawn_rounds(tmp_path, [([["poll", 1], ["poll", 6]], True)])
  assert r["sent"] == 2 and r["started"] == 2 and r["alive"] == [] and r["status"] == 143, r


def _gone(pid: int) -> bool:
  try:
    return (pathlib.Path("/proc") / str(pid) / "stat").read_text().split(")")[-1].split()[0] == "Z"
  except OSError:
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stage_ends_with_its_runner_even_when_the_runner_is_killed(tmp_path):
  import signal
  import time
  stage = ("import sys, time\nfrom darl_jax.studies import runner\nrunner._die_with_runner()\n"
           "open(sys.argv[1], 'w').close()\ntime.sleep(120)")
  # The runner stand-in starts a stage as Runner._spawn does (its pid in the
  # stage's environment) and is then killed with SIGKILL: nothing of it runs.
  runner = subprocess.Popen(
      [sys.executable, "-c", "import os, subprocess, sys, time\n"
       f"env = dict(os.environ, {runner_lib.RUNNER_PID_ENV}=str(os.getpid()))\n"
       f"child = subprocess.Popen([sys.executable, '-c', {stage!r}, {str(tmp_path / 'ready')!r}],"
       " env=env)\nprint(child.pid, flush=True)\ntime.sleep(120)"],
      cwd=ROOT, stdout=subprocess.PIPE, text=True)
  try:
    pid = int(runner.stdout.readline())
    deadline = time.time() + 120
    while not (tmp_path / "ready").exists() and time.time() < deadline:
      time.sleep(0.05)
    assert (tmp_path / "ready").exists()
  finally:
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    runner.stdout.close()
  deadline = time.time() + 30
  while not _gone(pid) and time.time() < deadline:
    time.sleep(0.05)
  assert _gone(pid)
  # A stage whose runner is gone before it could ask (another process is its
  # parent) does not start.
  env = dict(os.environ, **{runner_lib.RUNNER_PID_ENV: "1"})
  late = subprocess.run([sys.executable, "-c", stage, str(tmp_path / "late")], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=120)
  assert late.returncode == 1 and "study runner (pid 1)" in late.stderr
  assert not (tmp_path / "late").exists()
