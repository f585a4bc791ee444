"""Token movement strategies. ``local`` (one device) lives here; the expert-parallel strategies
(``a2a``, ``shadow``, ``mix``) sit beside it and share the same call signature:
``dispatch(x_TD, routing, weights) -> (rows, layout, meta)``, ``experts(rows, layout)``,
``combine(out, meta) -> y_TD``.

Files, in the order one step uses them (expert parallelism):

``strategies``   the strategy table: which planner, overlap or not, the config fingerprint
``expert_parallel`` the engine: count exchange (the host sync), plan, fetch, exchange, combine
``step_plan``    ``StepPlan``: this rank's host-side bookkeeping (splits, receive segments)
``step_shares``  the same under a plan with share entries (helper ranks)
``step_layout``  device index tensors of the step: ``OwnLayout`` (the plan-independent part)
                 and ``StepLayout`` (the whole step)
``replicas``     replica weights: pack, relay rounds, cache, gradient return
``step``         what the experts run: ``ExpertWork`` items, grouped as ``ExpertLayout``
``layout``       ``RowLayout``: one device's rows sorted by expert into blocks (``local``)

Four kinds of "layout", one per level: ``RowLayout`` (one device's block layout), ``OwnLayout``
and ``StepLayout`` (one expert-parallel step's index tensors), ``ExpertLayout`` (the work items
the experts execute, in order)."""

from mixmoe.dispatch.layout import RowLayout, counts_to_host, expert_row_layout
from mixmoe.dispatch.local import LocalDispatcher

__all__ = ["LocalDispatcher", "RowLayout", "counts_to_host", "expert_row_layout"]
