"""``python -m darl_jax.train.vtab``: the VTAB-1k suite's command, kept at
this name; the job itself is train/jobs/vtab.py."""

from darl_jax.train.jobs import vtab as vtab_job

if __name__ == "__main__":
  vtab_job.cli()
