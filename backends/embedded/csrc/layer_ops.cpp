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

// Rotary embedding of one head: out = x * cos + rotate_half(x) * sin, each product and the
// sum rounded as torch rounds them in T.
template <typename T>
inline void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = load(x, d), x2 = load(x, d + half);
    const float a = round_like(x, x1 * load(cos, d)) + round_like(x, -x2 * load(sin, d));
    const float b = round_like(x, x2 * load(cos, d + half)) + round_like(x, x1 * load(sin, d + half));
    store(out, d, a);
    store(out, d + half, b);
  }
}

template <typename T>
void rope_write_rows(const T* qkv, const T* cos, const T* sin, T* k_cache, T* v_cache,
                     const int64_t* slots, const int64_t* positions, T* query, int64_t n,
                     int64_t heads, int64_t kv_heads, int64_t dim, int64_t cache_len) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = qkv + i * width;
      const T* c = cos + i * dim;
      const T* s = sin + i * dim;
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head(row + h * dim, c, s, query + (i * heads + h) * dim, dim);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = ((slots[i] * kv_heads + h) * cache_len + positions[i]) * dim;
        rotate_head(row + (heads + h) * dim, c, s, k_cache + at, dim);
        const T* value = row + (heads + kv_heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) v_cache[at + d] = value[d];
      }
    }
  });
}

// qkv [rows, tokens, (heads + 2 kv_heads) * dim] (queries, keys, values); cos, sin [rows,
// tokens, dim]. Writes each token's rotated key and its value into the caches at (slot,
// position) and returns the rotated queries [rows, tokens, heads, dim].
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                      const at::Tensor& positions, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && cos.dim() == 3 && k_cache.dim() == 4,
              "rope_write: qkv [rows, tokens, width], cos/sin [rows, tokens, dim], caches 4-D");
  const int64_t rows = qkv.size(0), tokens = qkv.size(1);
  const int64_t kv_heads = k_cache.size(1), cache_len = k_cache.size(2), dim = k_cache.size(3);
  TORCH_CHECK(qkv.size(2) == (heads + 2 * kv_heads) * dim && dim % 2 == 0,
              "rope_write: qkv's width is not (heads + 2 kv_heads) * head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == rows && cos.size(1) == tokens &&
                  cos.size(2) == dim,
              "rope_write: cos and sin must be [rows, tokens, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "rope_write: caches must be contiguous and of one shape");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "rope_write: qkv, cos, sin and the caches must share a dtype");
  const at::Tensor slot_ids = slots.to(at::kLong).contiguous().view({-1});
  const at::Tensor pos = positions.to(at::kLong).contiguous().view({-1});
  const int64_t n = rows * tokens;
  TORCH_CHECK(slot_ids.numel() == n && pos.numel() == n, "rope_write: one slot and position per token");
  const int64_t* slot_ptr = slot_ids.data_ptr<int64_t>();
  const int64_t* pos_ptr = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot_ptr[i] >= 0 && slot_ptr[i] < k_cache.size(0) && pos_ptr[i] >= 0 &&
                    pos_ptr[i] < cache_len,
                "rope_write: slot or position out of range");
  }
  const at::Tensor x = qkv.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor query = at::empty({rows, tokens, heads, dim}, qkv.options());
  if (dtype == at::kFloat) {
    rope_write_rows<float>(x.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(),
                           k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slot_ptr,
                           pos_ptr, query.data_ptr<float>(), n, heads, kv_heads, dim, cache_len);
  } else if (dtype == at::kBFloat16) {
    using B = c10::BFloat16;
    rope_write_rows<B>(x.data_ptr<B>(), c.data_ptr<B>(), s.data_ptr<B>(), k_cache.data_ptr<B>(),
                       v_cache.data_ptr<B>(), slot_ptr, pos_ptr, query.data_ptr<B>(), n, heads,
                       kv_heads, dim, cache_len);
  } else {
    TORCH_CHECK(false, "rope_write: float32 or bfloat16 only");
  }
  return query;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(areal_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slots, Tensor positions, int heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(areal_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_write", &rope_write);
}
