// The cost model's aggregates and predictions of mixmoe.placement.counts and
// mixmoe.placement.cost_model, compiled (no share entries): on one link, and with a profile's
// topology (nodes of per_node consecutive ranks: plan_pricing's 6-row loads, pricing_nodes.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

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

// baseline from C's column sums `colsum` [N] and row sums `rowsum` [W], as the layer computes
// them where C is gathered (mixmoe.placement.counts.CountSums): no pass over C, only each
// rank's E own columns of its own row. False (out unspecified) when a sum is negative or the
// two totals differ; the sums are not otherwise checked against C.
bool baseline_from_sums(const Counts& counts, const int64_t* colsum, const int64_t* rowsum,
                        Baseline& out);

// The pass over n consecutive rows of C (`rows`: the first one's N counts) that baseline makes,
// eight rows at a time: adds each column's counts to colsum[g], writes each row's sum to
// sent[k] (k < n); false when some count is negative (the sums are then still the sums).
bool add_row_block(const int64_t* rows, int64_t n, int64_t N, int64_t* colsum, int64_t* sent);

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

// Whether a plan's experts ascend below N (replicas, ranges, kept: each list), its ranks lie in
// [0, W), and, relayed, its holders ascend and exclude the owner: the pricings read out of
// bounds otherwise, where the Python raises (ValueError, IndexError) or wraps a negative index
// (their entries then return -1 and the Python runs).
bool plan_in_range(const Counts& counts, const Replicas& replicas, bool relay,
                   const ExpertEntries& ranges, const ExpertEntries& kept);

// The C entries' plan: [n_replicas, then per hot expert (g, k, k holders); n_ranges, then per
// expert (g, k, k (helper, rows) pairs); n_kept, likewise (holder, local rows)]
// ranges.range_experts: f(g, ranges of g or nullptr, kept of g or nullptr) for every expert
// with ranges or kept holders, ascending g (a merge of the two lists, each ascending)
template <typename F>
void for_range_experts(const ExpertEntries& ranges, const ExpertEntries& kept, F f) {
  size_t i = 0, j = 0;
  while (i < ranges.size() || j < kept.size()) {
    const int64_t gr = i < ranges.size() ? ranges[i].first : INT64_MAX;
    const int64_t gk = j < kept.size() ? kept[j].first : INT64_MAX;
    const int64_t g = std::min(gr, gk);
    const Entries* r = gr == g ? &ranges[i++].second : nullptr;
    const Entries* k = gk == g ? &kept[j++].second : nullptr;
    f(g, r, k);
  }
}

inline const int64_t* read_plan(const int64_t* plan, Replicas& replicas,
                                ExpertEntries (&entries)[2]) {
  replicas.resize(static_cast<size_t>(*plan++));
  for (auto& [g, hs] : replicas) {
    g = *plan++;
    const int64_t k = *plan++;
    hs.assign(plan, plan + k);
    plan += k;
  }
  for (auto& list : entries) {
    list.resize(static_cast<size_t>(*plan++));
    for (auto& [g, pairs] : list) {
      g = *plan++;
      pairs.resize(static_cast<size_t>(*plan++));
      for (auto& [y, n] : pairs) {
        y = *plan++;
        n = *plan++;
      }
    }
  }
  return plan;
}

// A Prediction into a C entry's buffers: ints [token_bytes, weight_bytes, rows] (3W), reals
// [compute, comm] (2W); returns its step.
inline double write_prediction(const Prediction& p, int64_t* out_i, double* out_d) {
  const size_t W = p.rows.size();
  std::copy(p.compute.begin(), p.compute.end(), out_d);
  std::copy(p.comm.begin(), p.comm.end(), out_d + W);
  std::copy(p.token_bytes.begin(), p.token_bytes.end(), out_i);
  std::copy(p.weight_bytes.begin(), p.weight_bytes.end(), out_i + W);
  std::copy(p.rows.begin(), p.rows.end(), out_i + 2 * W);
  return p.step;
}

// The Prediction of `loads` whose rank r costs seconds(r) = (compute, comm): _pack_lists' bytes
// and step, shared by predict and predict_nodes.
template <typename Seconds>
Prediction pack_prediction(const Model& model, const Loads& loads, Seconds seconds) {
  const size_t W = loads.rows.size();
  Prediction p;
  p.compute.resize(W);
  p.comm.resize(W);
  p.token_bytes.resize(W);
  p.weight_bytes.resize(W);
  p.rows = loads.rows;
  const int64_t token = 2 * model.tbr, weight = 2 * model.P;
  for (size_t r = 0; r < W; ++r) {
    const auto [compute, comm] = seconds(r);
    p.compute[r] = compute;
    p.comm[r] = comm;
    const double total = compute + comm;
    if (r == 0 || total > p.step) p.step = total;  // Python's max: the first largest
    p.token_bytes[r] = token * loads.remote[r];
    const double n = loads.replica[r];
    // whole copies: exact int products; the relay's fractional ones: the float product
    // rounded half to even (Python's round, std::nearbyint in the default rounding mode)
    const double bytes = static_cast<double>(weight) * n;
    p.weight_bytes[r] = n == std::floor(n) ? weight * static_cast<int64_t>(n)
                                           : static_cast<int64_t>(std::nearbyint(bytes));
  }
  return p;
}

// plan_pricing's 6-row loads under a topology: LOADS, then the remote rows and the relay (or flat
// fan-out) copies that cross nodes, per rank.
struct NodeLoads {
  Loads loads;
  std::vector<int64_t> remote_inter;
  std::vector<double> replica_inter;
};

// cost_model._inter_node_loads of nothing replicated (remote rows crossing nodes per rank, nodes
// of per_node consecutive ranks; zeros when per_node >= W): plan_pricing_nodes starts from it.
std::vector<int64_t> inter_baseline(const Counts& counts, const Baseline& base, int64_t per_node);

// cost_model.plan_pricing(C, plan, E, profile) of a plan without share entries when the profile
// has nodes of `per_node` ranks (relay.nodes_of): its 6-row loads (out) and the weight rounds.
// `inter`: inter_baseline's; the rest as plan_pricing's.
int64_t plan_pricing_nodes(const Counts& counts, const Baseline& base,
                           const std::vector<int64_t>& inter, int64_t per_node,
                           const Replicas& replicas, bool relay, const ExpertEntries& ranges,
                           const ExpertEntries& kept, NodeLoads& out);

// StepModel.prediction_W(loads_6W, rounds) (rounds >= 0): seconds_W's 6-row prices
// (Model::seconds_nodes at `bw_inter`), packed as predict packs them.
Prediction predict_nodes(const Model& model, double bw_inter, const NodeLoads& loads,
                         int64_t rounds);

}  // namespace mixmoe_native
