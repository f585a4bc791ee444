// plan_mix's two other starts compiled: FasterMoE's shadowed experts (twin of
// mixmoe.placement.shadow.shadow_hot, both its list path and _shadow_hot_tensor) and the spread
// start (twin of mixmoe.placement.spread.spread_start).
//
// Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (row-major int64,
// C[s*N + g] = rows rank s routes to expert g; g's owner is g / E); colsum[g] = sum_s C[s][g]
// (baseline_loads' load_N), own[g] = C[g / E][g] (its own_N).
//
// Same decisions as the Python, bit for bit: integer sums stay int64 (the counts' sums are far
// below 2**53, so every int the Python meets converts to a double exactly, and Python's int / int,
// int * float and int-vs-float comparisons give what the doubles here give); the float
// expressions run in the Python's order; ties as the Python breaks them (load descending then
// expert id; (load, rank) ascending). Loaded by mixmoe/placement/native_candidates.py through
// ctypes (two C entry points: mixmoe_shadow_hot, mixmoe_spread_start).

#include "candidates.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

using namespace mixmoe_native;

// Experts by load descending, ties by id ascending (shadow._by_load's stable sort of ascending
// ids), popped one at a time off a heap: the search mostly stops within a few experts, so a
// full sort of N would cost more than the search.
class ByLoad {
 public:
  explicit ByLoad(const std::vector<int64_t>& load) : load_(load), heap_(load.size()) {
    for (size_t g = 0; g < heap_.size(); ++g) heap_[g] = static_cast<int64_t>(g);
    std::make_heap(heap_.begin(), heap_.end(), Later{&load_});
  }
  bool empty() const { return heap_.empty(); }
  int64_t pop() {
    std::pop_heap(heap_.begin(), heap_.end(), Later{&load_});
    const int64_t g = heap_.back();
    heap_.pop_back();
    return g;
  }

 private:
  struct Later {  // a max-heap's "less": a comes after b (lighter, or as heavy with a higher id)
    const std::vector<int64_t>* load;
    bool operator()(int64_t a, int64_t b) const {
      const int64_t la = (*load)[a], lb = (*load)[b];
      return la != lb ? la < lb : a > b;
    }
  };
  const std::vector<int64_t>& load_;
  std::vector<int64_t> heap_;
};

// spread_start's holders in the Python's order: heaviest expert first (the dict it returns).
Replicas spread_in_order(const Counts& counts, const std::vector<int64_t>& colsum,
                         int64_t slots) {
  const int64_t W = counts.W, E = counts.E, N = counts.N;
  Replicas out;
  int64_t total = 0;
  for (int64_t g = 0; g < N; ++g) total += colsum[g];
  if (slots <= 0 || W < 2 || total == 0) return out;
  const double mean = static_cast<double>(total) / static_cast<double>(W);  // total / W
  if (mean < 1.0) return out;  // fewer rows than ranks: the Python returns {} (its doc)
  const int64_t per_rank = static_cast<int64_t>(mean);  // int(mean) >= 1
  std::vector<int64_t> heavy;  // colsum > mean, in float64 as the Python compares them
  for (int64_t g = 0; g < N; ++g)
    if (static_cast<double>(colsum[g]) > mean) heavy.push_back(g);
  // heaviest first, ties by id: sorted(heavy, key=lambda g: (-cols[g], g))
  std::sort(heavy.begin(), heavy.end(), [&](int64_t a, int64_t b) {
    return colsum[a] != colsum[b] ? colsum[a] > colsum[b] : a < b;
  });
  // a rank's estimated rows: its own experts' rows (a Python int), then floats once it gains
  // or gives a share; every int here is exact as a double, so doubles throughout compare and
  // add as the Python's mixed ints and floats do
  std::vector<double> load(W);
  for (int64_t r = 0; r < W; ++r) {
    int64_t rows = 0;
    for (int64_t e = 0; e < E; ++e) rows += colsum[r * E + e];  // rank r owns g = r*E .. r*E+E-1
    load[r] = static_cast<double>(rows);
  }
  std::vector<int64_t> held(W, 0);
  std::vector<std::pair<double, int64_t>> free;  // (load, rank) of the ranks that may hold g
  for (const int64_t g : heavy) {
    const int64_t o = g / E, cols = colsum[g];
    // holders besides the owner: ceil(cols / int(mean)) - 1 (cols, per_rank > 0), at most W - 1
    const int64_t k = std::min(W - 1, (cols + per_rank - 1) / per_rank - 1);
    free.clear();
    for (int64_t r = 0; r < W; ++r)
      if (r != o && held[r] < slots) free.emplace_back(load[r], r);
    // heapq.nsmallest(k, free): the k smallest by (load, rank); pairs are distinct (ranks)
    const size_t take = k <= 0 ? 0 : std::min(free.size(), static_cast<size_t>(k));
    std::partial_sort(free.begin(), free.begin() + take, free.end());
    std::vector<int64_t> holders;
    holders.reserve(take);
    for (size_t i = 0; i < take; ++i) holders.push_back(free[i].second);
    if (holders.empty()) continue;
    std::sort(holders.begin(), holders.end());
    const double share =
        static_cast<double>(cols) / static_cast<double>(holders.size() + 1);  // cols / (h + 1)
    load[o] -= static_cast<double>(cols) - share;  // the owner keeps one share
    for (const int64_t r : holders) {
      held[r] += 1;
      load[r] += share;
    }
    out.emplace_back(g, std::move(holders));
  }
  return out;
}

}  // namespace

namespace mixmoe_native {

std::vector<int64_t> shadow_hot(const Counts& counts, const std::vector<int64_t>& colsum,
                                const std::vector<int64_t>& own, double t_row_feat,
                                double t_model) {
  const int64_t W = counts.W, E = counts.E;
  std::vector<int64_t> shadowed;
  if (W == 1) return shadowed;
  std::vector<int64_t> load(W, 0), trial(W);  // rows computed at each rank
  for (int64_t r = 0; r < W; ++r)
    for (int64_t e = 0; e < E; ++e) load[r] += colsum[r * E + e];
  // best = max(load_W) * t_row_feat: Python's int * float (the int rounded to a double first)
  double best = static_cast<double>(*std::max_element(load.begin(), load.end())) * t_row_feat;
  ByLoad order(colsum);
  while (!order.empty()) {
    const int64_t g = order.pop(), o = g / E;
    int64_t top = 0;  // max(trial_W): every trial load is >= 0
    for (int64_t r = 0; r < W; ++r) {
      // every source computes its own rows of g; the owner keeps only its own
      trial[r] = r == o ? load[o] - colsum[g] + own[g] : load[r] + counts.c(r, g);
      top = std::max(top, trial[r]);
    }
    const double lat = static_cast<double>(top) * t_row_feat +
                       static_cast<double>(static_cast<int64_t>(shadowed.size()) + 1) * t_model;
    if (!(lat < best)) break;  // the first g that does not lower the estimate ends the search
    best = lat;
    load.swap(trial);
    shadowed.push_back(g);
  }
  std::sort(shadowed.begin(), shadowed.end());
  return shadowed;
}

Replicas spread_start(const Counts& counts, const std::vector<int64_t>& colsum, int64_t slots) {
  Replicas out = spread_in_order(counts, colsum, slots);
  std::sort(out.begin(), out.end());  // ascending g (distinct)
  return out;
}

}  // namespace mixmoe_native

// C entries for mixmoe/placement/native_candidates.py. C: [W, N] int64; colsum, own: [N] int64.

// The shadowed experts ascending into out_g (room for N); returns how many.
extern "C" int64_t mixmoe_shadow_hot(const int64_t* C, int64_t W, int64_t E,
                                     const int64_t* colsum, const int64_t* own,
                                     double t_row_feat, double t_model, int64_t* out_g) {
  const int64_t N = W * E;
  const mixmoe_native::Counts counts{W, E, N, C};
  const std::vector<int64_t> cols(colsum, colsum + N), owns(own, own + N);
  const auto hot = mixmoe_native::shadow_hot(counts, cols, owns, t_row_feat, t_model);
  std::copy(hot.begin(), hot.end(), out_g);
  return static_cast<int64_t>(hot.size());
}

// The spread start in the Python dict's order (heaviest expert first) as groups
// [g, k, holder_1 .. holder_k] into out (room for 2*N + W*min(slots, N)); returns the ints
// written. C is read for its shape only: spread_start is a function of the column sums.
extern "C" int64_t mixmoe_spread_start(const int64_t* C, int64_t W, int64_t E,
                                       const int64_t* colsum, int64_t slots, int64_t* out) {
  const int64_t N = W * E;
  const mixmoe_native::Counts counts{W, E, N, C};
  const std::vector<int64_t> cols(colsum, colsum + N);
  int64_t at = 0;
  for (const auto& [g, holders] : spread_in_order(counts, cols, slots)) {
    out[at++] = g;
    out[at++] = static_cast<int64_t>(holders.size());
    for (const int64_t r : holders) out[at++] = r;
  }
  return at;
}
