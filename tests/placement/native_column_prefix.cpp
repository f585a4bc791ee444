// level_fill.cpp's read_block (plan_fields' block of rows read through the plan's column
// prefixes, ColumnPrefix in common.h) against C itself: random counts, random active experts,
// prefixes of every length a block can meet (none, shorter than the block's start, ending
// inside the block, at its end, past it), blocks of every size up to 64 rows, W up to 130. After
// each call the block must hold C's counts and every prefix C's column from row 0. Built by tests/placement/test_native_fill.py
// (test_column_prefixes_hold_cs_columns) with -I the native folder: it includes the .cpp
// itself. Prints "ok <blocks>", or the first block that differs.
#include "level_fill.cpp"

#include <cstdio>
#include <random>

int main() {
  using namespace mixmoe_native;
  std::mt19937_64 rng(65);
  int blocks = 0;
  ColumnPrefix prefix;  // one for every counts, reset for each, as plan_mix's thread keeps one
  for (int rep = 0; rep < 300; ++rep) {
    const int64_t W = 1 + static_cast<int64_t>(rng() % 130), E = 1 + static_cast<int64_t>(rng() % 3);
    const int64_t N = W * E;
    std::vector<int64_t> C(static_cast<size_t>(W * N));
    for (auto& x : C) x = static_cast<int64_t>(rng() % 50);
    prefix.reset(N);
    Fill f;
    f.W = W, f.E = E, f.N = N, f.C = C.data(), f.prefix = &prefix;
    // some prefixes to start from: any length up to W, read from C
    for (int64_t g = 0; g < N; ++g) {
      if (rng() % 3 == 0) continue;
      const int64_t len = static_cast<int64_t>(rng() % static_cast<uint64_t>(W + 1));
      std::vector<int64_t>& col = prefix.column(g);
      for (int64_t s = 0; s < len; ++s) col.push_back(C[s * N + g]);
    }
    std::vector<Stream> pool(static_cast<size_t>(1 + rng() % 6));
    std::vector<Stream*> active;
    for (auto& st : pool) {
      st.g = static_cast<int64_t>(rng() % static_cast<uint64_t>(N));
      active.push_back(&st);
    }
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 64);
    std::vector<int64_t> chunk(active.size() * static_cast<size_t>(rows), -1);
    std::vector<std::pair<size_t, int64_t>> todo{{7, 7}};  // read_block clears it first
    for (int64_t s0 = static_cast<int64_t>(rng() % 3) * rows; s0 < W; s0 += rows) {
      const int64_t s1 = std::min(W, s0 + rows);
      std::fill(chunk.begin(), chunk.end(), -1);  // a stale chunk would show
      read_block(f, active, s0, s1, rows, chunk, todo);
      ++blocks;
      for (size_t a = 0; a < active.size(); ++a)
        for (int64_t s = s0; s < s1; ++s)
          if (chunk[a * rows + (s - s0)] != C[s * N + active[a]->g]) {
            std::printf("block differs: rep %d W %ld rows %ld s0 %ld expert %ld row %ld\n", rep,
                        static_cast<long>(W), static_cast<long>(rows), static_cast<long>(s0),
                        static_cast<long>(active[a]->g), static_cast<long>(s));
            return 1;
          }
      for (int64_t g = 0; g < N; ++g)
        for (int64_t s = 0; s < prefix.len(g); ++s)
          if (prefix.data(g)[s] != C[s * N + g]) {
            std::printf("prefix differs: rep %d W %ld expert %ld row %ld\n", rep,
                        static_cast<long>(W), static_cast<long>(g), static_cast<long>(s));
            return 1;
          }
    }
  }
  std::printf("ok %d\n", blocks);
  return 0;
}
