// A layer's row-wise and elementwise steps on raw pointers, written against the vector layer
// (simd.h): RMSNorm, rotary, SiLU, adds, multiplies and conversions, each value rounded as torch
// rounds it.
// rows.cpp and verify.cpp bind them to torch; tests/native runs them on every ISA. T is float (float32) or
// uint16_t (bfloat16).
//
// Why by hand: at one to a few rows these are a few thousand values each, where a torch call's
// dispatch costs more than the work. Written against simd.h rather than left to the compiler's
// vectorizer, so that each ISA's bits are checked against the portable build's: RMSNorm of the
// 1.5B's 8,960 values a row took 14.8 us against 19.2 for the scalar loops before (AMD EPYC Zen 1,
// through Python). Each row's result depends on that row alone.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#include <algorithm>
#include <functional>

#include "simd.h"

namespace qd {
inline namespace QD_ISA_NS {

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return simd::from_bf16(v); }
template <typename T>
inline T from_float(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    return simd::to_bf16(f);
  }
}
inline void store(float* p, simd::F16 v) { simd::store_f(p, v); }
inline void store(uint16_t* p, simd::F16 v) { simd::store_bf16(p, v); }

// v rounded to T's precision (to nearest even, as torch rounds), kept as float32
template <typename T>
inline simd::F16 round_to(simd::F16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) uint16_t t[16];
    simd::store_bf16(t, v);
    return simd::load_f(t);
  }
}

// RMSNorm as Hugging Face's: the sum of squares in 16 lane chains (lane l: values l, l + 16, ...,
// in order), the lanes added 0..15; then, with a weight of T (LlamaRMSNorm), each value normalized
// in float32, rounded to T, times the weight, rounded to T; with a float32 weight for bfloat16 rows
// (Gemma's RMSNorm, whose weight is 1 + w in float32: the loader adds the 1), normalized times the
// weight in float32, rounded once. The two agree in float32. Rows [n, h] of X into Y (Y may not
// overlap X).
template <typename T, typename WT>
void rms_rows(const T* X, const WT* W, T* Y, int64_t n, int64_t h, float eps) {
  constexpr bool round_first = std::is_same_v<T, WT>;
  const int64_t whole = h / 16 * 16;
#pragma omp parallel for schedule(static) if (n > 8)
  for (int64_t r = 0; r < n; ++r) {
    const T* x = X + r * h;
    T* y = Y + r * h;
    simd::F16 acc = simd::zero_f();
    for (int64_t i = 0; i < whole; i += 16) {
      const simd::F16 v = simd::load_f(x + i);
      acc = simd::add(acc, simd::mul(v, v));
    }
    alignas(64) float lanes[16];
    simd::store_f(lanes, acc);
    for (int64_t i = whole; i < h; ++i) lanes[i % 16] += to_float(x[i]) * to_float(x[i]);
    float ss = 0.0f;
    for (float l : lanes) ss += l;
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    const simd::F16 iv = simd::set1_f(inv);
    for (int64_t i = 0; i < whole; i += 16) {
      const simd::F16 v = simd::mul(simd::load_f(x + i), iv);
      store(y + i, simd::mul(simd::load_f(W + i), round_first ? round_to<T>(v) : v));
    }
    for (int64_t i = whole; i < h; ++i) {
      const float v = to_float(x[i]) * inv;
      y[i] = from_float<T>(to_float(W[i]) * (round_first ? to_float(from_float<T>(v)) : v));
    }
  }
}

// rotate-half rotary, row r at position P[r]: y = x * cos + rotate_half(x) * sin in float32,
// rounded to T; X, Y [n, heads, d] (Y may be X: each pair of values is read before it is written),
// C, S [positions, d]
template <typename T>
void rotary_rows(const T* X, const float* C, const float* S, const int64_t* P, T* Y, int64_t n, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < n; ++r) {
    const float* c = C + P[r] * d;
    const float* s = S + P[r] * d;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = X + (r * heads + h) * d;
      T* y = Y + (r * heads + h) * d;
      for (int64_t i = 0; i < half; ++i) {
        const float a = to_float(x[i]), b = to_float(x[i + half]);
        y[i] = from_float<T>(a * c[i] - b * s[i]);
        y[i + half] = from_float<T>(b * c[i + half] + a * s[i + half]);
      }
    }
  }
}

// rows [len, heads, d] (contiguous, `bytes` = d's bytes) into a slot's cache [heads, >= at + len, d]
// at positions at..at+len-1; hs, ks: the cache's head and position strides in bytes
inline void write_rows(const void* rows, void* cache, int64_t hs, int64_t ks, int64_t at, int64_t len, int64_t heads,
                       int64_t bytes) {
  const char* src = static_cast<const char*>(rows);
  char* dst = static_cast<char*>(cache);
  for (int64_t r = 0; r < len; ++r)
    for (int64_t h = 0; h < heads; ++h) std::memcpy(dst + h * hs + (at + r) * ks, src + (r * heads + h) * bytes, bytes);
}

// Elementwise over `count` values: parallel only where the work outgrows a parallel region's cost
// (a prompt's pass); a value's result never depends on which thread computes it.
constexpr int64_t PARALLEL_VALUES = 1 << 16;

// op(n, i) for each 16 values i..i+15 of `count`, n of them real (16, or fewer for the last: the
// callers pad those through a copy), in parallel past `parallel` values
template <typename Op>
inline void in_sixteens(int64_t count, Op op, int64_t parallel = PARALLEL_VALUES) {
  const int64_t whole = count / 16;
#pragma omp parallel for schedule(static) if (count > parallel)
  for (int64_t c = 0; c < whole; ++c) op(16, c * 16);
  if (count % 16) op(static_cast<int>(count % 16), whole * 16);
}

// 16 values of T at p as float32, the first n real (the rest zeros)
template <typename T>
inline simd::F16 load_n(const T* p, int n) {
  if (n == 16) return simd::load_f(p);
  alignas(64) T t[16] = {};
  std::memcpy(t, p, sizeof(T) * n);
  return simd::load_f(t);
}

template <typename T>
inline void store_n(T* p, simd::F16 v, int n) {
  if (n == 16) return store(p, v);
  alignas(64) T t[16];
  store(t, v);
  std::memcpy(p, t, sizeof(T) * n);
}

// out = a + b, each value in float32 rounded once to T: the bits of torch's add (out may be a or b)
template <typename T>
void add_values(const T* a, const T* b, T* out, int64_t count) {
  in_sixteens(count, [&](int n, int64_t i) { store_n(out + i, simd::add(load_n(a + i, n), load_n(b + i, n)), n); });
}

// out = a * b, likewise torch's multiply (out may be a or b)
template <typename T>
void mul_values(const T* a, const T* b, T* out, int64_t count) {
  in_sixteens(count, [&](int n, int64_t i) { store_n(out + i, simd::mul(load_n(a + i, n), load_n(b + i, n)), n); });
}

// SiLU, x / (1 + e^-x), on simd.h's lane operations alone, so the same bits on every ISA: e^-x is
// exp_neg's with its argument at most 88 (2^n stays finite), so below x = -88 the result is
// x / (1 + e^88), about 1e-36 in size, where the exact value is smaller still. NaN stays NaN
// (max's operands in simd.h's order).
inline simd::F16 silu(simd::F16 x) {
  const simd::F16 e = simd::exp_neg(simd::mul(simd::max(simd::set1_f(-88.0f), x), simd::set1_f(-1.0f)));
  return simd::div(x, simd::add(simd::set1_f(1.0f), e));
}

// values from which silu_mul_values splits over the threads: the 0.5B's 4,864 bfloat16 values a row
// took 16.8 us on one AMD EPYC Zen 1 core and 10.5 on two (a parallel region costs ~1 us)
constexpr int64_t PARALLEL_SILU = 2048;

// out = T(T(silu(gate)) x up): the MLP's silu(gate) * up, rounded to T after each step as two torch
// operations would round them (out may be gate or up). Its own SiLU rather than torch's: one call
// instead of two, over the threads at one row, and the same bits on every ISA (torch's exponent
// is its own on each).
template <typename T>
void silu_mul_values(const T* gate, const T* up, T* out, int64_t count) {
  in_sixteens(
      count,
      [&](int n, int64_t i) { store_n(out + i, simd::mul(round_to<T>(silu(load_n(gate + i, n))), load_n(up + i, n)), n); },
      PARALLEL_SILU);
}

// GELU with the tanh approximation (Gemma's gelu_pytorch_tanh), 0.5 x (1 + tanh(u)) with u =
// sqrt(2 / pi) (x + 0.044715 x^3), written as x / (1 + e^(-2u)) (the same function: 0.5 (1 +
// tanh(u)) is the logistic of 2u) on exp_neg, so one exponent and the same bits on every ISA; e^(-2u)
// is capped at e^88 as in silu. Not torch's bits (its tanh is its own): held to it within float32's
// rounding in tests/models/test_rowwise.py.
inline simd::F16 gelu_tanh(simd::F16 x) {
  const simd::F16 x3 = simd::mul(simd::mul(x, x), x);
  const simd::F16 u = simd::mul(simd::set1_f(0.7978845608028654f), simd::fmadd(simd::set1_f(0.044715f), x3, x));
  const simd::F16 e = simd::exp_neg(simd::mul(simd::max(simd::set1_f(-88.0f), simd::mul(u, simd::set1_f(2.0f))), simd::set1_f(-1.0f)));
  return simd::div(x, simd::add(simd::set1_f(1.0f), e));
}

// The MLP's activation: the gate's function before it multiplies up (families.py's activation).
enum Activation : int64_t { SILU = 0, GELU_TANH = 1 };

// out = T(T(act(gate)) x up) for either activation, rounded as silu_mul_values (out may be gate or up)
template <typename T>
void act_mul_values(int64_t act, const T* gate, const T* up, T* out, int64_t count) {
  if (act == SILU) return silu_mul_values(gate, up, out, count);
  in_sixteens(
      count,
      [&](int n, int64_t i) { store_n(out + i, simd::mul(round_to<T>(gelu_tanh(load_n(gate + i, n))), load_n(up + i, n)), n); },
      PARALLEL_SILU);
}

// x [count] times s, rounded to T: Gemma's embeddings times sqrt(hidden)
// (s already rounded to T, as transformers multiplies by a tensor of the weights' dtype)
template <typename T>
void scale_values(T* x, int64_t count, float s) {
  in_sixteens(count, [&](int n, int64_t i) { store_n(x + i, simd::mul(load_n(x + i, n), simd::set1_f(s)), n); });
}

// dst = src in To's dtype (bfloat16 <-> float32, rounded to nearest even as torch's copy_)
template <typename From, typename To>
void convert_values(const From* src, To* dst, int64_t count) {
  in_sixteens(count, [&](int n, int64_t i) { store_n(dst + i, load_n(src + i, n), n); });
}

template <typename T>
inline simd::F16 load16(const T* x, int64_t i, int64_t n, float pad) {  // x[i..i+15], past n: pad
  if (i + 16 <= n) return simd::load_f(x + i);
  alignas(64) float t[16];
  for (int j = 0; j < 16; ++j) t[j] = i + j < n ? to_float(x[i + j]) : pad;
  return simd::load_f(t);
}

// A row of logits [n] -> its argmax as sampling.argmax_rows takes it: the lowest index on ties,
// the first NaN where there is one. With `finite`: whether every value is finite, from the same
// read (the verifier's check of a step's logits, engine/runner.py). One vector pass, by chunks of
// 256 values, finds the maximum, the first chunk that holds it, and whether anything is an
// infinity or a NaN (0 x v is NaN exactly there); then that chunk alone is searched for the index
// (searching the row from its start took as long as the pass, AMD EPYC Zen 1). The rare row with
// an infinity or a NaN is walked a value at a time.
template <typename T>
int64_t argmax_row(const T* x, int64_t n, bool* finite = nullptr) {
  constexpr int64_t CHUNK = 256;
  simd::F16 nonfinite = simd::zero_f();
  const simd::F16 zero = simd::zero_f();
  float best_value = -INFINITY;
  int64_t best_chunk = 0;
  for (int64_t c = 0; c < n; c += CHUNK) {
    const int64_t end = c + CHUNK < n ? c + CHUNK : n;
    simd::F16 top = simd::set1_f(-INFINITY);
    for (int64_t i = c; i < end; i += 16) {
      top = simd::max(top, load16(x, i, end, -INFINITY));
      nonfinite = simd::add(nonfinite, simd::mul(zero, load16(x, i, end, 0.0f)));  // NaN where any is inf or NaN
    }
    const float m = simd::reduce_max(top);
    if (m > best_value) best_value = m, best_chunk = c;  // a later chunk's equal maximum does not count
  }
  const bool all_finite = !std::isnan(simd::reduce_add(nonfinite));
  if (finite != nullptr) *finite = all_finite;
  int64_t best = 0;
  if (!all_finite) {
    float m = to_float(x[0]);
    for (int64_t i = 1; i < n && !std::isnan(m); ++i) {
      const float v = to_float(x[i]);
      if (v > m || std::isnan(v)) best = i, m = v;
    }
  } else {
    best = best_chunk;
    while (to_float(x[best]) != best_value) ++best;
  }
  return best;
}

// A sampling distribution at temperature t > 0 with no top-k, top-p or min-p: q [n] =
// softmax(x / t) of a row of logits [n], each x / t divided in float32 as torch divides,
// e^(x / t - max) from simd.h's exp_neg (the same bits on every ISA; below e^-87 it gives e^-87,
// where torch's gives less or 0) summed in simd.h's order, each divided by the sum. A logit of
// -inf (a grammar's mask, a ban) gets exactly 0, as in torch's softmax; a row whose maximum is
// +inf or NaN is all NaN, as torch's is. Written by hand because torch's softmax and its double
// cumulative sum for the draw took ~1.9 ms a 151,936-logit row (AMD EPYC Zen 1), against a draft
// pass of ~14 ms: sampling.logits_to_probs on the CPU, and the draft's native chains.
//
// In two steps, so that the verifier can test a draft token against a row without its third pass
// (verify_chains): softmax_exps leaves the row's e^(x / t - max) in q and returns their sum, and
// the division by it follows only where the whole row is wanted.
template <typename T>
float softmax_exps(const T* x, int64_t n, float t, float* q) {
  const simd::F16 tv = simd::set1_f(t), zero = simd::zero_f();
  simd::F16 top = simd::set1_f(-INFINITY), nonfinite = simd::zero_f();
  for (int64_t i = 0; i < n; i += 16) {
    top = simd::max(top, load16(x, i, n, -INFINITY));
    nonfinite = simd::add(nonfinite, simd::mul(zero, load16(x, i, n, 0.0f)));  // NaN where any is inf or NaN
  }
  // the largest x / t is the largest x divided by t: a correctly rounded division by t > 0 never
  // reverses an order, so one division, not one a value, gives the same bits
  const float m = simd::reduce_max(top) / t;
  if (!std::isfinite(m)) {
    for (int64_t i = 0; i < n; ++i) q[i] = NAN;
    return NAN;
  }
  const bool masked = std::isnan(simd::reduce_add(nonfinite));  // some logit is -inf (the maximum is finite)
  const simd::F16 minus = simd::set1_f(-m);
  simd::F16 sum = simd::zero_f();
  for (int64_t i = 0; i < n; i += 16) {
    const int live = n - i < 16 ? static_cast<int>(n - i) : 16;
    simd::F16 e = simd::exp_neg(simd::add(simd::div(load16(x, i, n, 0.0f), tv), minus));
    if (live < 16 || masked) {  // the tail's padding and the -inf logits add nothing
      alignas(64) float lanes[16];
      simd::store_f(lanes, e);
      for (int j = 0; j < 16; ++j)
        if (j >= live || to_float(x[i + j]) == -INFINITY) lanes[j] = 0.0f;
      e = simd::load_f(lanes);
    }
    sum = simd::add(sum, e);
    store_n(q + i, e, live);
  }
  return simd::reduce_add(sum);
}

// q [n] (softmax_exps's e values) divided by their sum `total`: softmax_row's last pass
inline void divide_row(float* q, int64_t n, float total) {
  const simd::F16 tv = simd::set1_f(total);
  for (int64_t i = 0; i < n; i += 16) {
    const int live = n - i < 16 ? static_cast<int>(n - i) : 16;
    store_n(q + i, simd::div(load_n(q + i, live), tv), live);
  }
}

template <typename T>
void softmax_row(const T* x, int64_t n, float t, float* q) {
  divide_row(q, n, softmax_exps(x, n, t, q));
}

// A token drawn from q [n] (q >= 0, some mass; need not sum to 1) with a uniform u in [0, 1):
// the first index whose cumulative mass exceeds u x total, the point kept below the total so that
// u -> 1 cannot run off the end, so a token of mass 0 is never drawn (sampling.sample_from_probs's
// rule). The cumulative mass is in float64, by blocks of 256 values: a block's start is the sum of
// the blocks before it (added in order); within a block four running sums take every fourth
// value, and a value's mass is the start plus (s0 + s1) + (s2 + s3) as they stand after it (the
// block's last value then gives its sum; each value only raises one running sum, so the mass
// never falls, and stays put over a value of 0). Four chains, not one: a float64 walk over the
// whole row is 151,936 dependent adds. Only the block that holds the point is walked value by value.
inline int64_t sample_row(const float* q, int64_t n, double u) {
  constexpr int64_t BLOCK = 256;
  const auto block_sum = [&](int64_t from, int64_t to, int64_t stop, double start, double point) -> std::pair<double, int64_t> {
    // the block [from, to)'s sum; with stop >= 0 (walking it), the first value whose mass passes point
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t i = from;
    if (stop < 0) {
      for (; i + 4 <= to; i += 4) s0 += q[i], s1 += q[i + 1], s2 += q[i + 2], s3 += q[i + 3];
    }
    for (; i < to; ++i) {
      const int64_t lane = (i - from) & 3;
      (lane == 0 ? s0 : lane == 1 ? s1 : lane == 2 ? s2 : s3) += q[i];
      if (stop >= 0 && start + ((s0 + s1) + (s2 + s3)) > point) return {0.0, i};
    }
    return {(s0 + s1) + (s2 + s3), -1};
  };
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  std::vector<double> sums(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = block_sum(b * BLOCK, std::min(n, (b + 1) * BLOCK), -1, 0.0, 0.0).first;
    total += sums[b];
  }
  const double point = std::min(u * total, std::nextafter(total, 0.0));
  double start = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (start + sums[b] > point) {
      const int64_t i = block_sum(b * BLOCK, std::min(n, (b + 1) * BLOCK), 0, start, point).second;
      if (i >= 0) return i;
    }
    start += sums[b];
  }
  int64_t last = n - 1;  // not reached where q has mass: the last value of mass
  while (last > 0 && !(q[last] > 0.0f)) --last;
  return last;
}

// The filters a request's sampling applies after its temperature (sampling.SamplingParams):
// top_k <= 0 or >= n, top_p >= 1 and min_p <= 0 are off.
struct Filters {
  int64_t top_k = 0;
  double top_p = 1.0;
  float min_p = 0.0f;
  bool top_k_on(int64_t n) const { return top_k > 0 && top_k < n; }
  bool top_p_on() const { return top_p < 1.0; }
  bool any(int64_t n) const { return top_k_on(n) || top_p_on() || min_p > 0.0f; }
};

// The sum of q [n] in simd.h's order (16 lane chains, then the lanes' tree): the same bits on every ISA.
inline float sum_row(const float* q, int64_t n) {
  simd::F16 sum = simd::zero_f();
  for (int64_t i = 0; i < n; i += 16) sum = simd::add(sum, load_n(q + i, n - i < 16 ? static_cast<int>(n - i) : 16));
  return simd::reduce_add(sum);
}

// The largest of v [n] (no NaN).
inline float max_row(const float* v, int64_t n) {
  simd::F16 top = simd::set1_f(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) top = simd::max(top, load16(v, i, n, -INFINITY));
  return simd::reduce_max(top);
}

// q [n] with every value whose key is below `floor` set to 0 and the rest divided by their sum
// (sum_row's). key: the values' keys [n] (q itself for min-p, the scaled logits for top-k and top-p).
inline void keep_from(float* q, const float* key, int64_t n, float floor) {
  for (int64_t i = 0; i < n; ++i) q[i] = key[i] >= floor ? q[i] : 0.0f;
  const simd::F16 total = simd::set1_f(sum_row(q, n));
  for (int64_t i = 0; i < n; i += 16) {
    const int live = n - i < 16 ? static_cast<int>(n - i) : 16;
    store_n(q + i, simd::div(load_n(q + i, live), total), live);
  }
}

// The smallest scaled logit that top-k and top-p keep, from s [n] (x / t) and their
// probabilities q [n] (softmax_row's, no NaN, summing to `total`): the k-th highest s, and the s of
// the nucleus's last token, the nucleus being the shortest run of tokens by descending s, among
// those top-k kept, whose mass (float64, over the kept mass) is >= top_p, so the top token always
// stays. Every token whose s equals the cut-off is kept, so the kept set depends on the values
// alone, never on how a sort orders equal ones (sampling.py's torch rule).
//
// No sort of the row: top-k finds the k-th value with a min-heap of k (one compare a value once
// it is full); the nucleus is looked for among the tokens within 2^-10 of the top one's
// probability (s >= max - 10 ln 2), then 2^-20, 2^-40, then all, until it closes inside them (a
// peaked row: a few dozen tokens).
inline float cutoff_of(const float* s, const float* q, int64_t n, const Filters& f, float total) {
  std::vector<std::pair<float, float>> top;  // (s, q) of the candidates
  const auto gather = [&](float from) {     // every token with s >= from, by descending s
    top.clear();
    for (int64_t i = 0; i < n; ++i)
      if (s[i] >= from) top.emplace_back(s[i], q[i]);
    std::sort(top.begin(), top.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  };
  const auto last_of_nucleus = [&](double want, bool* closed) {  // the s of its last token among top
    double before = 0.0;
    float last = top.front().first;
    size_t j = 0;
    for (; j < top.size() && before < want; ++j) last = top[j].first, before += top[j].second;
    *closed = j < top.size() || before >= want;
    return last;
  };
  bool closed = false;
  if (f.top_k_on(n)) {
    const auto above = std::greater<float>();
    std::vector<float> heap(s, s + f.top_k);
    std::make_heap(heap.begin(), heap.end(), above);  // front: the least of the k highest so far
    for (int64_t i = f.top_k; i < n; ++i) {
      if (s[i] > heap.front()) {
        std::pop_heap(heap.begin(), heap.end(), above);
        heap.back() = s[i];
        std::push_heap(heap.begin(), heap.end(), above);
      }
    }
    const float kth = heap.front();
    if (!f.top_p_on()) return kth;
    gather(kth);  // the k tokens, and any tied with the k-th
    double kept = 0.0;
    for (const auto& c : top) kept += c.second;
    return std::max(kth, last_of_nucleus(f.top_p * kept, &closed));  // top holds every kept token
  }
  const float smax = max_row(s, n);
  for (const float reach : {10.0f, 20.0f, 40.0f}) {
    gather(smax - reach * 0.6931472f);
    const float last = last_of_nucleus(f.top_p * total, &closed);
    if (closed) return last;
  }
  gather(-INFINITY);
  return last_of_nucleus(f.top_p * total, &closed);
}

// q [n] as sampling.logits_to_probs shapes a row at temperature t > 0 on the CPU: softmax_row,
// then top-k and top-p on the scaled logits (cutoff_of) and renormalized, then min-p (what is less
// likely than min_p times the most likely token goes) and renormalized. Without filters,
// softmax_row's bits; a row softmax_row leaves NaN stays so.
template <typename T>
void shaped_row(const T* x, int64_t n, float t, const Filters& f, float* q) {
  softmax_row(x, n, t, q);
  if (!f.any(n)) return;
  const float total = sum_row(q, n);
  if (std::isnan(total)) return;
  if (f.top_k_on(n) || f.top_p_on()) {
    thread_local std::vector<float> scaled;
    scaled.resize(n);
    const simd::F16 tv = simd::set1_f(t);
    for (int64_t i = 0; i < n; i += 16) {  // x / t as softmax_row divides it
      const int live = n - i < 16 ? static_cast<int>(n - i) : 16;
      store_n(scaled.data() + i, simd::div(load16(x, i, n, 0.0f), tv), live);
    }
    keep_from(q, scaled.data(), n, cutoff_of(scaled.data(), q, n, f, total));
  }
  if (f.min_p > 0.0f) keep_from(q, q, n, f.min_p * max_row(q, n));
}

// One row's draw: at temperature t > 0 shaped_row into q [n] and sample_row with u; at t = 0 the
// argmax, q one-hot there (sampling.logits_to_probs's greedy row). -> the head row drawn
template <typename T>
int64_t sample_one(const T* x, int64_t n, float t, double u, float* q, const Filters& f = {}) {
  if (t == 0.0f) {
    const int64_t best = argmax_row(x, n);
    std::memset(q, 0, sizeof(float) * n);
    q[best] = 1.0f;
    return best;
  }
  shaped_row(x, n, t, f, q);
  return sample_row(q, n, u);
}

}  // namespace QD_ISA_NS
}  // namespace qd
