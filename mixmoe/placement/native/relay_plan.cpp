// One rank's replica fetch compiled: mixmoe.dispatch.replicas.RelayPlan.build's fields (the pack,
// the rounds' sends, splits and receives, the replica slots) from a plan's replicas, the same
// values (tests/dispatch/test_relay_native.py compares every field with the Python,
// replicas.relay_plan_python, the slow twin).
//
// Legend: W ranks, E experts per rank, N = W*E experts (g's owner o = g / E), r the rank; an
// expert's holders split as relay.holder_groups splits them: k near (the owner's node, or all
// without a topology), R far on L other nodes, c of them on the node at hand. A message is
// (sender, receiver, chunk j, chunks n); a piece (g, j, n); a take (buffer, entry, j, n): buffer
// 0 = r's packed owned rows, k + 1 = round k's received pieces in receive order.
//
// The same steps as the Python: relay.relay_messages_at's messages of each expert r owns or
// holds (or the owner's flat fan-out), the rounds the longest route takes (relay.relay_rounds),
// then round by round the sends (receiver, expert, chunk ascending) read from where r holds each
// piece (that very piece, else the whole row it is cut from) and the receives (sender, expert,
// chunk ascending) recorded where they land. Only integer work; every order the Python fixes is
// fixed here by the same sorts. Topologies: one link (per_node 0) or nodes of per_node
// consecutive ranks (relay.nodes_of); any other distance runs the Python.
//
// Holders out of [0, W), repeated or the owner, an expert out of [0, N), or a piece r would read
// but does not hold: the entry returns FALLBACK and the caller runs the Python, which then raises
// its error (or does what it does). C entry: mixmoe_relay_plan (dispatch/relay_native.py).

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t FALLBACK = -2;  // run the Python (the file's doc)
constexpr int64_t SHORT = -1;     // the output buffer is too small: out[0] says how many ints
constexpr int MAX_ROUNDS = 3;     // relay.MAX_ROUNDS

using Msg = std::array<int64_t, 4>;  // (sender, receiver, j, n), or sorted keys (peer, g, j, n)

struct Route {  // relay.holder_groups: near ascending; far by node (ascending), holders ascending
  std::vector<int64_t> near, far;
  std::vector<int64_t> starts;  // each far node's first index in far, then far.size()
};

// `msgs` ((peer, g, j, n) keys) ascending, as std::sort orders them: each key one integer
// ((peer * N + g) * span + j) * span + n (every field below its radix: the integers ascend as
// the keys do) sorted with its index, the messages then gathered in that order (a far holder's
// ~8000 pieces at W = 1024 under nodes: one integer compare instead of up to four); keys past
// int64 keep the four-field sort
struct MsgScratch {
  std::vector<std::pair<uint64_t, uint32_t>> keys;
  std::vector<Msg> msgs;
};

void sort_msgs(std::vector<Msg>& msgs, int64_t W, int64_t N, int64_t span, MsgScratch& x) {
  const int64_t top = std::numeric_limits<int64_t>::max();
  if (W > ((top / span) / span) / N || msgs.size() > std::numeric_limits<uint32_t>::max()) {
    std::sort(msgs.begin(), msgs.end());
    return;
  }
  const uint64_t s = static_cast<uint64_t>(span), n_g = static_cast<uint64_t>(N);
  x.keys.clear();
  for (size_t i = 0; i < msgs.size(); ++i) {
    const Msg& m = msgs[i];
    const uint64_t key = ((static_cast<uint64_t>(m[0]) * n_g + static_cast<uint64_t>(m[1])) * s +
                          static_cast<uint64_t>(m[2])) * s + static_cast<uint64_t>(m[3]);
    x.keys.emplace_back(key, static_cast<uint32_t>(i));
  }
  std::sort(x.keys.begin(), x.keys.end());
  x.msgs.clear();
  for (const auto& [key, i] : x.keys) x.msgs.push_back(msgs[i]);
  msgs.swap(x.msgs);
}

Route route_of(int64_t owner, std::vector<int64_t> holders, int64_t per_node) {
  std::sort(holders.begin(), holders.end());
  Route rt;
  if (per_node == 0) {
    rt.near = std::move(holders);
  } else {
    const int64_t home = owner / per_node;
    for (int64_t h : holders) {
      if (h / per_node == home) {
        rt.near.push_back(h);
        continue;
      }
      // holders ascend, so one node's holders are consecutive and nodes come lowest first
      if (rt.far.empty() || rt.far.back() / per_node != h / per_node)
        rt.starts.push_back(static_cast<int64_t>(rt.far.size()));
      rt.far.push_back(h);
    }
  }
  rt.starts.push_back(static_cast<int64_t>(rt.far.size()));
  return rt;
}

int64_t groups(const Route& rt) { return static_cast<int64_t>(rt.starts.size()) - 1; }

int rounds_of(const Route& rt) {  // relay.relay_rounds
  const int64_t k = static_cast<int64_t>(rt.near.size()), R = static_cast<int64_t>(rt.far.size());
  if (k + R == 0) return 0;
  const int64_t L = groups(rt);
  return 1 + (k >= 2 || R >= 2) + (L >= 2 && R > L);
}

// relay._exchange_block: [lo, hi) of t that a far node's i-th holder (of c) receives
std::pair<int64_t, int64_t> block(int64_t i, int64_t c, int64_t lacking) {
  const int64_t q = lacking / c, extra = lacking % c;
  const int64_t lo = i * q + std::min(i, extra);
  return {lo, lo + q + (i < extra ? 1 : 0)};
}

// relay._exchange_receiver: the index in `far` of node [start, start + c)'s receiver of chunk p
int64_t receiver(int64_t p, int64_t start, int64_t c, int64_t R) {
  const int64_t t = p < start ? p : p - c;
  const int64_t q = (R - c) / c, extra = (R - c) % c;
  const int64_t big = extra * (q + 1);
  return start + (t < big ? t / (q + 1) : extra + (t - big) / q);
}

// the chunks the i-th holder of node [at, at + c) holds after the exchange: its own, then those
// of its block (relay_messages_at's held)
void held_chunks(int64_t i, int64_t at, int64_t c, int64_t R, std::vector<int64_t>& out) {
  out.clear();
  out.push_back(at + i);
  const auto [lo, hi] = block(i, c, R - c);
  for (int64_t t = lo; t < hi; ++t) out.push_back(t < at ? t : t + c);
}

// relay.relay_messages_at(r, owner, holders): r's messages of the route, by round
void messages_at(int64_t r, int64_t o, const Route& rt, std::vector<Msg> (&out)[MAX_ROUNDS]) {
  const int64_t k = static_cast<int64_t>(rt.near.size());
  if (r == o) {
    if (k == 1) out[0].push_back({o, rt.near[0], 0, 1});
    if (k >= 2)
      for (int64_t i = 0; i < k; ++i) out[0].push_back({o, rt.near[i], i, k});
  } else {
    const auto it = std::find(rt.near.begin(), rt.near.end(), r);
    if (it != rt.near.end()) {
      const int64_t i = it - rt.near.begin();
      out[0].push_back(k == 1 ? Msg{o, r, 0, 1} : Msg{o, r, i, k});
      if (k >= 2) {  // round 1: it passes chunk i on, and receives every other near chunk
        for (int64_t b : rt.near)
          if (b != r) out[1].push_back({r, b, i, k});
        for (int64_t j = 0; j < k; ++j)
          if (rt.near[j] != r) out[1].push_back({rt.near[j], r, j, k});
      }
    }
  }
  const int64_t R = static_cast<int64_t>(rt.far.size()), L = groups(rt);
  if (R == 1) {
    if (r == o || r == rt.far[0]) out[0].push_back({o, rt.far[0], 0, 1});
    return;
  }
  if (R < 2) return;
  if (r == o) {
    for (int64_t p = 0; p < R; ++p) out[0].push_back({o, rt.far[p], p, R});
    return;
  }
  const auto it = std::find(rt.far.begin(), rt.far.end(), r);
  if (it == rt.far.end()) return;
  const int64_t mine = it - rt.far.begin();  // r's chunk
  out[0].push_back({o, r, mine, R});
  int64_t home = 0;
  while (rt.starts[home + 1] <= mine) ++home;
  const int64_t at = rt.starts[home], c = rt.starts[home + 1] - at, i_r = mine - at;
  // the exchange (round 1): r's own chunk to one holder of each other far node, and each chunk
  // of r's block from its holder
  for (int64_t m = 0; m < L; ++m) {
    const int64_t start = rt.starts[m];
    if (start != at)
      out[1].push_back({r, rt.far[receiver(mine, start, rt.starts[m + 1] - start, R)], mine, R});
  }
  std::vector<int64_t> held;
  held_chunks(i_r, at, c, R, held);
  for (size_t x = 1; x < held.size(); ++x) out[1].push_back({rt.far[held[x]], r, held[x], R});
  // inside the node: r's chunks to each other holder, theirs to r
  auto& last = out[L >= 2 ? 2 : 1];
  for (int64_t p : held)
    for (int64_t b = at; b < at + c; ++b)
      if (b != mine) last.push_back({r, rt.far[b], p, R});
  std::vector<int64_t> theirs;
  for (int64_t a = at; a < at + c; ++a) {
    if (a == mine) continue;
    held_chunks(a - at, at, c, R, theirs);
    for (int64_t p : theirs) last.push_back({rt.far[a], r, p, R});
  }
}

bool valid(int64_t g, const int64_t* hs, int64_t n, int64_t W, int64_t E,
           std::vector<char>& seen) {  // relay._check, and every index in range
  if (g < 0 || g >= W * E) return false;
  bool ok = true;
  int64_t i = 0;
  for (; i < n; ++i) {
    const int64_t h = hs[i];
    if (h < 0 || h >= W || h == g / E || seen[h]) {
      ok = false;
      break;
    }
    seen[h] = 1;
  }
  for (int64_t x = 0; x < i; ++x) seen[hs[x]] = 0;
  return ok;
}

}  // namespace

// replicas: [m, then per replica: g, H, its H holders]; per_node 0: one link; relay 0: the
// owner's flat fan-out. out: [used, P, rounds, H, the P pack ids, per round (n_send, n_recv,
// in_splits W, out_splits W, sends 4 * n_send as (buffer, entry, j, n), receives 3 * n_recv as
// (g, j, n)), the H held experts, per held expert (n, then its chunks 0..n-1 as n takes (buffer,
// entry, j, n))].
// Returns the ints used, SHORT (out[0]: how many are needed) or FALLBACK.
extern "C" int64_t mixmoe_relay_plan(const int64_t* replicas, int64_t size, int64_t r, int64_t W,
                                     int64_t E, int64_t per_node, int64_t relay, int64_t* out,
                                     int64_t cap) {
  if (W < 1 || E < 1 || r < 0 || r >= W || per_node < 0 || size < 1) return FALLBACK;
  const int64_t m = replicas[0];
  std::vector<char> seen(static_cast<size_t>(W), 0);
  // every replica checked, each one's rounds; those r owns or holds routed
  int num_rounds = 0;
  std::vector<std::pair<int64_t, Route>> mine;  // (g, route)
  std::vector<int64_t> held;                    // replicas order: ascending g
  int64_t at = 1;
  for (int64_t x = 0; x < m; ++x) {
    if (at + 2 > size) return FALLBACK;
    const int64_t g = replicas[at], n = replicas[at + 1];
    const int64_t* hs = replicas + at + 2;
    if (n < 0 || at + 2 + n > size || !valid(g, hs, n, W, E, seen)) return FALLBACK;
    at += 2 + n;
    const int64_t o = g / E;
    const bool holds = std::find(hs, hs + n, r) != hs + n;
    if (holds) held.push_back(g);
    if (!relay) {
      num_rounds = std::max(num_rounds, n > 0 ? 1 : 0);
      if (o == r || holds) mine.emplace_back(g, Route{std::vector<int64_t>(hs, hs + n), {}, {}});
      continue;
    }
    if (o == r || holds) {
      mine.emplace_back(g, route_of(o, std::vector<int64_t>(hs, hs + n), per_node));
      num_rounds = std::max(num_rounds, rounds_of(mine.back().second));
    } else if (num_rounds < MAX_ROUNDS) {
      num_rounds = std::max(num_rounds, rounds_of(route_of(o, std::vector<int64_t>(hs, hs + n),
                                                           per_node)));
    }
  }
  if (at != size) return FALLBACK;
  // every round's messages of r, tagged with their expert: (peer, g, j, n) keys to sort
  std::vector<Msg> sends[MAX_ROUNDS], recvs[MAX_ROUNDS];
  std::vector<int64_t> pack;  // owned experts r sends in any round (local ids)
  std::vector<Msg> msgs[MAX_ROUNDS];
  for (const auto& [g, rt] : mine) {
    const int64_t o = g / E;
    for (auto& v : msgs) v.clear();
    if (relay) {
      messages_at(r, o, rt, msgs);
    } else {  // the owner's flat fan-out: every whole copy from the owner, round 0
      for (int64_t h : rt.near)
        if (r == o || r == h) msgs[0].push_back({o, h, 0, 1});
    }
    const int rounds = relay ? rounds_of(rt) : 1;
    bool sends_own = false;
    for (int k = 0; k < rounds; ++k)
      for (const Msg& msg : msgs[k]) {
        if (msg[0] == r) {
          sends[k].push_back({msg[1], g, msg[2], msg[3]});
          sends_own = sends_own || o == r;
        }
        if (msg[1] == r) recvs[k].push_back({msg[0], g, msg[2], msg[3]});
      }
    if (sends_own) pack.push_back(g - r * E);
  }
  std::sort(pack.begin(), pack.end());  // each owned expert once (mine holds each g once)
  // where r holds each piece: (buffer << 32 | entry), keyed by (g, j, n)
  const int64_t span = W + 1;  // j < n <= W
  // keys past int64 (W * E * (W + 1)**2): the Python
  if (W * E > (std::numeric_limits<int64_t>::max() / span) / span) return FALLBACK;
  const auto key = [span](int64_t g, int64_t j, int64_t n) { return (g * span + j) * span + n; };
  std::unordered_map<int64_t, int64_t> where;
  size_t pieces = pack.size();
  for (const auto& v : recvs) pieces += v.size();
  where.reserve(pieces * 2);
  for (size_t i = 0; i < pack.size(); ++i)
    where.emplace(key(r * E + pack[i], 0, 1), static_cast<int64_t>(i));
  std::unordered_map<int64_t, int64_t> chunks;  // a received expert's chunk count
  MsgScratch scratch;  // sort_msgs' buffers
  std::vector<int64_t> body;  // the rounds, in the output's layout
  for (int k = 0; k < num_rounds; ++k) {
    auto& snd = sends[k];
    auto& rcv = recvs[k];
    sort_msgs(snd, W, W * E, span, scratch);
    sort_msgs(rcv, W, W * E, span, scratch);  // all_to_all order
    body.push_back(static_cast<int64_t>(snd.size()));
    body.push_back(static_cast<int64_t>(rcv.size()));
    const size_t splits = body.size();
    body.resize(splits + 2 * static_cast<size_t>(W), 0);
    for (const Msg& s : snd) body[splits + s[0]] += 1;
    for (const Msg& s : rcv) body[splits + W + s[0]] += 1;
    for (const Msg& s : snd) {  // a sender holds what it sends: that piece, or the whole row
      auto it = where.find(key(s[1], s[2], s[3]));
      if (it == where.end()) it = where.find(key(s[1], 0, 1));
      if (it == where.end()) return FALLBACK;
      body.insert(body.end(), {it->second >> 32, it->second & 0xffffffff, s[2], s[3]});
    }
    for (size_t i = 0; i < rcv.size(); ++i) {
      const Msg& s = rcv[i];
      where[key(s[1], s[2], s[3])] = (static_cast<int64_t>(k + 1) << 32) | static_cast<int64_t>(i);
      chunks[s[1]] = s[3];
      body.insert(body.end(), {s[1], s[2], s[3]});
    }
  }
  for (int64_t g : held) {  // every slot's chunks in order
    const auto c = chunks.find(g);
    if (c == chunks.end()) return FALLBACK;
    const int64_t n = c->second;
    body.push_back(n);
    for (int64_t j = 0; j < n; ++j) {
      const auto it = where.find(key(g, j, n));
      if (it == where.end()) return FALLBACK;
      body.insert(body.end(), {it->second >> 32, it->second & 0xffffffff, j, n});
    }
  }
  const int64_t need = 4 + static_cast<int64_t>(pack.size() + held.size() + body.size());
  if (need > cap) {
    if (cap > 0) out[0] = need;
    return SHORT;
  }
  int64_t* p = out;
  *p++ = need;
  *p++ = static_cast<int64_t>(pack.size());
  *p++ = num_rounds;
  *p++ = static_cast<int64_t>(held.size());
  p = std::copy(pack.begin(), pack.end(), p);
  // the rounds, then the held experts, then the slots: body holds rounds then slots
  size_t b = 0;
  for (int k = 0; k < num_rounds; ++k) {
    const int64_t ns = body[b], nr = body[b + 1];
    const size_t len = 2 + 2 * static_cast<size_t>(W) + 4 * ns + 3 * nr;
    p = std::copy(body.begin() + b, body.begin() + b + len, p);
    b += len;
  }
  p = std::copy(held.begin(), held.end(), p);
  std::copy(body.begin() + b, body.end(), p);
  return need;
}

// dispatch.replicas._Layout for packed rows of Q elements, from mixmoe_relay_plan's output `plan`
// (its ints, as written). Buffers in the fetch's order: 0 the packed owned rows (Q each); per
// round k the pieces received, back to back in receive order (chunk j of n holding Q / n +
// (j < Q % n) elements, torch.tensor_split's order), then for every round but the last not
// received in (expert, chunk) order already the same pieces re-laid so, which later rounds and
// the slots read instead. Every
// list of reads is merged into spans where one starts where the last stopped in one buffer.
// out: [used, per round (in_splits W, out_splits W, n_spans, spans 3 * n_spans as (buffer,
// start, stop)), the slots' n_spans and spans, per round the re-laying's n_spans (-1: none) and
// spans, per buffer (n_cuts, cuts ascending)]. Returns the ints used, SHORT (out[0]: how many
// are needed) or FALLBACK (a take out of range: the Python's layout runs).
extern "C" int64_t mixmoe_relay_layout(const int64_t* plan, int64_t size, int64_t W, int64_t Q,
                                       int64_t* out, int64_t cap) {
  if (size < 4 || W < 1 || Q < 0 || plan[0] != size) return FALLBACK;
  const int64_t P = plan[1], num_rounds = plan[2], H = plan[3];
  if (P < 0 || num_rounds < 0 || num_rounds > MAX_ROUNDS || H < 0) return FALLBACK;
  const auto piece = [Q](int64_t j, int64_t n) { return Q / n + (j < Q % n ? 1 : 0); };
  // each buffer's entry starts (and its end), and whether each entry is a whole row
  std::vector<std::vector<int64_t>> starts;
  std::vector<std::vector<char>> whole;
  starts.emplace_back();
  for (int64_t i = 0; i <= P; ++i) starts[0].push_back(i * Q);
  whole.emplace_back(static_cast<size_t>(P), 1);
  struct Round {
    int64_t at, n_send, n_recv, raw, read;  // its ints, counts, received / read buffers
    std::vector<int64_t> entries;           // receive entry -> entry in the read buffer
    std::vector<int64_t> compact;           // the re-laying's spans (empty: none)
  };
  std::vector<Round> rounds;
  const auto ends_of = [](const std::vector<int64_t>& sizes) {
    std::vector<int64_t> e(1, 0);
    for (int64_t x : sizes) e.push_back(e.back() + x);
    return e;
  };
  const auto add_span = [](std::vector<int64_t>& spans, int64_t b, int64_t lo, int64_t hi) {
    const size_t m = spans.size();
    if (m && spans[m - 3] == b && spans[m - 1] == lo) {
      spans[m - 1] = hi;
    } else {
      spans.insert(spans.end(), {b, lo, hi});
    }
  };
  int64_t at = 4 + P;
  for (int64_t k = 0; k < num_rounds; ++k) {
    if (at + 2 > size) return FALLBACK;
    Round rd{at, plan[at], plan[at + 1], 0, 0, {}, {}};
    if (rd.n_send < 0 || rd.n_recv < 0 || at + 2 + 2 * W + 4 * rd.n_send + 3 * rd.n_recv > size)
      return FALLBACK;
    const int64_t* recv = plan + at + 2 + 2 * W + 4 * rd.n_send;
    std::vector<int64_t> sizes;
    std::vector<char> rows;
    for (int64_t i = 0; i < rd.n_recv; ++i) {
      const int64_t j = recv[3 * i + 1], n = recv[3 * i + 2];
      if (n < 1 || j < 0 || j >= n) return FALLBACK;
      sizes.push_back(piece(j, n));
      rows.push_back(n == 1);
    }
    rd.raw = static_cast<int64_t>(starts.size());
    starts.push_back(ends_of(sizes));
    whole.push_back(rows);
    rd.entries.resize(static_cast<size_t>(rd.n_recv));
    for (int64_t i = 0; i < rd.n_recv; ++i) rd.entries[i] = i;
    rd.read = rd.raw;
    const auto before = [recv](int64_t x, int64_t y) {  // (expert, chunk, chunks) order
      const int64_t* a = recv + 3 * x;
      const int64_t* b = recv + 3 * y;
      return std::lexicographical_compare(a, a + 3, b, b + 3);
    };
    // read by a later round and not received in (expert, chunk) order already: re-laid so
    if (k + 1 < num_rounds && !std::is_sorted(rd.entries.begin(), rd.entries.end(), before)) {
      std::vector<int64_t> order(rd.entries);
      std::sort(order.begin(), order.end(), before);
      std::vector<int64_t> sorted_sizes;
      std::vector<char> sorted_rows;
      const auto& ends = starts[rd.raw];
      for (size_t x = 0; x < order.size(); ++x) {
        const int64_t i = order[x];
        rd.entries[i] = static_cast<int64_t>(x);
        sorted_sizes.push_back(sizes[i]);
        sorted_rows.push_back(rows[i]);
        add_span(rd.compact, rd.raw, ends[i], ends[i + 1]);
      }
      rd.read = static_cast<int64_t>(starts.size());
      starts.push_back(ends_of(sorted_sizes));
      whole.push_back(sorted_rows);
    }
    rounds.push_back(std::move(rd));
    at += 2 + 2 * W + 4 * plan[at] + 3 * plan[at + 1];
  }
  at += H;  // the held experts; the slots follow
  if (at > size) return FALLBACK;
  // a take (b, i, j, n) -> its span, b naming round b - 1's buffer by receive entry
  const auto span_of = [&](const int64_t* t, int64_t& buf, int64_t& lo, int64_t& hi) {
    int64_t b = t[0], i = t[1];
    const int64_t j = t[2], n = t[3];
    if (b < 0 || b > num_rounds || n < 1 || j < 0 || j >= n || i < 0) return false;
    if (b > 0) {
      const Round& rd = rounds[static_cast<size_t>(b - 1)];
      if (i >= rd.n_recv) return false;
      i = rd.entries[static_cast<size_t>(i)];
      b = rd.read;
    } else if (i >= P) {
      return false;
    }
    lo = starts[b][i];
    hi = starts[b][i + 1];
    if (whole[b][i] && n > 1) {  // a chunk cut from a whole row (an owner scattering)
      const int64_t base = Q / n, extra = Q % n;
      lo += j * base + std::min(j, extra);
      hi = lo + base + (j < extra ? 1 : 0);
    }
    buf = b;
    return true;
  };
  const auto merge = [&](const int64_t* takes, int64_t n, std::vector<int64_t>& spans,
                         std::vector<int64_t>* read) {
    for (int64_t x = 0; x < n; ++x) {
      int64_t b, lo, hi;
      if (!span_of(takes + 4 * x, b, lo, hi)) return false;
      if (read) read->push_back(read->back() + hi - lo);
      add_span(spans, b, lo, hi);
    }
    return true;
  };
  std::vector<std::vector<int64_t>> cuts(starts.size());
  for (size_t b = 0; b < starts.size(); ++b) cuts[b] = {0, starts[b].back()};
  const auto cut = [&cuts](const std::vector<int64_t>& spans) {
    for (size_t x = 0; x < spans.size(); x += 3) {
      cuts[spans[x]].push_back(spans[x + 1]);
      cuts[spans[x]].push_back(spans[x + 2]);
    }
  };
  std::vector<int64_t> body, spans, read;
  for (const Round& rd : rounds) {
    const int64_t* in_n = plan + rd.at + 2;  // pieces to each rank
    const int64_t* out_n = in_n + W;         // pieces from each rank
    spans.clear();
    read.assign(1, 0);
    if (!merge(out_n + W, rd.n_send, spans, &read)) return FALLBACK;
    int64_t pos = 0;
    for (int64_t q = 0; q < W; ++q) {  // elements to each receiver: its pieces' sizes, summed
      if (in_n[q] < 0 || pos + in_n[q] > rd.n_send) return FALLBACK;
      body.push_back(read[pos + in_n[q]] - read[pos]);
      pos += in_n[q];
    }
    const auto& ends = starts[rd.raw];
    pos = 0;
    for (int64_t s = 0; s < W; ++s) {  // elements from each sender, as received
      if (out_n[s] < 0 || pos + out_n[s] > rd.n_recv) return FALLBACK;
      body.push_back(ends[pos + out_n[s]] - ends[pos]);
      pos += out_n[s];
    }
    body.push_back(static_cast<int64_t>(spans.size() / 3));
    body.insert(body.end(), spans.begin(), spans.end());
    cut(spans);
  }
  spans.clear();
  for (int64_t h = 0; h < H; ++h) {  // every slot's chunks, back to back
    if (at >= size) return FALLBACK;
    const int64_t n = plan[at];
    if (n < 0 || at + 1 + 4 * n > size) return FALLBACK;
    if (!merge(plan + at + 1, n, spans, nullptr)) return FALLBACK;
    at += 1 + 4 * n;
  }
  if (at != size) return FALLBACK;
  body.push_back(static_cast<int64_t>(spans.size() / 3));
  body.insert(body.end(), spans.begin(), spans.end());
  cut(spans);
  for (int64_t k = 0; k < num_rounds; ++k) {
    const Round& rd = rounds[static_cast<size_t>(k)];
    if (rd.read == rd.raw) {
      body.push_back(-1);  // not re-laid
      continue;
    }
    body.push_back(static_cast<int64_t>(rd.compact.size() / 3));
    body.insert(body.end(), rd.compact.begin(), rd.compact.end());
    cut(rd.compact);
  }
  for (auto& c : cuts) {
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
    body.push_back(static_cast<int64_t>(c.size()));
    body.insert(body.end(), c.begin(), c.end());
  }
  const int64_t need = 1 + static_cast<int64_t>(body.size());
  if (need > cap) {
    if (cap > 0) out[0] = need;
    return SHORT;
  }
  out[0] = need;
  std::copy(body.begin(), body.end(), out + 1);
  return need;
}
