// The native CPU library as one translation unit: the native sources,
// each beside its torch reference, compiled together.
//
// Decision: one unit, not one per source. Most of a kernel's compile time is
// torch's headers and the operator-registration templates (about 8 of a
// source's 10 s with g++ 12 at -O3); compiled together the sources take about
// as long as one, for every instruction set.
// kernels/cpu_library.py passes a digest of the sources to the compiler,
// so that a change to any of them rebuilds the library.

#define PY_SSIZE_T_CLEAN
#include <Python.h>  // first, as Python asks

#include "tree_attention_cpu.cpp"
#include "tree_acceptance_cpu.cpp"
#include "kv_compaction_cpu.cpp"
#include "retrieval_trie_cpu.cpp"

// The library is also a Python module (torch's loader imports it by this name), holding the
// retrieval tries' type; its ops are registered with torch as it loads.
#define ADAPTIVE_TREE_CONCAT(a, b) a##b
#define ADAPTIVE_TREE_INIT(name) ADAPTIVE_TREE_CONCAT(PyInit_, name)
#define ADAPTIVE_TREE_STRING(name) #name
#define ADAPTIVE_TREE_NAME(name) ADAPTIVE_TREE_STRING(name)

static PyModuleDef library_module = {PyModuleDef_HEAD_INIT, ADAPTIVE_TREE_NAME(TORCH_EXTENSION_NAME),
                                     "The plugin's native CPU library.", -1, nullptr};

PyMODINIT_FUNC ADAPTIVE_TREE_INIT(TORCH_EXTENSION_NAME)(void) {
  PyObject* module = PyModule_Create(&library_module);
  if (module != nullptr && add_retrieval_tries(module) < 0) Py_CLEAR(module);
  return module;
}
