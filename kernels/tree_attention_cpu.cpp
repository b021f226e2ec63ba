// Tree attention over vLLM's CPU_ATTN paged cache, read in place.
//
// The same result as kernels/tree_attention.py's reference: every query row
// of request b sees the request's context keys (positions before
// seq_lens[b] - window_lens[b]) and, of its last window_lens[b] keys, those
// its query_mask bits mark. The cache is vLLM's `vec` layout
// [num_blocks, kv_heads, block_size, 2 * head_size]: a (block, KV head) page
// holds K as [head_size, block_size] (keys contiguous), then V as
// [block_size, head_size].
//
// Work is split over (request, KV head, slice of keys), so that two cores
// are busy at batch 1; a task packs its request's rows times the KV group's
// query heads into the M rows of two small matrix products per page
// (scores = Q K, out += P V), both with the cache page as the streamed
// operand and register-tiled accumulators; each slice keeps its
// unnormalised output, row maxima and sums, merged afterwards.
//
// The vector width is the instruction set's (TREE_VEC floats: 16 with
// AVX-512, 8 with AVX2, 4 otherwise), set with the compiler flags by the
// loader (kernels/tree_attention_cpu.py), one library per instruction set,
// each registering its ops under its own namespace (TREE_NS).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef TREE_VEC
#define TREE_VEC 4
#endif
#ifndef TREE_MR  // rows of a product's register tile
#define TREE_MR 4
#endif
#ifndef TREE_NV  // vectors of a product's register tile
#define TREE_NV 2
#endif
#ifndef TREE_NS
#define TREE_NS adaptive_tree_cpu
#endif

namespace {

constexpr int V = TREE_VEC;
constexpr int MR = TREE_MR;
constexpr int NV = TREE_NV;
constexpr int MAX_SLICE_KEYS = 512;  // bounds a task's score buffer (rows x keys)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

typedef float vfloat __attribute__((vector_size(V * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(V * sizeof(int32_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline vfloat splat(float x) { return vfloat{} + x; }

// exp(x) for x <= 0 (scores minus their row's maximum); 0 below -87.
// 2^n * 2^f with n = round(x log2 e), |f| <= 1/2, 2^f by its Taylor
// polynomial of degree 6 (relative error below 2e-7).
inline vfloat vexp(vfloat x) {
  const vfloat lo = splat(-87.0f);
  vfloat clamped = x < lo ? lo : x;
  vfloat t = clamped * 1.44269504f;
  vfloat n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
  vfloat f = t - n;
  vfloat p = splat(1.5403530e-4f);
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  vfloat r = p * scale;
  return x < lo ? vfloat{} : r;
}

// C[R, W*V] (+)= A[R, K] B[K, W*V]; row strides lda, ldb, ldc.
template <int R, int W>
void tile(const float* A, int lda, const float* B, int ldb, float* C, int ldc, int K, bool accumulate) {
  vfloat c[R][W];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) c[i][j] = accumulate ? load(C + i * ldc + j * V) : vfloat{};
  for (int k = 0; k < K; ++k) {
    vfloat b[W];
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) b[j] = load(B + k * ldb + j * V);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float a = A[i * lda + k];  // a scalar operand: an FMA with a broadcast load, no shuffle
#pragma GCC unroll 8
      for (int j = 0; j < W; ++j) c[i][j] += a * b[j];
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < W; ++j) store(C + i * ldc + j * V, c[i][j]);
}

using TileFn = void (*)(const float*, int, const float*, int, float*, int, int, bool);

template <int R, int... W>
constexpr std::array<TileFn, sizeof...(W)> width_tiles(std::integer_sequence<int, W...>) {
  return {&tile<R, W + 1>...};
}
template <int... R>
constexpr std::array<std::array<TileFn, NV>, sizeof...(R)> tiles(std::integer_sequence<int, R...>) {
  return {width_tiles<R + 1>(std::make_integer_sequence<int, NV>{})...};
}
// TILES[r - 1][w - 1]: the r-row, w-vector tile.
constexpr auto TILES = tiles(std::make_integer_sequence<int, MR>{});

// C[M, N] (+)= A[M, K] B[K, N], N a multiple of V.
void gemm(int M, int N, int K, const float* A, int lda, const float* B, int ldb, float* C, int ldc,
          bool accumulate) {
  const int vectors = N / V;
  for (int j = 0; j < vectors; j += NV) {
    const int w = std::min(NV, vectors - j);
    for (int i = 0; i < M; i += MR) {
      const int r = std::min(MR, M - i);
      TILES[r - 1][w - 1](A + i * lda, lda, B + j * V, ldb, C + i * ldc + j * V, ldc, K, accumulate);
    }
  }
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// A cache page's K [D, bs] then V [bs, D] as float32: the page itself, or
// its conversion into `scratch`.
template <typename T>
const float* page_as_float(const T* page, int64_t count, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return page;
  } else {
    scratch.resize(count);
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(page);
    float* out = scratch.data();
    for (int64_t i = 0; i < count; ++i) {
      uint32_t word = uint32_t(bits[i]) << 16;
      std::memcpy(out + i, &word, sizeof word);
    }
    return out;
  }
}

struct Problem {
  int64_t heads, kv_heads, group, head_size, block_size;
  int64_t q_row_stride, q_head_stride, cache_block_stride, cache_head_stride, table_stride, mask_width;
  const int32_t *query_start_loc, *seq_lens, *window_lens, *block_table;
  const bool* mask;
  float scale;
};

// One task: request b, KV head h, keys [first, last) from a page boundary.
struct Task {
  int32_t request, kv_head, first, last;
  int64_t partial;  // offset of its [rows, D] output, then its [rows] maxima and sums
};

template <typename T>
void run_task(const Problem& p, const Task& task, const T* query, const T* cache, float* partials) {
  thread_local std::vector<float> rows_buffer, scores_buffer, page_buffer;
  const int64_t D = p.head_size, bs = p.block_size, G = p.group;
  const int32_t start = p.query_start_loc[task.request];
  const int L = p.query_start_loc[task.request + 1] - start;
  const int M = L * G;
  const int keys = task.last - task.first;
  const int stride = (keys + bs - 1) / bs * bs;
  rows_buffer.resize(M * D);
  scores_buffer.resize(int64_t(M) * stride);
  float* q = rows_buffer.data();
  float* s = scores_buffer.data();
  for (int l = 0; l < L; ++l)
    for (int g = 0; g < G; ++g) {
      const T* src = query + (start + l) * p.q_row_stride + (task.kv_head * G + g) * p.q_head_stride;
      for (int64_t d = 0; d < D; ++d) q[(l * G + g) * D + d] = to_float(src[d]) * p.scale;
    }
  const int32_t* table = p.block_table + int64_t(task.request) * p.table_stride;
  auto page_of = [&](int key) {
    return cache + table[key / bs] * p.cache_block_stride + task.kv_head * p.cache_head_stride;
  };
  for (int key = task.first; key < task.last; key += bs) {
    const float* k_page = page_as_float(page_of(key), D * bs, page_buffer);
    const int columns = (std::min<int>(bs, task.last - key) + V - 1) / V * V;  // not the last page's padding
    gemm(M, columns, D, q, D, k_page, bs, s + (key - task.first), stride, false);
  }
  // The window's keys: visible where the row's mask bit says.
  const int32_t seq_len = p.seq_lens[task.request];
  const int32_t context = seq_len - p.window_lens[task.request];
  for (int key = std::max<int32_t>(task.first, context); key < task.last; ++key) {
    const int64_t bit = key - context;
    for (int l = 0; l < L; ++l) {
      if (bit < p.mask_width && p.mask[(start + l) * p.mask_width + bit]) continue;
      for (int g = 0; g < G; ++g) s[(l * G + g) * stride + key - task.first] = NEG_INF;
    }
  }
  // Softmax numerators, each row's maximum and sum.
  float* out = partials + task.partial;
  float* maxima = out + M * D;
  float* sums = maxima + M;
  for (int m = 0; m < M; ++m) {
    float* row = s + m * stride;
    vfloat tops = splat(NEG_INF);
    int k = 0;
    for (; k + V <= keys; k += V) {
      const vfloat x = load(row + k);
      tops = x > tops ? x : tops;
    }
    float top = NEG_INF;
    for (int j = 0; j < V; ++j) top = std::max(top, tops[j]);
    for (; k < keys; ++k) top = std::max(top, row[k]);
    maxima[m] = top;
    if (top == NEG_INF) {  // nothing visible in this slice
      std::fill(row, row + keys, 0.0f);
      sums[m] = 0.0f;
      continue;
    }
    vfloat total = {};
    for (k = 0; k + V <= keys; k += V) {
      vfloat e = vexp(load(row + k) - top);
      store(row + k, e);
      total += e;
    }
    float sum = 0.0f;
    for (int j = 0; j < V; ++j) sum += total[j];
    for (; k < keys; ++k) sum += row[k] = std::exp(row[k] - top);
    sums[m] = sum;
  }
  for (int key = task.first; key < task.last; key += bs) {
    const float* v_page = page_as_float(page_of(key) + D * bs, D * bs, page_buffer);
    const int count = std::min<int>(bs, task.last - key);
    gemm(M, D, count, s + (key - task.first), stride, v_page, D, out, D, key != task.first);
  }
}

// The tasks: keys cut into slices of whole pages, small enough that about
// four tasks a thread exist, none over MAX_SLICE_KEYS keys (a slice's score
// buffer stays in the core's cache).
std::vector<Task> plan_tasks(const Problem& p, int64_t batch, int threads, int64_t& partial_floats) {
  const int64_t bs = p.block_size;
  int64_t pages = 0;
  for (int64_t b = 0; b < batch; ++b) pages += (p.seq_lens[b] + bs - 1) / bs * p.kv_heads;
  const int64_t wanted = int64_t(threads) * 4;
  const int64_t most = std::max<int64_t>(1, MAX_SLICE_KEYS / bs);
  const int64_t slice_pages = std::clamp<int64_t>((pages + wanted - 1) / wanted, 1, most);
  std::vector<Task> tasks;
  partial_floats = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int rows = (p.query_start_loc[b + 1] - p.query_start_loc[b]) * p.group;
    const int32_t seq_len = p.seq_lens[b];
    if (rows == 0 || seq_len == 0) continue;
    for (int32_t h = 0; h < p.kv_heads; ++h)
      for (int32_t first = 0; first < seq_len; first += slice_pages * bs) {
        const int32_t last = std::min<int64_t>(seq_len, first + slice_pages * bs);
        tasks.push_back({int32_t(b), h, first, last, partial_floats});
        partial_floats += rows * (p.head_size + 2);
      }
  }
  return tasks;
}

// Each (request, KV head)'s slices merged into the output rows.
template <typename T>
void merge(const Problem& p, const std::vector<Task>& tasks, int64_t first, int64_t last, const float* partials,
           T* output) {
  const int64_t D = p.head_size, G = p.group;
  const int32_t start = p.query_start_loc[tasks[first].request];
  const int M = (p.query_start_loc[tasks[first].request + 1] - start) * G;
  std::vector<float> row(D);
  for (int m = 0; m < M; ++m) {
    float top = NEG_INF;
    for (int64_t t = first; t < last; ++t) top = std::max(top, partials[tasks[t].partial + M * D + m]);
    std::fill(row.begin(), row.end(), 0.0f);
    float total = 0.0f;
    for (int64_t t = first; t < last; ++t) {
      const float* out = partials + tasks[t].partial;
      const float sum = out[M * D + M + m];
      if (sum == 0.0f) continue;
      const float weight = std::exp(out[M * D + m] - top);
      total += weight * sum;
      for (int64_t d = 0; d < D; ++d) row[d] += weight * out[m * D + d];
    }
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    const int l = m / G, g = m % G;
    T* dst = output + ((start + l) * p.heads + tasks[first].kv_head * G + g) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(row[d] * inverse);
  }
}

template <typename T>
void run(const Problem& p, int64_t batch, const T* query, const T* cache, T* output) {
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  int64_t partial_floats = 0;
  const std::vector<Task> tasks = plan_tasks(p, batch, threads, partial_floats);
  std::unique_ptr<float[]> partials(new float[partial_floats]);  // every float is written before it is read
  const int64_t count = tasks.size();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t t = 0; t < count; ++t) run_task(p, tasks[t], query, cache, partials.get());
  // The slices of one (request, KV head) are adjacent tasks.
  std::vector<int64_t> heads_first;
  for (int64_t t = 0; t < count; ++t)
    if (t == 0 || tasks[t].request != tasks[t - 1].request || tasks[t].kv_head != tasks[t - 1].kv_head)
      heads_first.push_back(t);
  heads_first.push_back(count);
  const int64_t merges = heads_first.size() - 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < merges; ++i) merge(p, tasks, heads_first[i], heads_first[i + 1], partials.get(), output);
}

at::Tensor tree_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          const at::Tensor& window_lens, const at::Tensor& query_mask, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [T, heads, head_size], last dim contiguous");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.stride(3) == 1 && kv_cache.stride(2) == kv_cache.size(3),
              "kv_cache: [blocks, kv_heads, block_size, 2 * head_size], pages contiguous");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "query and kv_cache: one dtype");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 only");
  for (const at::Tensor* t : {&block_table, &query_start_loc, &seq_lens, &window_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "int32, contiguous metadata");
  TORCH_CHECK(query_mask.scalar_type() == at::kBool && query_mask.is_contiguous() && query_mask.dim() == 2,
              "query_mask: [T, W] bool, contiguous");
  Problem p;
  p.heads = query.size(1);
  p.kv_heads = kv_cache.size(1);
  p.group = p.heads / p.kv_heads;
  p.head_size = query.size(2);
  p.block_size = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(3) == 2 * p.head_size && p.heads % p.kv_heads == 0, "shapes disagree");
  TORCH_CHECK(p.head_size % V == 0 && p.block_size % V == 0, "head_size and block_size: multiples of ", V);
  p.q_row_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.cache_block_stride = kv_cache.stride(0);
  p.cache_head_stride = kv_cache.stride(1);
  p.table_stride = block_table.size(1);
  p.mask_width = query_mask.size(1);
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.window_lens = window_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.mask = query_mask.data_ptr<bool>();
  p.scale = static_cast<float>(scale);
  at::Tensor output = at::empty({query.size(0), p.heads, p.head_size}, query.options());
  const int64_t batch = seq_lens.size(0);
  if (query.scalar_type() == at::kFloat)
    run(p, batch, query.data_ptr<float>(), kv_cache.data_ptr<float>(), output.data_ptr<float>());
  else
    run(p, batch, query.data_ptr<at::BFloat16>(), kv_cache.data_ptr<at::BFloat16>(),
        output.data_ptr<at::BFloat16>());
  return output;
}

}  // namespace

#define REGISTER_OPS(ns) TORCH_LIBRARY(ns, m)
REGISTER_OPS(TREE_NS) {
  m.def(
      "tree_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor window_lens, Tensor query_mask, float scale) -> Tensor");
  m.impl("tree_attention", c10::DispatchKey::CPU, &tree_attention);
}
