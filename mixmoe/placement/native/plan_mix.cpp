// mixmoe.placement.planner.plan_mix compiled: the whole mixed plan in one call (fill="level"; one
// link, or a profile's nodes of per_node consecutive ranks), from the parts declared in pricing.h,
// replica_search.h, candidates.h and level_fill.h.
//
// Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (row-major int64, C[s*N + g]
// = rows rank s routes to expert g; g's owner is g / E). A candidate: a plan (replicas, relay,
// ranges, kept) with its Prediction.
//
// The same steps as plan_mix, in the same order, with the same comparisons (common.h: every part
// is its Python's twin bit for bit), so the plan it returns is plan_mix's: the best of the source
// replicas (replica_search) and FasterMoE's shadowing (shadow_hot), then, unless that is balanced
// already, level fills from the best candidate, from nothing replicated, from the spread start,
// the kept fill and, last, from the best thinned (thinned_starts), the winner's plan kept only
// when its price is strictly below the best candidate's. With a topology every candidate and fill is priced by the 6-row pricing
// (plan_pricing_nodes, predict_nodes; the search and the fills see one link, as in the Python:
// the search the intra-node one, the fills the blend of both for rows, their relay copies
// split by the link they cross, StepModel.fill_link): the
// source-replica candidate repriced (cost_model.reprice), each fill's plan priced in full
// (planner._fill_step). tests/placement/test_native_planner.py and
// test_native_planner_nodes.py compare the plans with plan_mix's Python path (MIXMOE_NATIVE=0)
// field by field, floats bit for bit.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "candidates.h"
#include "common.h"
#include "level_fill.h"
#include "pricing.h"
#include "replica_search.h"

namespace {

using namespace mixmoe_native;

struct Settings {  // plan_mix's arguments and module constants
  int64_t slots, width, blk, passes;
  bool balance;
  double balanced, fill_stop, spread_when;  // BALANCED, FILL_STOP, SPREAD_WHEN
  double t_row_feat, t_model;               // shadow_hot's floats
  int64_t per_node;                         // the profile's ranks per node; 0: one link
  double bw_inter;                          // StepModel.bw_inter (per_node > 0)
  double thin_when, thin_gain;              // THIN_WHEN, THIN_GAIN
  int64_t thin_always;                      // THIN_ALWAYS
};

struct Candidate {  // a priced plan (Plan's fields)
  Replicas replicas;
  bool relay = false;
  ExpertEntries ranges, kept;
  Prediction pred;
};

struct Filled {  // a fill that moved rows, with what plan_mix reads of it
  FillOut out;
  double step;   // planner._fill_step
  bool stalled;  // planner._stalled
  std::optional<Prediction> priced;  // with a topology: its plan's price (fill_step's)
};

double fold_sum(const std::vector<double>& xs) {  // Python's left-to-right sum (level_fill.fold_sum)
  double s = 0.0;
  for (double x : xs) s = s + x;
  return s;
}

std::vector<double> totals_of(const Prediction& p) {  // compute_s + comm_s per rank
  std::vector<double> t(p.compute.size());
  for (size_t r = 0; r < t.size(); ++r) t[r] = p.compute[r] + p.comm[r];
  return t;
}

double max_of(const std::vector<double>& xs) { return *std::max_element(xs.begin(), xs.end()); }

bool any_nonzero(const std::vector<int64_t>& xs) {
  return std::any_of(xs.begin(), xs.end(), [](int64_t x) { return x != 0; });
}

// thinned.thinned_starts: when every expert of `best` (ascending by g) is held by all W - 1 ranks
// but its owner and it has two or more, the starts keeping its k hottest experts (column sum
// descending, ties: the lower id) with their holders, k = size - 1 down to 1, each ascending by g
std::vector<Replicas> thinned_starts(const Replicas& best, const std::vector<int64_t>& colsum,
                                     int64_t W) {
  std::vector<Replicas> out;
  if (best.size() < 2) return out;
  for (const auto& [g, hs] : best)
    if (static_cast<int64_t>(hs.size()) != W - 1) return out;
  std::vector<size_t> hottest(best.size());  // indices into best
  for (size_t i = 0; i < best.size(); ++i) hottest[i] = i;
  std::sort(hottest.begin(), hottest.end(), [&](size_t x, size_t y) {
    const int64_t cx = colsum[static_cast<size_t>(best[x].first)];
    const int64_t cy = colsum[static_cast<size_t>(best[y].first)];
    return cx != cy ? cx > cy : best[x].first < best[y].first;
  });
  for (size_t k = best.size() - 1; k >= 1; --k) {
    std::vector<size_t> keep(hottest.begin(), hottest.begin() + static_cast<std::ptrdiff_t>(k));
    std::sort(keep.begin(), keep.end());  // best's order: ascending by g
    Replicas start;
    start.reserve(k);
    for (size_t i : keep) start.push_back(best[i]);
    out.push_back(std::move(start));
  }
  return out;
}

class Planner {
 public:
  Planner(const Counts& k, const Model& m, const Baseline& base, const Settings& s)
      : k_(k), m_(m), base_(base), s_(s), fill_m_(m) {
    if (s_.per_node > 0) inter_ = inter_baseline(k_, base_, s_.per_node);
    if (s_.per_node > 0 && k_.W > s_.per_node) {  // StepModel.fill_link: the blend of both links
      const double far = static_cast<double>(k_.W - s_.per_node) / static_cast<double>(k_.W - 1);
      fill_m_.bw = 1.0 / (far / s_.bw_inter + (1.0 - far) / m_.bw);
      blended_ = true;
    }
  }

  // cost_model.plan_pricing(C, plan, E, profile) then StepModel.prediction_W: the plan's
  // prediction, its first 4 loads rows into `loads` (6 rows priced with a topology)
  Prediction price(const Replicas& replicas, bool relay, const ExpertEntries& ranges,
                   const ExpertEntries& kept, Loads& loads) const {
    if (s_.per_node == 0) {
      const int64_t rounds = plan_pricing(k_, base_, replicas, relay, ranges, kept, loads);
      return predict(m_, loads, rounds);
    }
    NodeLoads nl;
    const int64_t rounds = plan_pricing_nodes(k_, base_, inter_, s_.per_node, replicas, relay,
                                              ranges, kept, nl);
    Prediction p = predict_nodes(m_, s_.bw_inter, nl, rounds);
    loads = std::move(nl.loads);
    return p;
  }

  // the baseline: nothing replicated (with a topology: reprice's, 6 rows, rounds 0)
  Prediction baseline() const {
    if (s_.per_node == 0) return predict(m_, base_.loads, -1);
    Loads loads;
    return price({}, false, {}, {}, loads);
  }

  // planner._water_fill (fill="level", one link): the fill from `start` (holders) whose loads
  // are `loads` (nullptr: priced here under relay; nothing replicated: the baseline's), or
  // nothing when the start is level or no piece moved.
  // `beat`: the step the fill must beat (the winner's so far): a fill whose mean reaches it
  // stops and is dropped (FillOut.beaten, level_fill's beat)
  std::optional<Filled> water_fill(const Replicas& start, const Loads* loads, bool kept,
                                   double beat) const {
    Loads priced;
    if (loads == nullptr) {
      if (start.empty()) {
        loads = &base_.loads;  // nothing replicated: plan_pricing's first 4 rows are these
      } else {
        price(start, true, {}, {}, priced);
        loads = &priced;
      }
    }
    const bool any_remote = any_nonzero(loads->remote);
    // one link: the plan fields (ranges, kept) only of the fill that wins (fill_plan, below);
    // with a topology every fill's plan is priced in full (fill_step)
    FillSettings fs{s_.slots, s_.blk, s_.passes, s_.fill_stop, kept, s_.per_node > 0,
                    s_.per_node};
    if (blended_) fs.bw_near = m_.bw, fs.bw_far = s_.bw_inter;  // fill_link's two for copies
    fs.beat = beat;
    FillOut out = level_fill(k_, base_.colsum, base_.own, fill_m_, start, any_remote, *loads, fs);
    if (out.moves <= 0 || out.beaten) return std::nullopt;  // -2: a level start; 0: no move
    std::optional<Prediction> price_of;
    const double step = fill_step(out, any_remote, price_of);
    // planner._stalled: the max total (first max) at a rank the fill overshot
    const auto top = std::max_element(out.totals.begin(), out.totals.end()) - out.totals.begin();
    const bool stalled = out.overshot[static_cast<size_t>(top)] != 0;
    return Filled{std::move(out), step, stalled, std::move(price_of)};
  }

  // planner._fill_step: with a topology the step of the fill's plan priced in full (its
  // Prediction kept in `priced`: the winner's plan is priced so again at the end); on one link
  // the fill's max total when its remote flag is the one it ran with, else every rank's seconds
  // under the flag of its loads
  double fill_step(const FillOut& out, bool any_remote, std::optional<Prediction>& priced) const {
    if (s_.per_node > 0) {
      Loads loads;
      priced = price(out.replicas, true, out.ranges, out.kept, loads);
      return priced->step;
    }
    const bool now = any_nonzero(out.loads.remote);
    if (now == any_remote) return max_of(out.totals);
    double step = -INF;
    for (size_t r = 0; r < out.totals.size(); ++r) {
      const auto [compute, comm] = m_.seconds(out.loads.rows[r], out.loads.local[r],
                                              out.loads.remote[r], out.loads.replica[r], now,
                                              out.rounds);
      step = std::max(step, compute + comm);
    }
    return step;
  }

  // planner._no_worse: `best`, or nothing replicated where `best` is predicted slower (with a
  // topology the candidates searched on one link may cost more than they save once repriced)
  static Candidate no_worse(Candidate best, const Prediction& baseline) {
    if (best.pred.step > baseline.step) return Candidate{{}, false, {}, {}, baseline};
    return best;
  }

  Candidate priced(Replicas replicas, bool relay, ExpertEntries ranges, ExpertEntries kept) const {
    Loads loads;
    Prediction p = price(replicas, relay, ranges, kept, loads);
    return Candidate{std::move(replicas), relay, std::move(ranges), std::move(kept),
                     std::move(p)};
  }

  // plan_mix from replica_search's candidate on (planner.py, step for step)
  Candidate plan(const Prediction& baseline) const {
    const int64_t W = k_.W, E = k_.E;
    Candidate best{{}, false, {}, {}, baseline};
    int64_t moved = 0;  // remote rows in the group: plan_replicas' total_remote
    for (int64_t g = 0; g < k_.N; ++g) moved += base_.colsum[g] - base_.own[g];
    if (s_.slots > 0 && W > 1 && moved > 0) {  // plan_replicas
      Loads loads = base_.loads;
      Replicas accepted = replica_search(k_, m_, base_.colsum, loads, s_.slots, s_.width);
      if (!accepted.empty() && s_.per_node > 0) {  // the search saw one link: reprice
        best = priced(std::move(accepted), false, {}, {});
      } else if (!accepted.empty()) {
        best = Candidate{std::move(accepted), false, {}, {}, predict(m_, loads, -1)};
      }
    }
    if (W == 1 || s_.slots == 0) return best;
    std::vector<int64_t> hot = shadow_hot(k_, base_.colsum, base_.own, s_.t_row_feat, s_.t_model);
    if (!hot.empty() && static_cast<int64_t>(hot.size()) <= s_.slots) {  // shadow fits the budget
      Replicas shadow;
      for (int64_t g : hot) {
        std::vector<int64_t> everyone;  // every rank but the owner
        everyone.reserve(static_cast<size_t>(W - 1));
        for (int64_t r = 0; r < W; ++r)
          if (r != g / E) everyone.push_back(r);
        shadow.emplace_back(g, std::move(everyone));
      }
      Candidate c = priced(std::move(shadow), false, {}, {});
      if (c.pred.step < best.pred.step) best = std::move(c);
    }
    const std::vector<double> totals = totals_of(best.pred);
    if (!s_.balance || max_of(totals) <= s_.balanced * fold_sum(totals) / static_cast<double>(W))
      return no_worse(std::move(best), baseline);  // balanced already
    std::optional<Loads> relay_loads;  // the best candidate's loads under relay
    if (!best.replicas.empty()) {
      Loads loads;
      const Prediction p = price(best.replicas, true, {}, {}, loads);
      relay_loads = std::move(loads);
      if (p.step < best.pred.step) {
        best.relay = true;
        best.pred = p;
      }
    }
    best = no_worse(std::move(best), baseline);
    std::optional<Filled> won;
    double won_step = best.pred.step;
    bool stalled = false, from_none = false;
    const auto mean = [&]() {  // planner._fill_mean
      const std::vector<double> t = won ? won->out.totals : totals_of(best.pred);
      return fold_sum(t) / static_cast<double>(t.size());
    };
    const auto consider = [&](std::optional<Filled>&& f, bool counts_stall) {
      if (!f) return;
      if (counts_stall) stalled = stalled || f->stalled;
      if (f->step < won_step) {
        won_step = f->step;
        won = std::move(f);
      }
    };
    std::vector<Replicas> starts{best.replicas};
    if (!best.replicas.empty()) starts.emplace_back();
    double from_best = best.pred.step;  // the step of the fill from the best candidate
    for (size_t i = 0; i < starts.size(); ++i) {
      const Replicas& start = starts[i];
      from_none = from_none || start.empty();
      const Loads* loads = !start.empty() && relay_loads ? &*relay_loads : nullptr;
      std::optional<Filled> f = water_fill(start, loads, false, won_step);
      if (f && i == 0) from_best = f->step;
      consider(std::move(f), true);
      if (won_step <= s_.balanced * mean()) break;
    }
    if (won_step > s_.spread_when * mean()) {  // experts too heavy for one helper at a time
      const Replicas spread = spread_start(k_, base_.colsum, s_.slots);
      if (!spread.empty()) consider(water_fill(spread, nullptr, false, won_step), true);
    }
    const double base_mean = fold_sum(totals_of(baseline)) / static_cast<double>(W);
    if ((stalled || !from_none) && won_step > s_.fill_stop * base_mean)
      consider(water_fill({}, nullptr, true, won_step), false);  // the kept fill
    // the best in shadow's form, the fill from it below thin_when of its step or C small (at
    // most thin_always counts): fills from it
    // thinned, its coldest experts dropped one by one while each is the best fill so far and
    // ends thin_gain below the one before (the first: the fill from the best), last so that
    // they change no other fill's test (planner.plan_mix)
    double last = from_best;
    const bool small = W * k_.N <= s_.thin_always;
    const std::vector<Replicas> thinned = small || from_best < s_.thin_when * best.pred.step
                                              ? thinned_starts(best.replicas, base_.colsum, W)
                                              : std::vector<Replicas>{};
    for (const Replicas& start : thinned) {
      std::optional<Filled> f = water_fill(start, nullptr, false, won_step);
      if (!f) break;
      const double step = f->step;
      if (!(step < won_step)) break;  // not the best fill: the walk ends
      won_step = step;
      won = std::move(f);
      if (!(step < (1.0 - s_.thin_gain) * last)) break;
      last = step;
    }
    if (!won) return best;
    Candidate plan;
    if (s_.per_node == 0) {
      fill_plan(k_, s_.blk, won->out);
      plan = priced(std::move(won->out.replicas), true, std::move(won->out.ranges),
                    std::move(won->out.kept));
    } else {  // filled and priced already (fill_step: the same pricing of the same plan)
      plan = Candidate{std::move(won->out.replicas), true, std::move(won->out.ranges),
                       std::move(won->out.kept), std::move(*won->priced)};
    }
    if (!(plan.pred.step < best.pred.step)) return best;  // the guarantee holds on the price
    return plan;
  }

 private:
  const Counts& k_;
  const Model& m_;
  const Baseline& base_;
  const Settings& s_;
  Model fill_m_;                // the fills' one link for rows (StepModel.fill_link)
  bool blended_ = false;        // fill_m_ blends both links: the copies keep both (bw_far)
  std::vector<int64_t> inter_;  // inter_baseline's (with a topology)
};

// Writes groups by columns: their experts [g_1..g_m], their entry counts [k_1..k_m], then the
// entries in order (`put` writes one), so that the Python reads each column with one slice;
// returns the ints written, `m` the groups.
template <typename Groups, typename Put>
int64_t put_groups(const Groups& groups, int64_t* o, Put put, int64_t& m) {
  int64_t* start = o;
  m = static_cast<int64_t>(groups.size());
  for (const auto& group : groups) *o++ = group.first;
  for (const auto& group : groups) *o++ = static_cast<int64_t>(group.second.size());
  for (const auto& group : groups)
    for (const auto& e : group.second) o = put(e, o);
  return o - start;
}

int64_t group_ints(const Replicas& r) {
  int64_t n = 0;
  for (const auto& [g, h] : r) n += 2 + static_cast<int64_t>(h.size());
  return n;
}

int64_t group_ints(const ExpertEntries& x) {
  int64_t n = 0;
  for (const auto& [g, e] : x) n += 2 + 2 * static_cast<int64_t>(e.size());
  return n;
}

// The plan as step_native._pack lays it out for the compiled bookkeeping (step_plan.cpp's
// parse): the counts of replicas, share entries (none), ranges and kept entries, then each
// replica (g, k, holders) and each range and kept entry (g, k, (rank, rows) * k), in order.
void put_packed(const Candidate& plan, int64_t* o) {
  *o++ = static_cast<int64_t>(plan.replicas.size());
  *o++ = 0;
  *o++ = static_cast<int64_t>(plan.ranges.size());
  *o++ = static_cast<int64_t>(plan.kept.size());
  for (const auto& [g, holders] : plan.replicas) {
    *o++ = g;
    *o++ = static_cast<int64_t>(holders.size());
    o = std::copy(holders.begin(), holders.end(), o);
  }
  for (const ExpertEntries* entries : {&plan.ranges, &plan.kept})
    for (const auto& [g, pairs] : *entries) {
      *o++ = g;
      *o++ = static_cast<int64_t>(pairs.size());
      for (const auto& [y, n] : pairs) {
        *o++ = y;
        *o++ = n;
      }
    }
}

// Prediction p as ints [token_bytes, weight_bytes, rows] (3W) and reals [compute, comm] (2W),
// its step after them.
void put_prediction(const Prediction& p, int64_t W, int64_t* oi, double* od) {
  od[2 * W] = write_prediction(p, oi, od);
}

Settings settings_of(const int64_t* ints, const double* reals) {  // the C entries' layout
  return Settings{ints[2],  ints[3],   ints[4],   ints[5],   ints[6] != 0, reals[7],
                  reals[8], reals[9],  reals[10], reals[11], ints[12],     reals[12],
                  reals[13], reals[14], ints[13]};
}

// C's baseline (from its sums when given) and StepModel.check_exact's limits, as plan_replicas
// runs them: 0, or the C entries' -1 (a negative count), -2 (too large), -4 (bad sums).
int64_t baseline_checked(const Counts& k, const Model& m, const int64_t* colsum_N,
                         const int64_t* rowsum_W, Baseline& base) {
  if (colsum_N != nullptr && rowsum_W != nullptr) {
    if (!baseline_from_sums(k, colsum_N, rowsum_W, base)) return -4;
  } else if (!baseline(k, base)) {
    return -1;
  }
  __int128 rows = 0;  // check_exact(max(2 * sum(colsum), W * N))
  for (int64_t x : base.colsum) rows += x;
  const __int128 limit = static_cast<__int128>(1) << 53;
  if (2 * rows >= limit || static_cast<__int128>(k.W) * k.N >= limit || m.fpr >= limit ||
      m.tbr >= limit || m.P >= limit)
    return -2;
  return 0;
}

// The plan's replicas and ranges from Plan.packed (step_native._pack's layout): false when it is
// not one this reads (share entries; experts not ascending or out of range; holders not
// ascending, out of range or the owner; range helpers not ascending or rows not positive).
bool read_packed(const int64_t* p, int64_t len, const Counts& k, Replicas& replicas,
                 ExpertEntries& ranges, ExpertEntries& kept) {
  if (len < 4 || p[1] != 0) return false;
  const int64_t n_hot = p[0], n_ranges = p[2], n_kept = p[3];
  int64_t at = 4;
  auto take = [&](int64_t n) {  // n ints at p[at] (no overflow past the end)
    if (n < 0 || n > len - at) return false;
    at += n;
    return true;
  };
  for (int64_t i = 0; i < n_hot; ++i) {
    if (!take(2)) return false;
    const int64_t g = p[at - 2], n = p[at - 1];
    if (!take(n) || g < 0 || g >= k.N || (!replicas.empty() && g <= replicas.back().first))
      return false;
    std::vector<int64_t> holders(p + at - n, p + at);
    for (size_t j = 0; j < holders.size(); ++j)
      if (holders[j] < 0 || holders[j] >= k.W || holders[j] == g / k.E ||
          (j && holders[j] <= holders[j - 1]))
        return false;
    replicas.emplace_back(g, std::move(holders));
  }
  for (int part = 0; part < 2; ++part) {  // the ranges: helpers ascending, rows > 0; kept
    ExpertEntries& list = part ? kept : ranges;
    for (int64_t i = 0, count = part ? n_kept : n_ranges; i < count; ++i) {
      if (!take(2)) return false;
      const int64_t g = p[at - 2], n = p[at - 1];
      if (n < 0 || n > (len - at) / 2 || g < 0 || g >= k.N ||
          (!list.empty() && g <= list.back().first))
        return false;
      Entries pairs;
      for (int64_t j = 0; j < n; ++j, at += 2) {
        const int64_t y = p[at], rows = p[at + 1];
        if (y < 0 || y >= k.W || (j && y <= pairs.back().first)) return false;
        if (part ? rows < 0 : rows <= 0) return false;
        pairs.emplace_back(y, rows);
      }
      list.emplace_back(g, std::move(pairs));
    }
  }
  return true;
}

// The C entries' output (mixmoe_plan_mix's doc) of `plan` and `baseline`: 0, or -3 when out_i
// is too small.
int64_t write_plan(const Candidate& plan, const Prediction& baseline, int64_t W, int64_t* out_i,
                   int64_t cap_i, double* out_d, int64_t* counts) {
  const int64_t sections = group_ints(plan.replicas) + group_ints(plan.ranges) +
                           group_ints(plan.kept);
  const int64_t need = 2 * sections + 6 * W + 4;  // by columns, predictions, packed
  if (need > cap_i) return -3;
  int64_t* o = out_i;
  counts[0] = put_groups(plan.replicas, o, [](int64_t h, int64_t* p) {
    *p++ = h;
    return p;
  }, counts[4]);
  o += counts[0];
  const auto pair = [](const std::pair<int64_t, int64_t>& e, int64_t* p) {
    *p++ = e.first;
    *p++ = e.second;
    return p;
  };
  counts[1] = put_groups(plan.ranges, o, pair, counts[5]);
  o += counts[1];
  counts[2] = put_groups(plan.kept, o, pair, counts[6]);
  o += counts[2];
  counts[3] = plan.relay;
  put_prediction(plan.pred, W, o, out_d);
  put_prediction(baseline, W, o + 3 * W, out_d + 2 * W + 1);
  put_packed(plan, o + 6 * W);
  return 0;
}

// What both C entries read first: C's counts (`ints`, `reals`: plan_mix's settings; C's storage
// row-major, or by columns), the model, the settings, C's baseline (from its sums when given)
// and, with a topology and C row-major, this thread's column prefixes (every fill's cuts and
// the 6-row pricing read the hot columns once; by columns they are C's own columns).
struct Entry {
  Counts k;
  Model m;
  Settings s;
  Baseline base;

  Entry(const int64_t* C, const int64_t* ints, const double* reals, bool by_column)
      : k{ints[0], ints[1], ints[0] * ints[1], C, nullptr, by_column},
        m(Model::from(ints + 7, reals)),
        s(settings_of(ints, reals)) {}

  // 0, or baseline_checked's status
  int64_t open(const int64_t* colsum_N, const int64_t* rowsum_W) {
    const int64_t status = baseline_checked(k, m, colsum_N, rowsum_W, base);
    if (status != 0) return status;
    thread_local ColumnPrefix prefix;
    if (s.per_node > 0 && !k.by_column) {
      prefix.reset(k.N);
      k.prefix = &prefix;
    }
    return 0;
  }
};

}  // namespace

extern "C" {

// plan_mix(C, shape, profile, max_replicas, overlap, search_width=, block_size=, balance=,
// fill="level") on one link. Inputs: C (int64 [W, N], the caller checked shape and type);
//   ints:  W, E, slots (replica_slots), width, blk, passes (LEVEL_PASSES), balance, then
//          Model::from's 5 ints, then per_node (the profile's ranks_per_node; 0: one link),
//          THIN_ALWAYS;
//   reals: Model::from's 7 reals, then BALANCED, FILL_STOP, SPREAD_WHEN, t_row_feat, t_model,
//          bw_inter (StepModel.bw_inter; read when per_node > 0), THIN_WHEN, THIN_GAIN.
// Outputs: out_i: the plan's replicas, ranges and kept sections (put_groups' columns: experts,
// entry counts, then the holders, or the (y, n) pairs), then its prediction's and its
// baseline's [token_bytes, weight_bytes, rows] (3W each), then the plan packed for the step's
// bookkeeping (put_packed: as many ints as the three sections, and 4); out_d: the prediction's then the
// baseline's [compute, comm] (2W) and step; counts (7): the three sections' lengths, the relay
// flag, the three sections' groups. Returns 0; -1: a negative count, -2: counts or model
// terms too large for exact float arithmetic (StepModel.check_exact), -3: out_i too small; the
// caller's Python then raises its error (nothing written is meaningful). `colsum_N`,
// `rowsum_W`: null (C's sums and signs from one pass over it), or C's column and row sums
// (CountSums: the pass is skipped, C's signs taken as checked; -4 when a sum is negative or
// the totals differ). `by_column` != 0: C stored by columns (C[s][g] at C[g * W + s]; common.h's
// Layout), the same plan.
int64_t mixmoe_plan_mix(const int64_t* C, const int64_t* ints, const double* reals,
                        int64_t* out_i, int64_t cap_i, double* out_d, int64_t* counts,
                        const int64_t* colsum_N, const int64_t* rowsum_W, int64_t by_column) {
  Entry e(C, ints, reals, by_column != 0);
  const int64_t status = e.open(colsum_N, rowsum_W);
  if (status != 0) return status;
  const Counts& k = e.k;
  const Model& m = e.m;
  const Settings& s = e.s;
  const Baseline& base = e.base;
  const Planner planner(k, m, base, s);
  const Prediction baseline = planner.baseline();
  return write_plan(planner.plan(baseline), baseline, k.W, out_i, cap_i, out_d, counts);
}

// placement.refit.refit_plan compiled: `plan` (Plan.packed, step_native._pack's layout; no share
// entries) with its relay flag, made for the counts C1, fitted to C2 (C's counts as
// plan_mix's, `ints` and `reals` as plan_mix's: W, E, blk, the model, per_node, bw_inter are
// read). `colsum1`: C1's column sums (N; the step before's CountSums). C2's sums as plan_mix's
// (null: one pass over C2). A kept holder y of g keeps its local rows L while L < C2[y][g] (its
// rest stays in g's stream), else computes all its own rows (a plain holder). Each ranged
// expert g's helpers keep their share of its stream: rows n -> n * T2 // T1, T = g's column sum
// less the rows its holders compute locally (exact integers), cut again by plan_from (the plan
// fields' walk); priced as plan_mix prices; the plan with nothing replicated (its baseline)
// where that is not strictly cheaper. `moved` > 0: first, -6 (nothing fitted) when the hot
// experts' rows on C2 are below 1/moved of their share on C1 (refit.moved, in integers: moved *
// hot2 * total1 < hot1 * total2). Output and returns as plan_mix's; -5: a plan this does not
// read (helpers not ascending, out of range, a share entry, an empty stream before): the
// Python runs. `by_column1`, `by_column2`: C1, C2 stored by columns (plan_mix's `by_column`).
int64_t mixmoe_refit_plan(const int64_t* C2, const int64_t* C1, const int64_t* colsum1,
                          const int64_t* ints, const double* reals, const int64_t* plan,
                          int64_t plan_len, int64_t relay, int64_t* out_i, int64_t cap_i,
                          double* out_d, int64_t* counts, const int64_t* colsum_N,
                          const int64_t* rowsum_W, int64_t moved, int64_t by_column1,
                          int64_t by_column2) {
  Entry e(C2, ints, reals, by_column2 != 0);
  const Layout before{ints[0], ints[0] * ints[1], by_column1 != 0};  // C1's
  const int64_t status = e.open(colsum_N, rowsum_W);
  if (status != 0) return status;
  const Counts& k = e.k;
  const Model& m = e.m;
  const Settings& s = e.s;
  const Baseline& base = e.base;
  Replicas replicas;
  ExpertEntries ranges, kept;
  if (!read_packed(plan, plan_len, k, replicas, ranges, kept)) return -5;
  if (moved > 0 && !replicas.empty()) {  // the hot experts' share of the rows, before and after
    __int128 hot1 = 0, hot2 = 0, total1 = 0, total2 = 0;
    for (const auto& [g, holders] : replicas) hot1 += colsum1[g], hot2 += base.colsum[g];
    for (int64_t g = 0; g < k.N; ++g) total1 += colsum1[g], total2 += base.colsum[g];
    if (moved * hot2 * total1 < hot1 * total2) return -6;
  }
  FillOut out;  // the fitted state: the plan's holders, kept holders, the scaled amounts
  for (const auto& [g, pairs] : kept) {  // kept while L < C2[y][g] (plan_from's kept_local)
    Entries still;
    for (const auto& [y, n] : pairs)
      if (n < k.c(y, g)) still.emplace_back(y, n);
    if (!still.empty()) out.kept_local.emplace_back(g, std::move(still));
  }
  // the rows g's holders compute locally under `local` (kept: {y: L}, ascending y, or null):
  // a kept holder L, another all its own (c(y): its rows of g)
  const auto held = [](const std::vector<int64_t>& holders, const Entries* local, auto c,
                       auto ahead) {
    int64_t rows = 0;
    size_t at = 0;  // local ascends by holder, as the holders do
    for (size_t i = 0; i < holders.size(); ++i) {
      // a holder's count: a cache line each, far apart in the column (W = 1024 under nodes:
      // ~30 holders an expert), asked for COLUMN_AHEAD holders ahead
      if (i + COLUMN_AHEAD < holders.size()) ahead(holders[i + COLUMN_AHEAD]);
      const int64_t y = holders[i];
      while (local && at < local->size() && (*local)[at].first < y) ++at;
      const bool is_kept = local && at < local->size() && (*local)[at].first == y;
      rows += is_kept ? (*local)[at].second : c(y);
    }
    return rows;
  };
  const auto find = [](const ExpertEntries& x, size_t& q, int64_t g) -> const Entries* {
    while (q < x.size() && x[q].first < g) ++q;  // x ascends by expert, as the ranges do
    return q < x.size() && x[q].first == g ? &x[q].second : nullptr;
  };
  size_t h = 0, q1 = 0, q2 = 0;
  for (const auto& [g, pairs] : ranges) {
    while (h < replicas.size() && replicas[h].first < g) ++h;
    if (h == replicas.size() || replicas[h].first != g) return -5;  // a helper holds g's replica
    const std::vector<int64_t>& hs = replicas[h].second;
    // T before: the stream the ranges were cut from; T after: the fitted kept holders' rests
    const int64_t t1 = colsum1[g] - held(
        hs, find(kept, q1, g), [&](int64_t y) { return C1[before.at(y, g)]; },  // (holders only)
        [&](int64_t y) { prefetch_count(C1, before, y, g); });
    const int64_t t2 = base.colsum[g] - held(
        hs, find(out.kept_local, q2, g), [&](int64_t y) { return k.c(y, g); },
        [&](int64_t y) { k.prefetch(y, g); });
    if (t1 <= 0 || t2 < 0) return -5;
    Entries scaled;
    scaled.reserve(pairs.size());
    for (const auto& [y, n] : pairs)  // n * t2 // t1, exact (n, t2 < 2**53)
      scaled.emplace_back(y, static_cast<int64_t>(static_cast<__int128>(n) * t2 / t1));
    out.amounts.emplace_back(g, std::move(scaled));
  }
  out.replicas = std::move(replicas);
  fill_plan(k, s.blk, out);  // the ranges of the scaled amounts, the kept holders' blocks
  const Planner planner(k, m, base, s);
  const Prediction baseline = planner.baseline();
  Loads loads;
  Prediction priced = planner.price(out.replicas, relay != 0, out.ranges, out.kept, loads);
  Candidate fitted{std::move(out.replicas), relay != 0, std::move(out.ranges),
                   std::move(out.kept), std::move(priced)};
  if (!(fitted.pred.step < baseline.step)) fitted = Candidate{{}, false, {}, {}, baseline};
  return write_plan(fitted, baseline, k.W, out_i, cap_i, out_d, counts);
}

}  // extern "C"
