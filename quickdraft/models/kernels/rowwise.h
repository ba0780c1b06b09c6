// A layer's row-wise and elementwise steps on raw pointers, written against the vector layer
// (simd.h): RMSNorm, rotary, SiLU, adds, multiplies and conversions, each value rounded as torch
// rounds it.
// rowwise.cpp binds them to torch; tests/native runs them on every ISA. T is float (float32) or
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
// in order), the lanes added 0..15; each value normalized in float32, rounded to T, times the
// weight, rounded to T. Rows [n, h] of X into Y (Y may not overlap X).
template <typename T>
void rms_rows(const T* X, const T* W, T* Y, int64_t n, int64_t h, float eps) {
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
    for (int64_t i = 0; i < whole; i += 16)
      store(y + i, simd::mul(simd::load_f(W + i), round_to<T>(simd::mul(simd::load_f(x + i), iv))));
    for (int64_t i = whole; i < h; ++i) y[i] = from_float<T>(to_float(W[i]) * to_float(from_float<T>(to_float(x[i]) * inv)));
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

// dst = src in To's dtype (bfloat16 <-> float32, rounded to nearest even as torch's copy_)
template <typename From, typename To>
void convert_values(const From* src, To* dst, int64_t count) {
  in_sixteens(count, [&](int n, int64_t i) { store_n(dst + i, load_n(src + i, n), n); });
}

}  // namespace QD_ISA_NS
}  // namespace qd
