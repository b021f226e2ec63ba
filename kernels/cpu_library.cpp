// The native CPU library as one translation unit: the native sources,
// each beside its torch reference, compiled together.
//
// Decision: one unit, not three. Most of a kernel's compile time is torch's
// headers and the operator-registration templates (about 8 of a source's
// 10 s with g++ 12 at -O3); compiled together they take about as long as
// one, a fraction of the CPU time a first use costs, for every instruction set.
// kernels/cpu_library.py passes a digest of the sources to the compiler,
// so that a change to any of them rebuilds the library.

#include "tree_attention_cpu.cpp"
#include "tree_acceptance_cpu.cpp"
#include "kv_compaction_cpu.cpp"
#include "retrieval_trie_cpu.cpp"
