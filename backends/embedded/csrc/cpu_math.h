// Small numeric helpers shared by the engine's CPU kernels.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include <c10/util/BFloat16.h>

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

}  // namespace areal
