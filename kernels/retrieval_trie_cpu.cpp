// The retrieval drafter's host work in one native object: each request's
// n-gram index, the longest-suffix match and this step's tries, giving the
// trees of vllm_adaptive_spec/drafters/retrieval_trie.py (the Python
// reference: RetrievalDrafter.prepare, children and candidate_trees), node
// for node and bit for bit in q.
//
// Index: a request's tokens, and for every n-gram of n <= l_max the
// positions where it ended, oldest first, under a 64-bit hash of (n, the
// n tokens); a match is checked token by token, so a hash collision costs a
// comparison, never a wrong continuation. Tries: built lazily, as the
// reference's, since only the nodes above the step's floor are read.
// Built into the native CPU library (kernels/cpu_library.py).

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#ifndef TREE_NS
#define TREE_NS adaptive_tree_cpu
#endif

namespace {

constexpr double EVIDENCE_EXPONENT = 1.3;  // retrieval_trie.EVIDENCE_EXPONENT
constexpr int64_t CHECKED = 16;             // retrieval_trie._extends: the tokens a reused id is judged by

uint64_t mix(uint64_t h, uint64_t value) {
  h ^= value + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdULL;
  return h ^ (h >> 33);
}

struct RequestIndex {
  std::vector<int64_t> tokens;
  std::unordered_map<uint64_t, std::vector<int32_t>> ends;  // hash(n, n-gram) -> where it ended

  // The keys of the n-grams ending at `end`, n = 1 .. min(l_max, end + 1), into `keys`.
  void keys_at(int64_t end, int64_t l_max, std::vector<uint64_t>& keys) const {
    keys.clear();
    uint64_t h = 0;
    for (int64_t n = 1; n <= l_max && n <= end + 1; ++n) {
      h = mix(h, static_cast<uint64_t>(tokens[end - n + 1]));
      keys.push_back(mix(h, static_cast<uint64_t>(n)));
    }
  }

  template <typename T>
  void extend(const T* row, int64_t from, int64_t to, int64_t l_max, std::vector<uint64_t>& keys) {
    for (int64_t i = from; i < to; ++i) {
      tokens.push_back(row[i]);
      keys_at(i, l_max, keys);
      for (uint64_t key : keys) ends[key].push_back(static_cast<int32_t>(i));
    }
  }

  // Whether the n tokens ending at `end` equal the n tokens ending at the last position.
  bool same_suffix(int64_t end, int64_t n) const {
    const int64_t last = static_cast<int64_t>(tokens.size()) - 1;
    for (int64_t j = 0; j < n; ++j)
      if (tokens[end - j] != tokens[last - j]) return false;
    return true;
  }
};

// One request's trie of this step: its continuations (each a run of the
// request's tokens, copied) and the nodes built so far.
struct Trie {
  struct Kid {
    int64_t token;
    double q;
    int64_t child;
  };
  std::vector<std::vector<int64_t>> continuations;
  int64_t match_length = 0;
  double prior = 0.0;
  std::vector<std::vector<int32_t>> members{{}};  // node -> its continuations, in priority order
  std::vector<int64_t> depths{0};
  std::vector<std::vector<Kid>> kids{{}};
  std::vector<char> expanded{0};

  const std::vector<Kid>& children(int64_t node) {
    if (!expanded[node]) {
      std::vector<Kid> made = expand(node);
      kids[node] = std::move(made);
      expanded[node] = 1;
    }
    return kids[node];
  }

  // The reference's _Trie._expand: group by next token in first-seen order, score, sort by q (stable).
  std::vector<Kid> expand(int64_t node) {
    const int64_t depth = depths[node];
    std::vector<int64_t> tokens;
    std::vector<std::vector<int32_t>> groups;
    for (int32_t i : members[node]) {
      const std::vector<int64_t>& c = continuations[i];
      if (depth >= static_cast<int64_t>(c.size())) continue;
      const auto at = std::find(tokens.begin(), tokens.end(), c[depth]) - tokens.begin();
      if (at == static_cast<int64_t>(tokens.size())) {
        tokens.push_back(c[depth]);
        groups.emplace_back();
      }
      groups[at].push_back(i);
    }
    std::vector<Kid> scored;
    if (groups.empty()) return scored;
    double total = 0.0;
    for (const auto& g : groups) total += static_cast<double>(g.size());
    const double kappa = prior * std::pow(static_cast<double>(match_length + depth), -EVIDENCE_EXPONENT);
    for (size_t g = 0; g < groups.size(); ++g) {
      const double count = static_cast<double>(groups[g].size());
      scored.push_back({tokens[g], count / total * count / (count + kappa), static_cast<int64_t>(members.size())});
      members.push_back(std::move(groups[g]));
      depths.push_back(depth + 1);
      kids.emplace_back();
      expanded.push_back(0);
    }
    std::stable_sort(scored.begin(), scored.end(), [](const Kid& a, const Kid& b) { return a.q > b.q; });
    return scored;
  }
};

class RetrievalTries : public torch::CustomClassHolder {
 public:
  RetrievalTries(int64_t l_max, int64_t l_min, int64_t max_matches, int64_t max_depth, double evidence_prior)
      : l_max_(l_max), l_min_(l_min), max_matches_(max_matches), max_depth_(max_depth), prior_(evidence_prior) {}

  // RetrievalDrafter.prepare: rows `rows` of `array` ([R, L] int32 or int64, the engine's tokens)
  // up to `lengths`.
  void prepare(std::vector<std::string> request_ids, at::Tensor array, std::vector<int64_t> rows,
               std::vector<int64_t> lengths) {
    TORCH_CHECK(array.dim() == 2 && (array.scalar_type() == at::kInt || array.scalar_type() == at::kLong) &&
                    array.stride(1) == 1,
                "retrieval tries: the token array must be 2-D int32 or int64 with unit stride in a row");
    TORCH_CHECK(request_ids.size() == rows.size() && rows.size() == lengths.size(),
                "retrieval tries: one row and one length per request");
    tries_.clear();
    tries_.reserve(request_ids.size());
    if (array.scalar_type() == at::kInt)
      prepare_rows(request_ids, array, array.data_ptr<int32_t>(), rows, lengths);
    else
      prepare_rows(request_ids, array, array.data_ptr<int64_t>(), rows, lengths);
  }

  template <typename T>
  void prepare_rows(const std::vector<std::string>& request_ids, const at::Tensor& array, const T* base,
                    const std::vector<int64_t>& rows, const std::vector<int64_t>& lengths) {
    for (size_t b = 0; b < request_ids.size(); ++b) {
      TORCH_CHECK(rows[b] >= 0 && rows[b] < array.size(0) && lengths[b] >= 0 && lengths[b] <= array.size(1),
                  "retrieval tries: a row or a length outside the token array");
      const T* row = base + rows[b] * array.stride(0);
      RequestIndex& index = indexes_[request_ids[b]];
      if (!extends(row, lengths[b], index.tokens)) index = RequestIndex();
      index.extend(row, static_cast<int64_t>(index.tokens.size()), lengths[b], l_max_, keys_);
      tries_.push_back(build(index));
    }
  }

  // RetrievalDrafter.candidate_trees: every trie's nodes of path probability >= floor, breadth-first,
  // as (sizes, tokens, parents (-1: the root), q), flat.
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>>
  candidate_trees(double floor) {
    std::vector<int64_t> sizes, tokens, parents;
    std::vector<double> qs;
    struct Queued {
      int64_t node, index;
      double p;
    };
    std::vector<Queued> queue;
    for (Trie& trie : tries_) {
      const int64_t start = static_cast<int64_t>(tokens.size());
      queue.assign(1, {0, -1, 1.0});
      for (size_t at = 0; at < queue.size(); ++at) {
        const Queued here = queue[at];
        for (const Trie::Kid& kid : trie.children(here.node)) {
          const double p = here.p * kid.q;
          if (p < floor) break;  // the rest are less likely still
          queue.push_back({kid.child, static_cast<int64_t>(tokens.size()) - start, p});
          tokens.push_back(kid.token);
          parents.push_back(here.index);
          qs.push_back(kid.q);
        }
      }
      sizes.push_back(static_cast<int64_t>(tokens.size()) - start);
    }
    return {sizes, tokens, parents, qs};
  }

  // RetrievalDrafter.children: request b's children of node `handle` (-1: the root) as (tokens, q, handles).
  std::tuple<std::vector<int64_t>, std::vector<double>, std::vector<int64_t>> children(int64_t b, int64_t handle) {
    TORCH_CHECK(b >= 0 && b < static_cast<int64_t>(tries_.size()), "retrieval tries: no request ", b, " this step");
    Trie& trie = tries_[b];
    TORCH_CHECK(handle >= -1 && handle + 1 < static_cast<int64_t>(trie.depths.size()),
                "retrieval tries: no node ", handle);
    std::vector<int64_t> tokens, handles;
    std::vector<double> qs;
    for (const Trie::Kid& kid : trie.children(handle + 1)) {
      tokens.push_back(kid.token);
      qs.push_back(kid.q);
      handles.push_back(kid.child - 1);
    }
    return {tokens, qs, handles};
  }

  void forget(std::string request_id) { indexes_.erase(request_id); }

  int64_t requests_held() { return static_cast<int64_t>(indexes_.size()); }

 private:
  // retrieval_trie._extends: the row continues `tokens`, judged by their last CHECKED tokens.
  template <typename T>
  static bool extends(const T* row, int64_t length, const std::vector<int64_t>& tokens) {
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (n > length) return false;
    for (int64_t i = std::max<int64_t>(n - CHECKED, 0); i < n; ++i)
      if (row[i] != tokens[i]) return false;
    return true;
  }

  // RetrievalDrafter._matches (the request's own index): the longest suffix that occurred before,
  // and the continuations after its most recent max_matches occurrences, most recent first.
  Trie build(const RequestIndex& index) {
    Trie trie;
    trie.prior = prior_;
    const std::vector<int64_t>& tokens = index.tokens;
    const int64_t n = static_cast<int64_t>(tokens.size());
    if (n == 0) return trie;
    index.keys_at(n - 1, l_max_, keys_);
    for (int64_t k = std::min(l_max_, n); k >= l_min_; --k) {
      const auto found = index.ends.find(keys_[k - 1]);
      if (found == index.ends.end()) continue;
      const std::vector<int32_t>& ends = found->second;
      for (auto it = ends.rbegin(); it != ends.rend() && static_cast<int64_t>(trie.continuations.size()) < max_matches_;
           ++it) {
        const int64_t end = *it;
        if (end >= n - 1 || !index.same_suffix(end, k)) continue;
        const int64_t stop = std::min(n, end + 1 + max_depth_);
        trie.continuations.emplace_back(tokens.begin() + end + 1, tokens.begin() + stop);
      }
      if (!trie.continuations.empty()) {
        trie.match_length = k;
        break;
      }
    }
    trie.members[0].resize(trie.continuations.size());
    for (size_t i = 0; i < trie.continuations.size(); ++i) trie.members[0][i] = static_cast<int32_t>(i);
    return trie;
  }

  int64_t l_max_, l_min_, max_matches_, max_depth_;
  double prior_;
  std::unordered_map<std::string, RequestIndex> indexes_;
  std::vector<Trie> tries_;
  std::vector<uint64_t> keys_;  // scratch
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(TREE_NS, m) {
  m.class_<RetrievalTries>("RetrievalTries")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double>())
      .def("prepare", &RetrievalTries::prepare)
      .def("candidate_trees", &RetrievalTries::candidate_trees)
      .def("children", &RetrievalTries::children)
      .def("forget", &RetrievalTries::forget)
      .def("requests_held", &RetrievalTries::requests_held);
}
