"""The what-if simulator: predicted step times per strategy on the planner's own cost model.

- ``layer``:      one MoE layer per strategy (a2a, shadow, mix): per-rank compute, communication,
                  overlap, forward / backward / step, the replicas the planner would choose.
- ``routing``:    routing sources (uniform, zipf:S, hot:P, recorded counts files).
- ``model``:      a model of L MoE layers + dense part + data-parallel all-reduce + pipeline bubble.
- ``replay``:     a CMD trace replayed with its MoE all-to-alls re-predicted under another
                  profile or strategy, the rest kept as measured.
- ``validation``: predictions against stored ``bench layer`` measurements.
"""
