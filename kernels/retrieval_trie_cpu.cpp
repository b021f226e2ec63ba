// The retrieval drafter's host work in one native object: each request's
// n-gram index, the longest-suffix match and this step's tries, giving the
// trees of vllm_adaptive_spec/drafters/retrieval_trie.py (the Python
// reference: RetrievalDrafter.prepare, children and candidate_trees), node
// for node and bit for bit in q.
//
// Index: a request's tokens, and for every n-gram of n <= l_max the
// positions where it ended, newest first, under a 64-bit hash of (n, the
// n tokens) (RequestIndex); a match is checked token by token, so a hash
// collision costs a comparison, never a wrong continuation. Tries: built lazily, as the
// reference's, since only the nodes above the step's floor are read.
// Built into the native CPU library (kernels/cpu_library.py), whose Python
// module holds it as the type RetrievalTries.
//
// Decision (a CPython type, not a torch custom class): the drafter calls it
// twice a step on the host right after the forward, when the caches are
// cold; there a torch custom class's first method call took about 80 us
// (its schema and IValue machinery), more than the whole Python reference at
// batch 1. A type with METH_FASTCALL methods reads its arguments straight
// from the Python objects (lists, and the token array by the buffer protocol).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <stdexcept>
#include <vector>

namespace {

constexpr double EVIDENCE_EXPONENT = 1.3;  // retrieval_trie.EVIDENCE_EXPONENT
constexpr int64_t CHECKED = 16;             // retrieval_trie._extends: the tokens a reused id is judged by

uint64_t mix(uint64_t h, uint64_t value) {
  h ^= value + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h *= 0xff51afd7ed558ccdULL;
  return h ^ (h >> 33);
}

// A request's tokens and, for every n-gram of n <= l_max, where it ended: each occurrence is a
// slot, position * l_max + n - 1. An open-addressing table maps a key, hash(n, n-gram), to its
// newest slot, and `earlier` links every slot to the one before it under the same key, so a
// key's occurrences are read newest first with no list of their own. Decision: a list per key
// cost a heap allocation per new n-gram (about 1 KB a context token over 8 lengths, and most of
// `prepare`'s time at batch 64, its maps cold after the forward); the chains take
// 8 bytes a slot and the table 16 bytes a bucket, at most half of them used.
struct RequestIndex {
  std::vector<int64_t> tokens;
  std::vector<int64_t> earlier;   // slot -> the previous slot of its key, -1: none
  std::vector<uint64_t> keys;     // bucket -> its key
  std::vector<int64_t> newest;    // bucket -> its key's newest slot, -1: an empty bucket
  int64_t filled = 0;             // buckets in use

  // The keys of the n-grams ending at `end`, n = 1 .. min(l_max, end + 1), into `out`.
  void keys_at(int64_t end, int64_t l_max, std::vector<uint64_t>& out) const {
    out.clear();
    uint64_t h = 0;
    for (int64_t n = 1; n <= l_max && n <= end + 1; ++n) {
      h = mix(h, static_cast<uint64_t>(tokens[end - n + 1]));
      out.push_back(mix(h, static_cast<uint64_t>(n)));
    }
  }

  template <typename T>
  void extend(const T* row, int64_t from, int64_t to, int64_t l_max, std::vector<uint64_t>& scratch) {
    for (int64_t i = from; i < to; ++i) {
      tokens.push_back(row[i]);
      earlier.resize(static_cast<size_t>((i + 1) * l_max), -1);
      keys_at(i, l_max, scratch);
      for (size_t n = 0; n < scratch.size(); ++n) insert(scratch[n], i * l_max + static_cast<int64_t>(n));
    }
  }

  // The newest slot under `key`, -1 for none.
  int64_t latest(uint64_t key) const { return newest.empty() ? -1 : newest[bucket(key)]; }

  // Whether the n tokens ending at `end` equal the n tokens ending at the last position (false
  // where fewer than n end there: only a hash collision across lengths points there).
  bool same_suffix(int64_t end, int64_t n) const {
    const int64_t last = static_cast<int64_t>(tokens.size()) - 1;
    if (end < n - 1) return false;
    for (int64_t j = 0; j < n; ++j)
      if (tokens[end - j] != tokens[last - j]) return false;
    return true;
  }

 private:
  // The bucket holding `key`, or the empty one where it would go (linear probing).
  size_t bucket(uint64_t key) const {
    const size_t mask = newest.size() - 1;
    size_t at = static_cast<size_t>(key) & mask;
    while (newest[at] >= 0 && keys[at] != key) at = (at + 1) & mask;
    return at;
  }

  void insert(uint64_t key, int64_t slot) {
    if (2 * (filled + 1) > static_cast<int64_t>(newest.size())) grow();
    const size_t at = bucket(key);
    if (newest[at] < 0) {
      keys[at] = key;
      ++filled;
    }
    earlier[static_cast<size_t>(slot)] = newest[at];
    newest[at] = slot;
  }

  // Twice the buckets (64 at first), every key moved over with its newest slot.
  void grow() {
    std::vector<uint64_t> old_keys = std::move(keys);
    std::vector<int64_t> old_newest = std::move(newest);
    const size_t size = std::max<size_t>(64, 2 * old_newest.size());
    keys.assign(size, 0);
    newest.assign(size, -1);
    for (size_t b = 0; b < old_newest.size(); ++b)
      if (old_newest[b] >= 0) {
        const size_t at = bucket(old_keys[b]);
        keys[at] = old_keys[b];
        newest[at] = old_newest[b];
      }
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

void check(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("retrieval tries: " + message);
}

// A 2-D int32 or int64 token array, rows `row_stride` elements apart.
struct TokenArray {
  const void* data;
  bool wide;  // int64, else int32
  int64_t rows, columns, row_stride;
};

class RetrievalTries {
 public:
  RetrievalTries(int64_t l_max, int64_t l_min, int64_t max_matches, int64_t max_depth, double evidence_prior)
      : l_max_(l_max), l_min_(l_min), max_matches_(max_matches), max_depth_(max_depth), prior_(evidence_prior) {}

  // RetrievalDrafter.prepare: rows `rows` of `array` (the engine's tokens) up to `lengths`.
  void prepare(const std::vector<std::string>& request_ids, const TokenArray& array,
               const std::vector<int64_t>& rows, const std::vector<int64_t>& lengths) {
    check(request_ids.size() == rows.size() && rows.size() == lengths.size(), "one row and one length per request");
    tries_.clear();
    tries_.reserve(request_ids.size());
    for (size_t b = 0; b < request_ids.size(); ++b) {
      check(rows[b] >= 0 && rows[b] < array.rows && lengths[b] >= 0 && lengths[b] <= array.columns,
            "a row or a length outside the token array");
      RequestIndex& index = indexes_[request_ids[b]];
      if (array.wide)
        update(index, static_cast<const int64_t*>(array.data) + rows[b] * array.row_stride, lengths[b]);
      else
        update(index, static_cast<const int32_t*>(array.data) + rows[b] * array.row_stride, lengths[b]);
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
    check(b >= 0 && b < static_cast<int64_t>(tries_.size()), "no request " + std::to_string(b) + " this step");
    Trie& trie = tries_[b];
    check(handle >= -1 && handle + 1 < static_cast<int64_t>(trie.depths.size()), "no node " + std::to_string(handle));
    std::vector<int64_t> tokens, handles;
    std::vector<double> qs;
    for (const Trie::Kid& kid : trie.children(handle + 1)) {
      tokens.push_back(kid.token);
      qs.push_back(kid.q);
      handles.push_back(kid.child - 1);
    }
    return {tokens, qs, handles};
  }

  void forget(const std::string& request_id) { indexes_.erase(request_id); }

  int64_t requests_held() const { return static_cast<int64_t>(indexes_.size()); }

 private:
  // A request's index brought up to its row: reset where the row does not continue it, then extended.
  template <typename T>
  void update(RequestIndex& index, const T* row, int64_t length) {
    if (!extends(row, length, index.tokens)) index = RequestIndex();
    index.extend(row, static_cast<int64_t>(index.tokens.size()), length, l_max_, keys_);
  }

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
      for (int64_t slot = index.latest(keys_[k - 1]);
           slot >= 0 && static_cast<int64_t>(trie.continuations.size()) < max_matches_; slot = index.earlier[slot]) {
        const int64_t end = slot / l_max_;
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

// ---------------------------------------------------------------- the Python type

struct PyTries {
  PyObject_HEAD RetrievalTries* tries;
};

// The Python error for a C++ one (bad input: ValueError; anything else: RuntimeError), or NULL.
template <typename F>
PyObject* guarded(F&& body) {
  try {
    return body();
  } catch (const std::invalid_argument& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return nullptr;
}

std::vector<int64_t> int_list(PyObject* list, const char* what) {
  check(PyList_Check(list), std::string(what) + " must be a list of ints");
  std::vector<int64_t> out(PyList_GET_SIZE(list));
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
    if (out[i] == -1 && PyErr_Occurred()) throw std::invalid_argument(std::string(what) + " must be a list of ints");
  }
  return out;
}

std::vector<std::string> str_list(PyObject* list) {
  check(PyList_Check(list), "request ids must be a list of str");
  std::vector<std::string> out;
  out.reserve(PyList_GET_SIZE(list));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) {
    Py_ssize_t size = 0;
    const char* text = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(list, i), &size);
    if (text == nullptr) throw std::invalid_argument("request ids must be a list of str");
    out.emplace_back(text, size);
  }
  return out;
}

template <typename T>
PyObject* py_list(const std::vector<T>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = std::is_floating_point<T>::value ? PyFloat_FromDouble(static_cast<double>(values[i]))
                                                      : PyLong_FromLongLong(static_cast<long long>(values[i]));
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

// A tuple of new references, or NULL (releasing those made) where one failed.
PyObject* py_tuple(std::initializer_list<PyObject*> items) {
  for (PyObject* item : items)
    if (item == nullptr) {
      for (PyObject* other : items) Py_XDECREF(other);
      return nullptr;
    }
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(items.size()));
  Py_ssize_t i = 0;
  for (PyObject* item : items) PyTuple_SET_ITEM(tuple, i++, item);
  return tuple;
}

int tries_init(PyTries* self, PyObject* args, PyObject* kwargs) {
  long long l_max, l_min, max_matches, max_depth;
  double prior;
  if (!PyArg_ParseTuple(args, "LLLLd", &l_max, &l_min, &max_matches, &max_depth, &prior)) return -1;
  delete self->tries;
  self->tries = new RetrievalTries(l_max, l_min, max_matches, max_depth, prior);
  return 0;
}

void tries_dealloc(PyTries* self) {
  delete self->tries;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// prepare(request_ids, array, rows, lengths): array is any 2-D int32 or int64 buffer (a numpy array).
PyObject* tries_prepare(PyTries* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "prepare(request_ids, array, rows, lengths)");
    return nullptr;
  }
  Py_buffer view;
  if (PyObject_GetBuffer(args[1], &view, PyBUF_STRIDES | PyBUF_FORMAT) != 0) return nullptr;
  PyObject* result = guarded([&]() -> PyObject* {
    const std::string format = view.format ? view.format : "B";
    const bool wide = view.itemsize == 8 && (format == "q" || format == "l" || format == "<q" || format == "<l");
    const bool narrow = view.itemsize == 4 && (format == "i" || format == "<i");
    check(view.ndim == 2 && (wide || narrow) && view.strides[1] == view.itemsize &&
              view.strides[0] % view.itemsize == 0,
          "the token array must be 2-D int32 or int64 with unit stride in a row");
    const TokenArray array{view.buf, wide, view.shape[0], view.shape[1], view.strides[0] / view.itemsize};
    self->tries->prepare(str_list(args[0]), array, int_list(args[2], "rows"), int_list(args[3], "lengths"));
    Py_RETURN_NONE;
  });
  PyBuffer_Release(&view);
  return result;
}

// candidate_trees(floor) -> (sizes, tokens, parents, q), flat lists.
PyObject* tries_candidate_trees(PyTries* self, PyObject* floor) {
  const double value = PyFloat_AsDouble(floor);
  if (value == -1.0 && PyErr_Occurred()) return nullptr;
  return guarded([&]() -> PyObject* {
    auto [sizes, tokens, parents, q] = self->tries->candidate_trees(value);
    return py_tuple({py_list(sizes), py_list(tokens), py_list(parents), py_list(q)});
  });
}

// children(b, handle) -> (tokens, q, handles).
PyObject* tries_children(PyTries* self, PyObject* const* args, Py_ssize_t nargs) {
  long long b, handle;
  if (nargs != 2 || ((b = PyLong_AsLongLong(args[0])) == -1 && PyErr_Occurred()) ||
      ((handle = PyLong_AsLongLong(args[1])) == -1 && PyErr_Occurred())) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "children(b, handle)");
    return nullptr;
  }
  return guarded([&]() -> PyObject* {
    auto [tokens, q, handles] = self->tries->children(b, handle);
    return py_tuple({py_list(tokens), py_list(q), py_list(handles)});
  });
}

PyObject* tries_forget(PyTries* self, PyObject* request_id) {
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(request_id, &size);
  if (text == nullptr) return nullptr;
  self->tries->forget(std::string(text, size));
  Py_RETURN_NONE;
}

PyObject* tries_requests_held(PyTries* self, PyObject*) { return PyLong_FromLongLong(self->tries->requests_held()); }

PyMethodDef tries_methods[] = {
    {"prepare", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tries_prepare)), METH_FASTCALL,
     "prepare(request_ids, array, rows, lengths): update each request's index, build this step's tries"},
    {"candidate_trees", reinterpret_cast<PyCFunction>(tries_candidate_trees), METH_O,
     "candidate_trees(floor) -> (sizes, tokens, parents, q): the tries' nodes of path probability >= floor"},
    {"children", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(tries_children)), METH_FASTCALL,
     "children(b, handle) -> (tokens, q, handles): request b's trie children of a node (-1: the root)"},
    {"forget", reinterpret_cast<PyCFunction>(tries_forget), METH_O, "forget(request_id): drop its index"},
    {"requests_held", reinterpret_cast<PyCFunction>(tries_requests_held), METH_NOARGS, "requests with an index"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject tries_type = [] {
  PyTypeObject type{PyVarObject_HEAD_INIT(nullptr, 0)};
  type.tp_name = "RetrievalTries";
  type.tp_basicsize = sizeof(PyTries);
  type.tp_flags = Py_TPFLAGS_DEFAULT;
  type.tp_doc = "RetrievalTries(l_max, l_min, max_matches, max_depth, evidence_prior)";
  type.tp_methods = tries_methods;
  type.tp_init = reinterpret_cast<initproc>(tries_init);
  type.tp_new = PyType_GenericNew;
  type.tp_dealloc = reinterpret_cast<destructor>(tries_dealloc);
  return type;
}();

}  // namespace

// Adds the type to the library's module (cpu_library.cpp); 0, or -1 with a Python error set.
int add_retrieval_tries(PyObject* module) {
  if (PyType_Ready(&tries_type) < 0) return -1;
  Py_INCREF(&tries_type);
  if (PyModule_AddObject(module, "RetrievalTries", reinterpret_cast<PyObject*>(&tries_type)) < 0) {
    Py_DECREF(&tries_type);
    return -1;
  }
  return 0;
}
