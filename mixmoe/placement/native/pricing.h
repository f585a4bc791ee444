// The cost model's aggregates and predictions of mixmoe.placement.counts and
// mixmoe.placement.cost_model, compiled (one link: no topology, no share entries).
#pragma once

#include "common.h"

namespace mixmoe_native {

// counts.baseline_loads: the loads with nothing replicated (replica 0), C's column sums and each
// expert's owner's own rows C[g / E][g].
struct Baseline {
  Loads loads;
  std::vector<int64_t> colsum, own;
};

// counts.counts_with_sums' sign check and baseline_loads in one pass over C; false (out
// unspecified) when a count is negative (the caller's Python raises its error).
bool baseline(const Counts& counts, Baseline& out);

// cost_model.plan_pricing(C, plan, E, None) of a plan without share entries: its loads (out) and
// the weight rounds it returns. `replicas`: Plan.replicas (holders non-empty); `relay`:
// Plan.relay; `ranges`, `kept`: Plan.ranges and Plan.kept (mixmoe.placement.ranges).
int64_t plan_pricing(const Counts& counts, const Baseline& base, const Replicas& replicas,
                     bool relay, const ExpertEntries& ranges, const ExpertEntries& kept,
                     Loads& out);

// StepModel.prediction_lists(rows, local, remote, replica, rounds): the Prediction's fields.
// rounds < 0: Python's None (one round when any rank holds a copy, else none).
struct Prediction {
  std::vector<double> compute, comm;
  std::vector<int64_t> token_bytes, weight_bytes, rows;
  double step = 0.0;
};
Prediction predict(const Model& model, const Loads& loads, int64_t rounds);

}  // namespace mixmoe_native
