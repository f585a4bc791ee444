// What the planning benchmarks need to time the planner as the layer runs it (its Python side:
// mixmoe/placement/native_cache_lines.py; bench planner, bench balance): the counts the device
// copies to the host each step arrive in memory, not in this CPU's caches, so before each timed
// call the benchmark writes them back and drops them from every cache level, line by line, as
// that copy leaves them.

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Flushes the cache lines of [p, p + bytes) from every level (written back first where dirty).
// Returns 0, or -1 where this architecture's flush is not built here (the caller then evicts by
// writing a buffer larger than the caches).
extern "C" int64_t mixmoe_flush_lines(const void* p, int64_t bytes) {
#if defined(__x86_64__) || defined(__i386__) || defined(__aarch64__)
  constexpr int64_t LINE = 64;  // x86-64 and the Arm cores torch runs on: 64-byte lines
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes);
  for (uintptr_t at = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(LINE - 1); at < end; at += LINE) {
    const void* line = reinterpret_cast<const void*>(at);  // the line's first byte
#if defined(__aarch64__)
    asm volatile("dc civac, %0" : : "r"(line) : "memory");
#else
    _mm_clflush(line);
#endif
  }
#if defined(__aarch64__)
  asm volatile("dsb ish" : : : "memory");
#else
  _mm_mfence();  // the flushes done before the timed call reads
#endif
  return 0;
#else
  (void)p;
  (void)bytes;
  return -1;
#endif
}
