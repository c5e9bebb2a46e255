// Temperature sampling from float32 logits on CPU, one uniform number per row.
//
// Gumbel-max needs a random number, two logarithms and a comparison for every vocabulary
// entry (~6 ms a step for 16 rows of SmolLM2's 49,152 on two cores). Inverse-CDF sampling
// draws from the same distribution, softmax(logits / T), with one uniform per row: a pass
// for the max, one for the exponentials and their sum, and a scan of the cumulative sum up
// to u * sum. Rows with T <= 0 take the argmax. Each row's logprob is that of its token
// under log_softmax(logits / T) (T = 1 for greedy rows), as the trainer computes it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_math.h"

namespace {

using areal::exp_nonpositive;

void sample_row(const float* z, int64_t vocab, float temperature, double uniform, float* scratch,
                int64_t* token, float* logprob) {
  float top = -INFINITY;
#pragma omp simd reduction(max : top)
  for (int64_t v = 0; v < vocab; ++v) top = std::max(top, z[v]);
  const float inv = temperature > 0.f ? 1.f / temperature : 1.f;
  // Summed in double: in float, the many tiny terms added to a total near 1 round away
  // (a bias of ~1e-4 in the logprob over 49k entries).
  double sum = 0.0;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < vocab; ++v) {
    scratch[v] = exp_nonpositive((z[v] - top) * inv);
    sum += scratch[v];
  }
  int64_t pick = 0;
  if (temperature <= 0.f) {
    while (pick < vocab - 1 && z[pick] != top) ++pick;  // first maximum, as argmax
  } else {
    // Scan in blocks: a block's sum decides whether the target falls inside it.
    const double target = uniform * sum;
    constexpr int64_t kBlock = 256;
    double seen = 0.0;
    int64_t last_positive = -1;
    int64_t start = 0;
    for (; start < vocab; start += kBlock) {
      const int64_t end = std::min(vocab, start + kBlock);
      double block = 0.0;
#pragma omp simd reduction(+ : block)
      for (int64_t v = start; v < end; ++v) block += scratch[v];
      if (block > 0.0) last_positive = end - 1;
      if (seen + block > target) break;
      seen += block;
    }
    pick = -1;
    for (int64_t v = start; v < std::min(vocab, start + kBlock); ++v) {
      seen += scratch[v];
      if (scratch[v] > 0.f) pick = v;
      if (seen > target) break;
    }
    if (pick < 0) {
      // Rounding left the target above the scanned total: the last token with mass.
      pick = last_positive;
      while (pick > 0 && scratch[pick] == 0.f) --pick;
    }
  }
  *token = pick;
  *logprob = static_cast<float>((z[pick] - top) * inv - std::log(sum));
}

// logits [rows, vocab] float32; temperature [rows] float32; uniforms [rows] float64 in [0, 1).
// Returns (tokens [rows] int64, logprobs [rows] float32).
std::tuple<at::Tensor, at::Tensor> sample_temperature(const at::Tensor& logits,
                                                      const at::Tensor& temperature,
                                                      const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "sample_temperature: logits must be [rows, vocab] float32");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "sample_temperature: empty vocabulary");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == rows,
              "sample_temperature: one float32 temperature per row");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.numel() == rows,
              "sample_temperature: one float64 uniform per row");
  const at::Tensor z = logits.contiguous();
  const at::Tensor temps = temperature.contiguous();
  const at::Tensor us = uniforms.contiguous();
  at::Tensor tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({rows}, logits.options());
  const float* z_ptr = z.data_ptr<float>();
  const float* t_ptr = temps.data_ptr<float>();
  const double* u_ptr = us.data_ptr<double>();
  int64_t* tok_ptr = tokens.data_ptr<int64_t>();
  float* lp_ptr = logprobs.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(vocab);
    for (int64_t r = begin; r < end; ++r) {
      sample_row(z_ptr + r * vocab, vocab, t_ptr[r], u_ptr[r], scratch.data(), tok_ptr + r,
                 lp_ptr + r);
    }
  });
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(areal_cpu, m) {
  m.def("sample_temperature(Tensor logits, Tensor temperature, Tensor uniforms) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(areal_cpu, CPU, m) { m.impl("sample_temperature", &sample_temperature); }
