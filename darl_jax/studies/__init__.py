"""The paper's ablations as runnable studies (docs/STUDIES.md).

    python -m darl_jax.studies --study=noise_schedule --scale=fmnist --out=reports/studies

A study is a list of runs; a run is a chain of stages (pretrain -> fine-tune,
or one supervised stage); a stage is an experiment config plus config
overrides, exactly what ``python -m darl_jax.main`` takes. ``spec`` holds the
data types and the scales, ``catalog`` the seven studies, ``runner`` the
resumable execution, ``report`` the tables and plots.
"""
