// simd.h on ARM64 NEON with the dot-product extension (ARMv8.2-A dotprod: Apple M1 and later,
// AWS Graviton 2 and later, Ampere Altra): each type is four 128-bit registers, lanes 0..3 in
// the first. sdot multiplies signed bytes, so unsigned ones must stay within 127 (FULL_U8 false:
// simd.h); ARMv8.6's usdot (i8mm) would lift that, and is not used yet.
#pragma once

#include <arm_neon.h>

#include <algorithm>

namespace simd {
inline namespace neon {  // each ISA's names its own: several ISAs' builds may meet in one program

constexpr const char* ISA = "neon";
constexpr bool FULL_U8 = false;

constexpr int F16_REGS = 8;  // F16 values the registers hold: 32 q registers
struct F16 { float32x4_t q[4]; };
struct I16 { int32x4_t q[4]; };
struct B64 { uint8x16_t q[4]; };
struct BH32 { F16 even, odd; };  // as isa_avx2.h

#define QD_QUADS(i) for (int i = 0; i < 4; ++i)

inline F16 zero_f() { F16 r; QD_QUADS(i) r.q[i] = vdupq_n_f32(0.0f); return r; }
inline F16 set1_f(float a) { F16 r; QD_QUADS(i) r.q[i] = vdupq_n_f32(a); return r; }
inline F16 load_f(const float* p) { F16 r; QD_QUADS(i) r.q[i] = vld1q_f32(p + 4 * i); return r; }
inline F16 load_f(const uint16_t* p) {
  F16 r;
  QD_QUADS(i) r.q[i] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * i), 16));
  return r;
}
inline F16 load_f_part(const float* p, int n) {
  float t[16] = {};
  std::memcpy(t, p, sizeof(float) * n);
  return load_f(t);
}
inline void store_f(float* p, F16 a) { QD_QUADS(i) vst1q_f32(p + 4 * i, a.q[i]); }
inline void store_bf16(uint16_t* p, F16 a) {
  float t[16];
  store_f(t, a);
  for (int i = 0; i < 16; ++i) p[i] = to_bf16(t[i]);
}
inline F16 add(F16 a, F16 b) { QD_QUADS(i) a.q[i] = vaddq_f32(a.q[i], b.q[i]); return a; }
inline F16 mul(F16 a, F16 b) { QD_QUADS(i) a.q[i] = vmulq_f32(a.q[i], b.q[i]); return a; }
inline F16 div(F16 a, F16 b) { QD_QUADS(i) a.q[i] = vdivq_f32(a.q[i], b.q[i]); return a; }
inline F16 max(F16 a, F16 b) { QD_QUADS(i) a.q[i] = vmaxq_f32(a.q[i], b.q[i]); return a; }
inline F16 abs(F16 a) { QD_QUADS(i) a.q[i] = vabsq_f32(a.q[i]); return a; }
inline F16 fmadd(F16 a, F16 b, F16 c) { QD_QUADS(i) c.q[i] = vfmaq_f32(c.q[i], a.q[i], b.q[i]); return c; }
inline F16 fnmadd(F16 a, F16 b, F16 c) { QD_QUADS(i) c.q[i] = vfmsq_f32(c.q[i], a.q[i], b.q[i]); return c; }
inline float reduce_add(F16 a) {  // simd.h's tree: i + 8, i + 4, i + 2, i + 1
  const float32x4_t s4 = vaddq_f32(vaddq_f32(a.q[0], a.q[2]), vaddq_f32(a.q[1], a.q[3]));
  const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
  return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}
inline float reduce_max(F16 a) { return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.q[0], a.q[1]), vmaxq_f32(a.q[2], a.q[3]))); }
inline F16 half_to_f(const uint8_t* p) {
  F16 r;
  QD_QUADS(i) r.q[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p) + 4 * i)));
  return r;
}
inline F16 u8_to_f(const uint8_t* p) {
  const uint16x8_t lo = vmovl_u8(vld1_u8(p)), hi = vmovl_u8(vld1_u8(p + 8));
  return {{vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo))),
           vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)))}};
}
inline F16 i8_to_f(const uint8_t* p) {
  const int16x8_t lo = vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(p))), hi = vmovl_s8(vld1_s8(reinterpret_cast<const int8_t*>(p) + 8));
  return {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
           vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))}};
}

inline I16 zero_i() { I16 r; QD_QUADS(i) r.q[i] = vdupq_n_s32(0); return r; }
inline I16 set1_i(int32_t a) { I16 r; QD_QUADS(i) r.q[i] = vdupq_n_s32(a); return r; }
inline I16 load_i(const int32_t* p) { I16 r; QD_QUADS(i) r.q[i] = vld1q_s32(p + 4 * i); return r; }
inline I16 add_i(I16 a, I16 b) { QD_QUADS(i) a.q[i] = vaddq_s32(a.q[i], b.q[i]); return a; }
inline F16 to_f(I16 a) { F16 r; QD_QUADS(i) r.q[i] = vcvtq_f32_s32(a.q[i]); return r; }
inline I16 round_i(F16 a) { I16 r; QD_QUADS(i) r.q[i] = vcvtnq_s32_f32(a.q[i]); return r; }  // to nearest, ties to even
inline F16 pow2_f(I16 n) { F16 r; QD_QUADS(i) r.q[i] = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n.q[i], vdupq_n_s32(127)), 23)); return r; }
inline void store_i8(int8_t* p, I16 a) {
  const int16x8_t lo = vcombine_s16(vmovn_s32(a.q[0]), vmovn_s32(a.q[1])), hi = vcombine_s16(vmovn_s32(a.q[2]), vmovn_s32(a.q[3]));
  vst1q_s8(p, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
}
inline int32_t reduce_add_i(I16 a) { return vaddvq_s32(vaddq_s32(vaddq_s32(a.q[0], a.q[1]), vaddq_s32(a.q[2], a.q[3]))); }

inline B64 load_b(const void* p) { B64 r; QD_QUADS(i) r.q[i] = vld1q_u8(static_cast<const uint8_t*>(p) + 16 * i); return r; }
inline B64 load_b_part(const void* p, int n) {
  uint8_t t[64] = {};
  std::memcpy(t, p, n < 64 ? n : 64);
  return load_b(t);
}
inline void store_b(void* p, B64 a) { QD_QUADS(i) vst1q_u8(static_cast<uint8_t*>(p) + 16 * i, a.q[i]); }
inline B64 set1_b(uint8_t a) { B64 r; QD_QUADS(i) r.q[i] = vdupq_n_u8(a); return r; }
inline B64 and_b(B64 a, B64 b) { QD_QUADS(i) a.q[i] = vandq_u8(a.q[i], b.q[i]); return a; }
inline B64 or_b(B64 a, B64 b) { QD_QUADS(i) a.q[i] = vorrq_u8(a.q[i], b.q[i]); return a; }
inline B64 xor_b(B64 a, B64 b) { QD_QUADS(i) a.q[i] = veorq_u8(a.q[i], b.q[i]); return a; }
inline B64 shift_mask(B64 a, int shift, B64 mask) {  // byte shifts (negative: right)
  const int8x16_t s = vdupq_n_s8(static_cast<int8_t>(shift));
  QD_QUADS(i) a.q[i] = vandq_u8(vshlq_u8(a.q[i], s), mask.q[i]);
  return a;
}

inline I16 dot_ss(I16 acc, B64 a, B64 b) {
  QD_QUADS(i) acc.q[i] = vdotq_s32(acc.q[i], vreinterpretq_s8_u8(a.q[i]), vreinterpretq_s8_u8(b.q[i]));
  return acc;
}
inline I16 dot_us(I16 acc, B64 u, B64 s) { return dot_ss(acc, u, s); }  // u <= 127: the same bytes signed
inline I16 dot_ss_bcast(I16 acc, B64 a, const int32_t* p) {
  const int8x16_t x = vreinterpretq_s8_s32(vld1q_dup_s32(p));
  QD_QUADS(i) acc.q[i] = vdotq_s32(acc.q[i], vreinterpretq_s8_u8(a.q[i]), x);
  return acc;
}
inline I16 dot_us_bcast(I16 acc, B64 u, const int32_t* p) { return dot_ss_bcast(acc, u, p); }

inline BH32 load_bh(const uint16_t* p) {
  BH32 r;
  QD_QUADS(i) {
    const uint32x4_t w = vld1q_u32(reinterpret_cast<const uint32_t*>(p) + 4 * i);
    r.even.q[i] = vreinterpretq_f32_u32(vshlq_n_u32(w, 16));
    r.odd.q[i] = vreinterpretq_f32_u32(vandq_u32(w, vdupq_n_u32(0xffff0000u)));
  }
  return r;
}
inline BH32 load_bh_part(const uint16_t* p, int n) {
  uint16_t t[32] = {};
  std::memcpy(t, p, sizeof(uint16_t) * (n < 32 ? n : 32));
  return load_bh(t);
}
inline F16 dot_bf16(F16 acc, const BH32& x, const BH32& w) { return fmadd(x.odd, w.odd, fmadd(x.even, w.even, acc)); }

inline void prefetch_l1(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#undef QD_QUADS

}  // namespace neon
}  // namespace simd
