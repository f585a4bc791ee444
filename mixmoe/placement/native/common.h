// What every compiled part of the planner shares: Python's arithmetic rules, the cost model's
// per-rank seconds, and the shapes of counts, loads and holders.
//
// Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (row-major int64,
// C[s*N + g] = rows rank s routes to expert g; g's owner is g / E; or stored by columns where a
// part reads it through Counts / Layout, below). Loads in LOADS order
// (mixmoe.placement.cost_model): rows computed, local rows, remote rows, replica copies.
//
// Each part runs the same integer arithmetic and the same float expressions in the same order as
// its Python twin, so it returns the Python's values bit for bit: Python ints times ints are exact
// (here __int128 products, rounded once to double as Python's int / float rounds them), and the
// library is built with -ffp-contract=off (no fused multiply-add: Python rounds every product).
// All parts build into one library (mixmoe/placement/native_lib.py), each with its own C entry
// point; what the parts call of each other is declared in a header of the part's name.

#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace mixmoe_native {

constexpr int COPY_GRID_BITS = 24;  // relay.COPY_GRID_BITS
constexpr double INF = std::numeric_limits<double>::infinity();

// Python's int(v) for the finite doubles the planner converts, saturated at +-2**62 (every amount
// it meets with min() is far below: the saturated value never wins a min).
inline int64_t to_int(double v) {
  if (v >= 4.6e18) return int64_t(1) << 62;
  if (v <= -4.6e18) return -(int64_t(1) << 62);
  return static_cast<int64_t>(v);  // truncates toward zero, as int() does
}

// Python's (n * k) / d with ints n, k and a float d: the exact product, rounded once.
inline double mul_div(int64_t n, int64_t k, double d) {
  int64_t p;  // the product in int64 when it fits: the same nearest double, without the
  if (!__builtin_mul_overflow(n, k, &p)) return static_cast<double>(p) / d;  // 128-bit convert
  return static_cast<double>(static_cast<__int128>(n) * k) / d;
}

// relay._grid: n / d copies floored to a multiple of 2**-24.
inline double grid(int64_t n, int64_t d) {
  return static_cast<double>((n << COPY_GRID_BITS) / d) /
         static_cast<double>(int64_t(1) << COPY_GRID_BITS);
}

// relay.relay_degrees / relay_inter_copies of one far node's c holders, of the R far holders on
// L far nodes (R >= 2): holders 0 .. extra - 1 of the node take `high` copies (`high_in` of them
// crossing nodes), the rest `low` (`low_in`); the closed form of relay.py's module doc.
struct FarCopies {
  int64_t extra;
  double low, high, low_in, high_in;
};

inline FarCopies far_copies(int64_t R, int64_t L, int64_t c) {
  const int64_t extra = (R - c) % c, q = (R - c) / c;
  const double sent = grid(L - 1, R);  // the exchange: L - 1 chunks sent across
  const double low = 1.0 + grid(L - 1 + (1 + q) * (c - 1), R);
  const double low_in = grid(1 + q, R) + sent;
  return {extra, low, extra ? 1.0 + grid(L - 1 + (2 + q) * (c - 1), R) : low, low_in,
          extra ? grid(2 + q, R) + sent : low_in};
}

// StepModel.seconds_fn / total_fn's terms (cost_model.py). The Python side packs them with
// native_lib.model_args: ints [fpr, tbr, P, weight_collectives, overlap],
// reals [gf, bw, row_s, fixed_s, rep_s, token0 (TOKEN_COLLECTIVES * lat), lat].
struct Model {
  int64_t fpr, tbr, P, weight_collectives;
  bool overlap;
  double gf, bw, row_s, fixed_s, rep_s, token0, lat;

  static Model from(const int64_t* ints, const double* reals) {
    return Model{ints[0], ints[1], ints[2], ints[3], ints[4] != 0,
                 reals[0], reals[1], reals[2], reals[3], reals[4], reals[5], reals[6]};
  }

  // StepModel.seconds_fn(any_remote, rounds)(rows, local, remote, replica): (compute, comm).
  // rounds: the weight collectives' rounds (0: no replica anywhere; Python's True is 1).
  // replica: whole copies or the relay's fractional ones (exact in a double either way).
  std::pair<double, double> seconds(int64_t rows, int64_t local, int64_t remote, double replica,
                                    bool any_remote, int64_t rounds) const {
    double compute = mul_div(rows, fpr, gf);
    if (row_s != 0.0) compute = compute + static_cast<double>(rows) * row_s;
    if (fixed_s != 0.0) compute = compute + fixed_s;
    double token = 0.0;
    if (any_remote) {
      token = token0 + mul_div(remote, tbr, bw);
      if (overlap) {
        double hidden = mul_div(local, fpr, gf);
        if (row_s != 0.0) hidden = hidden + static_cast<double>(local) * row_s;
        const double x = token - hidden;
        token = x > 0.0 ? x : 0.0;  // max(0.0, x)
      }
    }
    double weight = 0.0;
    if (rounds != 0) {
      const double weight0 = static_cast<double>(weight_collectives * rounds) * lat;
      weight = weight0 + static_cast<double>(P) * replica / bw;
      if (rep_s != 0.0) weight = weight + replica * rep_s;
    }
    return {compute, token + weight};
  }

  // StepModel.split_total_fn(any_remote, rounds)(rows, local, remote, replica, replica_inter):
  // a fill's total across nodes, the rows on this (blended) link, `replica_inter` of the copies
  // at bw_far and the rest at bw_near, as seconds_W's replica term (and in its order).
  double total_split(int64_t rows, int64_t local, int64_t remote, double replica,
                     double replica_inter, double bw_near, double bw_far, bool any_remote,
                     int64_t rounds) const {
    const auto [compute, token] = seconds(rows, local, remote, 0.0, any_remote, 0);
    double weight = 0.0;
    if (rounds != 0) {
      const double weight0 = static_cast<double>(weight_collectives * rounds) * lat;
      const double Pd = static_cast<double>(P);
      weight = weight0 + ((replica - replica_inter) * Pd / bw_near + replica_inter * Pd / bw_far);
      if (rep_s != 0.0) weight = weight + replica * rep_s;
    }
    return compute + (token + weight);
  }

  // StepModel.seconds_W of one rank's 6-row loads (a profile with a topology): `remote_inter`
  // rows and `replica_inter` copies of remote / replica cross nodes, at `bw_inter`
  // (StepModel.bw_inter); the rest at bw. seconds_W's tensor expressions, in its order: the
  // remote term (remote - r_in) * tb / bw + r_in * tb / bwi (each product of two exact doubles
  // rounded once, as mul_div rounds it), the replica term likewise with P.
  std::pair<double, double> seconds_nodes(int64_t rows, int64_t local, int64_t remote,
                                          double replica, int64_t remote_inter,
                                          double replica_inter, double bw_inter,
                                          bool any_remote, int64_t rounds) const {
    double compute = mul_div(rows, fpr, gf);
    double hidden = mul_div(local, fpr, gf);
    const double remote_s = mul_div(remote - remote_inter, tbr, bw) +
                            mul_div(remote_inter, tbr, bw_inter);
    // replica - replica_inter: two 2**-24 grid values (exact difference)
    const double replica_s = (replica - replica_inter) * static_cast<double>(P) / bw +
                             replica_inter * static_cast<double>(P) / bw_inter;
    if (row_s != 0.0) {
      compute = compute + static_cast<double>(rows) * row_s;
      hidden = hidden + static_cast<double>(local) * row_s;
    }
    if (fixed_s != 0.0) compute = compute + fixed_s;
    double token = 0.0;
    if (any_remote) {
      token = token0 + remote_s;
      if (overlap) {
        const double x = token - hidden;
        token = x > 0.0 ? x : 0.0;  // clamp_min(0.0)
      }
    }
    if (rounds == 0) return {compute, token + 0.0};
    double weight = static_cast<double>(weight_collectives * rounds) * lat + replica_s;
    if (rep_s != 0.0) weight = weight + replica * rep_s;
    return {compute, token + weight};
  }

  // StepModel.total_fn(any_remote, rounds)(...): compute + comm, as Python adds them.
  double total(int64_t rows, int64_t local, int64_t remote, double replica, bool any_remote,
               int64_t rounds) const {
    const auto [compute, comm] = seconds(rows, local, remote, replica, any_remote, rounds);
    return compute + comm;
  }
};

// The prefixes of C's columns one plan has read down so far: expert g's counts C[0..len(g))[g],
// contiguous. A walk down a column of C touches a cache line per count; with a topology each
// fill's plan fields and its pricing's crossings walk the same hot experts' columns, fill after
// fill, so the plan fields keep what they read here and every later walk reads it back
// (plan_mix.cpp owns one per thread, reset for each plan; nothing else sets Counts.prefix).
class ColumnPrefix {
 public:
  void reset(int64_t N) {
    slot_.assign(static_cast<size_t>(N), -1);
    used_ = 0;
  }
  int64_t len(int64_t g) const {
    const int64_t k = slot_[static_cast<size_t>(g)];
    return k < 0 ? 0 : static_cast<int64_t>(cols_[static_cast<size_t>(k)].size());
  }
  const int64_t* data(int64_t g) const {  // len(g) > 0
    return cols_[static_cast<size_t>(slot_[static_cast<size_t>(g)])].data();
  }
  std::vector<int64_t>& column(int64_t g) {  // g's prefix, to extend (push_back)
    int64_t& k = slot_[static_cast<size_t>(g)];
    if (k < 0) {
      if (used_ == cols_.size()) cols_.emplace_back();  // buffers kept plan after plan
      k = static_cast<int64_t>(used_++);
      cols_[static_cast<size_t>(k)].clear();
    }
    return cols_[static_cast<size_t>(k)];
  }

 private:
  std::vector<int64_t> slot_;  // per expert: its column's index in cols_, -1: none read
  std::vector<std::vector<int64_t>> cols_;
  size_t used_ = 0;
};

// Column walks down C read a count per cache line, lines N * 8 bytes apart, which the
// hardware's prefetchers do not follow: the walks prefetch the counts COLUMN_AHEAD rows ahead
// (C fresh from the device is in memory, not in the caches).
constexpr int64_t COLUMN_AHEAD = 8;

// Where C[s][g] lies in C's storage: row-major (C[s * N + g]), or by columns (C[g * W + s]: the
// layer's counts from an accelerator, transposed there, so that a walk down a column reads
// consecutive counts, eight to a cache line, instead of a line per count)
struct Layout {
  int64_t W, N;
  bool by_column;
  int64_t at(int64_t s, int64_t g) const { return by_column ? g * W + s : s * N + g; }
};

// no fault: a prefetch past C is never issued (callers)
inline void prefetch_count(const int64_t* C, const Layout& x, int64_t s, int64_t g) {
  __builtin_prefetch(C + x.at(s, g));
}

// The validated counts (counts.counts_with_sums) and baseline_loads' aggregates of them.
struct Counts {
  int64_t W, E, N;
  const int64_t* C;  // [W, N], not owned: row-major, or by columns (by_column)
  ColumnPrefix* prefix = nullptr;  // the plan's column prefixes (plan_mix with a topology)
  bool by_column = false;
  Layout layout() const { return Layout{W, N, by_column}; }
  int64_t c(int64_t s, int64_t g) const { return C[layout().at(s, g)]; }
  void prefetch(int64_t s, int64_t g) const { prefetch_count(C, layout(), s, g); }
};

// Per-rank aggregates in LOADS order; replica copies as doubles (whole, or the relay's chunks).
struct Loads {
  std::vector<int64_t> rows, local, remote;
  std::vector<double> replica;
};

// (g, holder ranks ascending) by ascending g: Plan.replicas.
using Replicas = std::vector<std::pair<int64_t, std::vector<int64_t>>>;
// (rank, rows) pairs: Plan.ranges' and Plan.kept's entries of one expert.
using Entries = std::vector<std::pair<int64_t, int64_t>>;
// (g, entries) by ascending g: Plan.ranges, Plan.kept.
using ExpertEntries = std::vector<std::pair<int64_t, Entries>>;

}  // namespace mixmoe_native
