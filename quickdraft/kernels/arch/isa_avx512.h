// simd.h on x86 AVX-512 (F, BW, DQ, VL, VNNI; BF16 where the CPU has it): each type is one 512-bit
// register.
#pragma once

#include <immintrin.h>

namespace simd {
inline namespace avx512 {  // each ISA's names its own: several ISAs' builds may meet in one program

constexpr const char* ISA = "avx512";
constexpr bool FULL_U8 = true;  // vpdpbusd multiplies every unsigned byte exactly

constexpr int F16_REGS = 32;  // F16 values the registers hold: 32 zmm
struct F16 { __m512 v; };
struct I16 { __m512i v; };
struct B64 { __m512i v; };
#if defined(__AVX512BF16__)
struct BH32 { __m512bh v; };  // 32 bfloat16 values
#else
struct BH32 { __m512 even, odd; };  // as isa_avx2.h: elements 2l and 2l + 1 of lane l, as float32
#endif

inline F16 zero_f() { return {_mm512_setzero_ps()}; }
inline F16 set1_f(float a) { return {_mm512_set1_ps(a)}; }
inline F16 load_f(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 load_f(const uint16_t* p) {  // 16 bfloat16 -> float32 (bfloat16 is float32's upper half)
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
}
inline F16 load_f_part(const float* p, int n) {  // lanes n.. are zero
  return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)};
}
inline void store_f(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline void store_bf16(uint16_t* p, F16 a) {
  alignas(64) float t[16];
  _mm512_store_ps(t, a.v);
  for (int i = 0; i < 16; ++i) p[i] = to_bf16(t[i]);
}
inline F16 add(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 mul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 div(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 abs(F16 a) { return {_mm512_abs_ps(a.v)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }   // a * b + c
inline F16 fnmadd(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; } // c - a * b
inline float reduce_add(F16 a) { return _mm512_reduce_add_ps(a.v); }
// lane t = reduce_add(a[t]), simd.h's tree for each, sixteen at a time: each level adds two
// vectors' halves at once (vshuff32x4, then vshufps), ~45 instructions for 16 sums instead of ~130
#define QD_ISA_OWN_REDUCE16 1  // simd.h's reduce_add16 a vector at a time; AVX-512 transposes instead
inline F16 reduce_add16(const F16* a) {
  __m512 l1[8], l2[4], l3[2];
  // a[] in the order that leaves lane t with a[t] at the end: level 4 interleaves 4 x 4 (below)
  for (int i = 0; i < 8; ++i) {  // lanes i + i + 8: [x0..7 | y0..7] of x, y = the two inputs
    const int x = (2 * i) % 4 * 4 + (2 * i) / 4, y = (2 * i + 1) % 4 * 4 + (2 * i + 1) / 4;
    l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[x].v, a[y].v, _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(a[x].v, a[y].v, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i)  // i + 4: [x0..3 y0..3 z0..3 w0..3]
    l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // i + 2: in each 128-bit part, two lanes of one input, two of the other
    l3[i] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // i + 1: part k holds the sums of inputs k, 4 + k, 8 + k, 12 + k (x, y, z, w above, in the order read)
  return {_mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(l3[0], l3[1], _MM_SHUFFLE(3, 1, 3, 1)))};
}
inline float reduce_max(F16 a) { return _mm512_reduce_max_ps(a.v); }
inline F16 half_to_f(const uint8_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline F16 u8_to_f(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }
inline F16 i8_to_f(const uint8_t* p) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))}; }

inline I16 zero_i() { return {_mm512_setzero_si512()}; }
inline I16 set1_i(int32_t a) { return {_mm512_set1_epi32(a)}; }
inline I16 load_i(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
inline I16 add_i(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline F16 to_f(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I16 round_i(F16 a) { return {_mm512_cvtps_epi32(_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT))}; }  // half to even
// 2^n exactly, for n in -126..127: n + 127 in the exponent field
inline F16 pow2_f(I16 n) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n.v, _mm512_set1_epi32(127)), 23))}; }
inline void store_i8(int8_t* p, I16 a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v)); }
inline int32_t reduce_add_i(I16 a) { return _mm512_reduce_add_epi32(a.v); }

inline B64 load_b(const void* p) { return {_mm512_loadu_si512(p)}; }
inline B64 load_b_part(const void* p, int n) {  // bytes n.. are zero
  return {_mm512_maskz_loadu_epi8(n >= 64 ? ~__mmask64(0) : static_cast<__mmask64>((1ull << n) - 1), p)};
}
inline void store_b(void* p, B64 a) { _mm512_storeu_si512(p, a.v); }
inline B64 set1_b(uint8_t a) { return {_mm512_set1_epi8(static_cast<char>(a))}; }
inline B64 and_b(B64 a, B64 b) { return {_mm512_and_si512(a.v, b.v)}; }
inline B64 or_b(B64 a, B64 b) { return {_mm512_or_si512(a.v, b.v)}; }
inline B64 xor_b(B64 a, B64 b) { return {_mm512_xor_si512(a.v, b.v)}; }
// each byte shifted left (shift > 0) or right, then masked: a 16-bit shift, whose bits carried
// across a byte boundary the mask must clear (the callers' masks do)
inline B64 shift_mask(B64 a, int shift, B64 mask) {
  const __m512i v = shift >= 0 ? _mm512_slli_epi16(a.v, shift) : _mm512_srli_epi16(a.v, -shift);
  return {_mm512_and_si512(v, mask.v)};
}

inline I16 dot_us(I16 acc, B64 u, B64 s) { return {_mm512_dpbusd_epi32(acc.v, u.v, s.v)}; }
inline I16 dot_ss(I16 acc, B64 a, B64 b) {  // a's sign moved onto b: |a| is unsigned (ggml's trick)
  const __m512i abs_a = _mm512_abs_epi8(a.v);
  const __mmask64 neg = _mm512_movepi8_mask(a.v);
  const __m512i sb = _mm512_mask_sub_epi8(b.v, neg, _mm512_setzero_si512(), b.v);
  return {_mm512_dpbusd_epi32(acc.v, abs_a, sb)};
}
// acc += u . (4 bytes at p, broadcast): GCC 12 does not fold _mm512_set1_epi32(*p) into vpdpbusd,
// and a separate vpbroadcastd took a vector slot (L3-resident Q4_K 8960x1536, 16 rows: 0.95 ->
// 0.90 ms, the same bits)
inline I16 dot_us_bcast(I16 acc, B64 u, const int32_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc.v) : "v"(u.v), "m"(*p));
  return acc;
}
inline I16 dot_ss_bcast(I16 acc, B64 a, const int32_t* p) { return dot_ss(acc, a, B64{_mm512_set1_epi32(*p)}); }

#if defined(__AVX512BF16__)
inline BH32 load_bh(const uint16_t* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
inline BH32 load_bh_part(const uint16_t* p, int n) {
  return {(__m512bh)_mm512_maskz_loadu_epi16(n >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << n) - 1), p)};
}
// lane l += x[2l] w[2l] + x[2l + 1] w[2l + 1], as vdpbf16ps rounds it
inline F16 dot_bf16(F16 acc, BH32 x, BH32 w) { return {_mm512_dpbf16_ps(acc.v, x.v, w.v)}; }
#else  // AVX-512 without BF16 (Ice Lake, Cascade Lake): the even element's FMA, then the odd one's
inline BH32 from_words(__m512i a) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_and_si512(a, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}
inline BH32 load_bh(const uint16_t* p) { return from_words(_mm512_loadu_si512(p)); }
inline BH32 load_bh_part(const uint16_t* p, int n) {
  return from_words(_mm512_maskz_loadu_epi16(n >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << n) - 1), p));
}
inline F16 dot_bf16(F16 acc, BH32 x, BH32 w) { return {_mm512_fmadd_ps(x.odd, w.odd, _mm512_fmadd_ps(x.even, w.even, acc.v))}; }
#endif

inline void prefetch_l1(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

}  // namespace avx512
}  // namespace simd
