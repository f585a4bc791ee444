// level_fill.cpp's totals after each pass (Fill::retotal_touched: only the ranks the pass
// touched get theirs again) against every rank's total computed afresh, over fills of random
// counts: one link and nodes, plain and kept fills (whose keeps take rows back off helpers:
// Fill::keep's excess), blocks of 16 and 64 rows. Built by tests/placement/test_native_fill.py
// (test_touched_totals_are_every_total) with -DMIXMOE_CHECK_TOUCHED and -I the native folder: it
// includes the .cpp itself. Prints "ok <fills> <passes checked> <excess keeps> <live lists>
// <digest>", or the first fill whose totals differ. The digest hashes every fill's output (its
// loads, totals and replica bits, holders, amounts and kept rows): the test builds the driver
// again with -DMIXMOE_LIVE_FROM=0 (every holder walk of matched from a LiveHolders list, which
// the library takes from 64 holders on) and compares the two digests.
#define MIXMOE_CHECK_TOUCHED
#include "level_fill.cpp"

#include <cstdio>
#include <cstring>
#include <random>

uint64_t digest = 14695981039346656037ull;  // FNV-1a over every fill's output
void mix(uint64_t x) {
  for (int k = 0; k < 8; ++k) digest = (digest ^ ((x >> (8 * k)) & 0xff)) * 1099511628211ull;
}
uint64_t bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

int main() {
  using namespace mixmoe_native;
  std::mt19937_64 rng(26);
  int fills = 0;
  for (int rep = 0; rep < 400; ++rep) {
    const int64_t W = 2 + static_cast<int64_t>(rng() % 40), E = int64_t{1} << (rng() % 3);
    const int64_t N = W * E;
    // zipf-like popularity: a few hot experts, many cold ones, some ranks routing nothing
    std::vector<int64_t> C(static_cast<size_t>(W * N));
    for (int64_t s = 0; s < W; ++s) {
      if (rng() % 9 == 0) continue;
      for (int64_t g = 0; g < N; ++g) {
        const int64_t rank = static_cast<int64_t>((g * 7919 + rep) % N) + 1;
        C[s * N + g] = static_cast<int64_t>(rng() % static_cast<uint64_t>(4000 / rank + 2));
      }
    }
    const Counts counts{W, E, N, C.data()};
    std::vector<int64_t> colsum(N, 0), own(N, 0), sent(W, 0);
    Loads loads{std::vector<int64_t>(W, 0), std::vector<int64_t>(W, 0),
                std::vector<int64_t>(W, 0), std::vector<double>(W, 0.0)};
    for (int64_t s = 0; s < W; ++s)
      for (int64_t g = 0; g < N; ++g) colsum[g] += C[s * N + g], sent[s] += C[s * N + g];
    for (int64_t r = 0; r < W; ++r) {  // cost_model.baseline_loads
      for (int64_t g = r * E; g < (r + 1) * E; ++g) {
        own[g] = C[r * N + g];
        loads.rows[r] += colsum[g];
        loads.local[r] += own[g];
      }
      loads.remote[r] = (sent[r] - loads.local[r]) + (loads.rows[r] - loads.local[r]);
    }
    // fpr, tbr, P, weight collectives, overlap; gf, bw, row_s, fixed_s, rep_s, token0, lat
    const int64_t ints[5] = {50331648, 4096, 16787456, 2, static_cast<int64_t>(rng() % 2)};
    const double reals[7] = {5.934e14, 3.15e11, rng() % 2 ? 1e-8 : 0.0, 0.0,
                             rng() % 2 ? 2e-5 : 0.0, 1.2e-4, 3e-5};
    const Model model = Model::from(ints, reals);
    bool any_remote = false;
    for (int64_t x : loads.remote) any_remote = any_remote || x != 0;
    for (bool kept : {false, true}) {
      const int64_t per_node = rng() % 3 == 0 ? 1 + static_cast<int64_t>(rng() % 4) : 0;
      FillSettings settings{8, rng() % 2 ? 16 : 64, 12, 1.02, kept, true, per_node};
      if (per_node > 0 && rng() % 2)  // across nodes, the copies split by link (total_split)
        settings.bw_near = 3.15e11, settings.bw_far = 4e10;
      const FillOut out = level_fill(counts, colsum, own, model, {}, any_remote, loads, settings);
      ++fills;
      mix(static_cast<uint64_t>(out.moves));
      for (const auto* v : {&out.loads.rows, &out.loads.local, &out.loads.remote})
        for (int64_t x : *v) mix(static_cast<uint64_t>(x));
      for (const auto* v : {&out.totals, &out.loads.replica})
        for (double x : *v) mix(bits(x));
      for (const auto& [g, hs] : out.replicas)
        for (int64_t h : hs) mix(static_cast<uint64_t>(g * W + h));
      for (const auto* groups : {&out.amounts, &out.kept_local})
        for (const auto& [g, entries] : *groups)
          for (const auto& [r, n] : entries) mix(static_cast<uint64_t>((g * W + r) * 7 + n));
      if (touched_misses) {
        std::printf("totals differ: rep %d W %lld E %lld kept %d\n", rep,
                    static_cast<long long>(W), static_cast<long long>(E), kept);
        return 1;
      }
    }
  }
  std::printf("ok %d %lld %lld %lld %016llx\n", fills, static_cast<long long>(touched_checks),
              static_cast<long long>(excess_keeps), static_cast<long long>(live_lists),
              static_cast<unsigned long long>(digest));
  return 0;
}
