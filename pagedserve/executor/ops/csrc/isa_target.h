#pragma once
// A region of code compiled for one instruction set, inside a module built without -march
// (it runs on any x86-64; run-time dispatch picks the region the CPU can execute):
//
//   ISA_TARGET_BEGIN("avx2,fma,f16c")
//   namespace avx2 {
//   #include "some_kernels_avx2.h"
//   }
//   ISA_TARGET_END()
//
// GCC: push_options + target pragma; clang: a target attribute pushed onto every function.
#define ISA_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define ISA_TARGET_BEGIN(features) ISA_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
#define ISA_TARGET_END() ISA_PRAGMA(clang attribute pop)
#else
#define ISA_TARGET_BEGIN(features) ISA_PRAGMA(GCC push_options) ISA_PRAGMA(GCC target(features))
#define ISA_TARGET_END() ISA_PRAGMA(GCC pop_options)
#endif
