// The source-replica search of mixmoe.placement.replica_search (plan_replicas), compiled.
//
// Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (row-major int64, C[s*N + g] =
// rows rank s routes to expert g; g's owner is g / E); a rank's loads (rows, local, remote,
// replica) and total (seconds) as in StepModel.total_fn; m = moved[g], g's remote rows (colsum[g]
// minus its owner's own rows); TR = the remote rows left in the group (total_remote).
//
// Twin of _ListMixSearch (round, _listed, _try, _close) and _sources_may_pass, step for step: the
// bottleneck b (the first max), its shortlist walked in priority order (m descending, then g), a
// candidate with a full holder closed when it is reached and not counted against the width, the
// first whose every rank total stays strictly below the step accepted; the same integer loads and
// the same float expressions (common.h's Model), so the same decisions, loads and holders as every
// Python path (tests/placement/test_native_search.py). Built into the planner's library
// (mixmoe/placement/native_lib.py); loaded by mixmoe/placement/native_search.py through the C entry
// at the bottom; the compiled planner calls replica_search (replica_search.h).

#include "replica_search.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"

namespace {

using namespace mixmoe_native;

constexpr int BOUND_INTERVALS = 32;  // replica_search._BOUND_INTERVALS

// StepModel.prediction_lists' seconds of loads (rounds None: one round when a copy is held)
void seconds_of(const Model& m, const Loads& l, double* compute, double* comm) {
  const size_t W = l.rows.size();
  bool any_remote = false, any_hot = false;
  for (size_t r = 0; r < W; ++r) {
    any_remote = any_remote || l.remote[r] != 0;
    any_hot = any_hot || l.replica[r] != 0.0;
  }
  for (size_t r = 0; r < W; ++r)
    std::tie(compute[r], comm[r]) =
        m.seconds(l.rows[r], l.local[r], l.remote[r], l.replica[r], any_remote, any_hot);
}

// _sources_may_pass: whether some expert b does not own may bring b's total below best (false is
// a proof that none can: b's row need not be scored). b's loads: rows, local, remote, replica;
// cmax: the most rows b sends to one expert of another rank. Skipping it (always "maybe") leaves
// every plan of the twin tests unchanged; it saves 1.1-4x of the search at W = 64-1024.
bool sources_may_pass(const Model& m, int64_t rows, int64_t local, int64_t remote, double replica,
                      int64_t cmax, bool any_remote, double best) {
  if (cmax == 0) return false;  // b sends no rows to other ranks' experts
  // compute(c) never decreases and comm(c) never increases along c, so compute(lo) + comm(hi)
  // bounds every c in [lo, hi] from below
  auto bound = [&](int64_t lo, int64_t hi) {
    const double compute = m.seconds(rows + lo, local + lo, remote - lo, replica + 1.0,
                                     any_remote, 1).first;
    const double comm = m.seconds(rows + hi, local + hi, remote - hi, replica + 1.0, any_remote,
                                  1).second;
    return compute + comm;
  };
  std::vector<std::pair<int64_t, int64_t>> intervals{{1, cmax}};  // a stack: pop the last
  for (int i = 0; i < BOUND_INTERVALS; ++i) {
    if (intervals.empty()) return false;
    const auto [lo, hi] = intervals.back();
    intervals.pop_back();
    if (!(bound(lo, hi) < best)) continue;
    if (lo == hi) return true;  // compute(c) + comm(c) is b's new total at c: it passes
    const int64_t mid = (lo + hi) / 2;  // lo, hi >= 1: Python's floor division
    intervals.emplace_back(mid + 1, hi);
    intervals.emplace_back(lo, mid);  // pushed last: examined first, as the Python pops
  }
  return !intervals.empty();
}

struct Search {  // _ListMixSearch's state
  const Counts& cn;
  const Model& m;
  int64_t max_replicas, width;
  Loads& loads;                  // the accepted plan's loads (replica: whole copies)
  std::vector<double> totals;    // each rank's total under the last acceptance's flags
  std::vector<double> compute, comm;  // its two terms (StepModel.seconds_fn's pair)
  std::vector<int64_t> moved;    // per expert: m
  std::vector<int64_t> order;    // the candidates by m descending, g ascending (closed: skipped;
                                 // sorted when first walked: most searches never walk it)
  bool ordered = false;
  std::vector<char> open;        // per expert: still a candidate
  int64_t n_open = 0, total_remote = 0;
  std::vector<int64_t> held;     // per rank: replicas held
  // per segment (an owner's E experts), once read: each expert's sources but its owner, as
  // (s, C[s][g]) ascending in s (a replicated g's holders); seg_at[o]: index in sources, -1
  std::vector<int64_t> seg_at;
  std::vector<std::vector<std::vector<std::pair<int64_t, int64_t>>>> sources;
  std::vector<int64_t> cmax;     // per rank: its most rows to one other rank's expert (-1: not yet)
  // [any_remote][r]: r's seconds with its loads under that token flag, rounds 1 (a cache, as
  // _kept: filled when first needed, whole after an acceptance under that flag, cleared by one
  // under the other)
  std::vector<std::pair<double, double>> kept[2];
  std::vector<char> kept_ok[2];  // whether kept[.][r] holds r's seconds
  std::vector<char> touched;     // per rank: changed by the candidate under evaluation
  struct Fresh {
    int64_t r;
    double compute, comm, total;
  };
  std::vector<Fresh> fresh;  // the changed ranks' new seconds (the candidate under evaluation)
  Replicas accepted;             // in acceptance order

  // base: the baseline's seconds (compute [W], then comm [W]) when the caller has them, else
  // NULL (computed here, as prediction_lists does)
  Search(const Counts& c, const Model& model, const std::vector<int64_t>& colsum, Loads& l,
         int64_t max_rep, int64_t w, const double* base)
      : cn(c), m(model), max_replicas(max_rep), width(w), loads(l) {
    const int64_t W = cn.W, E = cn.E, N = cn.N;
    moved.resize(N);
    open.assign(N, 0);
    for (int64_t o = 0; o < W; ++o) {
      for (int64_t g = o * E; g < (o + 1) * E; ++g) {  // C[o][g] for o's experts g
        moved[g] = colsum[g] - cn.c(o, g);  // all rows of g but its owner's own
        total_remote += moved[g];
        if (moved[g] > 0) {
          open[g] = 1;
          order.push_back(g);
        }
      }
    }
    n_open = static_cast<int64_t>(order.size());
    // the baseline prediction's totals (prediction_lists: rounds 0 unless a copy is held)
    compute.resize(W);
    comm.resize(W);
    if (base != nullptr) {
      std::copy(base, base + W, compute.begin());
      std::copy(base + W, base + 2 * W, comm.begin());
    } else {
      seconds_of(m, loads, compute.data(), comm.data());
    }
    totals.resize(W);
    for (int64_t r = 0; r < W; ++r) totals[r] = compute[r] + comm[r];  // total_fn's sum
    held.assign(W, 0);
    seg_at.assign(W, -1);
    cmax.assign(W, -1);
    for (auto& k : kept) k.assign(W, {0.0, 0.0});
    for (auto& k : kept_ok) k.assign(W, 0);
    touched.assign(W, 0);
  }

  double total(int64_t rows, int64_t local, int64_t remote, double replica, bool any_remote) const {
    return m.total(rows, local, remote, replica, any_remote, 1);  // a replica exists: rounds 1
  }

  // r's new seconds under the flag (rounds 1) into fresh; false when its total is not below best
  bool priced(int64_t r, int64_t rows, int64_t local, int64_t remote, double replica,
              bool any_remote, double best) {
    const auto [cp, cm] = m.seconds(rows, local, remote, replica, any_remote, 1);
    const double t = cp + cm;
    fresh.push_back({r, cp, cm, t});
    return t < best;
  }

  // g's sources but its owner (its holders if replicated), with their rows. A column of C is
  // W reads N apart; its segment's E columns share those cache lines, so they are read at once
  const std::vector<std::pair<int64_t, int64_t>>& sources_of(int64_t g) {
    const int64_t E = cn.E, o = g / E;
    if (seg_at[o] < 0) {
      seg_at[o] = static_cast<int64_t>(sources.size());
      auto& seg = sources.emplace_back(static_cast<size_t>(E));
      for (int64_t i = 0; i < E; ++i) {  // sized first: one allocation a source list
        int64_t n = 0;
        for (int64_t s = 0; s < cn.W; ++s) n += s != o && cn.c(s, o * E + i) > 0;
        seg[i].reserve(static_cast<size_t>(n));
      }
      for (int64_t s = 0; s < cn.W; ++s) {
        if (s == o) continue;  // the owner computes its own rows wherever g is replicated
        for (int64_t i = 0; i < E; ++i) {  // C[s][o*E .. o*E + E)
          const int64_t n = cn.c(s, o * E + i);
          if (n > 0) seg[i].emplace_back(s, n);
        }
      }
    }
    return sources[seg_at[o]][g - o * E];
  }

  int64_t cmax_of(int64_t b) {  // max of b's row outside its own segment [b*E, (b+1)*E)
    if (cmax[b] < 0) {
      int64_t best = 0;
      for (int64_t g = 0; g < b * cn.E; ++g) best = std::max(best, cn.c(b, g));
      for (int64_t g = (b + 1) * cn.E; g < cn.N; ++g) best = std::max(best, cn.c(b, g));
      cmax[b] = best;
    }
    return cmax[b];
  }

  // _listed's test of one open candidate g at bottleneck b: whether b's new total is below best
  bool lowers_b(int64_t g, int64_t b, double best, bool sources) {
    const int64_t rows = loads.rows[b], local = loads.local[b], remote = loads.remote[b];
    const double replica = loads.replica[b];
    const int64_t m_g = moved[g], c = cn.c(b, g);
    double t;
    if (g / cn.E == b) {  // b owns g: it computes and exchanges m rows less, serves n replicas
      const int64_t n = static_cast<int64_t>(sources_of(g).size());
      t = total(rows - m_g, local, remote - m_g, replica + static_cast<double>(n),
                m_g < total_remote);
    } else if (c != 0) {  // b computes its c rows of g itself and fetches a replica
      if (!sources) return false;
      t = total(rows + c, local + c, remote - c, replica + 1.0, m_g < total_remote);
    } else if (m_g == total_remote) {  // g, the last candidate, ends the token phase
      t = total(rows, local, remote, replica, false);
    } else {
      return false;
    }
    return t < best;
  }

  void close(int64_t g) {
    open[g] = 0;
    n_open -= 1;
  }

  // _try: accept g if every rank's total then stays below best; false (nothing changed) at the
  // first rank that does not.
  bool try_accept(int64_t g, double best) {
    const auto& src = sources_of(g);  // the holders (ascending, the owner excluded)
    const int64_t o = g / cn.E, m_g = moved[g];
    const bool any_remote = m_g < total_remote;
    auto& rows = loads.rows;
    auto& local = loads.local;
    auto& remote = loads.remote;
    auto& replica = loads.replica;
    fresh.clear();
    const double n = static_cast<double>(src.size());
    // the owner, then the holders: the first whose total is not below best ends it
    if (!priced(o, rows[o] - m_g, local[o], remote[o] - m_g, replica[o] + n, any_remote, best))
      return false;
    for (const auto& [s, c] : src)
      if (!priced(s, rows[s] + c, local[s] + c, remote[s] - c, replica[s] + 1.0, any_remote, best))
        return false;
    for (const Fresh& f : fresh) touched[f.r] = 1;
    auto& kept_s = kept[any_remote];
    auto& ok = kept_ok[any_remote];
    bool passes = true;
    for (int64_t r = 0; r < cn.W && passes; ++r) {  // the other ranks keep their loads
      if (touched[r]) continue;
      if (!ok[r]) {
        kept_s[r] = m.seconds(rows[r], local[r], remote[r], replica[r], any_remote, 1);
        ok[r] = 1;
      }
      passes = kept_s[r].first + kept_s[r].second < best;
    }
    for (const Fresh& f : fresh) touched[f.r] = 0;
    if (!passes) return false;
    // accepted: every rank's seconds, the changed ones' new, the others' kept (all computed:
    // every rank passed)
    for (const Fresh& f : fresh) kept_s[f.r] = {f.compute, f.comm};
    for (int64_t r = 0; r < cn.W; ++r) {
      compute[r] = kept_s[r].first;
      comm[r] = kept_s[r].second;
      totals[r] = compute[r] + comm[r];
    }
    for (const Fresh& f : fresh) totals[f.r] = f.total;  // the same sum, as computed
    rows[o] -= m_g;
    remote[o] -= m_g;
    replica[o] += n;
    for (const auto& [s, c] : src) {
      rows[s] += c;
      local[s] += c;
      remote[s] -= c;
      replica[s] += 1.0;
      held[s] += 1;
    }
    // the new loads' seconds under this flag are the ones just taken (kept whole); the other
    // flag's are stale
    std::fill(ok.begin(), ok.end(), 1);
    std::fill(kept_ok[!any_remote].begin(), kept_ok[!any_remote].end(), 0);
    total_remote -= m_g;
    close(g);
    std::vector<int64_t> holders;
    holders.reserve(src.size());
    for (const auto& sc : src) holders.push_back(sc.first);
    accepted.emplace_back(g, std::move(holders));
    return true;
  }

  // round's handling of a listed candidate g: 1 accepted, 0 go on, -1 the round ends (width)
  int visit(int64_t g, double best, int64_t& evaluated) {
    if (evaluated == width) return -1;
    bool blocked = false;
    for (const auto& sc : sources_of(g)) blocked = blocked || held[sc.first] >= max_replicas;
    if (blocked) {
      close(g);  // a holder is full: g can never fit again
      return 0;
    }
    evaluated += 1;
    return try_accept(g, best) ? 1 : 0;
  }

  // One round (_ListMixSearch.round); true if an expert was accepted.
  bool round() {
    const int64_t E = cn.E;
    const int64_t b = std::max_element(totals.begin(), totals.end()) - totals.begin();  // first max
    const double best = totals[b];
    if (order.size() > 2 * static_cast<size_t>(n_open) + 16) {  // drop the closed candidates
      order.erase(std::remove_if(order.begin(), order.end(), [&](int64_t g) { return !open[g]; }),
                  order.end());
    }
    // with two open candidates or more none holds every remote row left: the token collectives
    // run after any of them (with one, the weaker bound without them)
    const bool sources = sources_may_pass(m, loads.rows[b], loads.local[b], loads.remote[b],
                                          loads.replica[b], cmax_of(b), n_open > 1, best);
    int64_t evaluated = 0;
    if (sources) {  // the whole list, lazily, in priority order
      if (!ordered) {  // m descending, then g: (m, g) pairs are unique, any sort is stable
        std::vector<std::pair<int64_t, int64_t>> keyed;
        keyed.reserve(order.size());
        for (int64_t g : order) keyed.emplace_back(-moved[g], g);
        std::sort(keyed.begin(), keyed.end());
        for (size_t i = 0; i < keyed.size(); ++i) order[i] = keyed[i].second;
        ordered = true;
      }
      for (size_t i = 0; i < order.size(); ++i) {
        const int64_t g = order[i];
        if (!open[g] || !lowers_b(g, b, best, true)) continue;
        const int v = visit(g, best, evaluated);
        if (v != 0) return v > 0;
      }
      return false;
    }
    // no source candidate passes: b's own experts, and the last candidate when it ends the
    // token phase (b sends it no row), in priority order
    std::vector<int64_t> listed;
    for (int64_t g = b * E; g < (b + 1) * E; ++g)
      if (open[g] && lowers_b(g, b, best, false)) listed.push_back(g);
    if (n_open == 1 && static_cast<int64_t>(listed.size()) == 0) {
      for (int64_t g : order)
        if (open[g]) {
          if (g / E != b && lowers_b(g, b, best, false)) listed.push_back(g);
          break;
        }
    }
    std::sort(listed.begin(), listed.end(), [&](int64_t x, int64_t y) {
      return moved[x] != moved[y] ? moved[x] > moved[y] : x < y;
    });
    for (int64_t g : listed) {
      const int v = visit(g, best, evaluated);
      if (v != 0) return v > 0;
    }
    return false;
  }
};

// replica_search with the seconds passed in and out: base, the baseline's (compute [W], comm
// [W]; NULL: computed here); out_seconds (NULL: not written), the accepted plan's under
// prediction_lists' flags (the last acceptance's: a copy is held, and remote rows are left iff
// the last accepted expert did not hold them all), written when an expert is accepted.
Replicas search_with(const Counts& counts, const Model& model, const std::vector<int64_t>& colsum,
                     Loads& loads, int64_t max_replicas, int64_t width, const double* base,
                     double* out_seconds) {
  Search search(counts, model, colsum, loads, max_replicas, width, base);
  if (search.total_remote == 0 || counts.W < 2 || max_replicas < 1) return {};
  while (search.round()) {
  }
  Replicas out = std::move(search.accepted);
  std::sort(out.begin(), out.end(),
            [](const auto& x, const auto& y) { return x.first < y.first; });
  if (out_seconds != nullptr && !out.empty()) {
    std::copy(search.compute.begin(), search.compute.end(), out_seconds);
    std::copy(search.comm.begin(), search.comm.end(), out_seconds + counts.W);
  }
  return out;
}

// StepModel.prediction_lists(rows, local, remote, replica) (rounds None) as plan_replicas packs
// it (_pack_lists), from the seconds in pred_d [2W] (compute, comm): pred_i [3, W] = token
// bytes, weight bytes, rows; pred_d[2W] = the step (the first max of compute + comm). False
// when a byte count leaves int64 (Python's ints do not: the caller prices those in Python).
bool pack(const Model& m, const Loads& l, int64_t* pred_i, double* pred_d) {
  const int64_t W = static_cast<int64_t>(l.rows.size());
  const __int128 token = 2 * static_cast<__int128>(m.tbr), weight = 2 * static_cast<__int128>(m.P);
  constexpr __int128 top = std::numeric_limits<int64_t>::max();
  double step = 0.0;
  for (int64_t r = 0; r < W; ++r) {
    const double total = pred_d[r] + pred_d[W + r];
    if (r == 0 || total > step) step = total;  // Python's max keeps the first of equals
    const __int128 tb = token * l.remote[r];
    const __int128 wb = weight * static_cast<int64_t>(l.replica[r]);  // whole copies
    if (tb > top || tb < -top || wb > top || wb < -top) return false;
    pred_i[r] = static_cast<int64_t>(tb);
    pred_i[W + r] = static_cast<int64_t>(wb);
    pred_i[2 * W + r] = l.rows[r];
  }
  pred_d[2 * W] = step;
  return true;
}

}  // namespace

namespace mixmoe_native {

Replicas replica_search(const Counts& counts, const Model& model,
                        const std::vector<int64_t>& colsum, Loads& loads, int64_t max_replicas,
                        int64_t width) {
  return search_with(counts, model, colsum, loads, max_replicas, width, nullptr, nullptr);
}

}  // namespace mixmoe_native

extern "C" {

// plan_replicas' search from C (int64 [W, N]).
// colsum: C's column sums (int64 [N]; NULL: summed here). loads: the baseline (float64 [4, W]
// holding ints, as baseline_loads returns it: rows, local, remote, replica; NULL: built here with
// baseline_loads' arithmetic, one pass over C).
// ints: W, E, max_replicas, width, then Model::from's 5 ints; reals: Model::from's 7.
// Outputs: loads_out (int64 [4, W]): the accepted plan's loads (the baseline's when nothing is
// accepted); out: the holders, a group [g, k, h_1..h_k] per accepted g by ascending g (cap: its
// length; written[0] = the ints written when `written` is not NULL); pred_i (int64 [2, 3, W])
// and pred_d (float64 [2, 2W + 1]), both NULL or both not: the baseline's and then the accepted
// plan's Prediction fields (pack above; the second only when an expert is accepted).
// Returns the number of accepted experts; -1: `out` too small, -2: a prediction's byte counts
// leave int64 (nothing meaningful is written then). W == 1, max_replicas 0, no remote row:
// nothing is accepted.
int64_t mixmoe_replica_search(const int64_t* C, const int64_t* colsum, const double* loads,
                              const int64_t* ints, const double* reals, int64_t* loads_out,
                              int64_t* out, int64_t cap, int64_t* pred_i, double* pred_d,
                              int64_t* written) {
  const int64_t W = ints[0], E = ints[1], N = W * E;
  const Counts counts{W, E, N, C};
  const Model model = Model::from(ints + 4, reals);  // ints 4-8, reals 0-6: common.h's order
  std::vector<int64_t> sums(static_cast<size_t>(N), 0);
  if (colsum != nullptr) {
    sums.assign(colsum, colsum + N);
  } else {
    for (int64_t s = 0; s < W; ++s)
      for (int64_t g = 0; g < N; ++g) sums[g] += C[s * N + g];  // row by row: C read in order
  }
  Loads l;
  l.rows.resize(W);
  l.local.resize(W);
  l.remote.resize(W);
  l.replica.resize(W);
  if (loads != nullptr) {
    for (int64_t r = 0; r < W; ++r) {  // whole numbers in float64: truncated as .to(int64)
      l.rows[r] = static_cast<int64_t>(loads[r]);
      l.local[r] = static_cast<int64_t>(loads[W + r]);
      l.remote[r] = static_cast<int64_t>(loads[2 * W + r]);
      l.replica[r] = loads[3 * W + r];
    }
  } else {  // counts.baseline_loads: rows = the column sums of r's segment, local = r's own
    for (int64_t r = 0; r < W; ++r) {
      int64_t rows = 0, local = 0, sent = 0;
      for (int64_t g = r * E; g < (r + 1) * E; ++g) {
        rows += sums[g];
        local += C[r * N + g];  // C[r][g]: r's own rows of its own expert
      }
      for (int64_t g = 0; g < N; ++g) sent += C[r * N + g];
      l.rows[r] = rows;
      l.local[r] = local;
      l.remote[r] = (sent - local) + (rows - local);  // sent away + received
      l.replica[r] = 0.0;
    }
  }
  const int64_t stride_d = 2 * W + 1;
  if (pred_i != nullptr) {  // the baseline's Prediction; its seconds start the search
    seconds_of(model, l, pred_d, pred_d + W);
    if (!pack(model, l, pred_i, pred_d)) return -2;
  }
  const Replicas hot = search_with(counts, model, sums, l, ints[2], ints[3], pred_d,
                                   pred_i != nullptr ? pred_d + stride_d : nullptr);
  int64_t need = 0;
  for (const auto& [g, holders] : hot) need += 2 + static_cast<int64_t>(holders.size());
  if (need > cap) return -1;
  int64_t* o = out;
  for (const auto& [g, holders] : hot) {
    *o++ = g, *o++ = static_cast<int64_t>(holders.size());
    for (int64_t h : holders) *o++ = h;
  }
  if (written != nullptr) written[0] = need;
  for (int64_t r = 0; r < W; ++r) {
    loads_out[r] = l.rows[r];
    loads_out[W + r] = l.local[r];
    loads_out[2 * W + r] = l.remote[r];
    loads_out[3 * W + r] = static_cast<int64_t>(l.replica[r]);
  }
  if (pred_i != nullptr && !hot.empty() && !pack(model, l, pred_i + 3 * W, pred_d + stride_d))
    return -2;
  return static_cast<int64_t>(hot.size());
}

}  // extern "C"
