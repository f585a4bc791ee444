// The batched water-fill of mixmoe.placement.level_fill over a RangeState, compiled, and the
// plan the state stands for (RangeState.plan_fields, mixmoe.placement.ranges' cuts).
//
// Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (row-major int64, C[s*N + g] =
// rows rank s routes to expert g; g's owner is g / E); a rank's loads (rows, local, remote, replica)
// and total (seconds) as in mixmoe.placement.range_state and StepModel.total_fn.
//
// The same passes as the Python fill, step for step: the same integer arithmetic, the same float
// expressions in the same order (Python ints times ints are exact: here __int128 products, rounded
// once to double as Python's int / float rounds them), the same tie rules (rank, then expert id), so
// the state it leaves is the Python fill's, bit for bit, and so are its plan fields
// (tests/placement/test_native_fill.py checks every field). Build: any C++17 compiler,
// -ffp-contract=off (no fused multiply-add: Python rounds every product). Two ways in, one code:
// mixmoe_native::level_fill (level_fill.h; one link) for the compiled planner, and the C entry
// mixmoe_level_fill (any topology, the whole state; mixmoe_level_fill_plan its plan fields) for
// mixmoe/placement/native_fill.py through ctypes; mixmoe_level_fill_out runs the former, and
// mixmoe_level the level alone, for the twin tests. The shared arithmetic and the cost model's
// Model in common.h.
//
// Speed (3 fills a plan at zipf:1.2, W = 64 and 1024): the per-expert and per-rank maps are FlatMaps
// (flat_map.h: sorted vectors, std::map's order), a rank's offers sit in place (Offers), the
// per-pass buffers are reused, and the level's points and the donor/receiver orders are sorted
// as 128-bit integers (Keyed: the same (x, insertion) order as a stable sort) by radix passes,
// the level's points only as far as its walk reads them (Ascending).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "flat_map.h"
#include "level_fill.h"

namespace {

using namespace mixmoe_native;

constexpr int OFFERED = 4;       // level_fill.OFFERED
constexpr int OFFERED_MAX = 16;  // level_fill.OFFERED_MAX
constexpr size_t KEEP_SORT_ALL = 32;  // Fill::keep: a list this short sorted whole at once
#ifndef MIXMOE_LIVE_FROM  // native_fill_totals.cpp builds it at 0 too: every walk from a list
#define MIXMOE_LIVE_FROM 64
#endif
constexpr size_t LIVE_FROM = MIXMOE_LIVE_FROM;  // matched: holders walked from a LiveHolders list

// Makes v[i] final, v[0, ready) being final already (its ascending sort's entries; distinct
// entries: a sorted prefix is the full sort's): a list of KEEP_SORT_ALL or fewer sorted whole at
// once; else the next chunk (doubling from 4) by a partial sort, the rest whole once a chunk would
// reach a quarter of it. Fill::keep reads a hot expert's ~W - 1 amounts, largest first, only until
// its excess is placed: one of them, in every keep of the bench planner's W = 1024 zipf plans
// (sorting all of them at each new holder was ~1/3 of the plan's time at W = 1024 zipf:2).
template <class T>
void sort_through(std::vector<T>& v, size_t i, size_t& ready) {
  if (i < ready) return;
  const auto from = v.begin() + static_cast<std::ptrdiff_t>(i);
  const size_t next = std::max<size_t>(2 * ready, 4);
  if (v.size() <= KEEP_SORT_ALL || 4 * (next - i) >= v.size() - i) {
    std::sort(from, v.end());
    ready = v.size();
  } else {
    std::partial_sort(from, v.begin() + static_cast<std::ptrdiff_t>(next), v.end());
    ready = next;
  }
}

struct Offer {  // level_fill._offer's [g, own rows allowed, own rows given at the offer]
  int64_t g, mine, given;
};

struct Offers {  // a rank's offers: at most OFFERED_MAX, held in place (no allocation per rank)
  Offer items[OFFERED_MAX];
  int n = 0;
  const Offer* begin() const { return items; }
  const Offer* end() const { return items + n; }
  bool empty() const { return n == 0; }
  void clear() { n = 0; }
  void push_back(const Offer& o) { items[n++] = o; }  // the caller stops at OFFERED_MAX
  const Offer& operator[](int i) const { return items[i]; }
};

// `v` as n empty entries, each keeping its buffer when `v` already had n (a reused Fill: its
// per-expert maps fill again without allocating, fill after fill)
template <class T>
void reset_each(std::vector<T>& v, size_t n) {
  if (v.size() != n) {
    v.clear();
    v.resize(n);
    return;
  }
  for (T& x : v) x.clear();
}

#ifdef MIXMOE_CHECK_TOUCHED  // tests/placement/native_fill_totals.cpp's counters
int64_t touched_checks = 0, touched_misses = 0, excess_keeps = 0, live_lists = 0;
#endif

struct Fill {  // RangeState's fields (range_state.py), per expert as vectors of length N
  int64_t W, E, N, slots, blk, per_node;  // per_node 0: no topology
  const int64_t* C;
  Layout layout{0, 0, false};      // C's (Counts.by_column)
  ColumnPrefix* prefix = nullptr;  // Counts.prefix: plan_fields reads and extends it
  bool any_remote;
  Model m;
  std::vector<std::vector<int64_t>> holders;  // per expert, ranks ascending
  std::vector<int64_t> held, owner_rows, own, others, taken, rows, local, remote;
  std::vector<double> replica, totals;
  std::vector<FlatMap<int64_t>> amounts, helped, kept;  // {g: {y: n}}, {r: {g: n}}, ...
  std::vector<FlatMap<double>> degrees;
  // across nodes (FillSettings.bw_far > 0, RangeState.split): each expert's relay copies that
  // cross nodes (relay.relay_inter_copies) and their sum per rank, priced at bw_far
  double bw_near = 0.0, bw_far = 0.0;
  std::vector<FlatMap<double>> inter;
  std::vector<double> replica_inter;
  int64_t rounds = 0;
  std::vector<char> overshot;
  bool beaten = false;  // RangeState.beaten: the passes stopped at the mean reaching p.beat
  // scratch reused call after call (no allocation per call): offer's candidates, relay's degrees
  mutable std::vector<std::pair<int64_t, int64_t>> heavy_;
  std::vector<std::pair<int64_t, int64_t>> order_;  // keep's amounts by size
  FlatMap<double> fresh_, fresh_inter_;
  mutable std::vector<int64_t> near_;                    // relay_degrees' near holders
  mutable std::vector<std::pair<size_t, size_t>> runs_;  // and far nodes' runs

  int64_t c(int64_t y, int64_t g) const { return C[layout.at(y, g)]; }

  bool holds(int64_t g, int64_t y) const {
    const auto& h = holders[g];
    return std::binary_search(h.begin(), h.end(), y);
  }

  void owner_part(int64_t g, int64_t p[3]) const {
    const int64_t oth = others[g], mine = own[g], tk = taken[g];
    p[0] = oth + mine - tk;
    p[1] = mine - std::max<int64_t>(0, tk - oth);
    p[2] = oth > tk ? oth - tk : tk - oth;
  }

  // the ranks whose loads changed since the totals were last computed (retotal_touched)
  std::vector<char> dirty_;
  std::vector<int64_t> touched_;
  int64_t totals_rounds_ = -1;  // the rounds the totals were computed with

  void touch(int64_t r) {
    if (!dirty_[r]) dirty_[r] = 1, touched_.push_back(r);
  }

  void add(int64_t r, const int64_t p[3], int64_t sign) {
    touch(r);
    rows[r] += sign * p[0];
    local[r] += sign * p[1];
    remote[r] += sign * p[2];
  }

  void keep(int64_t g, int64_t y, int64_t k) {  // RangeState._keep
    const int64_t o = g / E, cy = c(y, g);
    int64_t part[3];
    owner_part(g, part);
    add(o, part, -1);
    const int64_t mine[3] = {k, k, -k};
    add(y, mine, 1);
    others[g] -= k;
    auto& kg = kept[g];
    auto it = kg.find(y);
    if (it != kg.end()) {
      it->second += k;
      if (it->second >= cy) kg.erase(it);  // all local: an ordinary holder
    }
    int64_t excess = taken[g] - others[g] - own[g];
#ifdef MIXMOE_CHECK_TOUCHED
    excess_keeps += excess > 0;
#endif
    if (excess > 0) {  // off the largest amounts first, ties by rank
      auto& am = amounts[g];
      auto& order = order_;  // (-n, r), distinct by r: a sorted prefix is the full sort's
      order.clear();
      for (const auto& [r, n] : am)
        if (n != 0) order.emplace_back(-n, r);
      size_t ready = 0;  // order[0, ready) final (sort_through)
      for (size_t i = 0; i < order.size(); ++i) {
        sort_through(order, i, ready);
        const int64_t r = order[i].second;
        int64_t& n = am[r];
        const int64_t d = std::min(excess, n);
        n -= d;
        touch(r);
        rows[r] -= d;
        remote[r] -= d;
        helped[r][g] -= d;
        taken[g] -= d;
        excess -= d;
        if (excess == 0) break;
      }
    }
    owner_part(g, part);
    add(o, part, 1);
    owner_rows[g] = part[0];
  }

  void add_holder(int64_t g, int64_t y, int64_t local_rows /* -1: all */) {
    const int64_t cy = c(y, g);
    const int64_t k = local_rows < 0 ? cy : std::min(local_rows, cy);
    if (k < cy) kept[g][y] = 0;
    keep(g, y, k);
    auto& h = holders[g];
    h.insert(std::lower_bound(h.begin(), h.end(), y), y);
    held[y] += 1;
  }

  int64_t kept_rest(int64_t g, int64_t y) const {
    const auto& kg = kept[g];
    auto it = kg.find(y);
    return it == kg.end() ? 0 : c(y, g) - it->second;
  }

  void keep_more(int64_t g, int64_t y, int64_t k) {
    keep(g, y, std::min(k, c(y, g) - kept[g].find(y)->second));  // y is a kept holder of g
  }

  void move(int64_t g, int64_t b, int64_t y, int64_t n) {  // RangeState.move
    const int64_t o = g / E;
    int64_t part[3];
    owner_part(g, part);
    add(o, part, -1);
    auto& am = amounts[g];
    const std::pair<int64_t, int64_t> steps[2] = {{b, -n}, {y, n}};
    for (const auto& [r, d] : steps) {
      if (r == o) {
        taken[g] -= d;
      } else {
        am[r] += d;
        touch(r);
        rows[r] += d;
        remote[r] += d;
        helped[r][g] += d;
      }
    }
    owner_part(g, part);
    add(o, part, 1);
    owner_rows[g] = part[0];
  }

  // relay.relay_degrees: {rank: copies}, rounds (relay.py's module doc has the grid)
  int64_t relay_degrees(int64_t owner, const std::vector<int64_t>& hs,
                        FlatMap<double>& out) const {
    out.clear();
    if (hs.empty()) return 0;
    // with a topology: the holders on the owner's node, and each far node's holders as a run
    // [begin, end) of hs (ascending, as holders are kept: a node's holders are consecutive and
    // the runs come by lowest holder, relay.holder_groups' order); scratch kept per Fill
    auto& near_node = near_;
    auto& runs = runs_;
    near_node.clear();
    runs.clear();
    const std::vector<int64_t>& near = per_node == 0 ? hs : near_node;  // one link: all of them
    if (per_node != 0) {
      const int64_t home = owner / per_node;
      for (size_t i = 0; i < hs.size(); ++i) {
        const int64_t node = hs[i] / per_node;
        if (node == home) {
          near_node.push_back(hs[i]);
        } else if (!runs.empty() && hs[runs.back().first] / per_node == node) {
          runs.back().second = i + 1;  // the same far node as the holder before
        } else {
          runs.emplace_back(i, i + 1);
        }
      }
    }
    const int64_t k = static_cast<int64_t>(near.size()), L = static_cast<int64_t>(runs.size());
    int64_t R = 0;
    bool pair_far = false;
    for (const auto& [b, e] : runs) {
      R += static_cast<int64_t>(e - b);
      pair_far = pair_far || e - b >= 2;
    }
    out[owner] = static_cast<double>((k > 0) + (R > 0));
    if (k > 0) {
      const double near_copies = k == 1 ? 1.0 : 1.0 + grid(k - 1, k);
      for (int64_t h : near) out[h] = near_copies;
    }
    if (R == 1) {
      out[hs[runs[0].first]] = 1.0;
    } else if (R >= 2) {
      for (const auto& [b, e] : runs) {
        const int64_t cg = static_cast<int64_t>(e - b);
        const FarCopies f = far_copies(R, L, cg);
        for (int64_t i = 0; i < cg; ++i)
          out[hs[b + static_cast<size_t>(i)]] = i < f.extra ? f.high : f.low;
      }
    }
    return 1 + (k >= 2 || R >= 2) + (L >= 2 && pair_far);
  }

  bool split() const { return bw_far > 0.0; }

  // relay.relay_inter_copies of the holders relay_degrees grouped last (near_, runs_: the
  // same owner and holders, across nodes): the owner 1, a lone far holder 1, else each far
  // holder its chunks received and the exchange's sent (the closed form of relay.py)
  void relay_inter(int64_t owner, const std::vector<int64_t>& hs, FlatMap<double>& out) const {
    out.clear();
    int64_t R = 0;
    for (const auto& [b, e] : runs_) R += static_cast<int64_t>(e - b);
    if (R == 0) return;
    const int64_t L = static_cast<int64_t>(runs_.size());
    out[owner] = 1.0;
    if (R == 1) {
      out[hs[runs_[0].first]] = 1.0;
      return;
    }
    for (const auto& [b, e] : runs_) {
      const int64_t c = static_cast<int64_t>(e - b);
      const FarCopies f = far_copies(R, L, c);  // relay_degrees' two values per node
      for (int64_t i = 0; i < c; ++i)
        out[hs[b + static_cast<size_t>(i)]] = i < f.extra ? f.high_in : f.low_in;
    }
  }

  // a rank's total from its loads (StepModel.total_fn, or split_total_fn across nodes)
  double total_of(int64_t r) const {
    if (split())
      return m.total_split(rows[r], local[r], remote[r], replica[r], replica_inter[r], bw_near,
                           bw_far, any_remote, rounds);
    return m.total(rows[r], local[r], remote[r], replica[r], any_remote, rounds);
  }

  // replica[r] (or replica_inter[r]) += now - was over the ranks of `fresh` and `old` (each
  // once, ascending; absent: 0.0), each touched; then `old` takes `fresh`'s entries
  void add_copies(FlatMap<double>& fresh, FlatMap<double>& old, std::vector<double>& to) {
    auto i = fresh.begin(), j = old.begin();
    while (i != fresh.end() || j != old.end()) {
      const int64_t r = j == old.end() || (i != fresh.end() && i->first < j->first) ? i->first
                                                                                    : j->first;
      const double now = i != fresh.end() && i->first == r ? (i++)->second : 0.0;
      const double was = j != old.end() && j->first == r ? (j++)->second : 0.0;
      touch(r);
      to[r] += now - was;
    }
    std::swap(old, fresh);  // fresh keeps the old one's buffer for the next call
  }

  void relay(int64_t g) {  // RangeState.relay
    const int64_t depth = relay_degrees(g / E, holders[g], fresh_);
    if (split()) {  // from relay_degrees' groups, before add_copies reorders nothing of them
      relay_inter(g / E, holders[g], fresh_inter_);
      add_copies(fresh_inter_, inter[g], replica_inter);
    }
    add_copies(fresh_, degrees[g], replica);
    rounds = std::max(rounds, depth);
  }

  void retotal() {  // every rank's total (sizes the marks of retotal_touched)
    for (int64_t r = 0; r < W; ++r) totals[r] = total_of(r);
    dirty_.assign(static_cast<size_t>(W), 0);
    touched_.clear();
    totals_rounds_ = rounds;
  }

  // retotal after a pass: the same totals, computed again only at the ranks whose loads the
  // pass touched (the rounds, shared by every rank, unchanged; else all of them)
  void retotal_touched() {
    if (rounds != totals_rounds_) return retotal();
    for (int64_t r : touched_) {
      totals[r] = total_of(r);
      dirty_[r] = 0;
    }
    touched_.clear();
#ifdef MIXMOE_CHECK_TOUCHED  // the driver native_fill_totals.cpp: as if every total were new
    ++touched_checks;
    for (int64_t r = 0; r < W; ++r) touched_misses += totals[r] != total_of(r);
#endif
  }

  // level_fill._offer: rank b's offers (OFFERED, then more while they hold fewer rows than
  // `need`, up to OFFERED_MAX), and the rows they hold in all
  int64_t offer(int64_t b, double token, double t, double hide, double need, Offers& out) const {
    auto& heavy = heavy_;  // (-rows, g)
    heavy.clear();
    const int64_t first = b * E, end = first + E;  // b's own experts: g / E == b
    for (int64_t g = first; g < end; ++g)
      if (owner_rows[g] > 0) heavy.emplace_back(-owner_rows[g], g);
    for (const auto& [g, n] : helped[b])
      if (n > 0) heavy.emplace_back(-n, g);
    std::sort(heavy.begin(), heavy.end());
    int64_t headroom = token < 0 && t + hide > 0 ? to_int(-token / (t + hide)) : 0;
    int64_t avail = 0;
    out.clear();
    for (size_t i = 0; i < heavy.size() && i < static_cast<size_t>(OFFERED_MAX); ++i) {
      // Python compares the int with the float exactly; avail < 2**53 converts exactly
      if (i >= static_cast<size_t>(OFFERED) && static_cast<double>(avail) >= need) break;
      const auto [n, g] = heavy[i];
      if (g < first || g >= end) {  // as a helper: all its rows of g
        out.push_back({g, 0, 0});
        avail -= n;
        continue;
      }
      const int64_t given = std::max<int64_t>(0, taken[g] - others[g]);
      const int64_t mine = std::min(own[g] - given, headroom);
      headroom -= mine;
      out.push_back({g, mine, given});
      avail += std::max<int64_t>(0, others[g] - taken[g]) + mine;
    }
    return avail;
  }

  int64_t cap(int64_t b, const Offer& o) const {  // level_fill._cap
    const int64_t g = o.g;
    if (g / E != b) {
      const auto& am = amounts[g];
      auto it = am.find(b);
      return it == am.end() ? 0 : it->second;
    }
    const int64_t now = std::max<int64_t>(0, taken[g] - others[g]);
    return std::max<int64_t>(0, others[g] - taken[g]) + std::max<int64_t>(0, o.given + o.mine - now);
  }
};

// The thread's one Fill: the fills' state (level_fill), then the winner's plan fields
// (plan_from); each sets every field it reads, and its per-expert vectors keep their buffers
// (W = 1024: three vectors of 4096 maps, ~100 KB each: fresh pages every plan when allocated)
[[gnu::noinline]] Fill& thread_fill() {  // a call: see run_buffers
  thread_local Fill f;
  return f;
}

struct Point {
  double x, dslope, drop;
};

// A point's (or a rank's) place in a sort as one unsigned 128-bit integer: x's order key
// (order_key) in bits 32-95, `at` (the insertion index, or the rank) in bits 0-31. Integer
// order on it is the order by (x, at), a total order (no two `at`s are equal): every correct
// sort gives the one order a stable sort by x gives (ties in x keep insertion order, as
// Python's sorted does). One integer compare (no branch on ties) and a 16-byte move, as the
// (double, index) pair it replaces took two compares.
using Keyed = unsigned __int128;

// x's bits as an unsigned integer in x's order (finite x: INF never enters a sort): a positive
// double's bits ascend with it (set the sign bit: above every negative), a negative's descend
// (flip every bit). x + 0.0 first turns -0.0 into 0.0: equal doubles get one key, and their tie
// falls to `at`, as the double comparison's did.
inline uint64_t order_key(double x) {
  const double z = x + 0.0;
  uint64_t b;
  std::memcpy(&b, &z, sizeof b);
  const uint64_t negative = static_cast<uint64_t>(static_cast<int64_t>(b) >> 63);  // all 1s or 0
  return b ^ (negative | (uint64_t(1) << 63));
}

inline Keyed keyed(double x, uint32_t at) {
  return (static_cast<Keyed>(order_key(x)) << 32) | at;
}
inline uint64_t key_of(Keyed k) { return static_cast<uint64_t>(k >> 32); }  // order_key(x)
inline uint32_t at_of(Keyed k) { return static_cast<uint32_t>(k); }

struct LevelScratch {  // level's buffers (and sort_ranks'), reused pass after pass
  std::vector<Point> points;  // in insertion order (`at`)
  std::vector<Keyed> keys, tmp;
  std::vector<uint32_t> ends;  // the first bucket pass's bucket ends
};

void insertion_sort(Keyed* a, size_t n) {  // a[0, n) ascending (short or nearly sorted runs)
  for (size_t i = 1; i < n; ++i) {
    const Keyed v = a[i];
    size_t j = i;
    for (; j > 0 && v < a[j - 1]; --j) a[j] = a[j - 1];
    a[j] = v;
  }
}

constexpr size_t BUCKETS_FROM = 64;  // Ascending: std::sort below (measured as fast there)
constexpr int FIRST_BITS = 11;       // the first bucket pass: up to 2^11 buckets
constexpr int LATER_BITS = 8;        // a bucket's own passes: up to 2^8 (their ends on the stack)
constexpr size_t RADIX_SMALL = 16;   // radix_sort: a bucket up to this size by insertion

// One pass of a most-significant-digit radix sort on the x keys of a[0, n) (n >= 2; tmp: n
// scratch): ~n buckets (at most 2^max_bits) evenly over the range's own [lo, hi] of keys (the
// digit (key - lo) >> shift is monotone in the key: equal keys share a bucket, a larger key never
// lands in an earlier one), a counting scatter into tmp (stable), copied back. Returns the
// bucket count, ends[d] the end of bucket d (ends: room for 2^max_bits + 1); 0 when every key is
// equal (a as it was).
size_t bucket_pass(Keyed* a, Keyed* tmp, size_t n, uint32_t* ends, int max_bits) {
  uint64_t lo = key_of(a[0]), hi = lo;
  for (size_t i = 1; i < n; ++i) lo = std::min(lo, key_of(a[i])), hi = std::max(hi, key_of(a[i]));
  if (lo == hi) return 0;
  const int span = 64 - __builtin_clzll(hi - lo);  // the bits hi - lo needs (>= 1)
  const int bits = std::clamp(63 - __builtin_clzll(n), 4, max_bits);  // ~n buckets, >= 16
  const int shift = span > bits ? span - bits : 0;
  const size_t buckets = static_cast<size_t>((hi - lo) >> shift) + 1;  // <= 2^bits
  std::fill(ends, ends + buckets + 1, 0u);  // ends[d + 1]: bucket d's count, its start, its end
  for (size_t i = 0; i < n; ++i) ++ends[((key_of(a[i]) - lo) >> shift) + 1];
  for (size_t d = 1; d <= buckets; ++d) ends[d] += ends[d - 1];  // ends[d]: bucket d's start
  for (size_t i = 0; i < n; ++i) tmp[ends[(key_of(a[i]) - lo) >> shift]++] = a[i];
  std::memcpy(a, tmp, n * sizeof(Keyed));  // ends[d]: bucket d's end (the scatter moved it)
  return buckets;
}

// a[0, n) ascending: by insertion when small, else a bucket pass and each bucket again on its
// own narrower [lo, hi] (the points bunch near the level, the totals near the mean: one pass
// leaves clumps). Each pass spans at least 4 fewer key bits: the depth stays under 16.
void radix_sort(Keyed* a, Keyed* tmp, size_t n) {
  if (n <= RADIX_SMALL) return insertion_sort(a, n);
  uint32_t ends[(1 << LATER_BITS) + 1];
  const size_t buckets = bucket_pass(a, tmp, n, ends, LATER_BITS);
  if (buckets == 0) return std::sort(a, a + n);  // one x: by `at`
  size_t start = 0;
  for (size_t d = 0; d < buckets; ++d) {
    radix_sort(a + start, tmp + start, ends[d] - start);
    start = ends[d];
  }
}

// `keys` ascending (by (x, at): see Keyed), sorted only as far as they are read: one bucket pass
// over them all, then a bucket is sorted when an index in it is first read (level's walk stops
// at the level, about half way up its points: the buckets above are never sorted). Short lists
// by std::sort at once.
class Ascending {
 public:
  Ascending(std::vector<Keyed>& keys, LevelScratch& ws)
      : a_(keys.data()), n_(keys.size()), ws_(ws) {
    if (n_ < BUCKETS_FROM) {
      std::sort(keys.begin(), keys.end());
      return;
    }
    if (ws.tmp.size() < n_) ws.tmp.resize(n_);  // grown only: no zeroing pass after pass
    ws.ends.resize((size_t(1) << FIRST_BITS) + 1);
    if (bucket_pass(a_, ws.tmp.data(), n_, ws.ends.data(), FIRST_BITS) == 0) {
      std::sort(keys.begin(), keys.end());  // one x: by `at`
      return;
    }
    ready_ = 0;  // the buckets in place, none sorted yet
  }
  Keyed operator[](size_t i) {  // i < n
    while (i >= ready_) {  // sort the next bucket: a_[0, its end) is then final
      const size_t end = ws_.ends[next_++];
      radix_sort(a_ + ready_, ws_.tmp.data() + ready_, end - ready_);
      ready_ = end;
    }
    return a_[i];
  }
  void sort_all() {
    if (n_) (*this)[n_ - 1];
  }

 private:
  Keyed* a_;
  size_t n_;
  LevelScratch& ws_;
  size_t next_ = 0;  // the first bucket not sorted yet
  size_t ready_ = static_cast<size_t>(-1);  // a_[0, ready_) final (all of it when sorted at once)
};

// `ranks` (ascending) sorted by (T[r], r), or by (-T[r], r) when `descending` (-T: exact, and
// equal totals stay equal): the rank rides along as the key's `at`
void sort_ranks(std::vector<int64_t>& ranks, const std::vector<double>& T, bool descending,
                LevelScratch& ws) {
  ws.keys.clear();
  for (int64_t r : ranks) {
    const double x = T[static_cast<size_t>(r)];
    ws.keys.push_back(keyed(descending ? -x : x, static_cast<uint32_t>(r)));
  }
  Ascending(ws.keys, ws).sort_all();
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = at_of(ws.keys[i]);
}

// level_fill._level: the level where the rows shed above it equal the rows absorbed below it
double level(const std::vector<double>& T, const std::vector<int64_t>& avail,
             const std::vector<double>& save, const std::vector<double>& start, double cost,
             double cost_sum, const std::vector<char>& fresh, double copy, size_t tensor_points,
             LevelScratch& ws) {
  const size_t W = T.size();
  const double jump = copy * static_cast<double>(W) / cost_sum;
  std::vector<Point>& points = ws.points;  // in insertion order; ws.keys: their sorted order
  std::vector<Keyed>& keys = ws.keys;
  points.clear();
  keys.clear();
  const auto push = [&](double x, double dslope, double drop) {
    keys.push_back(keyed(x, static_cast<uint32_t>(points.size())));
    points.push_back({x, dslope, drop});
  };
  double d0 = 0.0;
  for (size_t r = 0; r < W; ++r) {
    if (avail[r] > 0) {
      const double drop = fresh[r] ? jump : 0.0;
      push(T[r] - static_cast<double>(avail[r]) * save[r], -1.0 / save[r], 0.0);
      push(T[r], 1.0 / save[r], -drop);
      d0 += static_cast<double>(avail[r]) + drop;
    }
    if (start[r] != INF) push(start[r], -1.0 / cost, 0.0);
  }
  if (points.empty()) return *std::max_element(T.begin(), T.end());
  Ascending by_x(keys, ws);  // a stable sort by x, as far as the walk reads it
  const size_t n = points.size();
  const auto pt = [&](size_t i) -> const Point& { return points[at_of(by_x[i])]; };  // i-th by x
  if (n <= tensor_points) {  // the list walk
    double d = d0, slope = 0.0, prev = pt(0).x;
    for (size_t i = 0; i < n; ++i) {
      const Point& p = pt(i);
      const double left = d + slope * (p.x - prev);
      if (left <= 0) break;
      d = left + p.drop;
      prev = p.x;
      if (d <= 0) return p.x;
      slope += p.dslope;
    }
    return prev + (slope < 0 ? d / -slope : 0.0);
  }
  // level_fill._crossing_tensor: sequential cumulative sums, as torch's on the CPU (slope_i,
  // right_i = (d0 + ramp_i) + drops_i, left_i = right_i - drop_i), walked once: k1, the first
  // i with left_i <= 0, and k2, the first with right_i <= 0 (the walk stops there: the answer
  // needs nothing after k2); the slope and right at k1 - 1 and at the last point kept
  size_t k1 = n, k2 = n;
  double s = 0.0, ramp = 0.0, drops = 0.0, s_prev = 0.0, right = 0.0;
  double s_k = 0.0, right_k = 0.0;  // at k1 - 1 once k1 is found
  for (size_t i = 0; i < n; ++i) {
    const Point& p = pt(i);
    s += p.dslope;
    if (i > 0) ramp += s_prev * (p.x - pt(i - 1).x);
    drops += p.drop;
    const double right_prev = right;
    right = (d0 + ramp) + drops;
    const double left = right - p.drop;
    if (k1 == n && left <= 0) k1 = i, s_k = i > 0 ? s_prev : 0.0, right_k = right_prev;
    if (right <= 0) {
      k2 = i;
      break;
    }
    s_prev = s;
  }
  double slope_k, right_at_k;
  size_t k;
  if (k2 == n) {
    k = n - 1, slope_k = s, right_at_k = right;
  } else {
    if (k2 < k1) return pt(k2).x;
    if (k1 == 0) return pt(0).x;
    k = k1 - 1, slope_k = s_k, right_at_k = right_k;
  }
  return pt(k).x + (slope_k < 0 ? right_at_k / -slope_k : 0.0);
}

struct Queue {
  std::vector<int64_t> ranks;
  size_t next = 0;
};

// matched's queue of receivers: every rank in `order` (a view: no copy)
struct View {
  const std::vector<int64_t>* ranks;
  size_t next = 0;
};

struct Params {  // level_fill's rates and settings
  double a, t, hide, copy, lat, stop, min_gain;
  int64_t passes, tensor_points;
  bool kept;
  double beat;  // level_fill's beat: no pass once the mean total reaches it (f.beaten)
};

// matched's walks over an expert's holders, less the ranks out of room: a rank whose room fell
// below half a block's cost takes no rows in the rest of the call (its room only falls), so a
// walk drops it from the expert's list, and later walks of the expert skip it. The lists keep
// the holders' order (ascending) and take the holders the call adds. W = 1024 zipf:2: a plan's
// walks met ~7 * 10**5 holders, 99.5% of them out of room, one donor after another.
struct LiveHolders {
  std::vector<int32_t> slot;  // by expert: its list in `lists`, -1 none yet this call
  std::vector<std::vector<int64_t>> lists;
  std::vector<int64_t> built;  // the experts with a list this call

  std::vector<int64_t>& list(int64_t g, const std::vector<int64_t>& holders) {
    int32_t& k = slot[static_cast<size_t>(g)];
    if (k < 0) {
      k = static_cast<int32_t>(built.size());
      if (built.size() == lists.size()) lists.emplace_back();
      lists[built.size()].assign(holders.begin(), holders.end());
      built.push_back(g);
#ifdef MIXMOE_CHECK_TOUCHED
      ++live_lists;
#endif
    }
    return lists[static_cast<size_t>(k)];
  }
  void add(int64_t g, int64_t y) {  // a new holder of g, kept ascending (none listed: built later)
    const int32_t k = slot[static_cast<size_t>(g)];
    if (k < 0) return;
    auto& l = lists[static_cast<size_t>(k)];
    l.insert(std::lower_bound(l.begin(), l.end(), y), y);
  }
  void start(size_t N) {  // a call's: no lists (their buffers kept)
    if (slot.size() != N) slot.assign(N, -1);
    for (int64_t g : built) slot[static_cast<size_t>(g)] = -1;
    built.clear();
  }
};

// level_fill._matched: place each donor's shed rows; returns the pieces moved, new holders in `fresh`
int64_t matched(Fill& f, const std::vector<Offers>& offers,
                const std::vector<std::pair<int64_t, int64_t>>& shed, std::vector<double>& room_W,
                const std::vector<int64_t>& order, double cost, const Params& p,
                std::vector<int64_t>& fresh, LiveHolders& live) {
  const int64_t blk = f.blk, E = f.E;
  const double a = p.a, copy = p.copy;
  int64_t moved = 0;
  View all{&order};
  std::vector<Queue> nodes;  // by node (empty: no such queue)
  if (f.per_node) {
    nodes.resize(static_cast<size_t>((f.W + f.per_node - 1) / f.per_node));
    for (int64_t y : order) nodes[y / f.per_node].ranks.push_back(y);
  }
  auto ask = [blk](double rows) { return std::max(blk, to_int(rows / blk + 0.5) * blk); };
  for (const auto& [b, left0] : shed) {
    int64_t left = left0;
    for (const Offer& of : offers[b]) {
      const int64_t g = of.g, o = g / E;
      // one rank that has room and is not b, the owner or a holder: no copy to pay; false when
      // the walk ends there
      const auto serve = [&](int64_t y) __attribute__((always_inline)) {
        const int64_t rest = f.kept_rest(g, y);
        if (rest) {  // a kept holder takes back its own rows, no others
          if (b == o && room_W[y] >= 0.5 * blk * a) {
            const int64_t k = std::min({rest, left, ask(room_W[y] / a), f.cap(b, of)});
            if (k > 0) {
              f.keep_more(g, y, k);
              moved += 1;
              left -= k;
              room_W[y] -= static_cast<double>(k) * a;
            }
          }
          return true;
        }
        const int64_t n = std::min({left, ask(room_W[y] / cost), f.cap(b, of)});
        if (n <= 0) return false;
        f.move(g, b, y, n);
        moved += 1;
        left -= n;
        room_W[y] -= static_cast<double>(n) * cost;
        return true;
      };
      const double no_room = 0.5 * blk * cost;  // below it a rank takes no rows
      // the owner, then the holders (ascending), while b has a block left to shed
      bool walking = left >= blk;
      if (walking && o != b && room_W[o] >= no_room) walking = serve(o);
      if (walking && f.holders[g].size() < LIVE_FROM) {  // a short list: walked whole
        for (const int64_t y : f.holders[g]) {
          if (left < blk) break;
          if (y != b && room_W[y] >= no_room && !serve(y)) break;
        }
      } else if (walking) {
        std::vector<int64_t>& hs = live.list(g, f.holders[g]);  // g's holders with room so far
        size_t kept = 0, i = 0;  // hs[0, kept): the holders walked that still have room
        for (; i < hs.size(); ++i) {
          const int64_t y = hs[i];
          if (left < blk) break;
          if (room_W[y] < no_room) continue;  // out of room for the rest of the call: dropped
          hs[kept++] = y;
          if (y != b && !serve(y)) {
            ++i;
            break;
          }
        }
        const auto end = std::copy(hs.begin() + static_cast<std::ptrdiff_t>(i), hs.end(),
                                   hs.begin() + static_cast<std::ptrdiff_t>(kept));
        hs.erase(end, hs.end());  // the holders not walked stay listed, in order
      }
      // the owner's node first (its replica crosses no slow link), then every rank: the queue
      // (its ranks, where it is) as pointers into `nodes` or `all`
      std::pair<const std::vector<int64_t>*, size_t*> queues[2];
      int n_queues = 0;
      if (f.per_node && !nodes[o / f.per_node].ranks.empty()) {
        Queue& q = nodes[o / f.per_node];
        queues[n_queues++] = {&q.ranks, &q.next};
      }
      queues[n_queues++] = {all.ranks, &all.next};
      for (int qi = 0; qi < n_queues; ++qi) {
        const std::vector<int64_t>& ranks = *queues[qi].first;
        size_t& next = *queues[qi].second;
        while (left >= blk && next < ranks.size()) {
          const int64_t y = ranks[next];
          double room = room_W[y] - copy;
          const bool held = y == o || f.holds(g, y);
          if (held || f.held[y] >= f.slots || room < 0.5 * blk * cost) {
            next += 1;
            continue;
          }
          if (f.cap(b, of) <= 0) break;
          int64_t own = f.c(y, g);  // local at y once it holds g
          const bool over = static_cast<double>(own) * a > room;
          if (over) f.overshot[y] = 1;
          if (p.kept && over) {  // the whole blocks that fit
            own = to_int(room / a) / blk * blk;
            if (own == 0) {
              next += 1;
              continue;
            }
            f.add_holder(g, y, own);
          } else {
            f.add_holder(g, y, -1);
          }
          live.add(g, y);  // walked by the next donor that offers g
          fresh.push_back(g);  // g has a new holder: relayed after the pass
          room -= static_cast<double>(own) * a;
          if (b == o) left -= own;
          const int64_t n = std::min({left, ask(room / cost), f.cap(b, of)});
          if (n > 0 && !f.kept_rest(g, y)) {
            f.move(g, b, y, n);
            left -= n;
            room -= static_cast<double>(n) * cost;
          }
          moved += 1;
          room_W[y] = room;
          if (room_W[y] < 0.5 * blk * cost) next += 1;
        }
      }
      if (left < blk) break;
    }
  }
  return moved;
}

double fold_sum(const std::vector<double>& xs) {  // level_fill.fold_sum: left to right
  double s = 0.0;
  for (double x : xs) s += x;
  return s;
}

struct RunBuffers {  // run's per-pass arrays, one set per thread (no allocation per fill)
  std::vector<Offers> offers;
  std::vector<int64_t> avail_W, by_total, order, fresh;
  std::vector<double> cost_W, token_W, save_W, start_W, room_W, T_W;
  std::vector<char> fresh_W;
  std::vector<std::pair<int64_t, int64_t>> shed;
  LevelScratch ws;
  std::vector<char> seen_N;  // the experts a free-copy pass has marked (all 0 between passes)
  std::vector<int64_t> seen;
  LiveHolders live;  // matched's
};

// The thread's buffers of run, reached through a call that is not inlined: the library is
// built -fPIC, where every use of a thread_local named inside a function re-derives its address
// with a __tls_get_addr call (64 of them in run's code, 32 in plan_fields'); through a
// reference returned by a call it is a plain pointer (W = 1024 zipf plans: ~12% faster, as fast
// as the same code linked statically)
[[gnu::noinline]] RunBuffers& run_buffers() {
  thread_local RunBuffers buffers;
  return buffers;
}

int64_t run(Fill& f, const Params& p) {  // level_fill.level_fill
  const int64_t W = f.W, E = f.E;
  const size_t Wz = static_cast<size_t>(W);
  const double a = p.a, t = p.t;
  const double cost = a + t;
  RunBuffers& buf = run_buffers();
  buf.cost_W.assign(Wz, cost);
  const double cost_sum = fold_sum(buf.cost_W);
  int64_t pieces = 0;
  bool free_copy = false;
  // every entry below is written each pass before it is read (offers: set or cleared per rank)
  std::vector<Offers>& offers = buf.offers;
  offers.resize(Wz);
  std::vector<int64_t>& avail_W = buf.avail_W;
  avail_W.resize(Wz);
  std::vector<double> &token_W = buf.token_W, &save_W = buf.save_W, &start_W = buf.start_W,
                      &room_W = buf.room_W, &T_W = buf.T_W;
  for (auto* v : {&token_W, &save_W, &start_W, &room_W}) v->resize(Wz);
  std::vector<char>& fresh_W = buf.fresh_W;
  fresh_W.resize(Wz);
  std::vector<int64_t> &by_total = buf.by_total, &order = buf.order, &fresh = buf.fresh;
  std::vector<std::pair<int64_t, int64_t>>& shed = buf.shed;
  LevelScratch& ws = buf.ws;
  std::vector<char>& seen_N = buf.seen_N;
  std::vector<int64_t>& seen = buf.seen;
  seen_N.resize(static_cast<size_t>(f.N), 0);  // all 0 already: each pass clears its marks
  for (int64_t pass = 0; pass < p.passes; ++pass) {
    T_W = f.totals;  // the pass's totals (the fill changes f.totals)
    const double top = *std::max_element(T_W.begin(), T_W.end());
    const double mean = fold_sum(T_W) / static_cast<double>(W);
    if (top <= p.stop * mean) break;
    for (int64_t b = 0; b < W; ++b)
      token_W[b] = p.lat + t * static_cast<double>(f.remote[b]) - p.hide * static_cast<double>(f.local[b]);
    for (int64_t b = 0; b < W; ++b) save_W[b] = token_W[b] > 0 && t != 0.0 ? a + t : a;
    for (int64_t b = 0; b < W; ++b) {
      if (T_W[b] > mean) {  // the rows b sheds to come down to the mean: its offers' goal
        const double need = save_W[b] > 0 ? (T_W[b] - mean) / save_W[b] : INF;
        avail_W[b] = f.offer(b, token_W[b], t, p.hide, need, offers[b]);
      } else {
        offers[b].clear();
        avail_W[b] = 0;
      }
    }
    for (int64_t r = 0; r < W; ++r) start_W[r] = f.held[r] < f.slots ? T_W[r] + p.copy : INF;
    if (free_copy) {  // the owners and holders of the experts offered: no copy
      // each expert once, however many ranks offer it (a hot expert's ~W holders offer it
      // all: W = 1024 zipf, ~8% of the fill's time when every offer walked its holders)
      for (int64_t b = 0; b < W; ++b)
        for (const Offer& of : offers[b]) {
          if (seen_N[of.g]) continue;
          seen_N[of.g] = 1;
          seen.push_back(of.g);
          start_W[of.g / E] = T_W[of.g / E];
          for (int64_t r : f.holders[of.g]) start_W[r] = T_W[r];
        }
      for (int64_t g : seen) seen_N[g] = 0;
      seen.clear();
    }
    for (int64_t b = 0; b < W; ++b) {
      bool fresh = !offers[b].empty();
      if (fresh) {
        const int64_t g = offers[b][0].g;
        if (g / E != b) fresh = false;
        for (int64_t r : f.holders[g])
          if (r != b) {
            fresh = false;
            break;
          }
      }
      fresh_W[b] = fresh;
    }
    const double L = level(T_W, avail_W, save_W, start_W, cost, cost_sum, fresh_W, p.copy,
                           static_cast<size_t>(p.tensor_points), ws);
    by_total.clear();  // the donors: ranks above L, by total descending, then rank
    for (int64_t r = 0; r < W; ++r)
      if (T_W[r] > L) by_total.push_back(r);
    sort_ranks(by_total, T_W, true, ws);
    shed.clear();  // (donor, rows)
    for (int64_t b : by_total) {
      const double x = (T_W[b] - L) / save_W[b];
      const double n = x < static_cast<double>(avail_W[b]) ? x : static_cast<double>(avail_W[b]);
      if (n >= 0.5 * f.blk) shed.emplace_back(b, std::max(f.blk, to_int(n / f.blk + 0.5) * f.blk));
    }
    for (int64_t r = 0; r < W; ++r) {
      const double x = L - T_W[r];
      room_W[r] = x > 0.0 ? x : 0.0;  // max(0.0, L - T)
    }
    order.clear();
    for (int64_t r = 0; r < W; ++r)
      if (start_W[r] < L) order.push_back(r);
    sort_ranks(order, T_W, false, ws);  // the receivers: by total ascending, then rank
    fresh.clear();
    buf.live.start(static_cast<size_t>(f.N));
    const int64_t moved = matched(f, offers, shed, room_W, order, cost, p, fresh, buf.live);
    std::sort(fresh.begin(), fresh.end());  // the experts with new holders, ascending, once each
    fresh.erase(std::unique(fresh.begin(), fresh.end()), fresh.end());
    for (int64_t g : fresh) f.relay(g);
    if (moved) f.retotal_touched();
    pieces += moved;
    if (fold_sum(f.totals) / static_cast<double>(W) >= p.beat) {  // its max cannot win either
      f.beaten = true;
      break;
    }
    if (*std::max_element(f.totals.begin(), f.totals.end()) > (1.0 - p.min_gain) * top) {
      const bool any_holder = std::any_of(f.holders.begin(), f.holders.end(),
                                          [](const std::vector<int64_t>& h) { return !h.empty(); });
      if (free_copy || !(moved || any_holder)) break;
      free_copy = true;
    }
  }
  return pieces;
}


constexpr int64_t TENSOR_POINTS = 384;  // level_fill.TENSOR_POINTS
constexpr double MIN_GAIN = 0.005;      // level_fill.MIN_GAIN

// level_fill.level_fill's rates from the model, its expressions (Python's int / float converts
// the int to the nearest double first, as static_cast does)
Params params(const Model& m, bool any_remote, const FillSettings& s) {
  const double a = static_cast<double>(m.fpr) / m.gf + m.row_s;
  const double t = any_remote ? static_cast<double>(m.tbr) / m.bw : 0.0;
  const double copy = 2.0 * (static_cast<double>(m.P) / m.bw + m.rep_s);
  // token0 is TOKEN_COLLECTIVES * lat, the fill's ``lat``
  return Params{a, t, m.overlap ? a : 0.0, copy, m.token0, s.stop, MIN_GAIN,
                s.passes, TENSOR_POINTS, s.kept, s.beat};
}

// RangeState.__init__ (range_state.py) from the fields the caller set (sizes, C, model, the
// start holders in any order, the start loads), then level_fill. Returns the pieces moved, or
// -2 when the start is level (no pass runs; the state is the start's: holders, loads, totals,
// rounds, nothing else moved).
int64_t fill_from_start(Fill& f, const int64_t* colsum, const int64_t* own, const Params& p) {
  const size_t N = static_cast<size_t>(f.N), Wz = static_cast<size_t>(f.W);
  f.held.assign(Wz, 0);
  for (auto& h : f.holders) {
    std::sort(h.begin(), h.end());
    for (int64_t y : h) f.held[y] += 1;
  }
  reset_each(f.degrees, N);
  f.rounds = 0;
  if (f.split()) {
    reset_each(f.inter, N);
    f.replica_inter.assign(Wz, 0.0);
  }
  for (size_t g = 0; g < N; ++g) {  // range_state.start_relay (and start_inter across nodes)
    if (f.holders[g].empty()) continue;
    const int64_t o = static_cast<int64_t>(g) / f.E;
    f.rounds = std::max(f.rounds, f.relay_degrees(o, f.holders[g], f.degrees[g]));
    if (!f.split()) continue;
    f.relay_inter(o, f.holders[g], f.inter[g]);  // relay_degrees' groups of these holders
    for (const auto& [r, x] : f.inter[g]) f.replica_inter[r] += x;  // grid values: exact sums
  }
  f.totals.resize(Wz);
  f.retotal();  // StepModel.seconds_W's totals, bit for bit (test_placement_planner_speed.py)
  reset_each(f.amounts, N);
  reset_each(f.kept, N);
  f.overshot.assign(Wz, 0);
  f.beaten = false;
  if (p.passes > 0) {  // level_fill's first test: a start within ``stop`` of its mean moves
    // nothing (the C entry's caller then builds that state in Python: cheaper than the rest)
    const double top = *std::max_element(f.totals.begin(), f.totals.end());
    if (top <= p.stop * (fold_sum(f.totals) / static_cast<double>(f.W))) return -2;
  }
  // range_state.stream_rows: the owner's own rows C[o][g], the rows it computes (the holders'
  // own rows are local at them), the stream's rows from other sources
  f.own.resize(N);
  f.owner_rows.resize(N);
  f.others.resize(N);
  for (size_t g = 0; g < N; ++g) {
    int64_t held_rows = 0;
    for (int64_t y : f.holders[g]) held_rows += f.c(y, static_cast<int64_t>(g));
    // C[o][g], o = g / E: given by the caller (the baseline read it) or read here
    f.own[g] = own ? own[g] : f.c(static_cast<int64_t>(g) / f.E, static_cast<int64_t>(g));
    f.owner_rows[g] = colsum[g] - held_rows;
    f.others[g] = f.owner_rows[g] - f.own[g];
  }
  f.taken.assign(N, 0);
  reset_each(f.helped, Wz);
  return run(f, p);
}

// ranges._cut: the amounts [(helper, rows)] as cuts of the stream whose segments start at
// `starts` (its end last): each cumulative cut to the nearest allowed position (a segment's
// start or end, or whole blocks into it; ties: the lower), capped at the end, never going back;
// ranges left with 0 rows dropped
Entries cut(const std::vector<int64_t>& starts, const Entries& amounts, int64_t blk) {
  const int64_t end = starts.back();
  const size_t last = starts.size() - 1;
  Entries out;
  out.reserve(amounts.size());  // one range at most per amount
  int64_t at = 0, want = 0;
  for (const auto& [y, n] : amounts) {
    want += n;
    int64_t q = std::min(want, end);
    // bisect_right(starts, q) - 1: the segment q falls in (or starts at); starts ascend strictly
    const size_t k = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), q) -
                                         starts.begin()) - 1;
    if (k < last) {  // inside the stream: rounded
      const int64_t off = q - starts[k];  // >= 0: Python's // is C++'s / here
      const int64_t down = off / blk * blk;  // the whole block below, or the segment's start
      const int64_t up = std::min(starts[k + 1] - starts[k], down + blk);  // block or end
      q = starts[k] + (off - down <= up - off ? down : up);
    }
    q = std::max(q, at);
    if (q > at) out.emplace_back(y, q - at);
    at = q;
  }
  return out;
}

// One expert's stream as plan_fields walks it (ranges.stream_sources, _prefix): its segments'
// starts so far, and where it is in its sorted holders and kept holders
struct Stream {
  int64_t g, o, want;  // the expert, its owner, its amounts' sum (the last cut's most)
  const std::vector<int64_t>* holders;
  size_t next_holder = 0;
  FlatMap<int64_t>::const_iterator next_kept, kept_end;
  std::vector<int64_t> starts{0};
};

// plan_fields' block of rows [s0, s1) of the active experts' columns into chunk (chunk[a * rows
// + s - s0] = C[s][g] of active expert a) with the plan's column prefixes: the rows a prefix
// holds copied from it, the others read off C row by row and appended to it. A prefix only
// grows contiguously (it reaches s0 here: the walk extends it block by block from row 0; one
// that did not would be read past, never appended to).
// plan_fields' buffers, one set per thread, kept plan after plan (W = 1024: ~10**2 streams of
// ~600 starts each, grown by push_back, and a 60 KB chunk a plan); reached through a call
// (run_buffers' reason)
struct FieldBuffers {
  std::vector<Stream> pool;  // the streams (the first n_streams in use)
  std::vector<Stream*> active;  // the streams still walking
  std::vector<int64_t> chunk;  // a block of rows of the active experts' columns
  std::vector<std::pair<size_t, int64_t>> todo;  // read_block's (a, the first row to read)
};

[[gnu::noinline]] FieldBuffers& field_buffers() {
  thread_local FieldBuffers buffers;
  return buffers;
}

void read_block(const Fill& f, const std::vector<Stream*>& active, int64_t s0, int64_t s1,
                int64_t rows, std::vector<int64_t>& chunk,
                std::vector<std::pair<size_t, int64_t>>& todo) {
  ColumnPrefix& prefix = *f.prefix;
  todo.clear();
  for (size_t a = 0; a < active.size(); ++a) {
    const int64_t g = active[a]->g, len = prefix.len(g);
    const int64_t have = std::clamp(len, s0, s1);  // the prefix holds rows [s0, have)
    if (have > s0) std::copy(prefix.data(g) + s0, prefix.data(g) + have, &chunk[a * rows]);
    if (have < s1) todo.emplace_back(a, have);
  }
  if (todo.empty()) return;
  for (int64_t s = s0; s < s1; ++s) {  // (C row-major: plan_fields walks C by columns itself)
    const int64_t* row = f.C + s * f.N;
    if (s + COLUMN_AHEAD < f.W)
      for (const auto& [a, from] : todo)
        prefetch_count(f.C, f.layout, s + COLUMN_AHEAD, active[a]->g);
    for (const auto& [a, from] : todo)
      if (s >= from) chunk[a * rows + (s - s0)] = row[active[a]->g];
  }
  for (const auto& [a, from] : todo) {
    std::vector<int64_t>& col = prefix.column(active[a]->g);
    if (static_cast<int64_t>(col.size()) == from)  // rows [0, from) held: extend it
      col.insert(col.end(), &chunk[a * rows + (from - s0)], &chunk[a * rows + (s1 - s0)]);
  }
}

// RangeState.plan_fields: the holders (Plan.replicas; hot is their experts), the kept holders'
// local rows rounded down to whole blocks (Plan.kept), and each expert's positive amounts by
// helper rank cut into ranges (ranges.cut_ranges_many: stream_sources, _prefix, _cut; an
// expert whose cuts all come out empty has no entry). The streams' segments are read down each
// expert's column where C is stored by columns (consecutive counts), else off C row by row,
// every expert at once (a column read down row-major C touches a new line per count: W = 1024
// zipf ~12 ns a count, memory-bound). An expert's walk stops once its segments pass its
// amounts' sum: every cut then falls inside a segment walked (_cut's arithmetic is the same on
// the shorter stream: no cut reaches its end; W = 1024 zipf: ~60% of the columns read).
void plan_fields(const Fill& f, Replicas& replicas, ExpertEntries& ranges, ExpertEntries& kept) {
  replicas.clear();
  ranges.clear();
  kept.clear();
  const int64_t blk = f.blk, W = f.W;
  // the experts with a positive amount: their ranges to cut (the streams, their starts, the
  // active list and the chunk in this thread's buffers)
  FieldBuffers& buf = field_buffers();
  std::vector<Stream>& pool = buf.pool;
  std::vector<Stream*>& active = buf.active;
  std::vector<int64_t>& chunk = buf.chunk;
  size_t n_streams = 0;
  for (int64_t g = 0; g < f.N; ++g) {
    if (!f.holders[g].empty()) replicas.emplace_back(g, f.holders[g]);
    const auto& kg = f.kept[g];  // {y: local rows}, each below C[y][g]
    if (!kg.empty()) {
      Entries blocks;
      for (const auto& [y, n] : kg) blocks.emplace_back(y, n / blk * blk);  // n >= 0: n // blk
      kept.emplace_back(g, std::move(blocks));
    }
    int64_t want = 0;
    for (const auto& [y, n] : f.amounts[g]) want += n > 0 ? n : 0;
    if (want > 0) {
      if (n_streams == pool.size()) pool.emplace_back();
      Stream& st = pool[n_streams++];
      st.g = g, st.o = g / f.E, st.want = want, st.holders = &f.holders[g];
      st.next_holder = 0, st.next_kept = kg.begin(), st.kept_end = kg.end();
      st.starts.assign(1, 0);  // keeps its buffer
    }
  }
  // the stream: sources with rows, neither the owner nor a holder (a kept holder stays, its
  // rest C[y][g] - local blocks), ascending; the owner last. Each expert walks its column's
  // rows [s0, s1) (col[s] = C[s][g]), and stops once past its amounts; false then
  const auto walk = [blk](Stream& st, const int64_t* col, int64_t s0, int64_t s1) {
    const auto& h = *st.holders;  // ascending: advanced with s
    for (int64_t s = s0; s < s1 && st.starts.back() <= st.want; ++s) {
      const int64_t c = col[s];
      if (c == 0 || s == st.o) continue;
      while (st.next_holder < h.size() && h[st.next_holder] < s) ++st.next_holder;
      if (st.next_holder == h.size() || h[st.next_holder] != s) {
        st.starts.push_back(st.starts.back() + c);
      } else {  // a holder: in the stream only when kept (ascending too)
        while (st.next_kept != st.kept_end && st.next_kept->first < s) ++st.next_kept;
        if (st.next_kept != st.kept_end && st.next_kept->first == s)
          st.starts.push_back(st.starts.back() + c - st.next_kept->second / blk * blk);
      }
    }
    return st.starts.back() <= st.want;
  };
  active.clear();
  if (f.layout.by_column) {  // each column's counts in order, in C (no prefix to keep)
    for (size_t i = 0; i < n_streams; ++i)
      if (walk(pool[i], f.C + f.layout.at(0, pool[i].g), 0, W)) active.push_back(&pool[i]);
  } else {  // C's rows ROWS at a time: the active experts' counts gathered row by row into
    // chunk (chunk[a * ROWS + s - s0]: C[s][g] of active expert a), then each walks its part
    for (size_t i = 0; i < n_streams; ++i) active.push_back(&pool[i]);
  }
  constexpr int64_t ROWS = 64;
  if (chunk.size() < active.size() * ROWS) chunk.resize(active.size() * ROWS);
  for (int64_t s0 = 0; s0 < W && !active.empty() && !f.layout.by_column; s0 += ROWS) {
    const int64_t s1 = std::min(W, s0 + ROWS);
    if (f.prefix == nullptr) {
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t* row = f.C + s * f.N;
        if (s + COLUMN_AHEAD < W)
          for (const Stream* st : active) prefetch_count(f.C, f.layout, s + COLUMN_AHEAD, st->g);
        for (size_t a = 0; a < active.size(); ++a) chunk[a * ROWS + (s - s0)] = row[active[a]->g];
      }
    } else {
      read_block(f, active, s0, s1, ROWS, chunk, buf.todo);
    }
    size_t keep = 0;
    for (size_t a = 0; a < active.size(); ++a)  // col[s] = C[s][g]; false: walked far enough
      if (walk(*active[a], chunk.data() + a * ROWS - s0, s0, s1)) active[keep++] = active[a];
    active.resize(keep);
  }
  for (Stream* st : active) {  // walked every source: the owner's own rows close the stream
    const int64_t own = f.c(st->o, st->g);
    if (own) st->starts.push_back(st->starts.back() + own);
  }
  Entries amounts;
  for (size_t i = 0; i < n_streams; ++i) {
    const Stream& st = pool[i];
    amounts.clear();
    for (const auto& [y, n] : f.amounts[st.g])  // ascending helper rank
      if (n > 0) amounts.emplace_back(y, n);
    Entries pieces = cut(st.starts, amounts, blk);
    if (!pieces.empty()) ranges.emplace_back(st.g, std::move(pieces));
  }
}

// The caller's start: holders per expert and the loads (rows, local, remote truncated to ints
// as .to(int64) does, replica copies as doubles)
void set_start(Fill& f, const Counts& k, const Model& m, bool any_remote, int64_t slots,
               int64_t blk, int64_t per_node) {
  f.W = k.W;
  f.E = k.E;
  f.N = k.N;
  f.C = k.C;
  f.layout = k.layout();
  f.prefix = k.prefix;
  f.m = m;
  f.any_remote = any_remote;
  f.slots = slots;
  f.blk = blk;
  f.per_node = per_node;
  f.bw_near = f.bw_far = 0.0;  // one link for the copies unless the caller sets both
  reset_each(f.holders, static_cast<size_t>(k.N));
}

// plan_fields of a state given by its holders, amounts and kept holders' local rows (entries
// by ascending g and rank): ranges and kept (replicas: the holders as they are)
void plan_from(const Counts& k, int64_t blk, const Replicas& holders, const ExpertEntries& amounts,
               const ExpertEntries& kept_local, ExpertEntries& ranges, ExpertEntries& kept) {
  Fill& f = thread_fill();  // the fills' state, done with: its per-expert buffers reused
  f.W = k.W, f.E = k.E, f.N = k.N, f.blk = blk, f.C = k.C, f.prefix = k.prefix;
  f.layout = k.layout();
  const size_t N = static_cast<size_t>(k.N);
  reset_each(f.holders, N);
  reset_each(f.amounts, N);
  reset_each(f.kept, N);
  for (const auto& [g, hs] : holders) f.holders[g] = hs;
  for (const auto& [g, e] : amounts) f.amounts[g].assign(e.begin(), e.end());
  for (const auto& [g, e] : kept_local) f.kept[g].assign(e.begin(), e.end());
  Replicas replicas;
  plan_fields(f, replicas, ranges, kept);
}

ExpertEntries entries_of(const std::vector<FlatMap<int64_t>>& per_g) {
  ExpertEntries out;
  out.reserve(static_cast<size_t>(
      std::count_if(per_g.begin(), per_g.end(), [](const auto& m) { return !m.empty(); })));
  for (size_t g = 0; g < per_g.size(); ++g)
    if (!per_g[g].empty())
      out.emplace_back(static_cast<int64_t>(g), Entries(per_g[g].begin(), per_g[g].end()));
  return out;
}

}  // namespace

namespace mixmoe_native {

void fill_plan(const Counts& counts, int64_t blk, FillOut& out) {
  plan_from(counts, blk, out.replicas, out.amounts, out.kept_local, out.ranges, out.kept);
}

FillOut level_fill(const Counts& counts, const std::vector<int64_t>& colsum,
                   const std::vector<int64_t>& own, const Model& model, const Replicas& start,
                   bool any_remote, const Loads& start_loads, const FillSettings& settings) {
  // one Fill per thread, reused fill after fill and plan after plan: its per-expert and
  // per-rank maps keep their buffers (W = 64 zipf: ~1000 of a plan's ~1400 allocations were
  // theirs); every field is set again below (set_start, fill_from_start)
  Fill& f = thread_fill();
  set_start(f, counts, model, any_remote, settings.slots, settings.blk, settings.per_node);
  if (settings.per_node > 0) f.bw_near = settings.bw_near, f.bw_far = settings.bw_far;
  for (const auto& [g, hs] : start) f.holders[g] = hs;
  f.rows = start_loads.rows;
  f.local = start_loads.local;
  f.remote = start_loads.remote;
  f.replica = start_loads.replica;
  FillOut out;
  out.moves = fill_from_start(f, colsum.data(), own.empty() ? nullptr : own.data(),
                              params(model, any_remote, settings));
  out.loads = Loads{std::move(f.rows), std::move(f.local), std::move(f.remote),
                    std::move(f.replica)};
  out.totals = std::move(f.totals);
  out.rounds = f.rounds;
  out.overshot = std::move(f.overshot);
  out.beaten = f.beaten;
  out.amounts = entries_of(f.amounts);
  out.kept_local = entries_of(f.kept);
  if (settings.plan) {
    plan_fields(f, out.replicas, out.ranges, out.kept);
  } else {
    for (int64_t g = 0; g < f.N; ++g)
      if (!f.holders[g].empty()) out.replicas.emplace_back(g, f.holders[g]);  // f keeps its buffer
  }
  return out;
}

}  // namespace mixmoe_native
namespace {

// One output section of the C entry, by columns (Python reads each column with one slice):
// the experts with entries [g_1..g_m], their entry counts [k_1..k_m], then the entries in
// order, each `width` ints (ranks; or (rank, n) pairs)
struct Section {
  std::vector<int64_t> g, k, values;
  void add(int64_t expert, size_t count) {
    g.push_back(expert);
    k.push_back(static_cast<int64_t>(count));
  }
  size_t size() const { return g.size() + k.size() + values.size(); }
  int64_t* put(int64_t* o) const {
    o = std::copy(g.begin(), g.end(), o);
    o = std::copy(k.begin(), k.end(), o);
    return std::copy(values.begin(), values.end(), o);
  }
};

Section ranks_section(const std::vector<std::vector<int64_t>>& per_g) {
  Section s;
  for (size_t g = 0; g < per_g.size(); ++g)
    if (!per_g[g].empty()) {
      s.add(static_cast<int64_t>(g), per_g[g].size());
      s.values.insert(s.values.end(), per_g[g].begin(), per_g[g].end());
    }
  return s;
}

Section pairs_section(const std::vector<FlatMap<int64_t>>& per_g) {
  Section s;
  for (size_t g = 0; g < per_g.size(); ++g)
    if (!per_g[g].empty()) {
      s.add(static_cast<int64_t>(g), per_g[g].size());
      for (const auto& [y, n] : per_g[g]) s.values.push_back(y), s.values.push_back(n);
    }
  return s;
}

Section entries_section(const ExpertEntries& entries) {
  Section s;
  for (const auto& [g, e] : entries) {
    s.add(g, e.size());
    for (const auto& [y, n] : e) s.values.push_back(y), s.values.push_back(n);
  }
  return s;
}

}  // namespace

extern "C" {

// One fill from the start RangeState.__init__ builds (range_state.py), then the passes (the
// state's plan fields: mixmoe_level_fill_plan, for the one fill the planner keeps).
// Inputs: C (int64 [W, N]), colsum (int64 [N], C's column sums), loads (float64 [4, W]: the start
// plan's rows, local, remote, replica), start (the start holders: m experts [g_1..g_m], their
// holder counts [k_1..k_m], then the holders, k_1 of g_1 first; any order within each),
//   ints:  W, E, slots, blk, per_node, any_remote, passes, kept, fpr, tbr, P,
//          weight_collectives, overlap, m;
//   reals: gf, bw, row_s, fixed_s, rep_s, token0, lat (common.h's Model), stop, bw_near, bw_far
//          (FillSettings': 0.0, one link for the copies; read with per_node > 0 only), beat.
// Outputs, out_i (int64, cap_i of them), in this order:
//   a header of 10: rounds, the number of overshot ranks, then (m, length) of each section;
//   per rank [W] each: held, rows, local, remote; the overshot ranks ascending;
//   per expert [N] each: owner_rows, own, others, taken;
//   four sections (Section: by columns, ascending g): holders (ranks; plan_fields' replicas
//   too), amounts and kept ((rank, n) pairs), degrees (ranks; their copies in out_d, in order);
// out_d (float64, cap_d): replica [W], totals [W], the degrees' copies.
// Returns the pieces moved; -2 when the start is level already (no pass runs: nothing is
// written); -4 when the fill is beaten (its mean reached beat: nothing is written); -1 when
// out_i or out_d is too small: out_i[0], out_i[1] then say the sizes needed
// (cap_i >= 2, else nothing is written).
int64_t mixmoe_level_fill(const int64_t* C, const int64_t* colsum, const double* loads,
                          const int64_t* start, const int64_t* ints, const double* reals,
                          int64_t* out_i, int64_t cap_i, double* out_d, int64_t cap_d) {
  const Counts k{ints[0], ints[1], ints[0] * ints[1], C};
  const Model m = Model::from(ints + 8, reals);  // ints 8-12, reals 0-6: common.h's order
  FillSettings s{ints[2], ints[3], ints[6], reals[7], ints[7] != 0};
  s.beat = reals[10];
  Fill f;
  set_start(f, k, m, ints[5] != 0, s.slots, s.blk, ints[4]);
  if (ints[4] > 0) f.bw_near = reals[8], f.bw_far = reals[9];  // 0.0: one link for the copies
  const int64_t groups = ints[13];
  const int64_t* ys = start + 2 * groups;  // the holders, group after group
  for (int64_t i = 0; i < groups; ++i) {
    auto& h = f.holders[start[i]];
    h.insert(h.end(), ys, ys + start[groups + i]);
    ys += start[groups + i];
  }
  const size_t N = static_cast<size_t>(k.N), W = static_cast<size_t>(k.W);
  f.rows.resize(W);
  f.local.resize(W);
  f.remote.resize(W);
  for (size_t r = 0; r < W; ++r) {  // the loads as float64: whole numbers, truncated as .to(int64)
    f.rows[r] = static_cast<int64_t>(loads[r]);
    f.local[r] = static_cast<int64_t>(loads[W + r]);
    f.remote[r] = static_cast<int64_t>(loads[2 * W + r]);
  }
  f.replica.assign(loads + 3 * W, loads + 4 * W);
  const int64_t pieces = fill_from_start(f, colsum, nullptr, params(m, f.any_remote, s));
  if (pieces == -2) return -2;
  if (f.beaten) return -4;  // the planner drops it: nothing written
  Section degrees;
  std::vector<double> copies;
  for (size_t g = 0; g < N; ++g)
    if (!f.degrees[g].empty()) {
      degrees.add(static_cast<int64_t>(g), f.degrees[g].size());
      for (const auto& [r, v] : f.degrees[g]) degrees.values.push_back(r), copies.push_back(v);
    }
  const Section sections[4] = {ranks_section(f.holders), pairs_section(f.amounts),
                               pairs_section(f.kept), degrees};
  size_t n_over = 0;
  for (char x : f.overshot) n_over += x != 0;
  size_t need = 10 + 4 * W + n_over + 4 * N;
  for (const Section& sec : sections) need += sec.size();
  const size_t need_d = 2 * W + copies.size();
  if (need > static_cast<size_t>(cap_i) || need_d > static_cast<size_t>(cap_d)) {
    if (cap_i >= 2) out_i[0] = static_cast<int64_t>(need), out_i[1] = static_cast<int64_t>(need_d);
    return -1;
  }
  int64_t* o = out_i;
  *o++ = f.rounds;
  *o++ = static_cast<int64_t>(n_over);
  for (const Section& sec : sections)
    *o++ = static_cast<int64_t>(sec.g.size()), *o++ = static_cast<int64_t>(sec.size());
  for (const auto* v : {&f.held, &f.rows, &f.local, &f.remote}) o = std::copy(v->begin(), v->end(), o);
  for (size_t r = 0; r < W; ++r)
    if (f.overshot[r]) *o++ = static_cast<int64_t>(r);
  for (const auto* v : {&f.owner_rows, &f.own, &f.others, &f.taken})
    o = std::copy(v->begin(), v->end(), o);
  for (const Section& sec : sections) o = sec.put(o);
  double* od = std::copy(f.replica.begin(), f.replica.end(), out_d);
  od = std::copy(f.totals.begin(), f.totals.end(), od);
  std::copy(copies.begin(), copies.end(), od);
  return pieces;
}

// RangeState.plan_fields' ranges and kept of the state mixmoe_level_fill left: C (int64 [W, N]),
// ints [W, E, blk, then (m, length) of the holders, amounts and kept sections], `sections`: those
// three sections as mixmoe_level_fill wrote them (one after the other). Writes out_i: a header
// of 4, (m, length) of the ranges and of the kept sections, then both (Section, (rank, n)
// pairs). Returns 0; -1 when cap_i is too small (the amounts' and kept's lengths plus 4 suffice).
int64_t mixmoe_level_fill_plan(const int64_t* C, const int64_t* ints, const int64_t* sections,
                               int64_t* out_i, int64_t cap_i) {
  const Counts k{ints[0], ints[1], ints[0] * ints[1], C};
  Replicas holders;
  ExpertEntries amounts, kept_local;
  const int64_t* at = sections;
  for (int part = 0; part < 3; ++part) {  // holders, amounts, kept: by columns (Section)
    const int64_t m = ints[3 + 2 * part], length = ints[4 + 2 * part];
    const int64_t* values = at + 2 * m;  // past the experts [m] and their counts [m]
    for (int64_t i = 0; i < m; ++i) {
      const int64_t g = at[i], n = at[m + i];
      if (part == 0) {
        holders.emplace_back(g, std::vector<int64_t>(values, values + n));
        values += n;
        continue;
      }
      Entries e;
      for (int64_t j = 0; j < n; ++j, values += 2) e.emplace_back(values[0], values[1]);
      (part == 1 ? amounts : kept_local).emplace_back(g, std::move(e));
    }
    at += length;
  }
  ExpertEntries ranges, kept;
  plan_from(k, ints[2], holders, amounts, kept_local, ranges, kept);
  const Section out[2] = {entries_section(ranges), entries_section(kept)};
  if (4 + out[0].size() + out[1].size() > static_cast<size_t>(cap_i)) return -1;
  int64_t* o = out_i;
  for (const Section& sec : out)
    *o++ = static_cast<int64_t>(sec.g.size()), *o++ = static_cast<int64_t>(sec.size());
  for (const Section& sec : out) o = sec.put(o);
  return 0;
}

// level for the twin tests: W ranks' T, avail (int64), save, start (float64; INF: not a
// receiver), fresh (int64, 0 or 1), the receivers' one cost (run's cost_W: every rank's the
// same, its sum folded left to right), copy, and the points from which the tensor walk runs
// (level_fill.TENSOR_POINTS) -> the level, as run computes it.
double mixmoe_level(const double* T, const int64_t* avail, const double* save,
                    const double* start, const int64_t* fresh, int64_t W, double cost,
                    double copy, int64_t tensor_points) {
  const size_t Wz = static_cast<size_t>(W);
  const std::vector<double> cost_W(Wz, cost);
  std::vector<char> fresh_W(Wz);
  for (size_t r = 0; r < Wz; ++r) fresh_W[r] = fresh[r] != 0;
  LevelScratch ws;
  return level(std::vector<double>(T, T + W), std::vector<int64_t>(avail, avail + W),
               std::vector<double>(save, save + W), std::vector<double>(start, start + W), cost,
               fold_sum(cost_W), fresh_W, copy, static_cast<size_t>(tensor_points), ws);
}

// mixmoe_native::level_fill for the twin tests: the C entry's inputs (per_node 0: one link), and
// the FillOut in out_i (int64, cap_i): moves, rounds, the (m, length) of the replicas, ranges and
// kept sections, then per rank [W] rows, local, remote, overshot (0/1), then the three sections
// (as the C entry's); out_d (float64, 2W): replica, totals. Every field is written, -2 (a level
// start: the start's fields) included. Returns moves (-4 when FillOut.beaten, the fields
// written); -1 when a buffer is too small; -3 when level_fill with settings.plan false then
// fill_plan gives other plan fields.
int64_t mixmoe_level_fill_out(const int64_t* C, const int64_t* colsum, const double* loads,
                              const int64_t* start, const int64_t* ints, const double* reals,
                              int64_t* out_i, int64_t cap_i, double* out_d, int64_t cap_d) {
  const Counts k{ints[0], ints[1], ints[0] * ints[1], C};
  const Model m = Model::from(ints + 8, reals);
  FillSettings s{ints[2], ints[3], ints[6], reals[7], ints[7] != 0};
  s.beat = reals[10];
  const size_t W = static_cast<size_t>(k.W);
  Replicas holders;  // the start as the driver passes it: (g, ranks) by ascending g
  const int64_t groups = ints[13];
  const int64_t* ys = start + 2 * groups;
  for (int64_t i = 0; i < groups; ++i) {  // start[groups + i]: expert start[i]'s holder count
    holders.emplace_back(start[i], std::vector<int64_t>(ys, ys + start[groups + i]));
    ys += start[groups + i];
  }
  std::sort(holders.begin(), holders.end());
  Loads base;
  for (size_t r = 0; r < W; ++r) {
    base.rows.push_back(static_cast<int64_t>(loads[r]));
    base.local.push_back(static_cast<int64_t>(loads[W + r]));
    base.remote.push_back(static_cast<int64_t>(loads[2 * W + r]));
    base.replica.push_back(loads[3 * W + r]);
  }
  std::vector<int64_t> sums(colsum, colsum + k.N);
  const FillOut out = level_fill(k, sums, {}, m, holders, ints[5] != 0, base, s);
  FillSettings later = s;  // the plan fields left to fill_plan: the same entries (else -3)
  later.plan = false;
  FillOut lazy = level_fill(k, sums, {}, m, holders, ints[5] != 0, base, later);
  if (!lazy.ranges.empty() || !lazy.kept.empty()) return -3;
  fill_plan(k, s.blk, lazy);
  if (lazy.replicas != out.replicas || lazy.ranges != out.ranges || lazy.kept != out.kept)
    return -3;
  Section replicas;
  for (const auto& [g, hs] : out.replicas) {
    replicas.add(g, hs.size());
    replicas.values.insert(replicas.values.end(), hs.begin(), hs.end());
  }
  const Section sections[3] = {replicas, entries_section(out.ranges), entries_section(out.kept)};
  size_t need = 8 + 4 * W;
  for (const Section& sec : sections) need += sec.size();
  if (need > static_cast<size_t>(cap_i) || 2 * W > static_cast<size_t>(cap_d)) return -1;
  int64_t* o = out_i;
  *o++ = out.moves;
  *o++ = out.rounds;
  for (const Section& sec : sections)
    *o++ = static_cast<int64_t>(sec.g.size()), *o++ = static_cast<int64_t>(sec.size());
  for (const auto* v : {&out.loads.rows, &out.loads.local, &out.loads.remote})
    o = std::copy(v->begin(), v->end(), o);
  for (char x : out.overshot) *o++ = x;
  for (const Section& sec : sections) o = sec.put(o);
  std::copy(out.loads.replica.begin(), out.loads.replica.end(), out_d);
  std::copy(out.totals.begin(), out.totals.end(), out_d + W);
  return out.beaten ? -4 : out.moves;
}

}  // extern "C"
