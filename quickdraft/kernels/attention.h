// Attention of new tokens over one sequence's cache, on raw pointers (attention.cpp binds it to
// torch; tests/native runs it on every ISA). Row j (of m) attends over its own keys: a chain's
// first ctx + j + 1, a tree node's context and ancestors. Written by hand for two reasons:
// - batch invariance: each (row, head) runs one fixed sequence over exactly its own keys, so its
//   bits do not depend on how many rows the pass has (torch's softmax and matmul round by shape);
// - cost: a verification pass of m rows is one call, not m x (a dozen small torch ops) per layer.
//
// A row's sequence for head h, over its keys i = 0..len-1 in order:
// - score s_i = reduce_add(16-lane fmadd chain of q . k_i over d) * scale;
// - mx = the largest s_i; p_i = simd::exp_neg(s_i - mx), 16 keys at once (the same bits on every ISA);
// - total = reduce_add of 16 lane sums (lane l: p_i for i = l mod 16, in order), inv = 1 / total;
// - out = (fmadd chain of p_i v_i over i, in order) * inv.
// The heads that share a KV head (grouped-query attention) run together, a block of keys at a
// time: the block's keys (then values) are converted to float32 once for all of them and read from
// L1 by each, which only interleaves the heads' sequences. A key at a time and head by head, with
// the C library's expf, this cost ~10 ns a (head, key) on an AMD EPYC Zen 4 (Qwen2.5-Coder-1.5B, 2
// threads, one row over 4,000 keys: 13.7 ms a token of attention); so, 10.0 ms, then with the
// prefetch below ~20% less again (interleaved A/B on a busy machine).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace qd {
inline namespace QD_ISA_NS {

constexpr int KEY_BLOCK = 16;  // keys (or values) converted at once (8 KiB of float32 at d 128): one score vector
// keys ahead asked for into L2: at 2 threads over Qwen2.5-1.5B's 28 layers of 4,000 keys (AMD EPYC
// Zen 4), 64 keys into L2 took 17-19 ms a token where 32 or 64 into L1 took 22-24, none 30-32
constexpr int KEY_PREFETCH = 4 * KEY_BLOCK;

// keys key(i0 + t), t < n = min(KEY_BLOCK, len - i0), as float32 (exact: bfloat16 is float32's
// upper half) into buf laid out [d / 16][KEY_BLOCK][16]: the block's vectors for one stretch of d
// lie together, so that the loops below read them at fixed offsets from one pointer (a pointer a
// key took more registers than x86 has); keys n.. are zeros, so that the last block's dot products
// too are a whole round (their scores go unread). The keys KEY_PREFETCH on are asked for meanwhile.
template <typename T, typename Key>
inline int64_t load_block(const T* K, int64_t ks, int64_t i0, int64_t len, int64_t d, Key key, float* buf) {
  const int64_t n = std::min<int64_t>(KEY_BLOCK, len - i0);
  for (int64_t t = 0; t < n; ++t) {
    if (i0 + t + KEY_PREFETCH < len)
      for (int64_t c = 0; c < d; c += 64 / sizeof(T)) simd::prefetch_l2(K + key(i0 + t + KEY_PREFETCH) * ks + c);
    const T* k = K + key(i0 + t) * ks;
    for (int64_t c = 0; c < d; c += 16) simd::store_f(buf + c * KEY_BLOCK + t * 16, simd::load_f(k + c));
  }
  for (int64_t t = n; t < KEY_BLOCK; ++t)
    for (int64_t c = 0; c < d; c += 16) simd::store_f(buf + c * KEY_BLOCK + t * 16, simd::zero_f());
  return n;
}

// The scores of heads g..g+HB-1 for the keys in buf: 16 / HB keys a round, each round's 16 fmadd
// chains (head h's q . key t over d, chain h * 16 / HB + t) TK at a time in registers, then one
// reduce_add16 (the 16 reductions in ~3 instructions each) and scale -> s[h * stride + t].
template <int HB, int TK>
inline void score_block(const float* q, int64_t d, const float* buf, float scale, float* s, int64_t stride) {
  constexpr int KB = 16 / HB;
  for (int t0 = 0; t0 < KEY_BLOCK; t0 += KB) {
    simd::F16 acc[16];
    for (int l0 = 0; l0 < 16; l0 += TK) {
      simd::F16 a[TK];
      for (int l = 0; l < TK; ++l) a[l] = simd::zero_f();
      for (int64_t c = 0; c < d; c += 16) {
        const float* b = buf + c * KEY_BLOCK + t0 * 16;
        for (int l = 0; l < TK; ++l)
          a[l] = simd::fmadd(simd::load_f(q + (l0 + l) / KB * d + c), simd::load_f(b + (l0 + l) % KB * 16), a[l]);
      }
      for (int l = 0; l < TK; ++l) acc[l0 + l] = a[l];
    }
    alignas(64) float r[16];
    simd::store_f(r, simd::mul(simd::reduce_add16(acc), simd::set1_f(scale)));
    for (int h = 0; h < HB; ++h) std::memcpy(s + h * stride + t0, r + h * KB, sizeof(float) * KB);
  }
}

// o + h * d (h < HB): [c0 .. c0 + 16 U) += p[h * stride + t] * value t's [c0 ..] for t < n, in
// order, HB x U accumulators in registers (each value vector loaded feeds HB heads)
template <int HB, int U>
inline void accumulate(float* o, int64_t d, const float* p, int64_t stride, const float* buf, int64_t n, int64_t c0) {
  simd::F16 acc[HB][U];
  for (int h = 0; h < HB; ++h)
    for (int u = 0; u < U; ++u) acc[h][u] = simd::load_f(o + h * d + c0 + 16 * u);
  const float* b = buf + c0 * KEY_BLOCK;
  for (int64_t t = 0; t < n; ++t) {
    simd::F16 pt[HB];
    for (int h = 0; h < HB; ++h) pt[h] = simd::set1_f(p[h * stride + t]);
    for (int u = 0; u < U; ++u) {
      const simd::F16 v = simd::load_f(b + 16 * (u * KEY_BLOCK + t));
      for (int h = 0; h < HB; ++h) acc[h][u] = simd::fmadd(pt[h], v, acc[h][u]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int u = 0; u < U; ++u) simd::store_f(o + h * d + c0 + 16 * u, acc[h][u]);
}

// the values in buf into heads g..g+HB-1's sums, as many columns at once as the registers hold
template <int HB>
inline void value_block(float* o, int64_t d, const float* p, int64_t stride, const float* buf, int64_t n) {
  constexpr int U = simd::F16_REGS / 2 / HB >= 8 ? 8 : simd::F16_REGS / 2 / HB >= 4 ? 4 : 1;
  int64_t c0 = 0;
  for (; c0 + 16 * U <= d; c0 += 16 * U) accumulate<HB, U>(o, d, p, stride, buf, n, c0);
  for (; c0 < d; c0 += 16) accumulate<HB, 1>(o, d, p, stride, buf, n, c0);
}

// Heads a round and chains in registers at once: where the registers hold 16 chains (AVX-512), 4
// heads x 4 keys, and for the values 4 heads x 4 vectors of sums, so that each vector loaded feeds
// 4 FMAs; else one head at a time. Of rounds of 1, 2 or 4 heads in either phase, 4 in both took
// least (AMD EPYC Zen 4, one thread, Qwen2.5-1.5B's shapes over 4,000 keys in L3: 0.47 ms a layer,
// 0.49-0.62 for the others).
constexpr int HEADS_AT_ONCE = simd::F16_REGS >= 32 ? 4 : 1;
constexpr int CHAINS_AT_ONCE = simd::F16_REGS >= 32 ? 16 : 4;

// run(HB, g) for heads g.. of G in rounds of HB heads, then of HB / 2, ..., 1 for the rest
template <int HB, typename Run>
inline void in_rounds(int64_t g, int64_t G, Run run) {
  for (; g + HB <= G; g += HB) run(std::integral_constant<int, HB>(), g);
  if constexpr (HB > 1) in_rounds<HB / 2>(g, G, run);
}

// heads q + g * d (g < G), which share one KV head, each over keys key(0)..key(len - 1) -> out +
// g * d; d a multiple of 16. scores: G x stride floats (stride >= len rounded up to 16), inv: G
// floats, buf: KEY_BLOCK x d floats. Which keys a row reads changes only the addresses: the
// arithmetic is the sequence above, so a tree node's row has the bits of the chain row that has
// its path as history.
template <typename T, typename Key>
void attend_group(const float* q, int64_t G, const T* K, const T* V, int64_t ks, int64_t len, int64_t d, float scale,
                  float* scores, int64_t stride, float* inv, float* buf, float* out, Key key) {
  for (int64_t i0 = 0; i0 < len; i0 += KEY_BLOCK) {
    load_block(K, ks, i0, len, d, key, buf);
    in_rounds<HEADS_AT_ONCE>(0, G, [&](auto hb, int64_t g) {
      score_block<hb, CHAINS_AT_ONCE>(q + g * d, d, buf, scale, scores + g * stride + i0, stride);
    });
  }
  const int64_t tail = len % 16;
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * stride;
    for (int64_t i = len; i < (len + 15) / 16 * 16; ++i) s[i] = -INFINITY;  // lanes past len: out of the max and the sum
    simd::F16 mv = simd::set1_f(-INFINITY);
    for (int64_t i = 0; i < len; i += 16) mv = simd::max(mv, simd::load_f(s + i));
    const simd::F16 neg = simd::set1_f(-simd::reduce_max(mv));
    simd::F16 sum = simd::zero_f();
    for (int64_t i = 0; i < len; i += 16) {
      const simd::F16 e = simd::exp_neg(simd::add(simd::load_f(s + i), neg));
      simd::store_f(s + i, e);
      sum = simd::add(sum, len - i < 16 ? simd::load_f_part(s + i, static_cast<int>(tail)) : e);
    }
    inv[g] = 1.0f / simd::reduce_add(sum);
    for (int64_t c = 0; c < d; c += 16) simd::store_f(out + g * d + c, simd::zero_f());
  }
  for (int64_t i0 = 0; i0 < len; i0 += KEY_BLOCK) {
    const int64_t n = load_block(V, ks, i0, len, d, key, buf);
    in_rounds<HEADS_AT_ONCE>(0, G, [&](auto hb, int64_t g) {
      value_block<hb>(out + g * d, d, scores + g * stride + i0, stride, buf, n);
    });
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < d; c += 16) simd::store_f(out + g * d + c, simd::mul(simd::load_f(out + g * d + c), simd::set1_f(inv[g])));
}

// The calling thread's scratch array `which` (0..2), at least n floats: kept from call to call
// (OpenMP's threads live as long as the process), so that attention allocates nothing once a
// thread has seen the longest context, where it took three arrays from the heap each layer of
// each pass. A thread keeps the largest it has needed: the scores of a KV head's query heads over
// the context (the 1.5B at 32,768 tokens: 6 x 32,768 floats, 768 KiB).
inline float* scratch(int which, int64_t n) {
  static thread_local std::vector<float> kept[3];
  std::vector<float>& v = kept[which];
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// rows j = 0..m-1 of Q [m, H, d] (heads h) each over len(j) keys, key(j, i) the i-th of them, of
// K, V [Hkv, L, d] (head stride hs, key stride ks) -> O [m, H * d]
template <typename T, typename Len, typename Key>
void attend_rows(const float* Q, const T* K, const T* V, int64_t hs, int64_t ks, float* O, int64_t m, int64_t H,
                 int64_t Hkv, int64_t d, int64_t ctx, float scale, Len len, Key key) {
  const int64_t group = H / Hkv;
  // a task is a row's KV head with some of its query heads: all of them where the pass has a task
  // a thread, else split so that every thread has work (one decoding row, 2 KV heads). The split
  // changes which thread runs a head, never its sequence.
  const int64_t threads = omp_get_max_threads(), pairs = m * Hkv;
  const int64_t parts = pairs >= threads ? 1 : std::min(group, (threads + pairs - 1) / pairs);
  const int64_t per = (group + parts - 1) / parts;
  const int64_t stride = (ctx + m + 15) / 16 * 16;
#pragma omp parallel
  {
    float *scores = scratch(0, per * stride), *inv = scratch(1, per), *buf = scratch(2, KEY_BLOCK * d);
    // tasks dealt out one at a time in turn: row j reads ctx + j + 1 keys, so halves in order gave
    // a prompt's pass (ctx 0) one thread three times the other's work (the 1.5B's 810-token
    // prompt, Intel Xeon, 2 threads: 45.6 -> 29.8 ms a layer; decoding rows: the same)
#pragma omp for schedule(static, 1) collapse(3)
    for (int64_t j = 0; j < m; ++j)
      for (int64_t kvh = 0; kvh < Hkv; ++kvh)
        for (int64_t part = 0; part < parts; ++part) {
          const int64_t h0 = kvh * group + part * per, G = std::min(per, group - part * per);
          if (G <= 0) continue;
          attend_group(Q + (j * H + h0) * d, G, K + kvh * hs, V + kvh * hs, ks, len(j), d, scale, scores, stride, inv,
                       buf, O + (j * H + h0) * d, [&](int64_t i) { return key(j, i); });
        }
  }
}

// the keys a row sees under a sliding window of `window` positions (0: none) when it sees `len` in
// position order: the last min(len, window) of them, as transformers' and llama.cpp's masks keep a
// key at position p for a query at position t where t - p < window. The window only moves where a
// row's keys start, so a row's bits stay those of a row with the same keys alone.
inline int64_t windowed(int64_t len, int64_t window) { return window > 0 && len > window ? window : len; }

// a chain: row j over keys 0..ctx+j (the last `window` of them where window > 0)
template <typename T>
void attend_chain(const float* Q, const T* K, const T* V, int64_t hs, int64_t ks, float* O, int64_t m, int64_t H,
                  int64_t Hkv, int64_t d, int64_t ctx, float scale, int64_t window = 0) {
  attend_rows(Q, K, V, hs, ks, O, m, H, Hkv, d, ctx, scale, [=](int64_t j) { return windowed(ctx + j + 1, window); },
              [=](int64_t j, int64_t i) { return ctx + j + 1 - windowed(ctx + j + 1, window) + i; });
}

// a tree: row j over keys 0..base-1, then base + path[start[j]] .. base + path[start[j + 1] - 1]
// (its ancestors among the tree's keys past base and itself, root first); the new rows' own keys
// are at ctx = base + hidden, after the hidden nodes an earlier pass wrote (a draft that grows its
// tree a level a pass)
// (a node's path holds its ancestors at consecutive positions, so the list is in position order
// and the window drops its first keys, as for a chain)
template <typename T>
void attend_tree(const float* Q, const T* K, const T* V, int64_t hs, int64_t ks, float* O, int64_t m, int64_t H,
                 int64_t Hkv, int64_t d, int64_t ctx, int64_t hidden, const int64_t* start, const int64_t* path, float scale,
                 int64_t window = 0) {
  const int64_t base = ctx - hidden;
  const auto seen = [=](int64_t j) { return base + start[j + 1] - start[j]; };
  attend_rows(Q, K, V, hs, ks, O, m, H, Hkv, d, ctx, scale, [=](int64_t j) { return windowed(seen(j), window); },
              [=](int64_t j, int64_t i) {
                const int64_t at = i + seen(j) - windowed(seen(j), window);
                return at < base ? at : base + path[start[j] + at - base];
              });
}

}  // namespace QD_ISA_NS
}  // namespace qd
