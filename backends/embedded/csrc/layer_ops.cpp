// The residual add and the RMSNorm after it, fused, for the engine on CPU.
//
// On CPU torch runs RMSNorm as six kernels (cast, square, mean, rsqrt, two products) and the
// residual add as a seventh, each a pass over memory and a dispatch: in a 16-row decode step
// the dispatches dominate, in a 2k-token prefill the passes (~15% of it). This is one pass
// per row with transformers' LlamaRMSNorm rounding: in bfloat16 the sum, the normalised row
// and its product with the weight are each rounded where torch rounds them.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "cpu_math.h"

namespace {

using areal::load;
using areal::round_like;
using areal::store;

template <typename T>
void add_rms_norm_rows(T* hidden, const T* delta, const T* weight, T* normed, int64_t rows,
                       int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* h = hidden + r * width;
      const T* d = delta != nullptr ? delta + r * width : nullptr;
      float squares = 0.f;
      if (d != nullptr) {
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; ++i) {
          const float x = round_like(h, load(h, i) + load(d, i));
          store(h, i, x);
          squares += x * x;
        }
      } else {
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; ++i) {
          const float x = load(h, i);
          squares += x * x;
        }
      }
      const float rstd = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
      T* out = normed + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float unit = round_like(h, load(h, i) * rstd);
        store(out, i, load(weight, i) * unit);
      }
    }
  });
}

// hidden [rows, width] (updated in place to hidden + delta when delta is given); returns
// rms_norm(hidden) * weight, as transformers' LlamaRMSNorm computes it.
at::Tensor add_rms_norm(at::Tensor& hidden, const std::optional<at::Tensor>& delta,
                        const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.is_contiguous(), "add_rms_norm: hidden must be contiguous");
  const int64_t width = hidden.size(-1);
  const int64_t rows = width == 0 ? 0 : hidden.numel() / width;
  TORCH_CHECK(weight.numel() == width && weight.scalar_type() == hidden.scalar_type(),
              "add_rms_norm: weight must be [width] of hidden's dtype");
  const at::Tensor w = weight.contiguous();
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == hidden.sizes() && d.scalar_type() == hidden.scalar_type(),
                "add_rms_norm: delta must match hidden");
  }
  at::Tensor normed = at::empty_like(hidden);
  const float e = static_cast<float>(eps);
  if (hidden.scalar_type() == at::kFloat) {
    add_rms_norm_rows<float>(hidden.data_ptr<float>(), d.defined() ? d.data_ptr<float>() : nullptr,
                             w.data_ptr<float>(), normed.data_ptr<float>(), rows, width, e);
  } else if (hidden.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    add_rms_norm_rows<B>(hidden.data_ptr<B>(), d.defined() ? d.data_ptr<B>() : nullptr,
                         w.data_ptr<B>(), normed.data_ptr<B>(), rows, width, e);
  } else {
    TORCH_CHECK(false, "add_rms_norm: float32 or bfloat16 only");
  }
  return normed;
}

// x * sigmoid(x) through exp(-|x|), which never overflows.
inline float silu(float x) {
  const float e = areal::exp_nonpositive(-std::fabs(x));
  return x * (x >= 0.f ? 1.f : e) / (1.f + e);
}

template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= width; i += 16) {
    const __m512 g = areal::load16(gate + i);
    const __m512 e = areal::exp16_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 numerator = _mm512_mask_blend_ps(negative, one, e);
    const __m512 activated =
        areal::round16_like(gate, _mm512_div_ps(_mm512_mul_ps(g, numerator), _mm512_add_ps(one, e)));
    areal::store16(out + i, _mm512_mul_ps(activated, areal::load16(up + i)));
  }
#endif
  for (; i < width; ++i) store(out, i, round_like(gate, silu(load(gate, i))) * load(up, i));
}

// gate_up [..., 2 * width] (the gate, then the up projection); returns silu(gate) * up with
// transformers' rounding (the activation rounded before the product).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  const at::Tensor x = gate_up.contiguous();
  const int64_t width = x.size(-1) / 2;
  TORCH_CHECK(x.size(-1) == 2 * width, "silu_mul: the last dimension must be even");
  const int64_t rows = width == 0 ? 0 : x.numel() / (2 * width);
  auto sizes = x.sizes().vec();
  sizes.back() = width;
  at::Tensor out = at::empty(sizes, x.options());
  auto run = [&](auto* in, auto* o) {
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        silu_mul_row(in + r * 2 * width, in + r * 2 * width + width, o + r * width, width);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>(), out.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    run(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "silu_mul: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(areal_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(areal_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
}
