// Tree acceptance on the CPU: the result of vllm_adaptive_spec/trees/verify.py's
// accept (the torch reference) in one pass over every tree's nodes.
//
// Nodes are breadth-first, every parent before its children, so a node is
// accepted exactly where its token is its parent row's target token and its
// parent is accepted (the root always is): one comparison and one lookup a
// node. The accepted nodes, in index order, are the path shallowest first;
// the bonus is the target token of the deepest accepted row (row 0, the
// root's, where none is). Built into the native CPU library beside the tree
// attention (kernels/tree_attention_cpu.py), under its namespace.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#ifndef TREE_NS
#define TREE_NS adaptive_tree_cpu
#endif

namespace {

constexpr int64_t PAD = -1;

// One tree: its accepted path into `path` and `output` (each pre-filled with PAD); returns its length.
int64_t accept_tree(const int64_t* tokens, const int64_t* parents, int64_t nodes, const int64_t* targets,
                    int64_t* path, int64_t* output, std::vector<char>& accepted) {
  int64_t count = 0, deepest_row = 0;
  for (int64_t node = 0; node < nodes; ++node) {
    const int64_t parent = parents[node];  // -1 (the root) or an earlier node; anything else is never accepted
    const bool ok = parent >= -1 && parent < node && tokens[node] == targets[parent + 1] &&
                    (parent < 0 || accepted[parent]);
    accepted[node] = ok;
    if (ok) {
      path[count] = node;
      output[count++] = tokens[node];
      deepest_row = node + 1;
    }
  }
  output[count] = targets[deepest_row];
  return count;
}

// tokens / parents [B, W] (padding: token -1, parent -1), num_nodes [B], row_tokens [B, >= W + 1]:
// each row's target token (root, then node i at column i + 1). Returns num_accepted [B], path [B, W]
// and output_tokens [B, W + 1] (the path's tokens, the bonus, then PAD; row_tokens' dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> accept_trees(const at::Tensor& tokens, const at::Tensor& parents,
                                                           const at::Tensor& num_nodes,
                                                           const at::Tensor& row_tokens) {
  TORCH_CHECK(tokens.dim() == 2 && parents.sizes() == tokens.sizes(), "tokens and parents must be [B, W] alike");
  const int64_t batch = tokens.size(0), width = tokens.size(1);
  TORCH_CHECK(num_nodes.dim() == 1 && num_nodes.size(0) == batch, "num_nodes must be [B]");
  TORCH_CHECK(row_tokens.dim() == 2 && row_tokens.size(0) == batch && row_tokens.size(1) >= width + 1,
              "row_tokens must be [B, >= W + 1]");
  const at::Tensor tok = tokens.to(at::kLong).contiguous(), par = parents.to(at::kLong).contiguous();
  const at::Tensor counts = num_nodes.to(at::kLong).contiguous(), rows = row_tokens.to(at::kLong).contiguous();
  at::Tensor num_accepted = at::empty({batch}, tok.options());
  at::Tensor path = at::full({batch, width}, PAD, tok.options());
  at::Tensor output = at::full({batch, width + 1}, PAD, tok.options());
  const int64_t row_width = rows.size(1);
  std::vector<char> accepted(static_cast<size_t>(width));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t nodes = std::clamp<int64_t>(counts.data_ptr<int64_t>()[b], 0, width);
    num_accepted.data_ptr<int64_t>()[b] = accept_tree(
        tok.data_ptr<int64_t>() + b * width, par.data_ptr<int64_t>() + b * width, nodes,
        rows.data_ptr<int64_t>() + b * row_width, path.data_ptr<int64_t>() + b * width,
        output.data_ptr<int64_t>() + b * (width + 1), accepted);
  }
  return {num_accepted, path, output.to(row_tokens.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(TREE_NS, m) {
  m.def("accept_trees(Tensor tokens, Tensor parents, Tensor num_nodes, Tensor row_tokens) -> (Tensor, Tensor, Tensor)");
  m.impl("accept_trees", c10::DispatchKey::CPU, &accept_trees);
}
