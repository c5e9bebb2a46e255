// Small numeric helpers shared by the engine's CPU kernels.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace areal {

// exp(x) for x <= 0 (softmax after subtracting the max), Cephes' expf: range reduction to
// [-ln2/2, ln2/2] and a degree-6 polynomial, ~1 ulp. Plain arithmetic, so the compiler
// vectorises the loop around it; std::exp is a scalar libm call that cost more than the rest
// of the kernel.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // 2^-126 and below: flush to the smallest normal, not to inf/nan
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
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
