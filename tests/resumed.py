"""Runs a config straight through and stopped-then-resumed, for the tests
that check a resumed run is the uninterrupted one."""

from darl_jax.train import loop


def straight_and_resumed(trainer_cls, config, root, stop_at: int = 2):
  """(final metrics of the straight run in ``root/a``, of the run in
  ``root/b`` stopped after ``stop_at`` steps and rerun to the end)."""
  straight = loop.run(trainer_cls(config), config, str(root / "a"))
  config.stop_after_steps = stop_at
  loop.run(trainer_cls(config), config, str(root / "b"))
  config.stop_after_steps = 0
  resumed = loop.run(trainer_cls(config), config, str(root / "b"))
  return straight, resumed
