"""The planner: hardware profile → cost model → plan search → a frozen, JSON-serialisable result.

Modules in the order a plan is made, from a model's description (``fuyou.schedule.shapes``, made by
``fuyou.models.description`` from the model itself): ``profile`` (the hardware profile and its JSON), ``measure`` (``fuyou profile``'s measurements;
torch imported inside), ``sim`` (discrete-event simulator), ``graph`` (one step as operations, built
from the step's rules in ``fuyou.schedule.rules``), ``cost`` (step time, busy time, memory per tier —
host memory by ``fuyou.schedule.sizing``, the engine's own rules —, SSD traffic and wear), ``search``
(the plan search), ``result`` (``PlannerResult``). The cost model and search import neither the
engine nor the device backends nor torch, so ``fuyou plan`` runs anywhere in seconds.
"""
