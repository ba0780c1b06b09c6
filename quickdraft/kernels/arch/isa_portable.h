// simd.h in plain C++: arrays of 16 lanes in loops any compiler builds (and may vectorize; the
// build passes -ffp-contract=off, so a lane's operations are exactly the ones written). The
// reference the other headers are tested against, and the path of CPUs without one of their own.
#pragma once

#include <algorithm>
#include <cmath>

namespace simd {
inline namespace portable {  // each ISA's names its own: several ISAs' builds may meet in one program

constexpr const char* ISA = "portable";
constexpr bool FULL_U8 = true;  // plain integer products: exact for every byte

constexpr int F16_REGS = 8;  // F16 values a kernel keeps at once (as AVX2's)
struct F16 { float v[16]; };
struct I16 { int32_t v[16]; };
struct B64 { uint8_t v[64]; };
struct BH32 { float v[32]; };

#define QD_LANES(i) for (int i = 0; i < 16; ++i)

inline F16 zero_f() { return F16{}; }
inline F16 set1_f(float a) { F16 r; QD_LANES(i) r.v[i] = a; return r; }
inline F16 load_f(const float* p) { F16 r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline F16 load_f(const uint16_t* p) { F16 r; QD_LANES(i) r.v[i] = from_bf16(p[i]); return r; }
inline F16 load_f_part(const float* p, int n) { F16 r{}; std::memcpy(r.v, p, sizeof(float) * n); return r; }
inline void store_f(float* p, F16 a) { std::memcpy(p, a.v, sizeof a.v); }
inline void store_bf16(uint16_t* p, F16 a) { QD_LANES(i) p[i] = to_bf16(a.v[i]); }
inline F16 add(F16 a, F16 b) { QD_LANES(i) a.v[i] += b.v[i]; return a; }
inline F16 mul(F16 a, F16 b) { QD_LANES(i) a.v[i] *= b.v[i]; return a; }
inline F16 div(F16 a, F16 b) { QD_LANES(i) a.v[i] /= b.v[i]; return a; }
inline F16 max(F16 a, F16 b) { QD_LANES(i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return a; }
inline F16 abs(F16 a) { QD_LANES(i) a.v[i] = std::fabs(a.v[i]); return a; }
inline F16 fmadd(F16 a, F16 b, F16 c) { QD_LANES(i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
inline F16 fnmadd(F16 a, F16 b, F16 c) { QD_LANES(i) c.v[i] = std::fma(-a.v[i], b.v[i], c.v[i]); return c; }
inline float reduce_add(F16 a) {  // simd.h's tree
  for (int h = 8; h >= 1; h /= 2)
    for (int i = 0; i < h; ++i) a.v[i] = a.v[i] + a.v[i + h];
  return a.v[0];
}
inline float reduce_max(F16 a) { return *std::max_element(a.v, a.v + 16); }
inline float half(uint16_t h) {  // IEEE binary16 -> float32, exactly
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t u;
  if (e == 0x1f) {
    u = sign | 0x7f800000 | (m << 13);
  } else if (e != 0) {
    u = sign | ((e + 112) << 23) | (m << 13);
  } else {  // zero or subnormal: m x 2^-24, exact in float32
    const float f = std::ldexp(static_cast<float>(m), -24);
    std::memcpy(&u, &f, 4);
    u |= sign;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline F16 half_to_f(const uint8_t* p) {
  F16 r;
  QD_LANES(i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    r.v[i] = half(h);
  }
  return r;
}
inline F16 u8_to_f(const uint8_t* p) { F16 r; QD_LANES(i) r.v[i] = static_cast<float>(p[i]); return r; }
inline F16 i8_to_f(const uint8_t* p) { F16 r; QD_LANES(i) r.v[i] = static_cast<float>(static_cast<int8_t>(p[i])); return r; }

inline I16 zero_i() { return I16{}; }
inline I16 set1_i(int32_t a) { I16 r; QD_LANES(i) r.v[i] = a; return r; }
inline I16 load_i(const int32_t* p) { I16 r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline I16 add_i(I16 a, I16 b) { QD_LANES(i) a.v[i] += b.v[i]; return a; }
inline F16 to_f(I16 a) { F16 r; QD_LANES(i) r.v[i] = static_cast<float>(a.v[i]); return r; }
inline I16 round_i(F16 a) { I16 r; QD_LANES(i) r.v[i] = static_cast<int32_t>(std::nearbyint(a.v[i])); return r; }
inline F16 pow2_f(I16 n) {
  F16 r;
  QD_LANES(i) {
    const uint32_t u = static_cast<uint32_t>(n.v[i] + 127) << 23;
    std::memcpy(&r.v[i], &u, 4);
  }
  return r;
}
inline void store_i8(int8_t* p, I16 a) { QD_LANES(i) p[i] = static_cast<int8_t>(a.v[i]); }
inline int32_t reduce_add_i(I16 a) { int32_t s = 0; QD_LANES(i) s += a.v[i]; return s; }

inline B64 load_b(const void* p) { B64 r; std::memcpy(r.v, p, 64); return r; }
inline B64 load_b_part(const void* p, int n) { B64 r{}; std::memcpy(r.v, p, n < 64 ? n : 64); return r; }
inline void store_b(void* p, B64 a) { std::memcpy(p, a.v, 64); }
inline B64 set1_b(uint8_t a) { B64 r; std::memset(r.v, a, 64); return r; }
inline B64 and_b(B64 a, B64 b) { for (int i = 0; i < 64; ++i) a.v[i] &= b.v[i]; return a; }
inline B64 or_b(B64 a, B64 b) { for (int i = 0; i < 64; ++i) a.v[i] |= b.v[i]; return a; }
inline B64 xor_b(B64 a, B64 b) { for (int i = 0; i < 64; ++i) a.v[i] ^= b.v[i]; return a; }
inline B64 shift_mask(B64 a, int shift, B64 mask) {
  for (int i = 0; i < 64; ++i) a.v[i] = static_cast<uint8_t>((shift >= 0 ? a.v[i] << shift : a.v[i] >> -shift) & mask.v[i]);
  return a;
}

inline I16 dot_us(I16 acc, B64 u, B64 s) {
  QD_LANES(l) for (int b = 0; b < 4; ++b) acc.v[l] += static_cast<int32_t>(u.v[4 * l + b]) * static_cast<int8_t>(s.v[4 * l + b]);
  return acc;
}
inline I16 dot_ss(I16 acc, B64 a, B64 b) {
  QD_LANES(l) for (int k = 0; k < 4; ++k) acc.v[l] += static_cast<int8_t>(a.v[4 * l + k]) * static_cast<int8_t>(b.v[4 * l + k]);
  return acc;
}
inline I16 dot_us_bcast(I16 acc, B64 u, const int32_t* p) {
  int8_t x[4];
  std::memcpy(x, p, 4);
  QD_LANES(l) for (int b = 0; b < 4; ++b) acc.v[l] += static_cast<int32_t>(u.v[4 * l + b]) * x[b];
  return acc;
}
inline I16 dot_ss_bcast(I16 acc, B64 a, const int32_t* p) {
  int8_t x[4];
  std::memcpy(x, p, 4);
  QD_LANES(l) for (int b = 0; b < 4; ++b) acc.v[l] += static_cast<int8_t>(a.v[4 * l + b]) * x[b];
  return acc;
}

inline BH32 load_bh(const uint16_t* p) { BH32 r; for (int i = 0; i < 32; ++i) r.v[i] = from_bf16(p[i]); return r; }
inline BH32 load_bh_part(const uint16_t* p, int n) { BH32 r{}; for (int i = 0; i < n && i < 32; ++i) r.v[i] = from_bf16(p[i]); return r; }
inline F16 dot_bf16(F16 acc, const BH32& x, const BH32& w) {  // as isa_avx2.h: the even element, then the odd one
  QD_LANES(l) acc.v[l] = std::fma(x.v[2 * l + 1], w.v[2 * l + 1], std::fma(x.v[2 * l], w.v[2 * l], acc.v[l]));
  return acc;
}

inline void prefetch_l1(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#undef QD_LANES

}  // namespace portable
}  // namespace simd
