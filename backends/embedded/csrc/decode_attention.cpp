// Decode attention over the engine's slot KV cache, for CPU.
//
// One query token per row, each row reading its own slot's first `lengths[r]` cached
// positions. At a decode step's shape (16 rows, 3 KV heads, ~200 positions) torch's CPU
// SDPA spends ~12 us of setup per (row, head) pair on ~0.1 MFLOP of work; this kernel does
// the same arithmetic (float32 accumulation, softmax with the running max) in one pass over
// the keys and one over the values, parallel over (row, KV head) with torch's thread pool.
// Grouped-query heads share each key/value load: query head h reads KV head h / groups.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using areal::exp_nonpositive;
using areal::load;
using areal::store;

#if defined(__AVX512F__)
// One (row, KV head) item with AVX-512: G query heads of dimension 16 * D16 held in
// registers, each key and value row loaded once for all G heads.
using areal::load16;

template <typename T, int G, int D16>
void attend_item_avx512(const float* query, const T* keys, const T* values, int64_t len,
                        float* scores, float* out) {
  constexpr int D = D16 * 16;
  __m512 q[G][D16];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < D16; ++j) q[g][j] = _mm512_loadu_ps(query + g * D + j * 16);
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = -INFINITY;
  for (int64_t t = 0; t < len; ++t) {
    __m512 k[D16];
    for (int j = 0; j < D16; ++j) k[j] = load16(keys + t * D + j * 16);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(q[g][0], k[0]);
      for (int j = 1; j < D16; ++j) acc = _mm512_fmadd_ps(q[g][j], k[j], acc);
      const float sc = _mm512_reduce_add_ps(acc);
      scores[g * len + t] = sc;
      top[g] = std::max(top[g], sc);
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = exp_nonpositive(sg[t] - top[g]);
      sum += sg[t];
    }
    total[g] = sum;
  }
  __m512 acc[G][D16];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < D16; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    __m512 v[D16];
    for (int j = 0; j < D16; ++j) v[j] = load16(values + t * D + j * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * len + t]);
      for (int j = 0; j < D16; ++j) acc[g][j] = _mm512_fmadd_ps(p, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / total[g]);
    for (int j = 0; j < D16; ++j) _mm512_storeu_ps(out + g * D + j * 16, _mm512_mul_ps(acc[g][j], inv));
  }
}

// The AVX-512 routine for this (groups, dim), or null where none is instantiated.
template <typename T>
using ItemFn = void (*)(const float*, const T*, const T*, int64_t, float*, float*);

template <typename T, int D16>
ItemFn<T> pick_groups(int64_t groups) {
  switch (groups) {
    case 1: return attend_item_avx512<T, 1, D16>;
    case 2: return attend_item_avx512<T, 2, D16>;
    case 3: return attend_item_avx512<T, 3, D16>;
    case 4: return attend_item_avx512<T, 4, D16>;
    case 5: return attend_item_avx512<T, 5, D16>;
    case 6: return attend_item_avx512<T, 6, D16>;
    case 7: return attend_item_avx512<T, 7, D16>;
    case 8: return attend_item_avx512<T, 8, D16>;
    default: return nullptr;
  }
}

template <typename T>
ItemFn<T> pick_item(int64_t groups, int64_t dim) {
  if (dim == 64) return pick_groups<T, 4>(groups);
  if (dim == 128) return pick_groups<T, 8>(groups);
  return nullptr;
}
#else
template <typename T>
using ItemFn = void (*)(const float*, const T*, const T*, int64_t, float*, float*);
template <typename T>
ItemFn<T> pick_item(int64_t, int64_t) { return nullptr; }
#endif

template <typename T>
void attend(const T* q, const T* k, const T* v, T* out, const int64_t* slots,
            const int64_t* lengths, int64_t rows, int64_t heads, int64_t kv_heads,
            int64_t cache_len, int64_t dim, float scale) {
  const int64_t groups = heads / kv_heads;
  const ItemFn<T> fast = pick_item<T>(groups, dim);
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(groups * dim), acc(groups * dim), line(dim), total(groups), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv_heads, h = item % kv_heads;
      const int64_t len = lengths[r];
      const int64_t base = (slots[r] * kv_heads + h) * cache_len * dim;
      const T* q_row = q + (r * heads + h * groups) * dim;
      for (int64_t i = 0; i < groups * dim; ++i) query[i] = load(q_row, i) * scale;
      scores.resize(groups * len);
      if (fast != nullptr) {
        fast(query.data(), k + base, v + base, len, scores.data(), acc.data());
        T* o_row = out + (r * heads + h * groups) * dim;
        for (int64_t i = 0; i < groups * dim; ++i) store(o_row, i, acc[i]);
        continue;
      }
      for (int64_t t = 0; t < len; ++t) {
        const T* key = k + base + t * dim;
        for (int64_t d = 0; d < dim; ++d) line[d] = load(key, d);
        for (int64_t g = 0; g < groups; ++g) {
          const float* qg = query.data() + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * line[d];
          scores[g * len + t] = s;
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* sg = scores.data() + g * len;
        const float top = *std::max_element(sg, sg + len);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = exp_nonpositive(sg[t] - top);
          sum += sg[t];
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* value = v + base + t * dim;
        for (int64_t d = 0; d < dim; ++d) line[d] = load(value, d);
        for (int64_t g = 0; g < groups; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += p * line[d];
        }
      }
      T* o_row = out + (r * heads + h * groups) * dim;
      for (int64_t g = 0; g < groups; ++g) {
        const float inv = 1.f / total[g];
        for (int64_t d = 0; d < dim; ++d) store(o_row, g * dim + d, acc[g * dim + d] * inv);
      }
    }
  });
}

// q [rows, heads, dim]; k_cache, v_cache [slots, kv_heads, cache_len, dim] (contiguous);
// slots, lengths [rows] int64. Returns [rows, heads, dim].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& slots,
                            const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: q [rows, heads, dim], caches [slots, kv_heads, len, dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "decode_attention: caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "decode_attention: slots and lengths must be int64");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), cache_len = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0,
              "decode_attention: head dims differ or heads are not a multiple of kv_heads");
  const at::Tensor query = q.contiguous();
  const at::Tensor slot_ids = slots.contiguous();
  const at::Tensor lens = lengths.contiguous();
  TORCH_CHECK(slot_ids.numel() == rows && lens.numel() == rows,
              "decode_attention: one slot and one length per row");
  at::Tensor out = at::empty_like(query);
  const int64_t* slot_ptr = slot_ids.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(slot_ptr[r] >= 0 && slot_ptr[r] < k_cache.size(0) && len_ptr[r] >= 1 &&
                    len_ptr[r] <= cache_len,
                "decode_attention: slot or length out of range");
  }
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    attend<float>(query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  out.data_ptr<float>(), slot_ptr, len_ptr, rows, heads, kv_heads, cache_len, dim,
                  s);
  } else if (q.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    attend<B>(query.data_ptr<B>(), k_cache.data_ptr<B>(), v_cache.data_ptr<B>(),
              out.data_ptr<B>(), slot_ptr, len_ptr, rows, heads, kv_heads, cache_len, dim, s);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(areal_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
      "Tensor lengths, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(areal_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
