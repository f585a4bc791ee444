// level_fill.cpp's sorts (Ascending: the level's points; sort_ranks: the donors and receivers;
// sort_through: the keep's amounts, below)
// against std::stable_sort by the double comparison (ties in x keep insertion order; -0.0 and
// 0.0 tie), on xs no fill may meet yet: ties, -0.0 with 0.0, clumps a few ulps wide, a huge
// range, subnormals, on both sides of BUCKETS_FROM and RADIX_SMALL. Built by
// tests/placement/test_native_fill.py (test_sorts_match_a_stable_sort) with -I the native
// folder: it includes the .cpp itself, so the library exports nothing for it. Prints "ok <cases>".
#include "level_fill.cpp"

#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <utility>

namespace {

// xs of one kind: random, few distinct values (ties), -0.0 mixed with 0.0, clumps a few ulps
// wide, negatives and a huge range, subnormals
std::vector<double> draw(std::mt19937_64& rng, int kind, size_t n) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> xs(n);
  for (size_t i = 0; i < n; ++i) {
    const double v = u(rng);
    switch (kind) {
      case 0: xs[i] = v; break;
      case 1: xs[i] = static_cast<double>(rng() % 5) * 0.25 - 0.5; break;
      case 2: xs[i] = rng() % 2 ? 0.0 : -0.0; if (rng() % 4 == 0) xs[i] = v - 0.5; break;
      case 3: xs[i] = std::nextafter(0.005 * (1 + rng() % 3), 1.0) + 1e-18 * (rng() % 7); break;
      case 4:  // both signs, exponents -1000 to 999
        xs[i] = (rng() % 2 ? -1 : 1) * std::ldexp(v, static_cast<int>(rng() % 2000) - 1000);
        break;
      default: xs[i] = (rng() % 2 ? -1 : 1) * 4.9e-324 * static_cast<double>(rng() % 4); break;
    }
  }
  return xs;
}

}  // namespace

int main() {
  std::mt19937_64 rng(2026);
  LevelScratch ws;
  int checked = 0;
  for (size_t n : {0, 1, 2, 3, 15, 16, 17, 33, 255, 256, 257, 300, 1000, 2600}) {
    for (int kind = 0; kind < 6; ++kind) {
      for (int rep = 0; rep < 3; ++rep) {
        const std::vector<double> xs = draw(rng, kind, n);
        std::vector<uint32_t> want(n);  // insertion indexes, stably by x (-0.0 == 0.0)
        std::iota(want.begin(), want.end(), 0u);
        std::stable_sort(want.begin(), want.end(),
                         [&](uint32_t p, uint32_t q) { return xs[p] < xs[q]; });
        std::vector<Keyed> keys;
        for (size_t i = 0; i < n; ++i) keys.push_back(keyed(xs[i], static_cast<uint32_t>(i)));
        Ascending by_x(keys, ws);  // as level reads it: index after index
        for (size_t i = 0; i < n; ++i)
          if (at_of(by_x[i]) != want[i]) {
            std::printf("Ascending differs: n %zu kind %d at %zu\n", n, kind, i);
            return 1;
          }
        for (bool descending : {false, true}) {  // the ranks by (T, r) and (-T, r)
          std::vector<int64_t> ranks(n), expect(n);
          std::iota(ranks.begin(), ranks.end(), 0);
          std::iota(expect.begin(), expect.end(), 0);
          std::stable_sort(expect.begin(), expect.end(), [&](int64_t p, int64_t q) {
            return descending ? -xs[p] < -xs[q] : xs[p] < xs[q];
          });
          sort_ranks(ranks, xs, descending, ws);
          if (ranks != expect) {
            std::printf("sort_ranks differs: n %zu kind %d descending %d\n", n, kind, descending);
            return 1;
          }
        }
        ++checked;
      }
    }
  }
  // sort_through (Fill::keep's amounts, largest first): each prefix read, however long, is the
  // full sort's, on lists short and long (KEEP_SORT_ALL), read a few entries (the chunks) or past
  // a quarter (the rest whole), amounts with ties (ranks break them) or none
  for (size_t n : {0, 1, 5, 31, 32, 33, 40, 64, 100, 257, 1023}) {
    for (size_t k : {1, 2, 4, 5, 8, 9, 13, 17, 33, 80, 300, 1023}) {
      if (k > n && k != 1) continue;
      for (int64_t spread : {3, 1000000}) {  // amounts drawn from [1, spread]: ties, or few
        std::vector<int64_t> ranks(n);
        std::iota(ranks.begin(), ranks.end(), 0);
        std::shuffle(ranks.begin(), ranks.end(), rng);
        std::vector<std::pair<int64_t, int64_t>> v(n);  // (-amount, rank), distinct by rank
        for (size_t i = 0; i < n; ++i)
          v[i] = {-1 - static_cast<int64_t>(rng() % static_cast<uint64_t>(spread)), ranks[i]};
        std::vector<std::pair<int64_t, int64_t>> want = v;
        std::sort(want.begin(), want.end());
        size_t ready = 0;
        for (size_t i = 0; i < std::min(k, n); ++i) {
          sort_through(v, i, ready);
          if (v[i] != want[i] || ready <= i || ready > n) {
            std::printf("sort_through differs: n %zu k %zu at %zu\n", n, k, i);
            return 1;
          }
        }
        std::sort(v.begin(), v.end());  // nothing lost or duplicated
        if (v != want) {
          std::printf("sort_through lost entries: n %zu k %zu\n", n, k);
          return 1;
        }
        ++checked;
      }
    }
  }
  std::printf("ok %d\n", checked);
  return 0;
}
