#pragma once
// The AMX tile plumbing shared by the kernels that run on the tiles (prefill attention,
// attention/csrc/prefill_amx.h; MoE experts, moe_kernels.cpp). Built into each module
// (cpp_build copies it beside their sources); only where the compiler targets AMX.
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

// ldtilecfg's 64-byte operand (palette 1): each tile's rows and bytes per row
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// as asm with the config as a memory operand: GCC 12's _tile_loadconfig builtin does not tell
// the optimizer it reads `c`, whose stores were then dropped (SIGILL at the first tile op)
inline void load_tile_config(const TileConfig& c) { asm volatile("ldtilecfg %0" ::"m"(c)); }

// Whether Linux lets this process use the tile data (asked once per module; the quant kernels
// ask the same at load, and a process may ask again): without it the first tile op is a SIGILL.
inline bool tiles_granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}
#endif  // __AMX_TILE__
