// A layer's row-wise and elementwise steps on raw pointers, written against the vector layer
// (simd.h): RMSNorm, SiLU(gate) x up, adds, multiplies and conversions. rowwise.cpp binds them
// to torch; tests/native runs them on every ISA. T is float (float32) or uint16_t (bfloat16).
//
// Why vectors: at one row a layer's elementwise steps are a few thousand values each, and their
// scalar loops (a bfloat16 rounding a value, with its NaN branch) and torch's silu (~15 us for the
// 0.5B's 4,864 values, through the dispatcher) came to about a twelfth of a draft pass on an AMD
// EPYC Zen 1. Each value's result is the same sequence of lane operations on every ISA (simd.h),
// so the bits are the portable build's, and each row's depend on that row alone.
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

// Elementwise over `count` values: parallel only where the work outgrows a parallel region's cost
// (a prompt's pass); a value's result never depends on which thread computes it.
constexpr int64_t PARALLEL_VALUES = 1 << 16;

// f over each 16 values i..i+15 of `count` (the last ones through a padded copy: op(n, i) gets
// how many are real), in parallel past PARALLEL_VALUES
template <typename Op>
inline void in_sixteens(int64_t count, Op op) {
  const int64_t whole = count / 16;
#pragma omp parallel for schedule(static) if (count > PARALLEL_VALUES)
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

// out = a * b, likewise torch's multiply
template <typename T>
void mul_values(const T* a, const T* b, T* out, int64_t count) {
  in_sixteens(count, [&](int n, int64_t i) { store_n(out + i, simd::mul(load_n(a + i, n), load_n(b + i, n)), n); });
}

// dst = src in To's dtype (bfloat16 <-> float32, rounded to nearest even as torch's copy_)
template <typename From, typename To>
void convert_values(const From* src, To* dst, int64_t count) {
  in_sixteens(count, [&](int n, int64_t i) { store_n(dst + i, load_n(src + i, n), n); });
}

// SiLU, x / (1 + e^-x), from simd::exp_neg alone (so the same bits on every ISA):
// x e^min(x, 0) / (1 + e^-|x|), which is x / (1 + e^-x) for either sign with both exponents <= 0.
// Within a few ulp of the exact value; below x = -87 the numerator's e^x stays at e^-87 (exp_neg's
// floor), a value of |x| x 1.6e-38 where the exact one is smaller still. NaN stays NaN.
inline simd::F16 silu(simd::F16 x) {
  const simd::F16 minus = simd::set1_f(-1.0f);
  const simd::F16 lower = simd::mul(simd::max(simd::mul(x, minus), simd::zero_f()), minus);  // min(x, 0)
  const simd::F16 num = simd::mul(x, simd::exp_neg(lower));
  return simd::div(num, simd::add(simd::set1_f(1.0f), simd::exp_neg(simd::mul(simd::abs(x), minus))));
}

// out = T(T(silu(gate)) x up): the decoder's silu(gate) * up, each rounded to T as the two torch
// operations would be (out may be gate or up)
template <typename T>
void silu_mul_values(const T* gate, const T* up, T* out, int64_t count) {
  in_sixteens(count, [&](int n, int64_t i) {
    store_n(out + i, simd::mul(round_to<T>(silu(load_n(gate + i, n))), load_n(up + i, n)), n);
  });
}

}  // namespace QD_ISA_NS
}  // namespace qd
