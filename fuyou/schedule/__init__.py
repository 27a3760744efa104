"""What a training step does, decided before it runs — plain data and rules, no torch.

Read in this order: ``plan`` (the ``Plan``: every choice the planner or the budget rules make),
``rules`` (the step's rules: schedule, load order, which gradients park and where), ``sizing`` (the
host buffers a plan reserves, the RAM tier, fitting a plan into the host budget), ``device_memory``
(what a step holds on the device), ``shapes`` (a model as the planner and device memory see it: per
block elements, FLOPs, saved bytes; made by ``fuyou.models.description``), with ``experts``,
``vocab`` and ``shards`` (how blocks split by experts, vocabulary rows and ranks). The engine
(``fuyou.engine``) executes these rules; the planner (``fuyou.planner``) simulates and searches with
the same ones. This package imports neither.
"""

from fuyou.schedule.plan import Plan

__all__ = ["Plan"]
