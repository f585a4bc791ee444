// One rank's step bookkeeping compiled: the fields of mixmoe.dispatch.step_plan.build_step_plan's
// StepPlan but the replica fetch, i.e. the twin of build_step_plan's vectorised replica rule,
// ranges.range_rows_moved, Plan.expanded(C, E, rank) (ranges.range_shares for one rank) and
// step_shares.share_fields (_runs_by_expert / _runs_by_key, _walk_segment).
//
// Legend: W ranks, E experts per rank, N = W*E experts, C = counts_WN (row-major int64,
// C[s*N + g] = rows rank s routes to expert g; g's owner is g / E), r the rank, H replicas held
// at r (its replica slots), M = E + H receive columns (own experts and replicas, by expert id),
// G experts with ranges or kept holders ("ranged"), F of them full at r (owned or held there:
// their whole stream is expanded), R runs of r's rows.
//
// Integer arithmetic only (int64 sums, exact as Python's ints at these sizes), in whatever order
// (sums of ints do not depend on it); the orders the Python fixes are kept: runs by expert id,
// then a segment's runs; the receive buffer source-major, then column; the stream of an expert
// its sources ascending, the owner last. C is read in one pass over its rows (the only read of
// all of it: the total rows), gathering on the way every column the rest needs (W = 1024: 32 MiB,
// the bulk of the call: docs/results/step-bookkeeping.md).
//
// Where the Python raises (Plan.expanded's checks of the range entries it builds, a KeyError for
// a run at r of an expert r neither owns nor holds) or reads an index out of range (a hand-made
// plan's ranks or experts outside [0, W) or [0, N), a holder that owns the expert, negative counts
// in r's row), the entry returns FALLBACK and the caller runs the Python, which then does what it
// does. C entry: mixmoe_step_plan (mixmoe/dispatch/step_native.py, through ctypes).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pricing.h"

namespace {

constexpr int64_t HEADER = 8;     // the output's header (mixmoe_step_plan's doc)
constexpr int64_t FALLBACK = -2;  // run the Python (the file's doc)
constexpr int64_t SHORT = -1;     // the output buffer is too small: out[0] says how many ints

struct Pairs {  // n (rank, rows) pairs at p[2i], p[2i + 1]: one entry's runs, ranges or kept
  const int64_t* p = nullptr;
  int64_t n = 0;
  int64_t rank(int64_t i) const { return p[2 * i]; }
  int64_t rows(int64_t i) const { return p[2 * i + 1]; }
};

struct Hot {  // Plan.replicas' (g, holders ascending)
  int64_t g;
  const int64_t* holders;
  int64_t n;
  bool holds(int64_t y) const { return std::binary_search(holders, holders + n, y); }
};

struct Ranged {  // ranges.range_experts' (g, ranges, kept): g has ranges or kept holders
  int64_t g;
  Pairs ranges, kept;
  // kept.get(y) as Python's dict: the local rows of holder y, or -1 when y is not kept
  int64_t kept_local(int64_t y) const {
    for (int64_t i = 0; i < kept.n; ++i)
      if (kept.rank(i) == y) return kept.rows(i);
    return -1;
  }
};

struct Run {  // one run of a segment: (rank computing it, rows)
  int64_t rank, rows;
};

struct Entry {  // an expanded share entry (s, g, runs): its runs in out.runs[at, at + n)
  int64_t s, g, at, n;
};

struct Entries {  // the share entries a range expansion builds, runs back to back
  std::vector<Entry> items;
  std::vector<Run> runs;
};

// Plan.__post_init__'s check of one share entry: runs, distinct ranks, rows > 0 each.
bool valid_runs(const Run* runs, int64_t n) {
  if (n == 0) return false;
  for (int64_t i = 0; i < n; ++i) {
    if (runs[i].rows <= 0) return false;
    for (int64_t j = 0; j < i; ++j)
      if (runs[j].rank == runs[i].rank) return false;
  }
  return true;
}

// Appends entry (s, g) with the runs pushed onto out.runs since `at`; false when Plan's checks
// would reject it (Plan.expanded raises: the Python's business).
bool close_entry(Entries& out, int64_t s, int64_t g, size_t at) {
  const int64_t n = static_cast<int64_t>(out.runs.size() - at);
  out.items.push_back({s, g, static_cast<int64_t>(at), n});
  return valid_runs(out.runs.data() + at, n);
}

// The plan packed by step_native._pack: [replicas, shares, ranges, kept] counts, then the
// replicas (g, k, holders...), the shares (s, g, k, (rank, rows) * k), the ranges and kept
// entries (g, k, (rank, rows) * k). False: malformed or out of range (the Python's business).
struct Plan {
  std::vector<Hot> hot;
  Entries shares;              // Plan.shares, their runs copied (few: hand-made plans)
  std::vector<Ranged> ranged;  // ascending g, the union of ranges and kept
  int64_t W, E, N;

  const Hot* find(int64_t g) const {  // g's replicas, nullptr when g is not hot
    auto it = std::lower_bound(hot.begin(), hot.end(), g,
                               [](const Hot& h, int64_t x) { return h.g < x; });
    return it != hot.end() && it->g == g ? &*it : nullptr;
  }
  bool holds(int64_t g, int64_t y) const {  // y in plan.holders(g)
    const Hot* h = find(g);
    return h != nullptr && h->holds(y);
  }
  int64_t computed_at(int64_t s, int64_t g) const {  // Plan.computed_at
    return s == g / E || holds(g, s) ? s : g / E;
  }

  bool parse(const int64_t* p, int64_t len) {
    if (len < 4) return false;
    const int64_t n_hot = p[0], n_shares = p[1], n_ranges = p[2], n_kept = p[3];
    int64_t at = 4;
    auto take = [&](int64_t k, int64_t size = 1) {  // k items of `size` ints at p[at]
      if (k < 0 || k > (len - at) / size) return false;  // past the end (no overflow)
      at += k * size;
      return true;
    };
    auto rank_ok = [&](int64_t y) { return 0 <= y && y < W; };
    for (int64_t i = 0; i < n_hot; ++i) {
      if (!take(2)) return false;
      const int64_t g = p[at - 2], k = p[at - 1];
      if (!take(k) || g < 0 || g >= N) return false;
      const int64_t* h = p + at - k;
      for (int64_t j = 0; j < k; ++j)  // holders in range, ascending, never the owner
        if (!rank_ok(h[j]) || h[j] == g / E || (j && h[j] <= h[j - 1])) return false;
      if (!hot.empty() && g <= hot.back().g) return false;
      hot.push_back({g, h, k});
    }
    for (int64_t i = 0; i < n_shares; ++i) {
      if (!take(3)) return false;
      const int64_t s = p[at - 3], g = p[at - 2], k = p[at - 1];
      if (!take(k, 2) || !rank_ok(s) || g < 0 || g >= N) return false;
      const Pairs runs{p + at - 2 * k, k};
      const std::vector<Entry>& items = shares.items;
      if (!items.empty() &&  // strictly ascending by (s, g), as Plan checks
          (s < items.back().s || (s == items.back().s && g <= items.back().g)))
        return false;
      const size_t first = shares.runs.size();
      for (int64_t j = 0; j < k; ++j) {
        if (!rank_ok(runs.rank(j))) return false;
        shares.runs.push_back({runs.rank(j), runs.rows(j)});
      }
      if (!close_entry(shares, s, g, first)) return false;
    }
    std::vector<std::pair<int64_t, Pairs>> lists[2];  // ranges, kept
    for (int part = 0; part < 2; ++part) {
      for (int64_t i = 0, n = part ? n_kept : n_ranges; i < n; ++i) {
        if (!take(2)) return false;
        const int64_t g = p[at - 2], k = p[at - 1];
        if (!take(k, 2) || g < 0 || g >= N) return false;
        const Pairs pairs{p + at - 2 * k, k};
        // Plan's checks: entries, distinct ranks; ranges' rows > 0, kept's local rows >= 0
        if (k == 0) return false;
        for (int64_t j = 0; j < k; ++j) {
          if (!rank_ok(pairs.rank(j)) || pairs.rows(j) < (part ? 0 : 1)) return false;
          for (int64_t i2 = 0; i2 < j; ++i2)
            if (pairs.rank(i2) == pairs.rank(j)) return false;
        }
        if (!lists[part].empty() && g <= lists[part].back().first) return false;
        lists[part].push_back({g, pairs});
      }
    }
    // the union by ascending g (range_experts): a merge of the two ascending lists
    size_t a = 0, b = 0;
    while (a < lists[0].size() || b < lists[1].size()) {
      const int64_t ga = a < lists[0].size() ? lists[0][a].first : N;
      const int64_t gb = b < lists[1].size() ? lists[1][b].first : N;
      Ranged x{std::min(ga, gb), {}, {}};
      if (ga == x.g) x.ranges = lists[0][a++].second;
      if (gb == x.g) x.kept = lists[1][b++].second;
      ranged.push_back(x);
    }
    // an expert with ranges or kept holders has no share entry (Plan's check)
    for (const Entry& en : shares.items) {
      auto it = std::lower_bound(ranged.begin(), ranged.end(), en.g,
                                 [](const Ranged& x, int64_t g) { return x.g < g; });
      if (it != ranged.end() && it->g == en.g) return false;
    }
    return at == len;
  }
};

// What one pass over C's rows gathers (the only read of all of C).
struct Pass {
  int64_t total = 0;  // every row of C
  int64_t diag = 0;   // rows routed to their own rank's experts: C[s][sE .. sE + E), summed
  std::vector<int64_t> own_WE;    // C[s][rE + e]: r's experts' columns
  std::vector<int64_t> col_G;     // ranged experts' column sums
  std::vector<int64_t> below_G;   // ranged experts' sums over the sources s < r
  std::vector<int64_t> full_FW;   // the full experts' columns, F x W
};

// `ranged_g`: the ranged experts' ids (ascending); `full_g`: those whose columns are kept whole;
// `colsum_N`: N int64 that get C's column sums (zeros in; null: summed in a scratch), or, when
// `given`, hold them (CountSums: the rows are then only gathered from, ~1/3 of the time at
// W = 1024). Given, they are trusted as the planner trusts them (`dispatcher.check_plans`
// checks them against C), and a ranged expert's column is read on the shorter side of r only:
// below_G sums the rows s < r where r <= W - r, else is the column's sum less the rows s >= r
// (every rank reads at most half of it: the step waits for the slowest rank). Eight rows at a
// time: their sums and columns by baseline's pass (pricing.h's add_row_block), then each row's
// gathers from those rows, just read (W = 1024: the block's 256 KiB are in L2).
Pass read_columns(const int64_t* C, int64_t W, int64_t E, int64_t r,
                  const std::vector<int64_t>& ranged_g, const std::vector<int64_t>& full_g,
                  int64_t* colsum_N, bool given);

Pass read_counts(const int64_t* C, const mixmoe_native::Layout& x, int64_t E, int64_t r,
                 const std::vector<int64_t>& ranged_g, const std::vector<int64_t>& full_g,
                 int64_t* colsum_N, bool given) {
  const int64_t W = x.W;
  if (x.by_column) return read_columns(C, W, E, r, ranged_g, full_g, colsum_N, given);
  const int64_t N = W * E, G = static_cast<int64_t>(ranged_g.size());
  const int64_t F = static_cast<int64_t>(full_g.size());
  Pass out;
  out.own_WE.resize(W * E);
  out.col_G.assign(G, 0);
  out.below_G.assign(G, 0);
  out.full_FW.resize(F * W);
  std::vector<int64_t> scratch;
  if (colsum_N == nullptr) {
    scratch.assign(N, 0);
    colsum_N = scratch.data();
  }
  // given the sums: the rows of the ranged columns read, [lo, hi) (the shorter side of r)
  const bool below = r <= W - r;
  const int64_t lo = below ? 0 : r, hi = below ? r : W;
  std::vector<int64_t> side_G(G, 0);  // those rows' sums
  if (given) {
    for (int64_t g = 0; g < N; ++g) out.total += colsum_N[g];
    for (int64_t k = 0; k < G; ++k) out.col_G[k] = colsum_N[ranged_g[k]];
  }
  constexpr int64_t BLOCK = 8;
  int64_t sent[BLOCK];  // the block's row sums
  for (int64_t s0 = 0; s0 < W; s0 += BLOCK) {
    const int64_t n = std::min(BLOCK, W - s0);
    if (!given) {
      mixmoe_native::add_row_block(C + s0 * N, n, N, colsum_N, sent);  // signs: r's row, below
      for (int64_t k = 0; k < n; ++k) out.total += sent[k];
    }
    for (int64_t s = s0; s < s0 + n; ++s) {
      const int64_t* row = C + s * N;
      if (given && s + mixmoe_native::COLUMN_AHEAD < W) {  // (not given: add_row_block read it)
        const int64_t ahead = s + mixmoe_native::COLUMN_AHEAD;
        if (lo <= ahead && ahead < hi)  // the ranged columns: their side of r only
          for (int64_t g : ranged_g) mixmoe_native::prefetch_count(C, x, ahead, g);
        for (int64_t g : full_g) mixmoe_native::prefetch_count(C, x, ahead, g);
      }
      if (given) {  // the ranged columns' side of r (the rest of them is never read)
        if (lo <= s && s < hi)
          for (int64_t k = 0; k < G; ++k) side_G[k] += row[ranged_g[k]];
      } else {
        if (s == r) std::copy(out.col_G.begin(), out.col_G.end(), out.below_G.begin());
        for (int64_t k = 0; k < G; ++k) out.col_G[k] += row[ranged_g[k]];
      }
      for (int64_t f = 0; f < F; ++f) out.full_FW[f * W + s] = row[full_g[f]];
      for (int64_t e = 0; e < E; ++e) {
        out.diag += row[s * E + e];  // s's own experts
        out.own_WE[s * E + e] = row[r * E + e];
      }
    }
  }
  if (given)  // below_G: the rows s < r, summed or the column's sum less the rows s >= r
    for (int64_t k = 0; k < G; ++k) out.below_G[k] = below ? side_G[k] : out.col_G[k] - side_G[k];
  return out;
}

// read_counts of a C stored by columns (C[s][g] at C[g * W + s]): the same Pass, read column by
// column, each a run of consecutive counts: a ranged expert's rows below r (fewer than half
// its column, or its sum less the rows from r on, as read_counts), a full expert's column, r's
// experts' columns; the diagonal (each rank's own experts) a count a cache line. Without the
// sums, one pass over C's storage in memory order sums it first (baseline's, transposed).
Pass read_columns(const int64_t* C, int64_t W, int64_t E, int64_t r,
                  const std::vector<int64_t>& ranged_g, const std::vector<int64_t>& full_g,
                  int64_t* colsum_N, bool given) {
  const int64_t N = W * E, G = static_cast<int64_t>(ranged_g.size());
  const int64_t F = static_cast<int64_t>(full_g.size());
  Pass out;
  std::vector<int64_t> scratch;
  if (colsum_N == nullptr) {
    scratch.assign(N, 0);
    colsum_N = scratch.data();
  }
  if (!given) {  // the storage's rows are C's columns: its row sums are C's column sums
    std::vector<int64_t> rowsum_W(W, 0);
    mixmoe_native::add_row_block(C, N, W, rowsum_W.data(), colsum_N);  // signs: r's row, below
  }
  for (int64_t g = 0; g < N; ++g) out.total += colsum_N[g];
  const auto column = [&](int64_t g) { return C + g * W; };  // C[0..W)[g]
  out.col_G.resize(G);
  out.below_G.resize(G);
  const bool below = r <= W - r;
  for (int64_t k = 0; k < G; ++k) {
    const int64_t* col = column(ranged_g[k]);
    out.col_G[k] = colsum_N[ranged_g[k]];
    int64_t side = 0;
    for (int64_t s = below ? 0 : r; s < (below ? r : W); ++s) side += col[s];
    out.below_G[k] = below ? side : out.col_G[k] - side;
  }
  out.full_FW.resize(F * W);
  for (int64_t f = 0; f < F; ++f)
    std::copy(column(full_g[f]), column(full_g[f]) + W, out.full_FW.begin() + f * W);
  out.own_WE.resize(W * E);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t* col = column(r * E + e);
    for (int64_t s = 0; s < W; ++s) out.own_WE[s * E + e] = col[s];
  }
  for (int64_t s = 0; s < W; ++s)
    for (int64_t e = 0; e < E; ++e) out.diag += C[(s * E + e) * W + s];  // C[s][sE + e]
  return out;
}

// ranges._runs: the runs of the segment at stream rows [lo, hi): the ranges' ranks where they
// cover it (`ends`: each range's end), the owner past the last; `i` the first range to look at.
void stream_runs(int64_t lo, int64_t hi, const Pairs& ranges, const std::vector<int64_t>& ends,
                 int64_t owner, size_t i, std::vector<Run>& out) {
  while (lo < hi) {
    int64_t top;
    if (i < ends.size()) {
      top = std::min(hi, ends[i]);
      out.push_back({ranges.rank(static_cast<int64_t>(i)), top - lo});
      ++i;
    } else {
      top = hi;
      out.push_back({owner, top - lo});
    }
    lo = top;
  }
}

// ranges._stream_entries of a full expert: every segment of g's stream with an entry (col_W:
// its column).
bool stream_entries(const Plan& plan, const Ranged& x, const int64_t* col_W,
                    const std::vector<int64_t>& ends, Entries& out) {
  const int64_t W = plan.W, g = x.g, o = g / plan.E;
  const Hot* hot = plan.find(g);
  // stream_sources: sources with rows, neither the owner nor a holder (a kept holder stays)
  auto held = [&](int64_t s) { return hot != nullptr && hot->holds(s) && x.kept_local(s) < 0; };
  const int64_t q = ends.empty() ? 0 : ends.back();
  size_t i = 0;     // the first range ending after the segment's start (a walk: never back)
  int64_t lo = 0;   // the segment's start in the stream (_prefix)
  for (int64_t k = 0; k <= W; ++k) {
    const int64_t s = k < W ? k : o;  // the sources ascending, the owner last
    if (col_W[s] == 0 || (k < W && (s == o || held(s)))) continue;
    const int64_t local = x.kept_local(s);
    const int64_t hi = lo + col_W[s] - (local < 0 ? 0 : local);
    if (local >= 0 || lo < q) {  // else: wholly at the owner, no entry (the replica rule)
      while (i < ends.size() && ends[i] <= lo) ++i;
      const size_t at = out.runs.size();
      if (local > 0) out.runs.push_back({s, local});  // a kept holder's local rows first
      stream_runs(lo, hi, x.ranges, ends, o, i, out.runs);
      if (!close_entry(out, s, g, at)) return false;
    }
    lo = hi;
  }
  return true;
}

// Plan.expanded(C, E, r)'s range entries (ranges.range_shares(C, plan, E, r)), unsorted, and
// ranges.range_rows_moved(C, plan, E) into `moved`. False: Plan.expanded would raise.
bool expand_ranges(const Plan& plan, const int64_t* C, const mixmoe_native::Layout& lay,
                   int64_t r, const Pass& pass, const std::vector<char>& full, Entries& out,
                   int64_t& moved) {
  const int64_t W = plan.W, E = plan.E;
  auto c = [&](int64_t s, int64_t g) { return C[lay.at(s, g)]; };
  std::vector<int64_t> ends;
  std::vector<int64_t> ys;  // the ranks whose cells of g's column the stream changes
  int64_t f = 0;            // full experts so far (their columns in pass.full_FW, in order)
  moved = 0;
  for (size_t k = 0; k < plan.ranged.size(); ++k) {
    const Ranged& x = plan.ranged[k];
    const int64_t g = x.g, o = g / E;
    const Hot* hot = plan.find(g);
    // range_rows_moved: others = the stream's rows from sources other than the owner
    int64_t held = 0, rest = 0, taken = 0;
    if (hot != nullptr)
      for (int64_t j = 0; j < hot->n; ++j) held += c(hot->holders[j], g);
    for (int64_t j = 0; j < x.kept.n; ++j) rest += c(x.kept.rank(j), g) - x.kept.rows(j);
    const int64_t others = pass.col_G[k] - c(o, g) - held + rest;
    ends.clear();
    for (int64_t j = 0; j < x.ranges.n; ++j) ends.push_back(taken += x.ranges.rows(j));
    moved += std::max<int64_t>(0, taken - others) + rest;
    if (full[k]) {  // r owns or holds g: every segment of its stream
      if (!stream_entries(plan, x, pass.full_FW.data() + f * W, ends, out)) return false;
      ++f;
      continue;
    }
    // r's segment only: it starts after the stream's sources below r. The sum of C[s][g] over
    // s < r, less the owner's and the holders' cells below r, a kept holder's cell its rest
    int64_t lo = pass.below_G[k];
    ys.clear();
    ys.push_back(o);
    if (hot != nullptr) ys.insert(ys.end(), hot->holders, hot->holders + hot->n);
    for (int64_t j = 0; j < x.kept.n; ++j) ys.push_back(x.kept.rank(j));
    std::sort(ys.begin(), ys.end());
    ys.erase(std::unique(ys.begin(), ys.end()), ys.end());
    for (const int64_t y : ys) {
      if (y >= r) break;
      const int64_t local = x.kept_local(y);
      lo -= local >= 0 ? local : c(y, g);  // kept: C[y][g] - local stays; else 0 stays
    }
    const int64_t rows = c(r, g), q = taken;
    if (rows != 0 && lo < q) {  // r's segment, partly or wholly in the ranges
      const size_t at = out.runs.size();
      const size_t i = std::upper_bound(ends.begin(), ends.end(), lo) - ends.begin();
      stream_runs(lo, lo + rows, x.ranges, ends, o, i, out.runs);
      if (!close_entry(out, r, g, at)) return false;
    }
  }
  return true;
}

// Everything build_step_plan computes but the fetch, as flat int vectors (mixmoe_step_plan's doc).
struct Fields {
  bool shared = false;
  int64_t rows_moved = 0, n_send = 0, owned_rows_stay = 0;
  std::vector<int64_t> rep;                                       // r's replica slots (H)
  std::vector<int64_t> in_splits, out_splits, recv_counts, send;  // send: the replica rule's
  std::vector<int64_t> col_slot, col_replica;                     // M each (shares)
  std::vector<int64_t> run_len, run_key, own_c, rep_c;            // SourceRuns (shares)
};

// build_step_plan's fields for rank r; false: run the Python.
bool step_fields(const int64_t* C, const mixmoe_native::Layout& lay, const Plan& plan,
                 int64_t r, int64_t* colsum_N, bool given, Fields& out) {
  const int64_t W = plan.W, E = plan.E, N = plan.N;
  auto c = [&](int64_t s, int64_t g) { return C[lay.at(s, g)]; };
  std::vector<int64_t> gathered;  // by columns: r's row, gathered once (a count a cache line)
  if (lay.by_column) {
    gathered.resize(N);
    for (int64_t g = 0; g < N; ++g) gathered[g] = c(r, g);
  }
  const int64_t* row_r = lay.by_column ? gathered.data() : C + r * N;
  for (int64_t g = 0; g < N; ++g)
    if (row_r[g] < 0) return false;  // (negative counts: the Python's business)
  // r's replica slots: the hot experts it holds, ascending (Plan.replica_slots)
  std::vector<int64_t>& rep = out.rep;
  for (const Hot& h : plan.hot)
    if (h.holds(r)) rep.push_back(h.g);
  const int64_t H = static_cast<int64_t>(rep.size());
  std::vector<int32_t> slot_N(N, -1);  // replica slot of each expert held here
  for (int64_t h = 0; h < H; ++h) slot_N[rep[h]] = static_cast<int32_t>(h);

  std::vector<int64_t> ranged_g, full_g;
  std::vector<char> full;
  for (const Ranged& x : plan.ranged) {
    ranged_g.push_back(x.g);
    full.push_back(x.g / E == r || plan.holds(x.g, r));
    if (full.back()) full_g.push_back(x.g);
  }
  const Pass pass = read_counts(C, lay, E, r, ranged_g, full_g, colsum_N, given);

  // the replica rule (build_step_plan's vectorised part): a segment (s, g) stays at s when s
  // owns g or holds its replica; r receives its own experts' rows from the other sources
  std::vector<int64_t> recv_WE = pass.own_WE;
  int64_t stay = pass.diag;
  for (const Hot& h : plan.hot) {
    for (int64_t j = 0; j < h.n; ++j) {
      stay += c(h.holders[j], h.g);
      if (h.g / E == r) recv_WE[h.holders[j] * E + h.g - r * E] = 0;  // the holder computes it
    }
  }
  std::fill(recv_WE.begin() + r * E, recv_WE.begin() + (r + 1) * E, 0);
  Entries expanded;
  int64_t ranges_moved = 0;
  if (!expand_ranges(plan, C, lay, r, pass, full, expanded, ranges_moved)) return false;
  out.rows_moved = pass.total - stay + ranges_moved;
  out.shared = !plan.shares.items.empty() || !plan.ranged.empty();
  out.in_splits.assign(W, 0);
  out.out_splits.assign(W, 0);
  if (!out.shared) {
    for (int64_t g = 0; g < N; ++g) {
      if (g / E == r || slot_N[g] >= 0) continue;  // stays here
      out.send.push_back(g);
      out.in_splits[g / E] += row_r[g];
    }
    for (int64_t s = 0; s < W; ++s)
      for (int64_t e = 0; e < E; ++e) out.out_splits[s] += recv_WE[s * E + e];
    out.recv_counts = std::move(recv_WE);
    return true;
  }

  // -- share_fields, source side: r's rows as runs, expert by expert (its entries by g: the
  // explicit shares of source r, a range entry of source r; never both for one g)
  const Entries* both[] = {&plan.shares, &expanded};  // the expanded plan's share entries
  std::vector<std::pair<const Entry*, const Run*>> mine;  // r's entries, with their runs
  for (const Entries* entries : both)
    for (const Entry& en : entries->items)
      if (en.s == r) mine.push_back({&en, entries->runs.data() + en.at});
  // by g: unique (an expert has share entries or ranges, not both; one range entry per (s, g))
  std::sort(mine.begin(), mine.end(),
            [](const auto& a, const auto& b) { return a.first->g < b.first->g; });
  out.own_c.assign(E, 0);
  out.rep_c.assign(H, 0);
  size_t next = 0;  // the next entry of r's
  auto walk = [&](int64_t g, int64_t rank, int64_t n) {  // _walk_segment's one run
    int64_t key;
    if (rank != r) {
      key = E + H + rank * N + g;  // by receiver, then expert: the receiver's order
      out.in_splits[rank] += n;
    } else if (g / E == r) {
      key = g - r * E;  // own slot
      out.own_c[key] += n;
    } else {
      if (slot_N[g] < 0) return false;  // a run here without a replica: the Python's KeyError
      key = E + slot_N[g];
      out.rep_c[slot_N[g]] += n;
    }
    out.run_len.push_back(n);
    out.run_key.push_back(key);
    return true;
  };
  for (int64_t g = 0; g < N; ++g) {
    if (next < mine.size() && mine[next].first->g == g) {  // the segment's entry
      const auto [en, runs] = mine[next++];
      for (int64_t j = 0; j < en->n; ++j)
        if (!walk(g, runs[j].rank, runs[j].rows)) return false;
    } else if (row_r[g] != 0) {  // one run where the replica rule computes it
      // (Plan.computed_at(r, g): here when r owns g or holds its replica, else at the owner)
      if (!walk(g, g / E == r || slot_N[g] >= 0 ? r : g / E, row_r[g])) return false;
    }
  }
  int64_t own_sum = 0, own_c_sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    own_sum += row_r[r * E + e];
    own_c_sum += out.own_c[e];
  }
  for (int64_t s = 0; s < W; ++s) out.n_send += out.in_splits[s];
  out.owned_rows_stay = own_c_sum == own_sum;

  // -- receive side: columns = own experts and replicas held here, by expert id
  std::vector<int64_t> cols(rep);
  for (int64_t e = 0; e < E; ++e) cols.push_back(r * E + e);
  std::sort(cols.begin(), cols.end());
  const int64_t M = static_cast<int64_t>(cols.size());
  std::vector<int32_t> col_N(N, -1);  // (sparse: only cols' experts)
  for (int64_t j = 0; j < M; ++j) col_N[cols[j]] = static_cast<int32_t>(j);
  out.recv_counts.assign(W * M, 0);
  for (int64_t s = 0; s < W; ++s)  // the replica rule's counts (a replica column: 0)
    for (int64_t e = 0; e < E; ++e) out.recv_counts[s * M + col_N[r * E + e]] = recv_WE[s * E + e];
  auto receive = [&](int64_t s, int64_t g, const Run* runs, int64_t n) {
    if (s == r || col_N[g] < 0) return;
    int64_t here = 0;  // dict(runs).get(r, 0)
    for (int64_t j = 0; j < n; ++j)
      if (runs[j].rank == r) here = runs[j].rows;
    out.recv_counts[s * M + col_N[g]] = here;
  };
  for (const Entries* entries : both)
    for (const Entry& en : entries->items)
      receive(en.s, en.g, entries->runs.data() + en.at, en.n);
  std::fill(out.recv_counts.begin() + r * M, out.recv_counts.begin() + (r + 1) * M, 0);
  for (int64_t s = 0; s < W; ++s)
    for (int64_t j = 0; j < M; ++j) out.out_splits[s] += out.recv_counts[s * M + j];
  for (const int64_t g : cols) {
    out.col_slot.push_back(g / E == r ? g - r * E : slot_N[g]);
    out.col_replica.push_back(g / E != r);
  }
  // -- rows crossing ranks: the replica rule's total corrected for the explicit shares
  for (const Entry& en : plan.shares.items) {
    const int64_t before = plan.computed_at(en.s, en.g) != en.s ? c(en.s, en.g) : 0;
    int64_t away = 0;
    for (int64_t j = en.at; j < en.at + en.n; ++j)
      if (plan.shares.runs[j].rank != en.s) away += plan.shares.runs[j].rows;
    out.rows_moved += away - before;
  }
  return true;
}

}  // namespace

// build_step_plan(C, plan, r, E)'s fields but the fetch, for the plan packed at `packed`
// (`packed_len` ints: Plan's parse) and C [W, W*E] (int64: row-major, or by columns where
// `by_column` != 0: C[s][g] at C[g * W + s], read_columns). Writes into out (`cap`
// ints): the header [shared, rows_moved, n_send, owned_rows_stay, H, M (E when not shared),
// R (runs; the replica rule: the sent experts), 0], then the replica slots [H] (Plan.replica_slots),
// in_splits [W], out_splits [W], recv_counts [W * M] (source-major, then column) and, with
// shares, per column its slot [M] and
// whether it is a replica [M], run_len [R], run_key [R], own_c [E], rep_c [H]; without, the
// sent experts [R]. Returns the ints written, SHORT (out[0]: the ints needed, when cap >= 1) or
// FALLBACK (the caller runs the Python). `colsum_N`: null, or N int64 that get C's column sums
// (the rows routed to each expert over the group; read off the same pass; meaningful only when
// the entry returns the fields); `given` != 0: they hold C's column sums already (CountSums;
// left as they are, trusted: no pass sums C, and a ranged expert's column is read on the
// shorter side of r only: read_counts).
extern "C" int64_t mixmoe_step_plan(const int64_t* C, int64_t W, int64_t E, int64_t r,
                                    const int64_t* packed, int64_t packed_len, int64_t* out,
                                    int64_t cap, int64_t* colsum_N, int64_t given,
                                    int64_t by_column) {
  if (W < 1 || E < 1 || r < 0 || r >= W || (given && colsum_N == nullptr)) return FALLBACK;
  Plan plan;
  plan.W = W;
  plan.E = E;
  plan.N = W * E;
  if (!plan.parse(packed, packed_len)) return FALLBACK;
  Fields f;
  if (colsum_N && !given) std::fill(colsum_N, colsum_N + plan.N, 0);
  const mixmoe_native::Layout lay{W, W * E, by_column != 0};
  if (!step_fields(C, lay, plan, r, colsum_N, given != 0, f)) return FALLBACK;
  const std::vector<int64_t>* parts[] = {&f.rep, &f.in_splits, &f.out_splits, &f.recv_counts,
                                         &f.col_slot,  &f.col_replica, &f.run_len,
                                         &f.run_key,   &f.own_c,      &f.rep_c,
                                         &f.send};
  int64_t need = HEADER;
  for (const auto* v : parts) need += static_cast<int64_t>(v->size());
  if (need > cap) {
    if (cap >= 1) out[0] = need;
    return SHORT;
  }
  const int64_t M = f.shared ? static_cast<int64_t>(f.col_slot.size()) : E;
  const int64_t R = f.shared ? static_cast<int64_t>(f.run_len.size())
                             : static_cast<int64_t>(f.send.size());
  const int64_t head[HEADER] = {f.shared, f.rows_moved, f.n_send, f.owned_rows_stay,
                                static_cast<int64_t>(f.rep.size()), M, R, 0};
  int64_t at = 0;
  for (const int64_t v : head) out[at++] = v;
  for (const auto* v : parts) {
    std::copy(v->begin(), v->end(), out + at);
    at += static_cast<int64_t>(v->size());
  }
  return at;
}
