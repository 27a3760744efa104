"""What a training step does, decided before it runs — plain data and rules, no torch.

Read in this order: ``plan`` (the ``Plan``: every choice the planner or the budget rules make),
``rules`` (the step's rules: schedule, load order, which gradients park and where), ``sizing`` (the
host buffers a plan reserves, the RAM tier, fitting a plan into the host budget). The engine
(``fuyou.engine``) executes these rules; the planner (``fuyou.planner``) simulates and searches with
the same ones. This package imports neither.
"""

from fuyou.schedule.plan import Plan

__all__ = ["Plan"]
