// Matrix products with weights kept in GGUF's packed block formats (Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, Q4_K, Q5_K, Q6_K; F32/F16/BF16 rows too), float activations.
//
// One kernel file per instruction set, each compiled in its own namespace and target region of
// this one translation unit (ISA_TARGET_BEGIN): quant_scalar.h (portable), quant_avx2.h
// (AVX2+FMA+F16C) with quant_rows16_avx2.h (its few-row products on the row-interleaved copies,
// whose layouts and writer are quant_rows16_layout.h, portable), quant_avx512.h (AVX-512
// F/BW/VL/DQ), and on top of the AVX-512 one
// quant_rows16.h (row-interleaved few-row products), quant_vnni.h (AVX512-VNNI integer
// products), quant_bf16.h (AVX512-BF16 many-row products), quant_rows16_bf16.h (AVX512-BF16
// few-row products of bf16 models on the row-interleaved copies) and quant_rows16_q6k_vbmi.h /
// quant_rows16_q6k_vbmi_bf16.h (both few-row kernels on Q6_K's six-bit copy, AVX512-VBMI), and
// the act_q8 kernels on the row-interleaved copies (quant_rows16_q8_avx2.h beside the AVX2 one,
// quant_rows16_vnni.h beside the VNNI one, quant_rows16_q6k_vnni.h for Q6_K's copies there); the
// AVX2 act_q8 files compiled once more for AVX-VNNI (namespaces avx_vnni, avx_vnni_rows16:
// quant_dot_u8s8.h's vpdpbusd for vpmaddubsw, the AVX2 level's integer products where the CPU
// has it, the same bits). The
// first three share the
// ISA-neutral block code (quant_dequant.h) and loops (quant_loops.h), compiled into each; a new
// ISA is one more file and one more region here. The path is chosen at run time from what the
// CPU has (CPUID; or forced with set_isa, which the Python side drives from
// PAGEDSERVE_CPU_ISA). No -march flags: the module runs on any x86-64.
//
//   gemm(x [M,K] f32, w uint8 [N, row_bytes], type, out [M, ldo] f32, col0)
//       out[:, col0:col0+N] = x @ dequant(w).T
//     few rows (M < prefill_rows): every packed row is read once for all M activation rows,
//     OpenMP (at::parallel_for) over output rows; with a row-interleaved copy of Q4_0 / Q4_1 /
//     Q5_0 / Q5_1 / Q8_0 rows (interleave_rows16, quant_rows16_layout.h: 16 rows' blocks side by
//     side) the copy's kernel instead (AVX-512: quant_rows16.h, ~2x; AVX2: quant_rows16_avx2.h,
//     1.2-1.6x at 1 row, the same bits), over groups of 16 output rows (a bf16 model's
//     activations on avx512_bf16: gemm_bf16 with the copy, the same layout on vdpbf16ps; the
//     K-quants' copies (Q4_K, Q5_K, Q6_K) for both);
//     many rows, AVX2: chunks of output rows are dequantized into an L2-resident float buffer
//     and multiplied by a register-blocked micro-kernel (3 x 4, 80-89% of the FMA peak; faster
//     than the BLAS at 12-1024 rows, BENCHMARKS section 20), the AVX-512 levels the same kernel
//     below set_float_blas_rows's 512 rows (section 62); from there, and on the scalar path, the
//     weight is dequantized in row tiles into a float matrix and multiplied with at::mm (the BLAS).
//     act_q8 (the named option "gguf_q8"; Q4_0 / Q4_1 / Q8_0, the K-quants from int8_rows): the activations are quantized
//     to int8 per 32-element block first and meet the weights in integer multiply-adds, as
//     llama.cpp's q8 dot products (faster, not float-exact): few rows, each packed row against
//     every activation row; many rows (AVX2), chunks of weights repacked so that each 32-bit
//     lane is one output column, one vpmaddubsw per step for 8 columns (AVX512-VNNI: one
//     vpdpbusd per step for 16 columns; the same bits as the AVX2 kernels); with a
//     row-interleaved copy (Q4_0 / Q4_1 / Q4_K / Q5_K and Q6_K's byte layout from AVX2 up, Q8_0
//     and Q6_K's six bits from VNNI up) below rows16_q8_rows (VNNI: every row count, Q8_0 and
//     Q6_K 64; AVX2: 12, Q6_K 32), the copy's int8 kernel instead, the many-row
//     kernel's bits (rows16_q8_gemm).
//   dequant(w, type, K, rows?) -> float [R, K]   (all rows, or the given row ids: embeddings)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "isa_target.h"  // ISA_TARGET_BEGIN / END: a region compiled for one instruction set
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define QK_X86 1
#else
#define QK_X86 0
#endif

enum QType {
  T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
  T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

#pragma pack(push, 1)
struct bq4_0 { uint16_t d; uint8_t qs[16]; };
struct bq4_1 { uint16_t d, m; uint8_t qs[16]; };
struct bq5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };
struct bq5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };
struct bq8_0 { uint16_t d; int8_t qs[32]; };
struct bq4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct bq5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct bq6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
#pragma pack(pop)
static_assert(sizeof(bq4_0) == 18 && sizeof(bq4_1) == 20 && sizeof(bq5_0) == 22 && sizeof(bq5_1) == 24, "block");
static_assert(sizeof(bq8_0) == 34 && sizeof(bq4_K) == 144 && sizeof(bq5_K) == 176 && sizeof(bq6_K) == 210, "block");

static inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q6_K's row-interleaved copy (quant_rows16_layout.h) keeps six bits a quant where the CPU has
// AVX512-VBMI, whose byte permutes and multishift both AVX-512 few-row kernels decode them with
// (quant_rows16_q6k_vbmi.h), else a byte a quant. set_q6k_six_bits switches (tests, A/B): a copy
// written under the other setting has the other size, so no kernel takes it.
static int g_q6k_six_bits = -1;
static bool q6k_six_bits();  // (after the CPUID helpers)

struct GemmArgs {
  int type;
  const uint8_t* W;  // [N, rb] packed rows
  int64_t rb, K, M, ldo;
  const float* X;     // [M, K]
  const float* xsum;  // [M, K/32] block sums of X (Q4_1, Q5_1, Q4_K, Q5_K few-row products)
  float* out;         // already offset by col0
};

struct GemmQ8Args {  // activation-quantized products (Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights)
  int type;
  const uint8_t* W;
  int64_t rb, K, M, ldo;
  const int8_t* xq;  // [M, K] activation quants, per 32-block
  const float* xd;   // [M, K/32] their scales
  const float* xs;   // [M, K/32] scale * sum(quants) (Q4_1's min term)
  float* out;        // already offset by col0
  // the VNNI many-row kernel's start values: Q8_0 [M, K/32] -128 * sum(quants); Q6_K [M, K/16]
  // -32 * sum(quants) per half block
  const int32_t* xc = nullptr;
};

namespace scalar {
#include "quant_scalar.h"
}  // namespace scalar

#define QK_AVX_VNNI 0  // quant_dot_u8s8.h: the AVX2 act_q8 code's sums in vpmaddubsw (1: vpdpbusd, below)
#if QK_X86
// the row-interleaved copies' layouts and the code that writes them, portable (quant_rows16_layout.h)
namespace rows16_layout {
#include "quant_rows16_layout.h"
}  // namespace rows16_layout

ISA_TARGET_BEGIN("avx2,fma,f16c")
namespace avx2 {
#include "quant_avx2.h"
}  // namespace avx2
// few-row products on the row-interleaved copies (quant_rows16_avx2.h), same target
namespace avx2_rows16 {
using namespace rows16_layout;
#include "quant_rows16_avx2.h"
#include "quant_rows16_q8_avx2.h"  // act_q8's products on the copies
}  // namespace avx2_rows16
ISA_TARGET_END()

// AVX-VNNI (VEX vpdpbusd; Alder Lake and later clients, Sierra Forest: AVX2 CPUs without AVX-512): the AVX2 act_q8
// kernels again, each u8 x s8 step one vpdpbusd (quant_dot_u8s8.h), the AVX2 level's integer
// products where the CPU has it (avx_vnni_on); the other AVX2 code is shared through the using
// directives
#undef QK_AVX_VNNI
#define QK_AVX_VNNI 1
ISA_TARGET_BEGIN("avx2,fma,f16c,avxvnni")
namespace avx_vnni {
using namespace avx2;
#include "quant_avx2_q8.h"
#include "quant_avx2_q8_many.h"
#include "quant_loops_q8.h"
}  // namespace avx_vnni
namespace avx_vnni_rows16 {
using namespace rows16_layout;
using namespace avx2_rows16;
#include "quant_rows16_q8_avx2.h"
}  // namespace avx_vnni_rows16
ISA_TARGET_END()
#undef QK_AVX_VNNI
#define QK_AVX_VNNI 0

ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace avx512 {
#include "quant_avx512.h"
}  // namespace avx512
// few-row products on row-interleaved Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights (quant_rows16.h), same target
namespace avx512_rows16 {
using namespace rows16_layout;
#include "quant_rows16.h"
}  // namespace avx512_rows16
ISA_TARGET_END()

// AVX512-VNNI: the act_q8 integer kernels (quant_vnni.h) on the AVX-512 build's helpers
ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
namespace avx512_vnni {
using namespace avx512;
#include "quant_vnni.h"
}  // namespace avx512_vnni
// few-row act_q8 products on the row-interleaved copies (quant_rows16_vnni.h), same target
namespace avx512_vnni_rows16 {
using namespace rows16_layout;
#include "quant_rows16_vnni.h"
#include "quant_rows16_q6k_vnni.h"  // Q6_K's byte layout
}  // namespace avx512_vnni_rows16
ISA_TARGET_END()
// and Q6_K's six-bit layout (quant_rows16_q6k_vnni.h again), with AVX512-VBMI
ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")
namespace avx512_vnni_vbmi {
using namespace rows16_layout;
#include "quant_rows16_q6k_vnni.h"
}  // namespace avx512_vnni_vbmi
ISA_TARGET_END()

// AVX512-BF16: the bf16 many-row products of bfloat16 models (quant_bf16.h)
ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c")
namespace avx512_bf16 {
using namespace avx512;
#include "quant_bf16.h"
}  // namespace avx512_bf16
// few-row products of bf16 models on the row-interleaved copies (quant_rows16_bf16.h)
namespace avx512_bf16_rows16 {
#include "quant_rows16_bf16.h"
}  // namespace avx512_bf16_rows16
ISA_TARGET_END()

// AVX512-VBMI: Q6_K's six-bit copy, its run decoder and the float kernel's tile
// (quant_rows16_q6k_vbmi.h), and beside AVX512-BF16 the bf16 kernel's tile
// (quant_rows16_q6k_vbmi_bf16.h). Not a level of the ladder below (Ice Lake has VBMI without
// AVX512-BF16, Cooper Lake the reverse): chosen by q6k_six_bits()
ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,f16c")
namespace avx512_vbmi {
#include "quant_rows16_q6k_vbmi.h"
}  // namespace avx512_vbmi
ISA_TARGET_END()
ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi,avx2,fma,f16c")
namespace avx512_bf16_vbmi {
#include "quant_rows16_q6k_vbmi_bf16.h"
#include "quant_rows16_amx_q6k.h"  // Q6_K's six-bit copy as the AMX tile kernel's B rows
}  // namespace avx512_bf16_vbmi
ISA_TARGET_END()

// AMX-BF16: bf16 models' many-row products on the tiles, weights dequantized from the
// row-interleaved copies as they are used (quant_rows16_amx.h; Q6_K's six-bit copies through
// avx512_bf16_vbmi's amx_b_rows_q6k_six, above: every AMX CPU has VBMI)
ISA_TARGET_BEGIN("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c,bmi2")
namespace amx_bf16_rows16 {
using namespace rows16_layout;
#include "quant_rows16_amx.h"
#include "quant_rows16_amx_exact.h"  // few rows, exact quants
}  // namespace amx_bf16_rows16
ISA_TARGET_END()
#endif  // QK_X86

// ---- threads ------------------------------------------------------------------------------------
// The kernels split output rows over OpenMP's team (at::parallel_for), the team every other op
// of a step (BLAS, attention, norms, sampling) runs on. An own thread pool beside it was measured
// and removed: two teams' idle threads spin after their jobs and take the cores the other team
// needs (n-gram speculation at batch 1 1.19x with the pool vs 1.48x without, a 4-row decode step
// 25 vs 20 ms, a 64-row step 670 vs 470 ms; BENCHMARKS section 19).

// ---- run-time dispatch ------------------------------------------------------------------------
// Levels, each the one below it plus its own instructions (set_isa forces one; the best one
// the CPU has is the default); the avx2 level runs its act_q8 products on AVX-VNNI where the
// CPU has it (avx_vnni_on, below: a switch within the level, not a level):
//   avx512_vnni: vpdpbusd in the act_q8 integer kernels;
//   avx512_bf16: and the bf16 products of bfloat16 models: many rows (quant_bf16.h), few rows on
//     the row-interleaved copies (quant_rows16_bf16.h);
//   amx_bf16 / amx_int8: the CPU has AMX tiles and Linux granted this process their state
//     (arch_prctl): the bf16 products of Q4_0 / Q4_1 / Q4_K / Q5_x / Q8_0 / Q6_K (six bits)
//     segments with a row-interleaved copy run 1 .. 16 rows on the exact tile kernel
//     (quant_rows16_amx_exact.h, g_amx_exact_rows); the same types from g_rows16_bf16_rows rows
//     (past the exact kernel's) on this module's own tile kernel over bf16-rounded weights
//     (quant_rows16_amx.h); other
//     segments' many-row products go to oneDNN from g_amx_onednn_rows rows on (the tiles
//     again); otherwise the avx512_bf16 kernels. (A QuantLinear's oneDNN-packed bf16 copy, in
//     Python, takes the largest products before they reach this module.)
enum Isa {
  ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_VNNI = 3, ISA_AVX512_BF16 = 4, ISA_AMX_BF16 = 5,
  ISA_AMX_INT8 = 6, ISA_LAST = 6,
};

#if QK_X86 && (defined(__GNUC__) || defined(__clang__))
// CPUID leaf 7 bits (subleaf 0: ebx/ecx/edx, subleaf 1: eax)
static bool cpuid7(int sub, int reg, int bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(7, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}
static uint64_t xcr0() {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid(1, &r[0], &r[1], &r[2], &r[3]) || !((r[2] >> 27) & 1u)) return 0;  // OSXSAVE
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((uint64_t)hi << 32) | lo;
}
enum { EAX = 0, EBX = 1, ECX = 2, EDX = 3 };
#endif

// AMX: the tile state needs the kernel's permission per process (Linux 5.16+:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); refused or never asked, the AMX
// levels are unavailable and the avx512_bf16 one runs. g_amx_perm: -1 not asked yet, 0
// granted, else the errno of the refusal.
static int g_amx_perm = -1;
static int g_isa = -1;  // the path in use (-1: the best one, picked at first use)

static bool amx_cpuid(bool int8) {
#if QK_X86 && (defined(__GNUC__) || defined(__clang__))
  const bool tiles = cpuid7(0, EDX, 24) && cpuid7(0, EDX, 22) && (!int8 || cpuid7(0, EDX, 25));  // tile, bf16, int8
  return tiles && (xcr0() & (3ull << 17)) == (3ull << 17);  // XTILECFG + XTILEDATA enabled by the OS
#else
  (void)int8;
  return false;
#endif
}

// Asks for the tile state (once; again when `again`); simulate_refusal: the refusal path
// without a syscall (tests). Returns 0 (granted) or the errno. A refusal takes an AMX path
// already in use back to the best one left; a grant asked `again` picks the best path anew.
int64_t request_amx_permission(bool simulate_refusal, bool again) {
  if (simulate_refusal) {
    g_amx_perm = EPERM;
    if (g_isa >= ISA_AMX_BF16) g_isa = -1;
    return g_amx_perm;
  }
  if (g_amx_perm >= 0 && !again) return g_amx_perm;
#if QK_X86 && defined(__linux__)
  if (!amx_cpuid(false)) {
    g_amx_perm = ENODEV;
    return g_amx_perm;
  }
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  g_amx_perm = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
#else
  g_amx_perm = ENOSYS;
#endif
  if (g_amx_perm != 0 ? g_isa >= ISA_AMX_BF16 : again) g_isa = -1;  // re-granted: the best path again
  return g_amx_perm;
}
int64_t amx_permission() { return g_amx_perm; }
bool amx_in_cpu() { return amx_cpuid(false); }

static bool cpu_has(int isa) {
  if (isa == ISA_SCALAR) return true;
#if QK_X86 && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (isa == ISA_AVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == ISA_AVX512)
    return cpu_has(ISA_AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (isa == ISA_AVX512_VNNI) return cpu_has(ISA_AVX512) && cpuid7(0, ECX, 11);
  if (isa == ISA_AVX512_BF16) return cpu_has(ISA_AVX512_VNNI) && cpuid7(1, EAX, 5);
  if (isa == ISA_AMX_BF16 || isa == ISA_AMX_INT8) {  // (and BMI2's pext: the tile kernel's Q5 masks)
    if (!cpu_has(ISA_AVX512_BF16) || !__builtin_cpu_supports("bmi2") || !amx_cpuid(isa == ISA_AMX_INT8)) return false;
    return request_amx_permission(false, false) == 0;
  }
#endif
  return false;
}

static bool cpu_has_vbmi() {
#if QK_X86 && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return cpu_has(ISA_AVX512) && cpuid7(0, ECX, 1);
#else
  return false;
#endif
}
static int current_isa();
static bool q6k_six_bits() {
  // first asked (the first Q6_K copy, after PAGEDSERVE_CPU_ISA's set_isa): a path forced below
  // AVX-512 gets the byte layout, as a CPU without VBMI
  if (g_q6k_six_bits < 0) g_q6k_six_bits = cpu_has_vbmi() && current_isa() >= ISA_AVX512;
  return g_q6k_six_bits == 1;
}

// AVX-VNNI on the AVX2 level: its act_q8 products run the avx_vnni copies of its kernels (the
// same bits) where the CPU has AVX-VNNI (CPUID 7.1 EAX bit 4). Not a level of the ladder: Ice
// Lake servers have AVX512-VNNI without it, and the AVX-512 levels have their own integer
// kernels. g_avx_vnni: -1 not resolved (set_isa resets it: the CPU's answer at first use), 0
// off, 1 on; set_avx_vnni forces it (Python: PAGEDSERVE_CPU_ISA=avx2 off, =avx_vnni on).
static int g_avx_vnni = -1;
static bool cpu_has_avx_vnni() {
#if QK_X86 && (defined(__GNUC__) || defined(__clang__))
  return cpu_has(ISA_AVX2) && cpuid7(1, EAX, 4);
#else
  return false;
#endif
}
static bool avx_vnni_on() {
  if (current_isa() != ISA_AVX2) return false;
  if (g_avx_vnni < 0) g_avx_vnni = cpu_has_avx_vnni();
  return g_avx_vnni == 1;
}
bool set_avx_vnni(bool on) {
  TORCH_CHECK(!on || cpu_has_avx_vnni(), "AVX-VNNI: this CPU lacks the requested instruction set");
  const bool prev = g_avx_vnni < 0 ? cpu_has_avx_vnni() : g_avx_vnni == 1;
  g_avx_vnni = on;
  return prev;
}
bool avx_vnni_in_use() { return avx_vnni_on(); }
bool avx_vnni_in_cpu() { return cpu_has_avx_vnni(); }

static int best_isa() {
  for (int i = ISA_LAST; i > ISA_SCALAR; --i)
    if (cpu_has(i)) return i;
  return ISA_SCALAR;
}

static int64_t g_prefill_rows = 12;
// act_q8 with nibble weights: the many-row kernel from this many rows. Measured in the model's
// decode steps (weights streamed from memory, not the hot-cache micro-benchmark's 2 rows):
// 3 rows 11.9 (few-row kernel) vs 16.0 ms, 5 rows 18.8 vs 20.5, 8 rows 29.9 vs 27.3, 11 rows
// 35.7 vs 30.0 (BENCHMARKS section 23)
static int64_t g_q8_many_rows = 6;

// bfloat16 models (x arrives in bf16), avx512_bf16 and up: from this many rows the products of
// block-type weights run on the bf16 many-row kernels (quant_bf16.h; below it the float path,
// or for a segment with an interleaved copy that copy's bf16 kernel, quant_rows16_bf16.h); from
// g_bf16_onednn_rows on (g_amx_onednn_rows on the AMX levels) split bf16 weight tiles go to
// oneDNN through at::mm (AMX tiles where the CPU has them), below it the vdpbf16ps kernel.
// Measured on a Zen 4 (avx512_bf16, one thread, hot cache), float few-row kernel vs the bf16
// kernel, us: 4 rows 152 vs 150, 6 rows 234 vs 195, 8 rows 285 vs 197 (Q4_1 1536 x 576); the
// kernel beat oneDNN at every shape measured, so oneDNN is off by default below AMX. (Prepacked
// bf16 copies do beat it there from 16 rows: quant/layers.py's bf16_copies, BENCHMARKS section 41.)
static int64_t g_bf16_rows = 6;
// The same threshold for a segment with a row-interleaved copy: its few-row kernel (then the
// float one, quant_rows16.h) beat the bf16 units and oneDNN's tiles up to 8 rows (AMX Xeon, the
// default model's decode steps, 6 / 8 / 9 / 10 rows: 13.6-14.1 / 16.8-17.0 / 20.9-21.1 /
// 21.7-22.2 ms against 17.5-18.0 / 18.9-19.1 / 20.3-20.8 / 21.0-21.1 on the bf16 copies;
// BENCHMARKS section 39). Its bf16 kernel (quant_rows16_bf16.h), faster, runs below it now; on a
// Zen 4 it stayed level with the bf16 copies at 12-16 rows (section 44), so 9 stands.
static int64_t g_rows16_bf16_rows = 9;
static int64_t g_bf16_onednn_rows = 1 << 30;
// The AMX levels' threshold: oneDNN's tiles should win from a few dozen rows; not measured
// (no AMX machine was at hand): set_bf16_onednn_rows(m, amx=true) tunes it there.
static int64_t g_amx_onednn_rows = 32;

static int current_isa() {
  if (g_isa < 0) g_isa = best_isa();
  return g_isa;
}

int64_t set_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= ISA_LAST, "isa: 0 scalar, 1 avx2, 2 avx512, 3 avx512_vnni, 4 avx512_bf16, 5 amx_bf16, 6 amx_int8");
  TORCH_CHECK(cpu_has((int)isa), "this CPU lacks the requested instruction set");
  g_isa = (int)isa;
  g_avx_vnni = -1;  // the AVX2 level: AVX-VNNI where the CPU has it, unless set_avx_vnni says otherwise
  return g_isa;
}
int64_t get_isa() { return current_isa(); }
bool set_q6k_six_bits(bool on) {
  const bool prev = q6k_six_bits();
  TORCH_CHECK(!on || cpu_has_vbmi(), "Q6_K's six-bit copies need AVX512-VBMI, which this CPU lacks");
  g_q6k_six_bits = on;
  return prev;
}
bool isa_available(int64_t isa) { return isa >= 0 && isa <= ISA_LAST && cpu_has((int)isa); }
int64_t set_prefill_rows(int64_t m) {
  const int64_t old = g_prefill_rows;
  g_prefill_rows = m;
  return old;
}
int64_t set_bf16_rows(int64_t m, bool rows16) {
  int64_t& v = rows16 ? g_rows16_bf16_rows : g_bf16_rows;
  const int64_t old = v;
  v = m;
  return old;
}
int64_t set_bf16_onednn_rows(int64_t m, bool amx) {
  int64_t& v = amx ? g_amx_onednn_rows : g_bf16_onednn_rows;
  const int64_t old = v;
  v = m;
  return old;
}
int64_t set_q8_many_rows(int64_t m) {
  const int64_t old = g_q8_many_rows;
  g_q8_many_rows = m;
  return old;
}

static void isa_gemm_rows(const GemmArgs& g, int64_t n0, int64_t n1) {
#if QK_X86
  switch (std::min(current_isa(), (int)ISA_AVX512)) {
    case ISA_AVX512: return avx512::gemm_rows(g, n0, n1);
    case ISA_AVX2: return avx2::gemm_rows(g, n0, n1);
    default: break;
  }
#endif
  scalar::gemm_rows(g, n0, n1);
}

// The many-row blocked kernel (AVX2 code) for every row count on the AVX2 level, where the float
// checkpoints' linears take it too (FloatLinear); the scalar path takes dequantized tiles + BLAS
static bool has_many_rows_kernel() { return QK_X86 && current_isa() == ISA_AVX2; }
bool many_rows_kernel() { return has_many_rows_kernel(); }

// Packed weights' float32 products on the AVX-512 levels (float32 engines: AVX-512F CPUs without
// AVX512-BF16 pick float32) take the same AVX2 kernel below this many rows, dequantized tiles +
// BLAS from it. Zen 4, [2048, 5632] layers (benchmarks/float_blas_rows.py), the kernel took
// 0.13-0.5x the tiles' time at 12-64 rows and 0.53-0.95x at 128-256, every type: the tiles
// (~93 rows of 2 MB each, one small BLAS call each) cost 4-17 ms a call at any row count. Zen 4
// runs AVX-512 at the AVX2 FMA rate; a Xeon with two 512-bit FMA ports multiplies up to twice as
// fast in the BLAS, which by the same figures would bring the two about even near 256-512 rows
// (not measured: no such CPU here), hence 512, past a default prefill chunk of 256 tokens, whose
// engine step the tiles also made slower by a third in some processes (BENCHMARKS section 62).
static int64_t g_float_blas_rows = 512;
int64_t set_float_blas_rows(int64_t m) {
  const int64_t old = g_float_blas_rows;
  g_float_blas_rows = m;
  return old;
}
static bool many_rows_kernel_for(int64_t M) {
  return has_many_rows_kernel() || (QK_X86 && current_isa() >= ISA_AVX512 && M < g_float_blas_rows);
}

static void isa_gemm_many_rows(const GemmArgs& g, int64_t n0, int64_t n1) {
#if QK_X86
  avx2::gemm_many_rows(g, n0, n1);
#endif
}

static void isa_gemm_q8_rows(const GemmQ8Args& g, int64_t n0, int64_t n1) {
#if QK_X86
  if (current_isa() >= ISA_AVX512_VNNI) return avx512_vnni::gemm_q8_rows(g, n0, n1);
  switch (current_isa()) {
    case ISA_AVX512: return avx512::gemm_q8_rows(g, n0, n1);
    case ISA_AVX2: return avx_vnni_on() ? avx_vnni::gemm_q8_rows(g, n0, n1) : avx2::gemm_q8_rows(g, n0, n1);
    default: break;
  }
#endif
  scalar::gemm_q8_rows(g, n0, n1);
}

static void isa_gemm_q8_many(const GemmQ8Args& g, int64_t n0, int64_t n1) {
#if QK_X86
  if (current_isa() >= ISA_AVX512_VNNI) return avx512_vnni::gemm_q8_many(g, n0, n1);
  if (avx_vnni_on()) return avx_vnni::gemm_q8_many(g, n0, n1);
  avx2::gemm_q8_many(g, n0, n1);
#endif
}

// x [M, K] -> per 32-block int8 quants, scale max|x| / 127 and scale * sum(quants) (llama.cpp's
// q8_1), on OpenMP's team; the vector and scalar code compute the same bits (quantize_q8_blocks)
static void quantize_q8(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / 32;
  const bool vec = current_isa() >= ISA_AVX2;
  at::parallel_for(0, M * nb, std::max<int64_t>(1, 4096 / 32), [&](int64_t b0, int64_t b1) {
#if QK_X86
    if (vec) return avx2::quantize_q8_blocks(x, b0, b1, q, d, s);
#endif
    scalar::quantize_q8_blocks(x, b0, b1, q, d, s);
  });
}

// x [M, K] float32 -> (int8 quants [M, K], scales [M, K/32], scale * sum(quants) [M, K/32]):
// the activations as act_q8 products see them (tests compare the ISAs' bits)
std::vector<torch::Tensor> quantize_act_q8(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % 32 == 0,
              "x: contiguous float32 [M, K], K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, torch::kChar);
  auto d = torch::empty({M, K / 32}, torch::kFloat), s = torch::empty({M, K / 32}, torch::kFloat);
  quantize_q8(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  return {q, d, s};
}

static void isa_dequant_rows(int type, const uint8_t* W, int64_t rb, int64_t K, const int64_t* rows, int64_t r0,
                             int64_t r1, float* out) {
#if QK_X86
  switch (std::min(current_isa(), (int)ISA_AVX512)) {
    case ISA_AVX512: return avx512::dequant_rows(type, W, rb, K, rows, r0, r1, out);
    case ISA_AVX2: return avx2::dequant_rows(type, W, rb, K, rows, r0, r1, out);
    default: break;
  }
#endif
  scalar::dequant_rows(type, W, rb, K, rows, r0, r1, out);
}

static int64_t block_elems(int type) {
  switch (type) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    default: return 0;
  }
}
static int64_t block_bytes(int type) {
  switch (type) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return sizeof(bq4_0);
    case T_Q4_1: return sizeof(bq4_1);
    case T_Q5_0: return sizeof(bq5_0);
    case T_Q5_1: return sizeof(bq5_1);
    case T_Q8_0: return sizeof(bq8_0);
    case T_Q4_K: return sizeof(bq4_K);
    case T_Q5_K: return sizeof(bq5_K);
    case T_Q6_K: return sizeof(bq6_K);
    default: return 0;
  }
}

// A layer's packed rows dropped under gguf_q8 (quant/layers.py's drop_packed_rows: their
// row-interleaved copy serves every row count): [N, row_bytes] expanded from one byte, which
// only gemm's act_q8 product on the copy accepts; every other reader refuses it (check_packed).
static bool packed_dropped(const torch::Tensor& w) { return w.dim() == 2 && w.size(1) > 1 && w.stride(1) == 0; }

static void check_packed(const torch::Tensor& w, int64_t type, int64_t K, bool dropped_ok = false) {
  const int64_t be = block_elems((int)type);
  TORCH_CHECK(be > 0, "unsupported packed type ", type);
  TORCH_CHECK(K > 0 && K % be == 0, "K=", K, " is not a positive multiple of the block size ", be);
  TORCH_CHECK(dropped_ok || !packed_dropped(w),
              "w: its packed rows were dropped (gguf_q8 keeps only their row-interleaved copy, which act_q8's "
              "products read); nothing else can read them");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && (w.is_contiguous() || packed_dropped(w)),
              "w: contiguous uint8 [N, row_bytes]");
  TORCH_CHECK(w.size(1) == K / be * block_bytes((int)type), "row bytes ", w.size(1), " do not match K=", K);
}

torch::Tensor dequant(torch::Tensor w, int64_t type, int64_t K, c10::optional<torch::Tensor> rows) {
  check_packed(w, type, K);
  const uint8_t* W = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1);
  torch::Tensor ids;
  const int64_t* rp = nullptr;
  int64_t R = w.size(0);
  if (rows.has_value()) {
    ids = rows->to(at::kLong).contiguous();
    rp = ids.data_ptr<int64_t>();
    R = ids.numel();
    for (int64_t i = 0; i < R; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < w.size(0), "row id out of range");
  }
  auto out = torch::empty({R, K}, torch::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)),
                   [&](int64_t r0, int64_t r1) { isa_dequant_rows((int)type, W, rb, K, rp, r0, r1, o); });
  return out;
}

// The types with a row-interleaved copy, which the few-row kernels read (float activations:
// quant_rows16.h, quant_rows16_avx2.h; bf16 ones: quant_rows16_bf16.h; Q6_K's six-bit copy:
// quant_rows16_q6k_vbmi*.h, AVX-512 only)
static bool rows16_type(int64_t type) {
  return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0 || type == T_Q4_K ||
         type == T_Q5_K || type == T_Q6_K;
}

// Bytes of the row-interleaved copy of packed rows w (N a multiple of 16): per 16 rows and block
static int64_t rows16_copy_bytes(const torch::Tensor& w, int64_t type) {
#if QK_X86
  return w.size(0) / 16 * (w.size(1) / block_bytes((int)type)) * rows16_layout::rows16_block_bytes((int)type);
#else
  (void)w, (void)type;
  return 0;
#endif
}

// Whether a kernel on the ISA path now set reads `type`'s copy: AVX2 and up, but Q6_K's six-bit
// copy (AVX512-VBMI CPUs) only on the AVX-512 paths
static bool rows16_readable(int64_t type) {
  const int isa = current_isa();
  return rows16_type(type) && isa >= ISA_AVX2 && (isa >= ISA_AVX512 || type != T_Q6_K || !q6k_six_bits());
}

// Bytes of interleave_rows16's copy of packed rows w, 0 where it does not apply (another type,
// rows not a multiple of 16, no kernel on the path now set reads it)
int64_t rows16_copy_size(torch::Tensor w, int64_t type, int64_t K) {
  check_packed(w, type, K);
  const int64_t N = w.size(0);
  return rows16_readable(type) && N % 16 == 0 && N > 0 ? rows16_copy_bytes(w, type) : 0;
}

// The row-interleaved copy of packed rows w (quant_rows16_layout.h) for the few-row kernels, or
// an empty tensor where it does not apply (rows16_copy_size 0)
torch::Tensor interleave_rows16(torch::Tensor w, int64_t type, int64_t K) {
  const int64_t size = rows16_copy_size(w, type, K);
  if (size == 0) return torch::empty({0}, torch::kUInt8);
  const int64_t N = w.size(0);
  auto out = torch::empty({size}, torch::kUInt8);
#if QK_X86
  const uint8_t* W = w.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t rb = w.size(1);
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) { rows16_layout::interleave16((int)type, W, rb, K, g0, g1, o); });
#endif
  return out;
}

// wi is w's copy and the float kernel (bf16: the bf16 kernel) reads it on the ISA path now set
static bool rows16_usable(const c10::optional<torch::Tensor>& wi, const torch::Tensor& w, int64_t type, bool bf16 = false) {
#if QK_X86
  return (bf16 ? current_isa() >= ISA_AVX512_BF16 : rows16_readable(type)) && rows16_type(type) &&
         wi.has_value() && wi->defined() && w.size(0) % 16 == 0 &&
         wi->numel() == rows16_copy_bytes(w, type) &&
         wi->scalar_type() == at::kByte && wi->is_contiguous();
#else
  (void)wi, (void)w, (void)type, (void)bf16;
  return false;
#endif
}

// The K-quants under act_q8 (Q4_K, Q5_K, Q6_K): int8 activations from int8_rows(type) rows, on
// the integer kernels; fewer rows keep float activations on the row-interleaved copy. Set by
// set_int8_rows (tests, A/B); -1, the default, is the type's rule:
//   Q6_K on AVX512-VNNI at every row count: its int8 kernel on the copy (quant_rows16_q6k_vnni.h)
//     took 0.73-1.03x the copy's float and bf16 kernels' time at 1-2 rows, 0.46-0.91x at 4-8
//     (float32 engines gain most), 0.26-0.47x at 12-16, where they leave the copy ([2048, 5632]
//     and the 1 B model's [49152, 2048] LM head, Zen 4; BENCHMARKS section 64); with no copy, the
//     packed rows' int8 kernels took 0.4-0.9x the packed rows' float ones at 1-8 rows;
//   Q6_K below it at every row count too where its copy is in the byte layout (AVX2 CPUs, AVX-512 ones without
//     VBMI), which quant_rows16_q8_avx2.h reads: [2048, 5632] and [49152, 2048], us, int8 copy /
//     float copy, 1 row 350 / 340 and 4,108 / 3,723, 2 rows 347 / 421 and 2,921 / 3,422, 4 rows
//     495 / 850 and 4,002 / 6,890, 8 rows 944 / 1,461 and 8,990 / 12,251 (section 64); the
//     packed rows' int8 kernels took 0.46-0.83x their float ones at 1-8 rows;
//   Q6_K's six-bit copy below AVX512-VNNI (a path forced below it) from 9 rows: no int8 kernel
//     reads it, and at 1-8 rows the float and bf16 kernels on its copy took 0.5-0.8x
//     the int8 kernels' time (1 row even), and from 9-12 rows the float products leave the copy
//     for slower many-row paths, where the int8 kernel took 0.2-0.75x their time (section 60);
//   Q4_K and Q5_K at every row count: their int8 kernels on the copy (quant_rows16_vnni.h,
//     quant_rows16_q8_avx2.h) beat the copy's float and bf16 kernels at 1-8 rows on every level
//     (Q4_K, [2048, 5632], us: VNNI 1 row 190 vs 194 bf16, 4 rows 249 vs 299, 8 rows 350 vs 524;
//     the avx512 level's float kernel 1 row 164 vs 250, 8 rows 748 vs 915; Q5_K there 1.2-1.3x
//     at 2-8 rows, 1 row 243 vs 286 for the packed rows' int8 tile, the AVX2 path). Until then
//     the copy's float or bf16 kernel had won at 1-8 rows on the AVX-512 levels against the
//     packed rows' int8 tiles (sections 61-63 of BENCHMARKS).
static int64_t g_int8_rows[3] = {-1, -1, -1};  // Q4_K, Q5_K, Q6_K
static int kquant_index(int64_t type) { return type == T_Q4_K ? 0 : type == T_Q5_K ? 1 : type == T_Q6_K ? 2 : -1; }
int64_t set_int8_rows(int64_t type, int64_t m) {
  const int i = kquant_index(type);
  TORCH_CHECK(i >= 0, "set_int8_rows: Q4_K, Q5_K or Q6_K, not type ", type);
  const int64_t old = g_int8_rows[i];
  g_int8_rows[i] = m;
  return old;
}
static bool rows16_q8_type(int64_t type);
static int64_t int8_rows(int64_t type) {
  const int64_t set = g_int8_rows[kquant_index(type)];
  if (set >= 0) return set;
  return type == T_Q6_K && !rows16_q8_type(type) ? 9 : 1;
}

// The types whose products act_q8 ("gguf_q8") runs on int8 activations at every row count, so
// that their layers need no float few-row copy (an int8 one where rows16_q8_type): Q4_0 / Q4_1 /
// Q8_0, and a K-quant where its rule says 1 row (Q4_K's and Q5_K's everywhere, Q6_K's on AVX512-VNNI; asked at load, after
// PAGEDSERVE_CPU_ISA). The K-quants otherwise from int8_rows on (act_q8_rows); the other types
// keep float activations.
static bool act_q8_type(int64_t type) {
  if (kquant_index(type) >= 0) return int8_rows(type) <= 1;
  return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0;
}

// Whether act_q8 runs this type's product over M activation rows on int8 activations
static bool act_q8_rows(int64_t type, int64_t M) {
  if (kquant_index(type) >= 0) return M >= int8_rows(type);
  return act_q8_type(type);
}

// Float few-row products that read an interleaved copy so far (tests: a copy given but not
// usable, e.g. Q6_K's in the other layout, falls back to the packed rows silently)
static int64_t g_rows16_calls = 0;
int64_t rows16_calls() { return g_rows16_calls; }

// act_q8's products on a row-interleaved copy (quant_rows16_vnni.h on AVX512-VNNI and up: Q4_0 /
// Q4_1 / Q8_0 / Q4_K / Q5_K, and Q6_K's quant_rows16_q6k_vnni.h; quant_rows16_q8_avx2.h on the
// avx2 and avx512 levels: Q4_0 / Q4_1 / Q4_K / Q5_K, Q6_K's byte layout)
// below rows16_q8_rows(type) rows, the packed rows' kernels from there (the same bits from the
// many-row threshold on, so the line may lie anywhere). Set by set_rows16_q8_rows (tests, A/B);
// -1, the default, is the ISA's rule (Zen 4, us a layer, copy / packed rows,
// benchmarks/q8_copy_rows.py; BENCHMARKS sections 63, Q6_K's 64):
//   AVX512-VNNI: every row count, Q8_0 and Q6_K below 64. [2048, 5632] Q4_1 1 row 180-229 / 233-240, 2
//     rows 190-207 / 349-351 (the packed rows' few-row tile), 8 rows 352 / 659, 256 rows 9,842 /
//     11,017 (their many-row kernel), 1,024 rows 39,142 / 43,717; the default model's [3072, 576]
//     and [576, 1536] 0.5x at 1-8 rows, even (0.97-1.03x) at 256-1,024. Q8_0 gains less from 16
//     rows (even at 64-256 rows) and a 256-token prefill of an all-Q8_0 0.9 B model took 2-6%
//     longer on the copy. Q6_K [2048, 5632], float32: 16 rows 943 / 1,345, 64 rows 3,495 /
//     3,805, 256 rows 14,035 / 13,278 (the LM head [49152, 2048] even at 64 rows, 1.28x at 256);
//   below it: under 12 rows, where 4-row tiles re-read the copy: [2048, 5632] Q4_1 1-4 rows
//     0.55-0.89x, 8 rows even, 16 rows 1.2x, 64 rows 1.44x; the default model's shapes 0.5-0.7x
//     at 1-8 rows, 0.74-0.95x at 16, 1.3x at 64. Q6_K (its byte layout) under 32 rows, its tiles
//     walking both halves at once: [2048, 5632] 1 row 350 / 365, 4 rows 495 / 1,068, 16 rows
//     2,102 / 2,573, 24 rows 2,559 / 3,151, 32 rows 3,328 / 3,265, 48 rows 4,990 / 4,568;
//   AVX-VNNI (the AVX2 level's kernels on vpdpbusd): under 16 rows. Sapphire Rapids forced to
//   the level, float32: [2048, 5632] Q4_1 8 rows 643 / 868, 12 rows 946 / 985, 16 rows 1,189 /
//   1,181, 24 rows 1,650 / 1,484; the default model's shapes 0.6x at 8 rows, 0.77-0.85x at 12,
//   0.83-0.88x at 16, even at 24-64 (BENCHMARKS section 68).
static int64_t g_rows16_q8_rows[4] = {-1, -1, -1, -1};  // Q4_0 and Q4_1; Q8_0; Q4_K and Q5_K; Q6_K
static int64_t& rows16_q8_set(int64_t type) {
  return g_rows16_q8_rows[type == T_Q8_0 ? 1 : type == T_Q4_K || type == T_Q5_K ? 2 : type == T_Q6_K ? 3 : 0];
}
static int64_t rows16_q8_rows(int64_t type) {
  const int64_t set = rows16_q8_set(type);
  if (set >= 0) return set;
  if (current_isa() < ISA_AVX512_VNNI) return type == T_Q6_K ? 32 : avx_vnni_on() ? 16 : 12;
  return type == T_Q8_0 || type == T_Q6_K ? 64 : int64_t(1) << 40;
}
int64_t set_rows16_q8_rows(int64_t type, int64_t m) {
  TORCH_CHECK(type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || kquant_index(type) >= 0,
              "set_rows16_q8_rows: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K or Q6_K, not type ", type);
  const int64_t old = rows16_q8_set(type);
  rows16_q8_set(type) = m;
  return old;
}
// act_q8 products on a copy so far (tests)
static int64_t g_rows16_q8_calls = 0;
int64_t rows16_q8_calls() { return g_rows16_q8_calls; }

// Whether act_q8 runs every product of this type on its interleaved copy, whatever the row count
// (so that a layer with the copy needs no packed rows: quant/layers.py's drop_packed_rows)
static bool rows16_q8_every_row(int64_t type) {
  return act_q8_type(type) && rows16_q8_type(type) && rows16_q8_rows(type) >= (int64_t(1) << 40);
}

// Whether act_q8 runs this type's few-row products on its interleaved copy on the ISA path now
// set (so that its layers keep one under gguf_q8)
static bool rows16_q8_type(int64_t type) {
  const int isa = current_isa();
  if (!QK_X86 || isa < ISA_AVX2) return false;
  if (type == T_Q8_0) return isa >= ISA_AVX512_VNNI;
  if (type == T_Q6_K) return isa >= ISA_AVX512_VNNI || !q6k_six_bits();  // (AVX2's kernel: the byte layout)
  return type == T_Q4_0 || type == T_Q4_1 || type == T_Q4_K || type == T_Q5_K;
}

// The integer kernels' start values (GemmQ8Args::xc) for g.M rows' quants: Q8_0's unsigned
// weights' offset (128) on AVX512-VNNI, Q6_K's (32 per half block) there and for the copies'
// kernels (`copy`, AVX2 too). Nothing for the other types or the AVX2 many-row kernels, which
// take signed weights.
static void q8_start_values(GemmQ8Args& g, bool copy = false) {
#if QK_X86
  const bool vnni = current_isa() >= ISA_AVX512_VNNI;
  if (!(g.type == T_Q8_0 && vnni) && !(g.type == T_Q6_K && (vnni || copy))) return;
  thread_local std::vector<int32_t> xc;
  const int64_t nb = g.K / 32;
  const bool q6k = g.type == T_Q6_K;
  xc.resize((q6k ? 2 : 1) * g.M * nb);
  const int8_t* q = g.xq;  // (thread_local: the pointers, not the names, go to the team)
  int32_t* c = xc.data();
  at::parallel_for(0, g.M * nb, 256, [&](int64_t b0, int64_t b1) {
    if (q6k)
      avx2_rows16::q8_half_corr(q, b0, b1, c);
    else
      avx512_vnni::q8_block_corr(q, b0, b1, c);
  });
  g.xc = c;
#else
  (void)g, (void)copy;
#endif
}

// act_q8 over M rows on the copy wi of w (a.xq: the rows' quants as quantize_q8 wrote them)
static bool rows16_q8_gemm(GemmQ8Args a, const c10::optional<torch::Tensor>& wi, const torch::Tensor& w) {
  const int64_t M = a.M, N = w.size(0), nb = a.K / 32;
  if (!rows16_q8_type(a.type) || M >= rows16_q8_rows(a.type) || !rows16_usable(wi, w, a.type)) return false;
#if QK_X86
  ++g_rows16_q8_calls;
  q8_start_values(a, true);  // (Q8_0's and Q6_K's)
  if (a.type != T_Q8_0 && a.type != T_Q6_K) {  // the quants in the order of the copy's nibbles
    thread_local std::vector<int8_t> xo;
    xo.resize(M * a.K);
    const int8_t* q = a.xq;  // (thread_local: the pointers, not the names, go to the team)
    int8_t* o = xo.data();
    at::parallel_for(0, M * nb, 1024, [&](int64_t b0, int64_t b1) { avx2_rows16::q4_copy_order(q, b0, b1, o); });
    a.xq = o;
  }
  const uint8_t* WI = wi->data_ptr<uint8_t>();
  const bool vnni = current_isa() >= ISA_AVX512_VNNI, six = q6k_six_bits(), avx_vnni = avx_vnni_on();
  at::parallel_for(0, N / 16, std::max<int64_t>(1, 4096 / a.K), [&](int64_t g0, int64_t g1) {
    if (vnni && a.type == T_Q6_K && six)
      avx512_vnni_vbmi::gemm_rows16_q8_q6k<true>(a, WI, g0, g1);
    else if (vnni && a.type == T_Q6_K)
      avx512_vnni_rows16::gemm_rows16_q8_q6k<false>(a, WI, g0, g1);
    else if (vnni)
      avx512_vnni_rows16::gemm_rows16_q8(a, WI, g0, g1);
    else if (avx_vnni)
      avx_vnni_rows16::gemm_rows16_q8(a, WI, g0, g1);
    else
      avx2_rows16::gemm_rows16_q8(a, WI, g0, g1);
  });
#endif
  return true;
}

void gemm(torch::Tensor x, torch::Tensor w, int64_t type, torch::Tensor out, int64_t col0, bool act_q8,
          c10::optional<torch::Tensor> wi) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(), "out: contiguous float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_packed(w, type, K, true);
  TORCH_CHECK(out.size(0) == M && col0 >= 0 && col0 + N <= out.size(1), "out shape");
  if (M == 0 || N == 0) return;
  const int64_t ldo = out.size(1);
  const bool q8 = act_q8 && act_q8_rows(type, M);
  const char* dropped = "w: its packed rows were dropped (gguf_q8 keeps their row-interleaved copy only), and this "
                        "product would read them: the copy's kernel does not run here (another ISA path or rule)";
  TORCH_CHECK(q8 || !packed_dropped(w), dropped);
  if (q8) {
    // int8 activations (llama.cpp's q8_1 blocks), then integer products: the column-interleaved
    // many-row kernel (AVX2 code, which AVX-512 CPUs run too; 2.2-2.5x the float kernel at 12+
    // rows) from g_q8_many_rows on for nibble weights and from the float threshold on for Q8_0
    // (whose repacking costs more than its few-row kernel below ~12 rows); BENCHMARKS section 23
    const int64_t nb = K / 32;
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> xd, xs;
    xq.resize(M * K);
    xd.resize(M * nb);
    xs.resize(M * nb);
    quantize_q8(x.data_ptr<float>(), M, K, xq.data(), xd.data(), xs.data());
    GemmQ8Args g{(int)type, w.data_ptr<uint8_t>(), w.size(1), K, M, ldo, xq.data(), xd.data(), xs.data(),
                 out.data_ptr<float>() + col0};
    if (rows16_q8_gemm(g, wi, w)) return;
    TORCH_CHECK(!packed_dropped(w), dropped);
    const int64_t many_from = type == T_Q8_0 ? g_prefill_rows : g_q8_many_rows;
    if (QK_X86 && current_isa() >= ISA_AVX2 && M >= many_from) {
      q8_start_values(g);
      at::parallel_for(0, (N + 15) / 16, 1,  // tasks of two groups of 8 columns
                       [&](int64_t a, int64_t b) { isa_gemm_q8_many(g, a * 16, std::min(N, b * 16)); });
    } else {
      const int64_t grain = std::max<int64_t>(1, 65536 / K);
      at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { isa_gemm_q8_rows(g, n0, n1); });
    }
    return;
  }
  if (M >= g_prefill_rows) {
    GemmArgs g{(int)type, w.data_ptr<uint8_t>(), w.size(1), K, M, ldo, x.data_ptr<float>(), nullptr,
               out.data_ptr<float>() + col0};
    if (many_rows_kernel_for(M) && K % 8 == 0) {  // tasks of 4 output rows (the micro-kernel's width)
      at::parallel_for(0, (N + 3) / 4, 1,
                       [&](int64_t a, int64_t b) { isa_gemm_many_rows(g, a * 4, std::min(N, b * 4)); });
      return;
    }
    // otherwise: dequantize tiles of output rows, then the BLAS GEMM
    // tiles of ~2 MB of float weights in a reused buffer (a fresh one per call page-faults)
    const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(N, (int64_t(512) << 10) / K));
    const int64_t rb = w.size(1);
    thread_local torch::Tensor buf;
    if (!buf.defined() || buf.numel() < tile * K) buf = torch::empty({tile * K}, torch::kFloat);
    for (int64_t t0 = 0; t0 < N; t0 += tile) {
      const int64_t t1 = std::min(N, t0 + tile);
      auto wf = buf.narrow(0, 0, (t1 - t0) * K).view({t1 - t0, K});
      float* o = wf.data_ptr<float>();
      const uint8_t* W = w.data_ptr<uint8_t>() + t0 * rb;
      at::parallel_for(0, t1 - t0, std::max<int64_t>(1, 16384 / K),
                       [&](int64_t r0, int64_t r1) { isa_dequant_rows((int)type, W, rb, K, nullptr, r0, r1, o); });
      out.narrow(1, col0 + t0, t1 - t0).copy_(at::mm(x, wf.t()));
    }
    return;
  }
  std::vector<float> xsum;
  GemmArgs g{(int)type, w.data_ptr<uint8_t>(), w.size(1), K, M, ldo, x.data_ptr<float>(), nullptr,
             out.data_ptr<float>() + col0};
  if (type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K) {  // their minimums' terms
    const int64_t nb = K / 32;
    xsum.resize(M * nb);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < nb; ++i) {
        const float* p = g.X + m * K + i * 32;
        float s = 0.f;
        for (int j = 0; j < 32; ++j) s += p[j];
        xsum[m * nb + i] = s;
      }
    g.xsum = xsum.data();
  }
  // grain: at least ~64k weights per task so small layers are not split into tiny jobs
  const int64_t grain = std::max<int64_t>(1, 65536 / K);
  if (rows16_usable(wi, w, type)) {
    ++g_rows16_calls;
#if QK_X86
    const uint8_t* WI = wi->data_ptr<uint8_t>();
    const bool six = type == T_Q6_K && q6k_six_bits(), avx512 = current_isa() >= ISA_AVX512;
    at::parallel_for(0, N / 16, std::max<int64_t>(1, grain / 16), [&](int64_t g0, int64_t g1) {
      if (!avx512)
        avx2_rows16::gemm_rows16(g, WI, g0, g1);
      else if (six)
        avx512_vbmi::gemm_rows16_q6k_six(g, WI, g0, g1);
      else
        avx512_rows16::gemm_rows16(g, WI, g0, g1);
    });
#endif
    return;
  }
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { isa_gemm_rows(g, n0, n1); });
}

static bool bf16_products() { return QK_X86 && current_isa() >= ISA_AVX512_BF16; }
// products on the vdpbf16ps kernel / oneDNN / the interleaved copies' bf16 kernel / the AMX
// tiles over the copies / the AMX exact few-row kernel (tests)
static int64_t g_bf16_calls[5] = {0, 0, 0, 0, 0};
std::vector<int64_t> bf16_calls() { return std::vector<int64_t>(g_bf16_calls, g_bf16_calls + 5); }
// Whether a bf16 model's few-row products on segments with an interleaved copy run on the
// bf16 units (quant_rows16_bf16.h) or widen the activations for the float kernel
// (quant_rows16.h). -1 (the default): the rule, the bf16 kernel except for Q4_0 / Q4_1 / Q8_0
// on the AMX levels, where the float kernel took 0.63-0.85x its time at 2-8 rows (equal at 1)
// on an AMX Xeon (the default model's layers, its Q8_0 head 0.62-0.8x at 1-8 rows; n-gram
// speculation 1.51x -> 1.77x; BENCHMARKS section 65), while the bf16 one led on a Zen 4
// (section 44); the K-quants were not measured there. 0 / 1: set_rows16_bf16 (A/B, tests).
static int g_rows16_bf16 = -1;
static bool rows16_bf16(int64_t type) {
  if (g_rows16_bf16 >= 0) return g_rows16_bf16 == 1;
  return !(current_isa() >= ISA_AMX_BF16 && (type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0));
}
// on: the bf16 kernel for every type; off: the float one; none: the rule. Returns whether
// Q4_1's products took the bf16 kernel before.
bool set_rows16_bf16(c10::optional<bool> on) {
  const bool prev = rows16_bf16(T_Q4_1);
  g_rows16_bf16 = on.has_value() ? int(*on) : -1;
  return prev;
}

// Whether a type's products may take the bf16 route (block types: integer quants and group
// scales, exact in bf16; float rows take the float path)
static bool bf16_type(int64_t type) {
#if QK_X86
  return avx512_bf16::quant_group_size((int)type) > 0;
#else
  (void)type;
  return false;
#endif
}

// The interleaved copy's bf16 kernel (quant_rows16_bf16.h): out (offset by col0) = x @ w.T
static void gemm_rows16_bf16(const uint16_t* X, int64_t M, int64_t K, int64_t N, int64_t type, const uint8_t* WI,
                             float* out, int64_t ldo) {
#if QK_X86
  thread_local std::vector<uint32_t> xp;
  thread_local std::vector<float> xs;
  if (type != T_Q6_K) {  // it reads the activations' own pairs
    xp.resize(M * K / 2);
    avx512_bf16_rows16::pair_activations(X, K, 0, M, xp.data());
  }
  float* sums = nullptr;  // Q4_1's, Q5_1's, Q4_K's and Q5_K's block sums of the activations
  if (type == T_Q4_1 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K) {
    xs.resize(M * (K / 32));
    sums = xs.data();
    avx512_bf16::group_sums(X, K, 32, 0, M, sums);
  }
  const avx512_bf16_rows16::Rows16Bf16Args g{(int)type, K, M, ldo, xp.data(), reinterpret_cast<const uint32_t*>(X), sums, out};
  const int64_t grain = std::max<int64_t>(1, 65536 / K);  // as gemm's few-row kernels
  const bool six = type == T_Q6_K && q6k_six_bits();
  at::parallel_for(0, N / 16, std::max<int64_t>(1, grain / 16), [&](int64_t g0, int64_t g1) {
    if (six)
      avx512_bf16_vbmi::gemm_q6k_six(g, WI, g0, g1);
    else
      avx512_bf16_rows16::gemm_rows16_bf16(g, WI, g0, g1);
  });
#endif
}

// Types the AMX tile kernel dequantizes from their copies (quant_rows16_amx.h)
static bool amx_rows16_type(int64_t type) {
  return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || type == T_Q4_K || type == T_Q5_0 || type == T_Q5_1 ||
         type == T_Q5_K || (type == T_Q6_K && q6k_six_bits());
}
// Whether a bf16 model's products of this type, g_rows16_bf16_rows rows and more, run on the AMX
// tile kernel over the type's copy (an AMX path; set_amx_rows16(false): oneDNN's bf16 copies or
// the vdpbf16ps kernel instead, the A/B of BENCHMARKS section 65)
static bool g_amx_rows16 = true;
bool amx_rows16(int64_t type) { return QK_X86 && g_amx_rows16 && current_isa() >= ISA_AMX_BF16 && amx_rows16_type(type); }
bool set_amx_rows16(bool on) {
  const bool prev = g_amx_rows16;
  g_amx_rows16 = on;
  return prev;
}

// The checks of both tile entry points below (gemm_amx_exact, gemm_amx_rows16): x bf16 [M, K],
// out float32 [M, >= col0 + N], the amx_bf16 path, wi w's copy; false: nothing to compute
static bool check_amx_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& wi, int64_t type,
                              const torch::Tensor& out, int64_t col0) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(), "out: contiguous float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(current_isa() >= ISA_AMX_BF16, "the AMX tile products need the amx_bf16 path (or above)");
  TORCH_CHECK(K % 32 == 0 && rows16_usable(wi, w, type, true), "wi: w's interleave_rows16 copy, K a multiple of 32");
  TORCH_CHECK(out.size(0) == M && col0 >= 0 && col0 + N <= out.size(1), "out shape");
  return M > 0 && N > 0;
}

// Few-row products on the tiles with the quants exact (quant_rows16_amx_exact.h): Q4_0 / Q4_1 /
// Q4_K / Q5_0 / Q5_1 / Q5_K / Q8_0 / Q6_K (six-bit) segments with a copy, 1 .. g_amx_exact_rows rows (at most 16; 0: off), ahead of the
// float / bf16 few-row kernels and of the bf16-rounded tiles above. Rows 1 .. 16 then compute
// every row alike, so n-gram verifications of up to 15 guesses give the 1-row steps' tokens
// (Q6_K: from 2 rows, amx_exact_one_row).
static int64_t g_amx_exact_rows = 16;
static bool amx_exact_type(int64_t type) {
  return type == T_Q4_0 || type == T_Q4_1 || type == T_Q4_K || type == T_Q5_0 || type == T_Q5_1 || type == T_Q5_K ||
         type == T_Q8_0 || (type == T_Q6_K && q6k_six_bits());
}
static bool amx_exact(int64_t type) {
  return QK_X86 && g_amx_exact_rows > 0 && current_isa() >= ISA_AMX_BF16 && amx_exact_type(type);
}
// One row: not Q6_K, whose sub-blocks of 16 take twice the tile work a weight: a batch-1 step of
// a Q6_K file ran 10-20% slower on the tiles than on the copy's bf16 kernel (BENCHMARKS section
// 70), which keeps its one-row products. Its 2-16-row ones then differ from those in float32
// rounding only (the quants exact in both).
static bool amx_exact_one_row(int64_t type) { return type != T_Q6_K && amx_exact(type); }
// The types the exact kernel takes at M rows (qlinear's layer check and its per-segment one)
static bool (*amx_exact_rule(int64_t M))(int64_t) { return M == 1 ? amx_exact_one_row : amx_exact; }
int64_t set_amx_exact_rows(int64_t m) {
  TORCH_CHECK(m >= 0 && m <= 16, "the exact tile kernel takes 0 (off) .. 16 rows");
  const int64_t prev = g_amx_exact_rows;
  g_amx_exact_rows = m;
  return prev;
}

// x (bf16 [M, K], M <= 16) @ dequant(the copy wi of N rows).T on the AMX tiles, the quants
// exact, into float columns f or bf16 ones h (the float bias added first; may be null), row
// stride ldo
static void amx_exact_run(const torch::Tensor& x, const torch::Tensor& wi, int64_t type, int64_t N, float* f,
                          uint16_t* h, const float* bias, int64_t ldo) {
  ++g_bf16_calls[4];
#if QK_X86
  const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t M = x.size(0), K = x.size(1);
  thread_local std::vector<uint32_t> xp;
  thread_local std::vector<float> xs;
  if (type != T_Q6_K) {  // (Q6_K's tiles take the activations as they are, and no offset term)
    xp.resize(M * K / 2);
    xs.resize(M * (K / 32));
    avx512_bf16_rows16::pair_activations(X, K, 0, M, xp.data());
    avx512_bf16::group_sums(X, K, 32, 0, M, xs.data());
  }
  const amx_bf16_rows16::ExactArgs a{(int)type, K, M, X, xp.data(), xs.data(), f, h, bias, ldo};
  const int64_t grain = std::max<int64_t>(1, 4096 / K);  // groups a task (~64 KB of Q4 copy)
  at::parallel_for(0, N / 16, grain, [&](int64_t g0, int64_t g1) {
    amx_bf16_rows16::gemm_exact(a, wi.data_ptr<uint8_t>(), g0, g1);
  });
#else
  (void)x, (void)wi, (void)type, (void)N, (void)f, (void)h, (void)bias, (void)ldo;
#endif
}

// out[:, col0:col0+N] (float32) = x (bf16 [M, K], M <= 16) @ dequant(w).T on the AMX tiles, the
// quants exact, read from wi (w's interleave_rows16 copy; amx_exact_type's: Q4_0 / Q4_1 / Q4_K /
// Q5_0 / Q5_1 / Q5_K / Q8_0, Q6_K's six-bit one)
void gemm_amx_exact(torch::Tensor x, torch::Tensor w, torch::Tensor wi, int64_t type, torch::Tensor out, int64_t col0) {
  TORCH_CHECK(amx_exact_type(type), "the exact tile products take Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q8_0 copies and Q6_K's six-bit ones");
  TORCH_CHECK(x.dim() != 2 || x.size(0) <= 16, "the exact tile products take 1 .. 16 rows");
  if (check_amx_product(x, w, wi, type, out, col0))
    amx_exact_run(x, wi, type, w.size(0), out.data_ptr<float>() + col0, nullptr, nullptr, out.size(1));
}

// x (bf16 [M, K]) @ dequant(the copy wi of N rows).T on the AMX tiles into float columns f or
// bf16 ones h (the float bias added first; may be null), row stride ldo
// The tile kernel's rows in chunks whose activations (~512 KB) stay in each core's L2 while every
// item streams past them (each chunk dequantizes the weights again): 2,048 rows in one pass read
// the activations from memory once per item, at 0.54x oneDNN's speed (0.69x in chunks; BENCHMARKS
// section 65). A product of more rows than one chunk dequantizes its weights twice or more: K =
// 8,192 (chunks of 64 rows) took 1.6-2x the time at 80 rows that it took at 64 (section 68), so a
// layer's bf16 copy serves from chunk + 1 rows where that is below layers.AMX_COPY_MIN_ROWS.
int64_t amx_rows16_chunk(int64_t K) { return std::clamp<int64_t>((int64_t{1} << 18) / std::max<int64_t>(K, 1) / 32 * 32, 64, 512); }

static void amx_rows16_run(const torch::Tensor& x, const torch::Tensor& wi, int64_t type, int64_t N, float* f, uint16_t* h,
                           const float* bias, int64_t ldo) {
  ++g_bf16_calls[3];
#if QK_X86
  const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* WI = wi.data_ptr<uint8_t>();
  const int64_t M = x.size(0), K = x.size(1), pairs = (N / 16 + 1) / 2;
  const int64_t chunk = amx_rows16_chunk(K);
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t m = std::min(chunk, M - r0);
    at::parallel_for(0, pairs, 1, [&](int64_t a, int64_t b) {
      amx_bf16_rows16::Out o;
      o.f = f ? f + r0 * ldo : nullptr;
      o.h = h ? h + r0 * ldo : nullptr;
      o.bias = bias;
      o.ldo = ldo;
      amx_bf16_rows16::gemm((int)type, WI, K, X + r0 * K, m, o, 2 * a, std::min(N / 16, 2 * b));
    });
  }
#else
  (void)x, (void)wi, (void)type, (void)N, (void)f, (void)h, (void)bias, (void)ldo;
#endif
}

// out[:, col0:col0+N] (float32) = x (bf16 [M, K]) @ dequant(w).T on the AMX tiles, the weights
// read from wi (w's interleave_rows16 copy) and rounded to bf16 as they are used
void gemm_amx_rows16(torch::Tensor x, torch::Tensor w, torch::Tensor wi, int64_t type, torch::Tensor out, int64_t col0) {
  TORCH_CHECK(amx_rows16_type(type), "the AMX tile products take Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K copies and Q6_K's six-bit ones");
  if (check_amx_product(x, w, wi, type, out, col0))
    amx_rows16_run(x, wi, type, w.size(0), out.data_ptr<float>() + col0, nullptr, nullptr, out.size(1));
}

// out[:, col0:col0+N] (float32) = x (bf16 [M, K], K a multiple of 32) @ dequant(w).T on the
// bf16 units, a block type's weights unrounded: with wi (w's interleave_rows16 copy; Q4_0 /
// Q4_1 / Q8_0) the few-row kernel on it (quant_rows16_bf16.h), else (quant_bf16.h) the
// vdpbf16ps kernel over exact quants and float group scales, or (onednn) at::mm over [x, x] and
// the weights split into bf16 hi + lo (2K deep).
void gemm_bf16(torch::Tensor x, torch::Tensor w, int64_t type, torch::Tensor out, int64_t col0, bool onednn,
               c10::optional<torch::Tensor> wi) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(), "out: contiguous float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_packed(w, type, K);
  TORCH_CHECK(K % 32 == 0, "bf16 products: K must be a multiple of 32");
  TORCH_CHECK(bf16_products(), "bf16 products need the avx512_bf16 path (or above)");
  TORCH_CHECK(bf16_type(type), "bf16 products: block types only (Q4_0 ... Q6_K)");
  TORCH_CHECK(out.size(0) == M && col0 >= 0 && col0 + N <= out.size(1), "out shape");
  const bool interleaved = wi.has_value() && wi->defined();
  TORCH_CHECK(!interleaved || rows16_usable(wi, w, type, true),
              "wi: w's interleave_rows16 copy (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K, rows a multiple of 16)");
  TORCH_CHECK(!(interleaved && onednn), "wi and onednn exclude each other");
  if (M == 0 || N == 0) return;
  ++g_bf16_calls[interleaved ? 2 : onednn ? 1 : 0];
#if QK_X86
  const uint8_t* W = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1), ldo = out.size(1);
  if (interleaved) {
    gemm_rows16_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, N, type,
                     wi->data_ptr<uint8_t>(), out.data_ptr<float>() + col0, ldo);
    return;
  }
  if (onednn) {
    // tiles of ~2 MB of split bf16 weights in a reused buffer, each multiplied by the BLAS (oneDNN)
    const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(N, (int64_t(512) << 10) / K));
    thread_local torch::Tensor buf;
    if (!buf.defined() || buf.numel() < tile * 2 * K) buf = torch::empty({tile * 2 * K}, torch::kBFloat16);
    const torch::Tensor x2 = at::cat({x, x}, 1);
    for (int64_t t0 = 0; t0 < N; t0 += tile) {
      const int64_t t1 = std::min(N, t0 + tile);
      auto wb = buf.narrow(0, 0, (t1 - t0) * 2 * K).view({t1 - t0, 2 * K});
      uint16_t* o = reinterpret_cast<uint16_t*>(wb.data_ptr<at::BFloat16>());
      const uint8_t* Wt = W + t0 * rb;
      at::parallel_for(0, t1 - t0, std::max<int64_t>(1, 16384 / K), [&](int64_t r0, int64_t r1) {
        avx512_bf16::dequant_rows_bf16x2((int)type, Wt + r0 * rb, rb, K, 0, r1 - r0, o + r0 * 2 * K, 2 * K);
      });
      out.narrow(1, col0 + t0, t1 - t0).copy_(at::mm(x2, wb.t()));
    }
    return;
  }
  const uint16_t* X = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int gsz = avx512_bf16::quant_group_size((int)type);
  thread_local std::vector<float> xs;
  const float* XS = nullptr;
  if (avx512_bf16::quant_has_min((int)type)) {
    xs.resize(M * (K / gsz));
    float* p = xs.data();  // (thread_local: the pointer, not the name, goes to the team)
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K),
                     [&](int64_t r0, int64_t r1) { avx512_bf16::group_sums(X, K, gsz, r0, r1, p); });
    XS = p;
  }
  float* o = out.data_ptr<float>() + col0;
  constexpr int64_t NC = 16 * avx512_bf16::BF_G;
  at::parallel_for(0, (N + NC - 1) / NC, 1, [&](int64_t a, int64_t b) {
    avx512_bf16::gemm_bf16_cols((int)type, W, rb, K, X, XS, M, o, ldo, a * NC, std::min(N, b * NC));
  });
#endif
}

// bf16 <-> float32 for qlinear's few-row calls without ATen's dispatch (~3 us a call, 4 calls
// a layer at batch 1): the same bits as Tensor.to (exact widening; round to nearest even,
// NaN -> 0x7FC0 as c10::BFloat16)
static torch::Tensor widen_bf16(const torch::Tensor& x) {
  auto y = at::detail::empty_cpu(x.sizes(), at::kFloat, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt);
  const uint16_t* s = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  uint32_t* d = reinterpret_cast<uint32_t*>(y.data_ptr<float>());
  for (int64_t i = 0, n = x.numel(); i < n; ++i) d[i] = uint32_t(s[i]) << 16;
  return y;
}
static torch::Tensor narrow_bf16(const torch::Tensor& x) {
  auto y = at::detail::empty_cpu(x.sizes(), at::kBFloat16, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt);
  const uint32_t* s = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
  uint16_t* d = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  for (int64_t i = 0, n = x.numel(); i < n; ++i) {
    const uint32_t u = s[i];
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    d[i] = nan ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  return y;
}

// Whether a bf16 layer's product runs wholly on the AMX tiles: every segment has its copy and
// a type they take (takes: amx_rows16 or amx_exact), no int8 activations, the bias (if any) float32 of N
static bool amx_layer(const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types,
                      const std::vector<torch::Tensor>& wis, bool act_q8, const c10::optional<torch::Tensor>& bias, int64_t N,
                      bool (*takes)(int64_t)) {
  if (act_q8 || wis.size() != types.size()) return false;
  for (size_t i = 0; i < types.size(); ++i)
    if (wis[i].numel() == 0 || !takes(types[i]) || !rows16_usable(wis[i], ws[i], types[i], true)) return false;
  return !(bias.has_value() && bias->defined()) ||
         (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N);
}

// A whole QuantLinear forward in one call (the Python version cost ~20 us of tensor ops per
// layer): x [..., K] of any float dtype -> [..., N] of x's dtype; segments of packed rows
// (one per run of equal types) write their own output columns; optional float bias.
torch::Tensor qlinear(torch::Tensor x, const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types,
                      const std::vector<int64_t>& cols, int64_t N, c10::optional<torch::Tensor> bias,
                      bool act_q8, const std::vector<torch::Tensor>& wis) {
  TORCH_CHECK(ws.size() == types.size() && ws.size() == cols.size(), "segments");
  TORCH_CHECK(wis.empty() || wis.size() == ws.size(), "wis: one interleaved copy (or an empty tensor) per segment");
  const bool flat = x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous();  // the common case
  torch::Tensor x2 = x, xb;
  if (!flat) x2 = x.reshape({-1, x.size(-1)});
  const int64_t M = x2.size(0), K = x2.size(1);
  // a bfloat16 model's products on the bf16 units: many rows (see g_bf16_rows; a segment with
  // an interleaved copy from g_rows16_bf16_rows rows), and fewer on an interleaved copy
  const bool bf16 = x2.scalar_type() == at::kBFloat16 && K % 32 == 0 && bf16_products();
  if (bf16) xb = x2.contiguous();
  const bool exact = bf16 && M > 0 && M <= g_amx_exact_rows &&
                     amx_layer(ws, types, wis, act_q8, bias, N, amx_exact_rule(M));
  if (exact || (bf16 && M >= g_rows16_bf16_rows && amx_layer(ws, types, wis, act_q8, bias, N, amx_rows16))) {
    // every segment on the AMX tiles: bf16 out of the kernel, the bias added before rounding
    torch::Tensor o = at::detail::empty_cpu({M, N}, at::kBFloat16, c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt);
    uint16_t* h = reinterpret_cast<uint16_t*>(o.data_ptr<at::BFloat16>());
    const float* b = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
    for (size_t i = 0; i < ws.size(); ++i)
      (exact ? amx_exact_run : amx_rows16_run)(xb, wis[i], types[i], ws[i].size(0), nullptr, h + cols[i],
                                               b ? b + cols[i] : nullptr, N);
    auto sizes = x.sizes().vec();
    sizes.back() = N;
    return o.view(sizes);
  }
  torch::Tensor out = at::detail::empty_cpu({M, N}, at::kFloat, c10::nullopt, c10::nullopt, c10::nullopt,
                                            c10::nullopt);
  for (size_t i = 0; i < ws.size(); ++i) {
    const int64_t t = types[i];
    const bool rows16 = !wis.empty() && wis[i].numel() > 0;
    const bool int8 = act_q8 && act_q8_rows(t, M);
    if (bf16 && rows16 && M <= g_amx_exact_rows && !int8 && amx_exact_rule(M)(t)) {
      gemm_amx_exact(xb, ws[i], wis[i], t, out, cols[i]);
      continue;
    }
    if (bf16 && rows16 && M >= g_rows16_bf16_rows && !int8 && amx_rows16(t)) {
      gemm_amx_rows16(xb, ws[i], wis[i], t, out, cols[i]);
      continue;
    }
    if (bf16 && M >= (rows16 ? g_rows16_bf16_rows : g_bf16_rows) && bf16_type(t) && !int8) {
      const bool onednn = M >= (current_isa() >= ISA_AMX_BF16 ? g_amx_onednn_rows : g_bf16_onednn_rows);
      gemm_bf16(xb, ws[i], t, out, cols[i], onednn, c10::nullopt);
      continue;
    }
    if (bf16 && rows16 && rows16_bf16(t) && !int8) {
      gemm_bf16(xb, ws[i], t, out, cols[i], false, wis[i]);
      continue;
    }
    if (x2.scalar_type() == at::kBFloat16 && x2.is_contiguous()) x2 = widen_bf16(x2);
    else if (x2.scalar_type() != at::kFloat || !x2.is_contiguous()) x2 = x2.to(at::kFloat).contiguous();
    gemm(x2, ws[i], t, out, cols[i], act_q8, wis.empty() ? c10::optional<torch::Tensor>() : wis[i]);
  }
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  if (flat) return out;
  if (x.scalar_type() == at::kBFloat16) out = narrow_bf16(out);
  else if (x.scalar_type() != at::kFloat) out = out.to(x.scalar_type());
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return out.view(sizes);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "x @ packed.T (+ bias), all segments", py::arg("x"), py::arg("ws"), py::arg("types"),
        py::arg("cols"), py::arg("N"), py::arg("bias"), py::arg("act_q8") = false,
        py::arg("wis") = std::vector<torch::Tensor>());
  m.def("gemm", &gemm, "out[:, col0:col0+N] = x @ dequant(w).T (packed weights)", py::arg("x"), py::arg("w"),
        py::arg("type"), py::arg("out"), py::arg("col0"), py::arg("act_q8") = false, py::arg("wi") = py::none());
  m.def("act_q8_type", &act_q8_type, "whether act_q8 runs this type's products on int8 activations at every row count",
        py::arg("type"));
  m.def("act_q8_rows", &act_q8_rows, "whether act_q8 runs this type's product over M rows on int8 activations",
        py::arg("type"), py::arg("M"));
  m.def("set_int8_rows", &set_int8_rows, "act_q8: a K-quant's int8 activations from this many rows (-1: the ISA's rule)",
        py::arg("type"), py::arg("m"));
  m.def("rows16_copy_size", &rows16_copy_size, "bytes of interleave_rows16's copy (0: none)", py::arg("w"),
        py::arg("type"), py::arg("K"));
  m.def("interleave_rows16", &interleave_rows16, "packed rows -> the row-interleaved copy the few-row kernels read",
        py::arg("w"), py::arg("type"), py::arg("K"));
  m.def("dequant", &dequant, "packed rows -> float32", py::arg("w"), py::arg("type"), py::arg("K"),
        py::arg("rows") = py::none());
  m.def("gemm_bf16", &gemm_bf16, "out[:, col0:col0+N] = x_bf16 @ dequant(w).T on the bf16 units (vdpbf16ps, or oneDNN)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("out"), py::arg("col0") = 0, py::arg("onednn") = false,
        py::arg("wi") = py::none());
  m.def("amx_rows16", &amx_rows16, "whether a bf16 model's many-row products of this type run on the AMX tiles over its copy",
        py::arg("type"));
  m.def("set_amx_rows16", &set_amx_rows16, "the AMX tile products over the copies on (default) or off");
  m.def("gemm_amx_exact", &gemm_amx_exact, "out[:, col0:col0+N] = x_bf16 @ dequant(w).T, 1-16 rows, on the AMX tiles, exact quants",
        py::arg("x"), py::arg("w"), py::arg("wi"), py::arg("type"), py::arg("out"), py::arg("col0") = 0);
  m.def("set_amx_exact_rows", &set_amx_exact_rows, "the exact AMX few-row kernel for 1 .. m rows (0: off); returns the previous m",
        py::arg("m"));
  m.def("amx_rows16_chunk", &amx_rows16_chunk, "rows the AMX tile kernel takes at a time at this K (more: its weights dequantized again)");
  m.def("gemm_amx_rows16", &gemm_amx_rows16, "out[:, col0:col0+N] = x_bf16 @ dequant(w).T on the AMX tiles, read from wi",
        py::arg("x"), py::arg("w"), py::arg("wi"), py::arg("type"), py::arg("out"), py::arg("col0") = 0);
  m.def("set_q6k_six_bits", &set_q6k_six_bits, "Q6_K's interleaved copies six bits a quant (AVX512-VBMI; else a byte)");
  m.def("q6k_six_bits", &q6k_six_bits, "whether Q6_K's interleaved copies keep six bits a quant");
  m.def("set_rows16_bf16", &set_rows16_bf16, "bf16 few-row products on interleaved copies on the bf16 units (on), the float kernel (off), the rule (None)",
        py::arg("on"));
  m.def("set_bf16_rows", &set_bf16_rows, py::arg("m"), py::arg("rows16") = false);
  m.def("rows16_calls", &rows16_calls, "float few-row products on interleaved copies so far");
  m.def("rows16_q8_calls", &rows16_q8_calls, "act_q8 few-row products on interleaved copies so far");
  m.def("set_rows16_q8_rows", &set_rows16_q8_rows, "act_q8 on a type's interleaved copy below this many rows",
        py::arg("type"), py::arg("m"));
  m.def("rows16_q8_type", &rows16_q8_type, "whether act_q8's few-row products of this type read its copy (ISA now)");
  m.def("rows16_q8_every_row", &rows16_q8_every_row, "whether act_q8 runs every product of this type on its copy (ISA now)");
  m.def("bf16_calls", &bf16_calls, "bf16 products so far: [vdpbf16ps kernel, oneDNN, interleaved copies' bf16 kernel, AMX tiles over the copies, AMX exact few-row kernel]");
  m.def("set_bf16_onednn_rows", &set_bf16_onednn_rows, py::arg("m"), py::arg("amx") = false);
  m.def("set_isa", &set_isa);
  m.def("request_amx_permission", &request_amx_permission,
        "ask Linux for the AMX tile state (0 granted, else the errno); simulate_refusal: tests",
        py::arg("simulate_refusal") = false, py::arg("again") = false);
  m.def("amx_permission", &amx_permission, "-1 not asked yet, 0 granted, else the errno of the refusal");
  m.def("amx_in_cpu", &amx_in_cpu, "CPUID has AMX tiles (bf16) and the OS enables their state");
  m.def("get_isa", &get_isa);
  m.def("set_avx_vnni", &set_avx_vnni, "the AVX2 level's act_q8 products on AVX-VNNI (needs the CPU's); returns the previous");
  m.def("avx_vnni_in_use", &avx_vnni_in_use, "whether act_q8 products run the AVX-VNNI kernels now (the AVX2 level)");
  m.def("avx_vnni_in_cpu", &avx_vnni_in_cpu, "whether the CPU has AVX-VNNI (and AVX2)");
  m.def("isa_available", &isa_available);
  m.def("has_many_rows_kernel", &many_rows_kernel, "whether many-row products use the blocked kernel (ISA now set)");
  m.def("set_prefill_rows", &set_prefill_rows);
  m.def("set_q8_many_rows", &set_q8_many_rows);
  m.def("set_float_blas_rows", &set_float_blas_rows);
  m.def("quantize_act_q8", &quantize_act_q8, "x -> (int8 quants, block scales, scale * sum(quants))");
}
