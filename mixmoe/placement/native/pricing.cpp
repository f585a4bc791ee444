// The cost model's aggregates and predictions compiled: counts.baseline_loads (with
// counts_with_sums' sign check), cost_model.plan_pricing of a plan without share entries on one
// link (the replica rule _plan_loads_lists, ranges.range_loads / _stream_terms, relay.near_relay)
// and StepModel.prediction_lists + _pack_lists (equal to prediction_W / pack).
//
// Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (row-major int64,
// C[s*N + g] = rows rank s routes to expert g; g's owner is o = g / E); loads in LOADS order
// (rows computed, local rows, remote rows, replica copies), per rank.
//
// Every load but the relay's copies is an exact integer sum (the order of the additions cannot
// change it); the relay's copies lie on the 2**-24 grid (relay module doc: their sums are exact in
// any order); the prediction runs Model::seconds (common.h: StepModel.seconds_fn bit for bit) per
// rank and _pack_lists' byte counts, so every value equals the Python's bit for bit
// (tests/placement/test_native_pricing.py). Loaded by mixmoe/placement/native_pricing.py.

#include "pricing.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using namespace mixmoe_native;

// relay.near_relay(o, holders) of k >= 1 holders: (copies each holder sends + receives, rounds)
std::pair<double, int64_t> near_relay(int64_t k) {
  if (k == 1) return {1.0, 1};
  return {1.0 + grid(k - 1, k), 2};
}

// The holders of expert g in `replicas` (ascending by g), or null when g is not hot.
const std::vector<int64_t>* holders_of(const Replicas& replicas, int64_t g) {
  auto it = std::lower_bound(replicas.begin(), replicas.end(), g,
                             [](const auto& entry, int64_t key) { return entry.first < key; });
  return it != replicas.end() && it->first == g ? &it->second : nullptr;
}

// ranges.range_loads of expert g (cost_model.plan_pricing's range code, W <= LIST_PRICING_W;
// loads_tensor.range_relay_loads_tensor above: the same integers): its kept holders' rests go
// back to the stream, then its helpers take their ranges off the owner.
void range_expert(const Counts& counts, const Baseline& base, const Replicas& replicas,
                  int64_t g, const Entries* ranges, const Entries* kept, Loads& out) {
  const int64_t o = g / counts.E;
  // ranges._stream_terms: the stream's rows from sources other than the owner
  int64_t colsum = 0;
  if (base.colsum.empty()) {  // no column sums given: this column's, read here
    for (int64_t s = 0; s < counts.W; ++s) colsum += counts.c(s, g);
  } else {
    colsum = base.colsum[g];
  }
  int64_t held = 0;
  if (const auto* hs = holders_of(replicas, g))
    for (int64_t h : *hs) held += counts.c(h, g);
  int64_t rest = 0;
  if (kept)
    for (const auto& [y, local_y] : *kept) rest += counts.c(y, g) - local_y;
  const int64_t others = colsum - counts.c(o, g) - held + rest;
  if (kept) {
    for (const auto& [y, local_y] : *kept) {  // the replica rule undone for y's rest d
      const int64_t d = counts.c(y, g) - local_y;
      out.rows[y] -= d;
      out.local[y] -= d;
      out.remote[y] += d;
      out.rows[o] += d;
      out.remote[o] += d;
    }
  }
  int64_t taken = 0;
  if (ranges) {
    for (const auto& [y, n] : *ranges) {  // a helper computes its n rows, received
      out.rows[y] += n;
      out.remote[y] += n;
      taken += n;
    }
  }
  // the owner gives up the other sources' rows first, then its own (sent now, not local)
  const int64_t from_others = std::min(taken, others);
  const int64_t own = taken - from_others;
  out.rows[o] -= taken;
  out.remote[o] += own - from_others;
  out.local[o] -= own;
}

// Two int64 lanes in one 128-bit register (GCC / Clang vector extension: SSE2 on x86-64, NEON on
// aarch64, both baseline): the pass over C below adds two columns per instruction, which gcc -O2
// does not do by itself (its cheap cost model leaves a loop of unknown length scalar).
typedef int64_t Lanes __attribute__((vector_size(16)));
inline Lanes load(const int64_t* p) {  // unaligned: C and colsum need not be 16-byte aligned
  Lanes x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline void store(int64_t* p, Lanes x) { std::memcpy(p, &x, sizeof x); }

// baseline's pass over R consecutive rows of C (`rows`: the first one's counts, N each): adds
// each column's R counts to colsum[g], each row's sum to sent[k] (k < R: written, not added) and
// ORs every count into `sign`. Every sum is an integer sum, so the order of additions is free.
// Why this shape (measured, W = 1024 zipf:1.2): R rows per sweep load and store colsum once
// per R counts, eight rows being faster than four; sixteen rows are twice slower (probably the
// L1's 8 ways: the rows lie N * 8 bytes apart, a multiple of 4 KiB at W a power of two, so
// their lines share one set). One cache line (8 columns) per step with a software prefetch 512
// bytes ahead in each row keeps the R streams going (~10-20% faster than without); near a
// row's end the prefetch runs into the next sweep's rows (`next`, its first `more` rows: none
// past C's end), whose starts would otherwise wait on memory: short rows (a C by columns, or
// a small N) spend a larger part of each row there.
template <int R>
void add_rows(const int64_t* rows, int64_t N, const int64_t* next, int more, int64_t* colsum,
              int64_t* sent, Lanes& sign) {
  constexpr int64_t ahead = 512 / sizeof(int64_t);  // prefetch distance, in columns
  const int64_t N8 = N - N % 8;                       // whole lines; the last N % 8 columns after
  Lanes acc[R] = {}, bits = {};                        // acc[k]: row k's sum, in two lanes
  for (int64_t g = 0; g < N8; g += 8) {
    if (g + ahead < N) {  // stays inside C: the address is never past its end
      for (int k = 0; k < R; ++k) __builtin_prefetch(rows + k * N + g + ahead);
    } else if (g + ahead - N < N) {  // the next sweep's rows, as far into them
      for (int k = 0; k < more; ++k) __builtin_prefetch(next + k * N + g + ahead - N);
    }
    Lanes c0 = load(colsum + g), c1 = load(colsum + g + 2), c2 = load(colsum + g + 4),
          c3 = load(colsum + g + 6);  // columns g .. g+7, two per lane pair
    for (int k = 0; k < R; ++k) {
      const int64_t* p = rows + k * N + g;  // row k's counts of columns g .. g+7
      const Lanes x0 = load(p), x1 = load(p + 2), x2 = load(p + 4), x3 = load(p + 6);
      c0 += x0;
      c1 += x1;
      c2 += x2;
      c3 += x3;
      acc[k] += (x0 + x1) + (x2 + x3);
      bits |= (x0 | x1) | (x2 | x3);
    }
    store(colsum + g, c0);
    store(colsum + g + 2, c1);
    store(colsum + g + 4, c2);
    store(colsum + g + 6, c3);
  }
  for (int k = 0; k < R; ++k) sent[k] = acc[k][0] + acc[k][1];
  for (int64_t g = N8; g < N; ++g) {  // the last N % 8 columns, one count at a time
    for (int k = 0; k < R; ++k) {
      const int64_t v = rows[k * N + g];
      colsum[g] += v;
      sent[k] += v;
      bits[0] |= v;
    }
  }
  sign |= bits;
}

}  // namespace

namespace mixmoe_native {

bool add_row_block(const int64_t* rows, int64_t n, int64_t N, int64_t* colsum, int64_t* sent) {
  Lanes sign = {};  // the OR of every count: negative iff some count is
  int64_t s = 0;
  for (; s + 8 <= n; s += 8) {
    const int more = static_cast<int>(std::min<int64_t>(8, n - s - 8));  // the next sweep's rows
    add_rows<8>(rows + s * N, N, rows + (s + 8) * N, more, colsum, sent + s, sign);
  }
  for (; s < n; ++s) {
    const int more = s + 1 < n ? 1 : 0;
    add_rows<1>(rows + s * N, N, rows + (s + 1) * N, more, colsum, sent + s, sign);
  }
  return (sign[0] | sign[1]) >= 0;
}

bool plan_in_range(const Counts& counts, const Replicas& replicas, bool relay,
                   const ExpertEntries& ranges, const ExpertEntries& kept) {
  const int64_t W = counts.W, N = counts.N;
  auto rank_ok = [W](int64_t r) { return r >= 0 && r < W; };
  int64_t last = -1;
  for (const auto& [g, hs] : replicas) {
    if (g <= last || g >= N) return false;  // ascending experts (holders_of's binary search)
    last = g;
    int64_t prev = -1;
    for (int64_t h : hs) {
      if (!rank_ok(h)) return false;
      // relay.near_relay's check: holders distinct (here: ascending), never the owner
      if (relay && (h <= prev || h == g / counts.E)) return false;
      prev = h;
    }
  }
  for (const ExpertEntries* entries : {&ranges, &kept}) {
    last = -1;
    for (const auto& [g, list] : *entries) {
      if (g <= last || g >= N) return false;  // ascending experts (the merge in plan_pricing)
      last = g;
      for (const auto& [y, n] : list)
        if (!rank_ok(y)) return false;
    }
  }
  return true;
}

namespace {

// baseline's loads from C's row sums `sent` and out.colsum (filled): each rank's own experts'
// rows read from C (its E columns of its own row), the rows it computes, the rows it exchanges
void loads_from_sums(const Counts& counts, const int64_t* sent, Baseline& out) {
  const int64_t W = counts.W, E = counts.E;
  Loads& loads = out.loads;
  loads.rows.assign(W, 0);
  loads.local.assign(W, 0);
  loads.remote.assign(W, 0);
  loads.replica.assign(W, 0.0);
  out.own.assign(counts.N, 0);
  for (int64_t r = 0; r < W; ++r) {
    int64_t local = 0, rows = 0;
    for (int64_t g = r * E; g < (r + 1) * E; ++g) {  // r's own experts: C[r][g] stays at r
      out.own[g] = counts.c(r, g);
      local += out.own[g];
      rows += out.colsum[g];
    }
    loads.local[r] = local;
    loads.rows[r] = rows;
    // baseline_loads: (sent - local) + (rows - local): what r sends away, what it receives
    loads.remote[r] = (sent[r] - local) + (rows - local);
  }
}

}  // namespace

bool baseline(const Counts& counts, Baseline& out) {
  out.colsum.assign(counts.N, 0);
  std::vector<int64_t> sent(counts.W);  // row sums: what each source routes, anywhere
  // one pass over C in memory order, eight rows at a time, then the last W % 8 one by one
  // (measured at [1024, 4096] on a 2-core EPYC VM: ~1.4 ms, a plain sum of C ~1.3 ms; four
  // scalar rows at a time took ~2.3 ms)
  // (by columns: C's storage is C transposed, whose rows are C's columns: the same pass gives
  // the row sums as its column sums and the column sums as its row sums)
  const bool ok = counts.by_column
                      ? add_row_block(counts.C, counts.N, counts.W, sent.data(), out.colsum.data())
                      : add_row_block(counts.C, counts.W, counts.N, out.colsum.data(), sent.data());
  if (!ok) return false;
  loads_from_sums(counts, sent.data(), out);
  return true;
}

bool baseline_from_sums(const Counts& counts, const int64_t* colsum, const int64_t* rowsum,
                        Baseline& out) {
  const int64_t W = counts.W, N = counts.N;
  int64_t by_column = 0, by_row = 0;
  for (int64_t g = 0; g < N; ++g) {
    if (colsum[g] < 0) return false;
    by_column += colsum[g];
  }
  for (int64_t r = 0; r < W; ++r) {
    if (rowsum[r] < 0) return false;
    by_row += rowsum[r];
  }
  if (by_column != by_row) return false;
  out.colsum.assign(colsum, colsum + N);
  loads_from_sums(counts, rowsum, out);
  return true;
}

int64_t plan_pricing(const Counts& counts, const Baseline& base, const Replicas& replicas,
                     bool relay, const ExpertEntries& ranges, const ExpertEntries& kept,
                     Loads& out) {
  const int64_t E = counts.E, W = counts.W;
  out = base.loads;
  int64_t rounds = replicas.empty() ? 0 : 1;  // int(bool(plan.replicas))
  // the replica rule (_plan_loads_lists): a holder computes its own rows of g, locally
  for (const auto& [g, hs] : replicas) {
    const int64_t o = g / E;
    int64_t moved = 0;
    const size_t n = hs.size();
    for (size_t i = 0; i < n; ++i) {
      // the holders' counts: rows of column g far apart, a cache line each (W = 1024 under
      // nodes: ~5,000 holders), read COLUMN_AHEAD holders ahead
      if (i + COLUMN_AHEAD < n) counts.prefetch(hs[i + COLUMN_AHEAD], g);
      const int64_t h = hs[i];
      const int64_t c = counts.c(h, g);
      out.rows[h] += c;
      out.local[h] += c;
      out.remote[h] -= c;
      out.replica[h] += 1.0;
      moved += c;
    }
    out.rows[o] -= moved;  // the owner no longer computes (nor receives) them
    out.remote[o] -= moved;
    out.replica[o] += static_cast<double>(hs.size());
  }
  // every expert with ranges or kept holders, ascending
  for_range_experts(ranges, kept, [&](int64_t g, const Entries* r, const Entries* k) {
    range_expert(counts, base, replicas, g, r, k, out);
  });
  if (relay && !replicas.empty()) {  // each rank's copies in the one-link relays instead
    out.replica.assign(W, 0.0);
    rounds = 0;
    for (const auto& [g, hs] : replicas) {
      if (hs.empty()) continue;  // relay_degrees of no holder: no copy, 0 rounds
      const auto [copies, depth] = near_relay(static_cast<int64_t>(hs.size()));
      rounds = std::max(rounds, depth);
      out.replica[g / E] += 1.0;
      for (int64_t h : hs) out.replica[h] += copies;  // grid values: exact sums
    }
  }
  return rounds;
}

Prediction predict(const Model& model, const Loads& loads, int64_t rounds) {
  bool any_remote = false;
  for (int64_t x : loads.remote) any_remote = any_remote || x != 0;
  if (rounds < 0) {  // None: one round when any rank holds a copy
    rounds = 0;
    for (double x : loads.replica) rounds = rounds || x != 0.0;
  }
  return pack_prediction(model, loads, [&](size_t r) {
    return model.seconds(loads.rows[r], loads.local[r], loads.remote[r], loads.replica[r],
                         any_remote, rounds);
  });
}

}  // namespace mixmoe_native

extern "C" {

// baseline: C (int64 [W, N]) -> loads (float64 [4, W]: baseline_loads' loads_4W), colsum (int64
// [N]), own (int64 [N]) and, unless null, rowsum (int64 [W]: counts_with_sums' row sums). Returns
// 0, or -1 when a count is negative (nothing written is meaningful then). `given` != 0: colsum
// and rowsum are inputs, C's sums (CountSums; baseline_from_sums: no pass over C), left as
// they are; -4 when a sum is negative or the totals differ. `by_column` != 0: C stored by
// columns (common.h's Layout).
int64_t mixmoe_baseline(const int64_t* C, int64_t W, int64_t E, double* loads_4W,
                        int64_t* colsum_N, int64_t* own_N, int64_t* rowsum_W, int64_t given,
                        int64_t by_column) {
  const Counts counts{W, E, W * E, C, nullptr, by_column != 0};
  Baseline base;
  if (given) {
    if (rowsum_W == nullptr || !baseline_from_sums(counts, colsum_N, rowsum_W, base)) return -4;
  } else if (!mixmoe_native::baseline(counts, base)) {
    return -1;
  }
  const std::vector<int64_t>* ints[3] = {&base.loads.rows, &base.loads.local, &base.loads.remote};
  for (int64_t k = 0; k < 3; ++k)
    for (int64_t r = 0; r < W; ++r) loads_4W[k * W + r] = static_cast<double>((*ints[k])[r]);
  std::fill(loads_4W + 3 * W, loads_4W + 4 * W, 0.0);
  std::copy(base.own.begin(), base.own.end(), own_N);
  if (given) return 0;
  std::copy(base.colsum.begin(), base.colsum.end(), colsum_N);
  if (rowsum_W) {  // sent = remote - received + local, received = rows - local
    const Loads& l = base.loads;
    for (int64_t r = 0; r < W; ++r)
      rowsum_W[r] = l.remote[r] - (l.rows[r] - l.local[r]) + l.local[r];
  }
  return 0;
}

// plan_pricing: C (int64 [W, N]), base_4W (float64 [4, W]: the loads with nothing replicated, as
// baseline_loads returns them), colsum (int64 [N], C's column sums; null: the ranged experts'
// columns are summed here), the plan as flat int64 groups in `plan`: n_replicas, then per hot
// expert [g, k, k holders]; n_ranges, then per expert [g, k, k (helper, rows) pairs]; n_kept,
// then per expert [g, k, k (holder, local rows) pairs]; relay (Plan.relay). Writes the plan's
// loads (float64 [4, W], plan_pricing's loads_4W) and returns its rounds; -1 (nothing written)
// when an index is out of range or not ascending, or a relayed expert's holders repeat or
// include its owner: the Python prices (or rejects) such a plan.
int64_t mixmoe_plan_pricing(const int64_t* C, int64_t W, int64_t E, const double* base_4W,
                            const int64_t* colsum_N, const int64_t* plan, int64_t relay,
                            double* out_4W) {
  const Counts counts{W, E, W * E, C};
  Baseline base;
  std::vector<int64_t>* ints[3] = {&base.loads.rows, &base.loads.local, &base.loads.remote};
  for (int64_t k = 0; k < 3; ++k) {
    ints[k]->resize(W);
    for (int64_t r = 0; r < W; ++r) (*ints[k])[r] = static_cast<int64_t>(base_4W[k * W + r]);
  }
  base.loads.replica.assign(base_4W + 3 * W, base_4W + 4 * W);
  if (colsum_N) base.colsum.assign(colsum_N, colsum_N + W * E);
  Replicas replicas;
  ExpertEntries entries[2];  // ranges, kept
  read_plan(plan, replicas, entries);
  if (!plan_in_range(counts, replicas, relay != 0, entries[0], entries[1])) return -1;
  Loads out;
  const int64_t rounds =
      mixmoe_native::plan_pricing(counts, base, replicas, relay != 0, entries[0], entries[1], out);
  for (int64_t k = 0; k < 3; ++k) {
    const std::vector<int64_t>& v = k == 0 ? out.rows : k == 1 ? out.local : out.remote;
    for (int64_t r = 0; r < W; ++r) out_4W[k * W + r] = static_cast<double>(v[r]);
  }
  std::copy(out.replica.begin(), out.replica.end(), out_4W + 3 * W);
  return rounds;
}

// predict: model terms (common.h's Model::from order), loads (float64 [4, W], exact integer
// rows, local, remote; replica copies), rounds (< 0: Python's None) -> out_d (float64 [2, W]:
// compute, comm), out_i (int64 [3, W]: token_bytes, weight_bytes, rows); returns the step, or
// NaN (nothing written is meaningful) when a byte count would not fit in int64 (Python's ints
// are unbounded: the Python packs it).
double mixmoe_predict(const int64_t* model_i, const double* model_d, const double* loads_4W,
                      int64_t W, int64_t rounds, double* out_d, int64_t* out_i) {
  const Model model = Model::from(model_i, model_d);
  Loads loads;
  std::vector<int64_t>* ints[3] = {&loads.rows, &loads.local, &loads.remote};
  for (int64_t k = 0; k < 3; ++k) {
    ints[k]->resize(W);
    for (int64_t r = 0; r < W; ++r) (*ints[k])[r] = static_cast<int64_t>(loads_4W[k * W + r]);
  }
  loads.replica.assign(loads_4W + 3 * W, loads_4W + 4 * W);
  // pack's int64 bound: (max(remote, replica) + 1) * max(token, weight) < 2**63
  double top = 0.0;
  for (int64_t r = 0; r < W; ++r) top = std::max({top, loads_4W[2 * W + r], loads_4W[3 * W + r]});
  const double factor = static_cast<double>(2 * std::max(model.tbr, model.P));
  if ((top + 1.0) * factor >= 9.2e18) return std::nan("");
  const Prediction p = mixmoe_native::predict(model, loads, rounds);
  return write_prediction(p, out_i, out_d);
}

}  // extern "C"
