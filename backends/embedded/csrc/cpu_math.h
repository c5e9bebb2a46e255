// Small numeric helpers shared by the engine's CPU kernels.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace areal {

// bfloat16 <-> float on the raw bits, round-to-nearest-even like torch. c10::BFloat16's own
// conversion branches on NaN in a way that keeps loops from vectorising.
inline float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}
inline uint16_t float_to_bf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  // Branch-free: a NaN gets no rounding increment (which could carry it into the sign bit)
  // and its quiet bit set.
  const uint32_t is_nan = static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
  const uint32_t increment = (0x7FFFu + ((u >> 16) & 1u)) & (is_nan - 1u);
  return static_cast<uint16_t>(((u + increment) >> 16) | (is_nan << 6));
}

// Element i of a float or bfloat16 buffer as float, and back.
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::BFloat16* p, int64_t i, float v) {
  reinterpret_cast<uint16_t*>(p)[i] = float_to_bf16(v);
}
// A float result as a tensor of the buffer's type holds it.
inline float round_like(const float*, float v) { return v; }
inline float round_like(const c10::BFloat16*, float v) { return bf16_to_float(float_to_bf16(v)); }

// exp(x) for x <= 0 (softmax after subtracting the max), Cephes' expf: range reduction to
// [-ln2/2, ln2/2] and a degree-6 polynomial, ~1 ulp. Plain arithmetic, so the compiler
// vectorises the loop around it (std::exp is a scalar libm call).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // 2^-126 and below: the smallest normal, not inf or nan
  // floor(t) through a truncating conversion: std::floor keeps GCC from vectorising.
  const float t = x * 1.44269504088896341f + 0.5f;
  const float truncated = static_cast<float>(static_cast<int32_t>(t));
  const float n = truncated > t ? truncated - 1.f : truncated;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes: the same reduction and polynomial, with the power of two
// applied by vscalefps.
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 16 floats from a float or bfloat16 buffer, and back (bfloat16 rounded to nearest even).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512i bf16_bits16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(x)));
}
inline __m512 round16_like(const float*, __m512 x) { return x; }
inline __m512 round16_like(const c10::BFloat16*, __m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(x), 16));
}
#endif

}  // namespace areal
