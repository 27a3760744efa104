"""The planner: hardware profile → cost model → plan search → a frozen, JSON-serialisable result.

Modules: ``shapes`` (a model as blocks, from a config alone), ``profile`` (the hardware profile and
its JSON), ``measure`` (``fuyou profile``'s measurements; torch imported inside), ``sim`` (discrete-
event simulator), ``graph`` (one engine step as operations), ``cost`` (step time, busy time, memory
per tier, SSD traffic and wear), ``search`` (the plan search), ``result`` (``PlannerResult``).
Nothing here imports the engine's execution code or torch at import time (only the plain-data
``fuyou.engine.plan.Plan``), so ``fuyou plan`` runs anywhere in seconds.
"""
