// KV compaction on the CPU: kernels/kv_compaction.py's result (its torch
// reference, compact_kv_reference) for every layer's cache in one call.
//
// Each cache is a [num_blocks, block_size, heads, head_size] view (any
// strides: vLLM's CPU `vec` layout keeps a page's keys transposed); slot s is
// (block s / block_size, offset s % block_size). Row r of src_slots /
// dst_slots is one request's copies, -1 padding, run in order (a copy's
// source is never an earlier copy's destination), element by element
// through the strides. Built into the native CPU library
// (kernels/cpu_library.py), under its namespace.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#ifndef TREE_NS
#define TREE_NS adaptive_tree_cpu
#endif

namespace {

struct Move {
  int64_t src, dst;
};

// One cache's moves, for an element of `bytes` bytes.
void move_slots(const at::Tensor& cache, const std::vector<Move>& moves) {
  const int64_t block_size = cache.size(1), heads = cache.size(2), head_size = cache.size(3);
  const int64_t bytes = cache.element_size();
  const int64_t sb = cache.stride(0) * bytes, ss = cache.stride(1) * bytes, sh = cache.stride(2) * bytes;
  const int64_t sd = cache.stride(3) * bytes;
  char* base = static_cast<char*>(cache.data_ptr());
  for (const Move& move : moves) {
    char* src = base + (move.src / block_size) * sb + (move.src % block_size) * ss;
    char* dst = base + (move.dst / block_size) * sb + (move.dst % block_size) * ss;
    for (int64_t h = 0; h < heads; ++h) {
      if (sd == bytes) {
        std::memmove(dst + h * sh, src + h * sh, head_size * bytes);
        continue;
      }
      for (int64_t d = 0; d < head_size; ++d) {
        std::memcpy(dst + h * sh + d * sd, src + h * sh + d * sd, bytes);
      }
    }
  }
}

void compact_kv(const std::vector<at::Tensor>& caches, const at::Tensor& src_slots, const at::Tensor& dst_slots) {
  TORCH_CHECK(src_slots.dim() == 2 && dst_slots.sizes() == src_slots.sizes(), "src and dst slots must be [R, A] alike");
  const at::Tensor src = src_slots.to(at::kLong).contiguous(), dst = dst_slots.to(at::kLong).contiguous();
  std::vector<Move> moves;
  const int64_t* s = src.data_ptr<int64_t>();
  const int64_t* d = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < src.numel(); ++i) {  // row by row, each row's copies in order
    if (s[i] >= 0 && s[i] != d[i]) moves.push_back({s[i], d[i]});
  }
  if (moves.empty()) return;
  for (const at::Tensor& cache : caches) {
    TORCH_CHECK(cache.dim() == 4 && cache.device().is_cpu(), "a cache must be a [blocks, block_size, heads, dim] CPU tensor");
    const int64_t slots = cache.size(0) * cache.size(1);
    for (const Move& move : moves) {
      TORCH_CHECK(move.src < slots && move.dst >= 0 && move.dst < slots, "a slot lies outside the cache");
    }
    move_slots(cache, moves);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TREE_NS, m) {
  m.def("compact_kv(Tensor(a!)[] caches, Tensor src_slots, Tensor dst_slots) -> ()");
  m.impl("compact_kv", c10::DispatchKey::CPU, &compact_kv);
}
