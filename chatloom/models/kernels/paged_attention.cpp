// Attention that reads K/V straight from the paged pool: no gather, no padding.
// Each query token i attends to the first kv_len[i] positions of the sequence whose
// block table is block_tables[row[i]]. Work is split over (query token, KV head);
// the query heads that share a KV head (GQA) are scored together so K and V are read once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

template <typename T, typename Acc>
static void paged_attention_impl(const T* q, const T* kp, const T* vp, const int32_t* tables,
                                 const int32_t* rows, const int32_t* kv_lens, T* out,
                                 int64_t n_tokens, int64_t hq, int64_t hkv, int64_t d,
                                 int64_t block_size, int64_t table_width, double scale) {
  const int64_t group = hq / hkv;
  at::parallel_for(0, n_tokens * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<Acc> scores, acc(group * d), qv(group * d);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / hkv, h = job % hkv;
      const int64_t len = kv_lens[i];
      const int32_t* table = tables + (int64_t)rows[i] * table_width;
      scores.resize(len * group);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t x = 0; x < d; ++x)
          qv[g * d + x] = (Acc)q[(i * hq + h * group + g) * d + x] * (Acc)scale;
      std::vector<Acc> mx(group, -INFINITY);
      for (int64_t t = 0; t < len; ++t) {
        const T* k = kp + (((int64_t)table[t / block_size] * block_size + t % block_size) * hkv + h) * d;
        for (int64_t g = 0; g < group; ++g) {
          const Acc* qg = qv.data() + g * d;
          Acc s = 0;
#pragma omp simd reduction(+ : s)
          for (int64_t x = 0; x < d; ++x) s += qg[x] * (Acc)k[x];
          scores[t * group + g] = s;
          if (s > mx[g]) mx[g] = s;
        }
      }
      std::vector<Acc> sum(group, 0);
      for (int64_t t = 0; t < len; ++t)
        for (int64_t g = 0; g < group; ++g) {
          Acc e = std::exp(scores[t * group + g] - mx[g]);
          scores[t * group + g] = e;
          sum[g] += e;
        }
      std::fill(acc.begin(), acc.end(), (Acc)0);
      for (int64_t t = 0; t < len; ++t) {
        const T* v = vp + (((int64_t)table[t / block_size] * block_size + t % block_size) * hkv + h) * d;
        for (int64_t g = 0; g < group; ++g) {
          const Acc p = scores[t * group + g];
          Acc* a = acc.data() + g * d;
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) a[x] += p * (Acc)v[x];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (i * hq + h * group + g) * d;
        const Acc inv = (Acc)1 / sum[g];
        for (int64_t x = 0; x < d; ++x) o[x] = (T)(acc[g * d + x] * inv);
      }
    }
  });
}

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor block_tables, torch::Tensor rows, torch::Tensor kv_lens,
                              double scale) {
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && rows.scalar_type() == torch::kInt32 &&
              kv_lens.scalar_type() == torch::kInt32, "int32 tables");
  block_tables = block_tables.contiguous();
  auto out = torch::empty_like(q);
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t bs = k_pool.size(1), hkv = k_pool.size(2);
  if (q.scalar_type() == torch::kFloat32) {
    paged_attention_impl<float, float>(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
        block_tables.data_ptr<int32_t>(), rows.data_ptr<int32_t>(), kv_lens.data_ptr<int32_t>(),
        out.data_ptr<float>(), n, hq, hkv, d, bs, block_tables.size(1), scale);
  } else if (q.scalar_type() == torch::kFloat64) {
    paged_attention_impl<double, double>(q.data_ptr<double>(), k_pool.data_ptr<double>(), v_pool.data_ptr<double>(),
        block_tables.data_ptr<int32_t>(), rows.data_ptr<int32_t>(), kv_lens.data_ptr<int32_t>(),
        out.data_ptr<double>(), n, hq, hkv, d, bs, block_tables.size(1), scale);
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 and float64");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention over a paged KV pool");
}
