/* Paged attention on the CPU, read straight from the block-paged KV cache.
 *
 * The torch reference gathers a sequence's blocks into a contiguous copy and then
 * runs SDPA over it, so decode (memory-bound) reads every key and value three
 * times. These kernels read each once, in place. Two of them, same arguments:
 *   paged_attention  (paged_attention_kv.h)     one query row (all heads) at a time;
 *   chunk_attention  (paged_attention_chunk.h)  a tile of query vectors of one KV head at
 *                    a time, online softmax; the backend runs every row through it where it
 *                    takes the shape (kernels/attention/cpu_paged.py), the row kernel elsewhere.
 *
 * Layouts (contiguous; the caches float32, or bfloat16 for the *_bf16 entry points and float16
 * for the *_f16 ones, whose queries and outputs stay float32, and for chunk_attention_bf16q and
 * _bf16qf, whose queries are bfloat16 (two forms with the same bits, built with AVX512-BF16 and
 * AVX-512; see the end of this file; their value pass multiplies by the softmax weights rounded
 * to bfloat16, paged_attention_values.h): every product accumulates in float32):
 *   q                 [num_tokens, num_heads, head_dim], rows q_row_stride apart
 *   out               [num_tokens, num_heads, head_dim]
 *   k_cache           [num_blocks, num_kv_heads, head_dim, block_size]   keys transposed
 *   v_cache           [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, max_blocks_per_seq]      int32
 *   query_start_loc   [num_seqs + 1]                      int32
 *   seq_lens          [num_seqs]                          int32
 *   seq_ids           [num_selected]                      int32, the sequences to compute
 *
 * Sequence i owns query rows query_start_loc[i] .. query_start_loc[i+1]-1; the last
 * of them sits at position seq_lens[i] - 1, and row r attends to positions 0 .. its
 * own (causal). Query head h reads KV head h / (num_heads / num_kv_heads) (GQA).
 *
 * Why keys are stored transposed: with a block's keys of one head as a
 * [head_dim, block_size] tile, the scores of all block_size positions are one
 * vector accumulated over head_dim (acc += q[d] * keys[d][0..15]), with no
 * horizontal sum per position. Values stay row-major: the output is a sum of
 * value rows, which vectorizes over head_dim as it is.
 *
 * One work item is one query row (all heads), so a row's result never depends on
 * what else is in the batch (batch invariance), and its arithmetic order is fixed.
 *
 * The AMX form (paged_attention_amx.h, chunk_attention_bf16amx). TDPBF16PS does not round like a
 * chain of VDPBF16PS: over 512,000 random 16-pair dot products on this project's AMX Xeon,
 * VDPBF16PS equalled float32 FMAs in Intel's documented order (odd element first) every time,
 * while TDPBF16PS differed from that in 38 % of them (it keeps more precision inside). So an AMX
 * path only for prompt rows, with decode rows on vdpbf16ps, would change a row's bits with how it
 * was scheduled; the AMX form runs every row, decode rows too, and a TDPBF16PS element depends on
 * its own row and column alone. Its products are transposed (the item's vectors are the tiles'
 * columns, positions or dimensions the rows) so that a decode row still fills the tiles' rows, and
 * its cache layout is the vector forms' swapped, so that tiles load straight from the cache.
 *
 * Built with -ffast-math so the loops and exp vectorize; that is safe here because
 * only valid positions reach the softmax (no -inf masking) and every softmax
 * subtracts its row maximum first.
 */
#define _GNU_SOURCE /* syscall() under -std=c11, for the AMX form's permission request */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GCC/Clang vector extensions: 16 floats, compiled to whatever vector ISA -march
 * gives (one AVX-512 register, two AVX2 ones). memcpy = an unaligned load/store. */
typedef float vec16 __attribute__((vector_size(64)));
static inline vec16 load16(const float *p)
{
    vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store16(float *p, vec16 v) { memcpy(p, &v, sizeof v); }

typedef struct {
    int num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int whole_blocks_ahead; /* chunk kernel, per work item: see prefetch_blocks (0 = off) */
} Shape;

/* Work items are numbered sequence after sequence; starts[i] is the first item of selected
 * sequence i (starts[count] = the total). The i whose range holds `item`, by binary search. */
static inline int owner_of(const int64_t *starts, int count, int64_t item)
{
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (starts[mid] <= item)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* Blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at
 * every block boundary; the next block is requested while this one is used. */
static inline void prefetch_range(const void *start, int64_t num_bytes)
{
    for (int64_t i = 0; i < num_bytes; i += 64)
        __builtin_prefetch((const char *)start + i, 0, 2); /* into L2: L1 is too small to hold a block ahead */
}

/* bfloat16 = the high 16 bits of a float32: widening is a shift. With AVX-512 that is one
 * widening load and one shift; the generic form below is what other CPUs get, and where the
 * compiler tunes for 256-bit vectors (GCC 12's -march=native on Zen 4/5 tunes for Zen 3) it
 * splits into six instructions, four on the one shuffle port: that made the bf16 chunk kernel
 * no faster than the float32 one on warm caches. */
#ifdef __AVX512F__
#include <immintrin.h>
static inline vec16 load16_bf16(const uint16_t *p)
{
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (vec16)_mm512_castsi512_ps(wide);
}
#else
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
static inline vec16 load16_bf16(const uint16_t *p)
{
    u16x16 bits;
    memcpy(&bits, p, sizeof bits);
    const u32x16 wide = __builtin_convertvector(bits, u32x16) << 16;
    vec16 v;
    memcpy(&v, &wide, sizeof v);
    return v;
}
#endif
static inline float bf16_to_float(uint16_t x)
{
    const uint32_t wide = (uint32_t)x << 16;
    float f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

/* float16: widening is exact, by the conversion instruction (vcvtph2ps, AVX-512F) or the
 * compiler's _Float16 (GCC 12+ on x86-64 and aarch64; __FLT16_MAX__ says it has one). Where the
 * compiler has no _Float16 the float16 entry points are not built: paged_attention_f16_available
 * says so and the backend registry takes the torch reference (kernels/attention/registry.py). */
#ifdef __FLT16_MAX__
#define HAVE_FLOAT16 1
#ifdef __AVX512F__
static inline vec16 load16_f16(const uint16_t *p)
{
    return (vec16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#else
typedef _Float16 f16x16 __attribute__((vector_size(32)));
static inline vec16 load16_f16(const uint16_t *p)
{
    f16x16 halves;
    memcpy(&halves, p, sizeof halves);
    return __builtin_convertvector(halves, vec16);
}
#endif
static inline float f16_to_float(uint16_t x)
{
    _Float16 half;
    memcpy(&half, &x, sizeof half);
    return (float)half;
}
int paged_attention_f16_available(void) { return 1; }
#else
int paged_attention_f16_available(void) { return 0; }
#endif

/* float32 caches: paged_attention, chunk_attention, store_kv. */
#define KV_T float
#define KV_LOAD16(p) load16(p)
#define KV_TO_F(x) (x)
#define KV_NAME(n) n
#define Q_T float
#define Q_TO_F(x) (x)
#define QUERY_PAIRS 0
#include "paged_attention_kv.h"
#include "paged_attention_chunk.h"
#undef KV_T
#undef KV_LOAD16
#undef KV_TO_F
#undef KV_NAME

/* float16 caches: paged_attention_f16, chunk_attention_f16, store_kv_f16 (q and out stay float32). */
#define KV_T uint16_t
#ifdef HAVE_FLOAT16
#define KV_LOAD16(p) load16_f16(p)
#define KV_TO_F(x) f16_to_float(x)
#define KV_NAME(n) n##_f16
#include "paged_attention_kv.h"
#include "paged_attention_chunk.h"
#undef KV_LOAD16
#undef KV_TO_F
#undef KV_NAME
#endif

/* bfloat16 caches: paged_attention_bf16, chunk_attention_bf16, store_kv_bf16 (q and out stay float32). */
#define KV_LOAD16(p) load16_bf16(p)
#define KV_TO_F(x) bf16_to_float(x)
#define KV_NAME(n) n##_bf16
#include "paged_attention_kv.h"
#include "paged_attention_chunk.h"
#undef KV_NAME
#undef QUERY_PAIRS

/* bfloat16 queries on bfloat16 caches (the backend takes one of these for a bfloat16 model):
 *   chunk_attention_bf16q   scores and values with vdpbf16ps (paged_attention_scores.h,
 *                           paged_attention_values.h); built with AVX512-BF16 only;
 *   chunk_attention_bf16qf  the same bits from float32 multiply-adds; built with AVX-512.
 * The same arguments as chunk_attention, but q is bfloat16. Both run with denormals flushed to
 * zero (DAZ/FTZ, as vdpbf16ps always does), so they agree for every input. */
#undef Q_T
#undef Q_TO_F
#define Q_T uint16_t
#define Q_TO_F(x) bf16_to_float(x)
#if defined(__AVX512BF16__)
#define KV_NAME(n) n##_bf16q
#define QUERY_PAIRS 1
#include "paged_attention_chunk.h"
#undef KV_NAME
#undef QUERY_PAIRS
int chunk_attention_bf16q_available(void) { return 1; }
#else
int chunk_attention_bf16q_available(void) { return 0; }
#endif
#if defined(__AVX512F__)
#define KV_NAME(n) n##_bf16qf
#define QUERY_PAIRS 2
#include "paged_attention_chunk.h"
int chunk_attention_bf16qf_available(void) { return 1; }
#else
int chunk_attention_bf16qf_available(void) { return 0; }
#endif

#undef KV_NAME
#undef QUERY_PAIRS

/* chunk_attention_bf16amx: bfloat16 queries on a bfloat16 cache on AMX tiles
 * (paged_attention_amx.h). Not the bits of the two forms above: TDPBF16PS rounds its sums its
 * own way. The backend runs one form for every row, so a row's bits still depend on the row
 * alone. _available asks Linux for the AMX state (once per process suffices); _supported adds
 * the form's own condition, head_dim a whole number of 32-dimension steps. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KV_NAME(n) n##_bf16amx
#define QUERY_PAIRS 3
#include "paged_attention_chunk.h"
int chunk_attention_bf16amx_available(void) { return amx_permitted(); }
#else
int chunk_attention_bf16amx_available(void) { return 0; }
#endif
int chunk_attention_bf16amx_supported(int head_dim, int block_size)
{
    return chunk_attention_supported(head_dim, block_size) && head_dim % 32 == 0;
}

#include "dot_product_speed.h" /* bf16_dot_product_speed: which of the two is faster here */
