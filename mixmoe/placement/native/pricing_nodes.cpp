// cost_model.plan_pricing and StepModel.prediction_W with a profile's topology, compiled: the
// 6-row loads (LOADS, then the remote rows and replica copies that cross nodes) of a plan without
// share entries, twin of plan_pricing's list code with a `distance` (cost_model._inter_node_loads,
// loads_tensor.range_crossing_tensor, relay.relay_degrees and relay.relay_inter_copies with
// relay.nodes_of's nodes), and seconds_W's 6-row prices (common.h's Model::seconds_nodes).
//
// Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (row-major int64,
// C[s*N + g] = rows rank s routes to expert g; g's owner is o = g / E); P = per_node ranks per
// node, rank r on node r / P; near: on the owner's node, far: on another one; k near holders,
// R far ones on L far nodes (relay module doc).
//
// Every crossing load is an exact integer sum, every relay copy a 2**-24 grid value whose sums
// are exact in any order, so the loads equal the Python's whatever the order of the additions;
// the prices run seconds_W's expressions in its order (tests/placement/test_native_nodes.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "pricing.h"

namespace {

using namespace mixmoe_native;

// relay.holder_groups with relay.nodes_of(P), as index runs of the sorted holders: the near
// holders (on the owner's node) and each far node's holders. Sorted ascending, a node's holders
// are consecutive (node = h / P grows with h), so each far group is one run, and the runs come
// in the Python's order (first seen: by lowest holder). One scratch serves a pricing's experts.
struct Groups {
  std::vector<int64_t> hs;                      // the holders, ascending
  std::vector<int64_t> near;                    // the near holders, ascending
  std::vector<std::pair<size_t, size_t>> runs;  // each far node's [begin, end) in hs
};

void holder_groups(int64_t owner, const std::vector<int64_t>& holders, const int64_t* node_of,
                   Groups& out) {
  out.hs.assign(holders.begin(), holders.end());
  std::sort(out.hs.begin(), out.hs.end());  // relay sorts the holders first
  out.near.clear();
  out.runs.clear();
  const int64_t home = node_of[owner];
  for (size_t i = 0; i < out.hs.size(); ++i) {
    const int64_t node = node_of[out.hs[i]];
    if (node == home) {
      out.near.push_back(out.hs[i]);
    } else if (!out.runs.empty() && node_of[out.hs[out.runs.back().first]] == node) {
      out.runs.back().second = i + 1;  // the same far node as the run before
    } else {
      out.runs.emplace_back(i, i + 1);
    }
  }
}

int64_t relay_nodes(int64_t owner, const std::vector<int64_t>& holders, const int64_t* node_of,
                    std::vector<double>& replica, std::vector<double>& inter, Groups& x) {
  if (holders.empty()) return 0;
  holder_groups(owner, holders, node_of, x);  // x: the caller's scratch, reused expert after expert
  const auto& near = x.near;
  const auto& runs = x.runs;
  const int64_t k = static_cast<int64_t>(near.size()), L = static_cast<int64_t>(runs.size());
  int64_t R = 0;
  bool pairs = false;  // a far node with 2 holders or more
  for (const auto& [b, e] : runs) {
    R += static_cast<int64_t>(e - b);
    pairs = pairs || e - b >= 2;
  }
  replica[owner] += static_cast<double>((k > 0) + (R > 0));  // 1 per nonempty link class
  if (k > 0) {
    const double near_copies = k == 1 ? 1.0 : 1.0 + grid(k - 1, k);
    for (int64_t h : near) replica[h] += near_copies;
  }
  if (R > 0) inter[owner] += 1.0;  // the far scatter crosses once, in all
  if (R == 1) {
    const int64_t h = x.hs[runs[0].first];
    replica[h] += 1.0;
    inter[h] += 1.0;
  } else if (R >= 2) {
    for (const auto& [b, e] : runs) {
      const int64_t c = static_cast<int64_t>(e - b);
      const FarCopies f = far_copies(R, L, c);  // holders 0 .. extra - 1: one chunk more
      for (int64_t i = 0; i < c; ++i) {
        const int64_t h = x.hs[b + static_cast<size_t>(i)];
        replica[h] += i < f.extra ? f.high : f.low;
        inter[h] += i < f.extra ? f.high_in : f.low_in;
      }
    }
  }
  return 1 + (k >= 2 || R >= 2) + (L >= 2 && pairs);
}

struct Scratch {  // per-rank marks of range_crossing, reset after each expert
  const int64_t* node = nullptr;       // r / P by rank (PricingBuffers: no division per row)
  std::vector<char> holder, is_kept;   // the expert's holders, its kept holders
  std::vector<int64_t> rest;           // a kept holder's rows left in the stream
};

// plan_pricing_nodes' buffers, one set per thread, kept pricing after pricing (a plan prices
// each candidate and, under nodes, each fill): the ranks' nodes (r / P, built when W or P
// changes: the 64-bit divisions per holder were a pricing's hottest lines; a W = 64 zipf:2
// plan under h100-nvlink-ib, median of 6 runs, 0.232 -> 0.226 ms without them), range_crossing's
// marks and the relays' groups. Reached through a call
// (level_fill.cpp's run_buffers: a thread_local's address is a __tls_get_addr call per use)
struct PricingBuffers {
  std::vector<int64_t> node;
  int64_t W = -1, P = -1;  // node's
  Scratch x;
  Groups groups;
  const int64_t* nodes(int64_t w, int64_t p) {
    if (w != W || p != P) {
      node.resize(static_cast<size_t>(w));
      for (int64_t r = 0; r < w; ++r) node[static_cast<size_t>(r)] = r / p;
      W = w, P = p;
    }
    return node.data();
  }
};

[[gnu::noinline]] PricingBuffers& pricing_buffers() {
  thread_local PricingBuffers buffers;
  return buffers;
}

void range_crossing(const Counts& counts, int64_t g, const std::vector<int64_t>* hs,
                    const Entries* ranges, const Entries* kept, Scratch& x,
                    std::vector<int64_t>& inter) {
  const int64_t o = g / counts.E, home = x.node[o];
  if (hs)
    for (int64_t h : *hs) x.holder[h] = 1;
  if (kept)
    for (const auto& [y, local] : *kept) {  // the last entry of a rank counts (a dict's)
      x.is_kept[y] = 1;
      x.rest[y] = counts.c(y, g) - local;
    }
  // the rows the walk below hands to helpers (each entry's rows > 0: Plan's check)
  int64_t reach = 0;
  if (ranges)
    for (const auto& [y, n] : *ranges) reach += n;
  // the ranges' entry computing the stream's next row (past their end: the owner's rest)
  size_t piece = 0;
  int64_t piece_left = ranges && !ranges->empty() ? (*ranges)[0].second : -1;
  const auto next_piece = [&]() {
    while (piece_left == 0) {  // empty ranges hold no row
      ++piece;
      piece_left = piece < ranges->size() ? (*ranges)[piece].second : -1;
    }
  };
  next_piece();
  // one segment of the stream (n rows from src, in stream order) handed to the entries, each
  // crossing row counted at both ends (integer sums: the same loads in any order)
  const auto hand = [&](int64_t src, int64_t n) {
    while (n > 0) {
      const bool helper = piece_left > 0;  // -1: past the ranges, the owner's rest
      const int64_t dst = helper ? (*ranges)[piece].first : o;
      const int64_t len = helper ? std::min(n, piece_left) : n;
      if (x.node[src] != x.node[dst]) {
        inter[src] += len;
        inter[dst] += len;
      }
      n -= len;
      if (!helper) continue;
      piece_left -= len;
      next_piece();
    }
  };
  // the stream up to the segment that passes `reach`, each segment handed on as it is read:
  // past it every row is the owner's, and a source whose segment goes whole to the owner adds
  // nothing (the replica rule's crossing, undone below, is the same crossing again), so C's
  // column is read only that far (W = 1024 zipf:1.2 plans: ~60% of it) and the sources past it
  // are only the kept holders (their rest crosses to the owner, where the replica rule
  // computed it at the holder)
  // the column's prefix the plan fields read (plan_mix with a topology), else C itself
  const int64_t held = counts.prefix ? counts.prefix->len(g) : 0;
  const int64_t* read = held ? counts.prefix->data(g) : nullptr;
  int64_t at = 0, s = 0;  // the stream's rows so far; the next source
  for (; s < counts.W && at < reach; ++s) {
    if (s + COLUMN_AHEAD >= held && s + COLUMN_AHEAD < counts.W)
      counts.prefetch(s + COLUMN_AHEAD, g);
    if (s == o) continue;  // the owner's segment comes last
    const int64_t c = s < held ? read[s] : counts.c(s, g);  // else a strided read of column g
    if (!x.holder[s] && x.node[s] != home) {  // under the replica rule these rows crossed to o
      inter[s] -= c;
      inter[o] -= c;
    }
    // a holder's rows stay at it, but a kept holder's rest joins the stream
    const int64_t n = x.is_kept[s] ? x.rest[s] : x.holder[s] ? 0 : c;
    if (n > 0) hand(s, n), at += n;
  }
  if (at < reach) {  // every source read: the owner's segment closes the stream
    hand(o, counts.c(o, g));
  } else if (kept) {  // the kept holders past the stream read (distinct: Plan's check)
    for (const auto& [y, local] : *kept) {
      if (y < s || y == o || x.node[y] == home) continue;
      // the undo above and the walk's crossing below, for a segment whole at the owner
      const int64_t d = std::max<int64_t>(x.rest[y], 0) - (x.holder[y] ? 0 : counts.c(y, g));
      inter[y] += d;
      inter[o] += d;
    }
  }
  if (hs)
    for (int64_t h : *hs) x.holder[h] = 0;
  if (kept)
    for (const auto& [y, local] : *kept) x.is_kept[y] = 0;
}

const std::vector<int64_t>* holders_of(const Replicas& replicas, int64_t g) {
  auto it = std::lower_bound(replicas.begin(), replicas.end(), g,
                             [](const auto& entry, int64_t key) { return entry.first < key; });
  return it != replicas.end() && it->first == g ? &it->second : nullptr;
}

}  // namespace

namespace mixmoe_native {

std::vector<int64_t> inter_baseline(const Counts& counts, const Baseline& base, int64_t P) {
  const int64_t W = counts.W, E = counts.E, N = counts.N;
  std::vector<int64_t> inter(static_cast<size_t>(W), 0);
  if (P >= W) return inter;
  const Loads& l = base.loads;
  // sent across: s's row sum less its own node's experts; received across: g's column sum
  // less its owner's node's rows. Both "home" sums lie in C's diagonal blocks (a node's rows x
  // that node's experts), read here block by block in memory order: P * E contiguous counts a
  // row (a column read down the node's rows instead would touch a cache line per count: all
  // of C's lines at W = 64, where C is often no longer in cache). By columns a block is P * E
  // runs of P contiguous counts, prefetched a block ahead.
  const Layout x = counts.layout();
  for (int64_t lo = 0; lo < W; lo += P) {
    const int64_t hi = std::min(W, lo + P);
    const int64_t g_lo = lo * E, g_hi = std::min(N, hi * E);  // the node's experts
    if (x.by_column && hi < W)  // the next block's columns, from its first row
      for (int64_t g = hi * E; g < std::min(N, (hi + P) * E); ++g)
        prefetch_count(counts.C, x, hi, g);
    for (int64_t s = lo; s < hi; ++s) {
      // row-major: the block COLUMN_AHEAD rows down (rows N * 8 bytes apart)
      if (!x.by_column && s + COLUMN_AHEAD < W) {
        const int64_t ahead = s + COLUMN_AHEAD, a_lo = (ahead / P) * P * E;
        const int64_t a_hi = std::min(N, a_lo + P * E);
        for (int64_t g = a_lo; g < a_hi; g += 8) prefetch_count(counts.C, x, ahead, g);
      }
      int64_t home = 0;
      for (int64_t g = g_lo; g < g_hi; ++g) {
        const int64_t c = counts.C[x.at(s, g)];
        home += c;
        inter[g / E] -= c;  // g's owner: this node's rows of g never cross
      }
      inter[s] += l.remote[s] - (l.rows[s] - l.local[s]) + l.local[s] - home;
    }
  }
  for (int64_t g = 0; g < N; ++g) inter[g / E] += base.colsum[g];
  return inter;
}

int64_t plan_pricing_nodes(const Counts& counts, const Baseline& base,
                           const std::vector<int64_t>& inter, int64_t P,
                           const Replicas& replicas, bool relay, const ExpertEntries& ranges,
                           const ExpertEntries& kept, NodeLoads& out) {
  const int64_t W = counts.W, E = counts.E;
  // the replica rule, the ranges and kept holders: the loads on one link (relay's copies below)
  int64_t rounds = plan_pricing(counts, base, replicas, false, ranges, kept, out.loads);
  out.remote_inter = inter;
  out.replica_inter.assign(static_cast<size_t>(W), 0.0);
  PricingBuffers& buf = pricing_buffers();
  const int64_t* node = buf.nodes(W, P);
  if (P < W) {
    // _inter_node_loads: a holder's own rows stop crossing to a far owner; the flat fan-out's
    // owner -> far holder copies count at both
    for (const auto& [g, hs] : replicas) {
      const int64_t o = g / E;
      for (int64_t h : hs) {
        if (node[h] == node[o]) continue;
        const int64_t c = counts.c(h, g);
        out.remote_inter[h] -= c;
        out.remote_inter[o] -= c;
        out.replica_inter[h] += 1.0;
        out.replica_inter[o] += 1.0;
      }
    }
    // range_crossing_tensor of every expert with ranges or kept holders (ascending: a merge)
    Scratch& x = buf.x;  // its marks all 0 between experts (range_crossing resets its own)
    if (!ranges.empty() || !kept.empty()) {
      x.node = node;
      x.holder.assign(static_cast<size_t>(W), 0);
      x.is_kept.assign(static_cast<size_t>(W), 0);
      x.rest.assign(static_cast<size_t>(W), 0);
    }
    for_range_experts(ranges, kept, [&](int64_t g, const Entries* r, const Entries* k) {
      range_crossing(counts, g, holders_of(replicas, g), r, k, x, out.remote_inter);
    });
  }
  if (relay && !replicas.empty()) {  // every rank's copies in the relays, split by node
    out.loads.replica.assign(static_cast<size_t>(W), 0.0);
    out.replica_inter.assign(static_cast<size_t>(W), 0.0);
    rounds = 0;
    for (const auto& [g, hs] : replicas)
      rounds = std::max(rounds, relay_nodes(g / E, hs, node, out.loads.replica, out.replica_inter,
                                            buf.groups));
  }
  return rounds;
}

Prediction predict_nodes(const Model& model, double bw_inter, const NodeLoads& nl,
                         int64_t rounds) {
  const Loads& loads = nl.loads;
  bool any_remote = false;
  for (int64_t x : loads.remote) any_remote = any_remote || x != 0;
  return pack_prediction(model, loads, [&](size_t r) {
    return model.seconds_nodes(loads.rows[r], loads.local[r], loads.remote[r], loads.replica[r],
                               nl.remote_inter[r], nl.replica_inter[r], bw_inter, any_remote,
                               rounds);
  });
}

}  // namespace mixmoe_native

extern "C" {

// plan_pricing_nodes (cost_model.plan_pricing with nodes, native_nodes.plan_loads_nodes): C (int64 [W, N], counts the caller checked), per_node,
// the plan (read_plan's layout; experts ascending, ranks in range, relayed holders distinct and
// not the owner, plan_in_range: else -1), relay -> out_6W (float64 [6, W]: plan_pricing's
// loads); returns the rounds, -1 when a count is negative or the plan out of range.
int64_t mixmoe_plan_pricing_nodes(const int64_t* C, int64_t W, int64_t E, int64_t per_node,
                                  const int64_t* plan, int64_t relay, double* out_6W) {
  const Counts counts{W, E, W * E, C};
  Baseline base;
  if (!baseline(counts, base)) return -1;
  Replicas replicas;
  ExpertEntries entries[2];
  read_plan(plan, replicas, entries);
  if (!plan_in_range(counts, replicas, relay != 0, entries[0], entries[1])) return -1;
  NodeLoads out;
  const std::vector<int64_t> inter = inter_baseline(counts, base, per_node);
  const int64_t rounds = plan_pricing_nodes(counts, base, inter, per_node, replicas, relay != 0,
                                            entries[0], entries[1], out);
  const std::vector<int64_t>* ints[4] = {&out.loads.rows, &out.loads.local, &out.loads.remote,
                                         &out.remote_inter};
  for (int64_t k = 0; k < 3; ++k)
    for (int64_t r = 0; r < W; ++r) out_6W[k * W + r] = static_cast<double>((*ints[k])[r]);
  std::copy(out.loads.replica.begin(), out.loads.replica.end(), out_6W + 3 * W);
  for (int64_t r = 0; r < W; ++r) out_6W[4 * W + r] = static_cast<double>((*ints[3])[r]);
  std::copy(out.replica_inter.begin(), out.replica_inter.end(), out_6W + 5 * W);
  return rounds;
}

// predict_nodes for the twin tests: model terms (Model::from's order), bw_inter, loads (float64
// [6, W]), rounds >= 0 -> out_d (float64 [2, W]: compute, comm), out_i (int64 [3, W]:
// token_bytes, weight_bytes, rows); returns the step.
double mixmoe_predict_nodes(const int64_t* model_i, const double* model_d, double bw_inter,
                            const double* loads_6W, int64_t W, int64_t rounds, double* out_d,
                            int64_t* out_i) {
  const Model model = Model::from(model_i, model_d);
  NodeLoads nl;
  std::vector<int64_t>* ints[4] = {&nl.loads.rows, &nl.loads.local, &nl.loads.remote,
                                   &nl.remote_inter};
  const int64_t at[4] = {0, 1, 2, 4};  // the integer rows of loads_6W
  for (int64_t k = 0; k < 4; ++k) {
    ints[k]->resize(static_cast<size_t>(W));
    for (int64_t r = 0; r < W; ++r)
      (*ints[k])[r] = static_cast<int64_t>(loads_6W[at[k] * W + r]);
  }
  nl.loads.replica.assign(loads_6W + 3 * W, loads_6W + 4 * W);
  nl.replica_inter.assign(loads_6W + 5 * W, loads_6W + 6 * W);
  const Prediction p = predict_nodes(model, bw_inter, nl, rounds);
  return write_prediction(p, out_i, out_d);
}

}  // extern "C"
