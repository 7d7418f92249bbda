/* bf16 projections on AVX512-BF16: C[m, n] = A[m, k] @ W[n, k]^T (+ bias), fp32 accumulation.
 *
 * Why our own GEMM: on a CPU with AVX512-BF16 and no AMX, this kernel ran SmolLM2's 121
 * projections 1.06-1.6x as fast as oneDNN's bf16 GEMM on prepacked weights, at every row count
 * from 1 to 2,048, on the project's 2-core machine (benchmarks/cpu_gemm.py, benchmarks/README.md).
 * Where the CPU has AMX, tile instructions are several times faster and gemm_amx.c is used
 * instead (kernels/linear.py decides).
 *
 * Layout. The weight is packed once into panels of 16 output columns (one zmm of fp32 sums);
 * inside a panel, for each pair of k, the 16 columns' two weights sit side by side:
 *   packed[panel][k / 2][column][k % 2]
 * which is the operand order of vdpbf16ps (acc[i] += a[2i] * b[2i] + a[2i+1] * b[2i+1]).
 * A row of A contributes one 32-bit broadcast (its two bf16 at k, k + 1) per pair.
 *
 * Micro-kernel: ROWS_PER_TILE rows x PANELS_PER_TILE panels (4 x 96 columns), 24 accumulators
 * in registers; per k pair, 6 weight loads and 4 broadcasts feed 24 vdpbf16ps. The weight
 * tile (96 columns x k) stays in L2 while all row tiles of A pass over it, so each weight is
 * read from memory once per call; each thread takes a contiguous range of column tiles.
 *
 * Prefetch. The first row tile over a column tile would otherwise wait on DRAM while the later
 * ones compute from L2: at 32-64 rows (decode batches) that serializes the weight stream and
 * the arithmetic. So while a thread computes one column tile it requests the next tile's
 * weights into L2, a few lines per k pair, spread evenly over all its row tiles: 17 -> 13 ms
 * for SmolLM2's 121 projections at 32 rows here (and not below 5 rows, see gemm_bf16).
 *
 * Invariant (RULES G18, batch invariance): an output element is the sum over k pairs in
 * increasing order, in one fp32 register, plus the bias, rounded once to bf16 (ties to even).
 * That order depends on nothing but k, so a row's result is the same bit for bit whatever
 * rows share the call and whatever thread computes it.
 *
 * SiLU epilogue (gemm_bf16_silu_mul). For an MLP's gate/up projection the weight is packed with
 * gate and up panels alternating (gate columns 0-15, up columns 0-15, gate 16-31, ...), so a tile
 * holds both halves of 48 output columns and writes silu(gate) * up straight from its accumulators:
 * no [m, 2 * inter] intermediate, no separate pass over it, and the SiLU runs on both threads.
 * It rounds exactly where fused_ops.c's silu_and_mul_bf16 does on the GEMM's rounded output and
 * computes the same silu_of (silu.h). The two agree to within one bf16 step, and bit for bit in
 * all but ~4 in 100,000 elements: GCC vectorizes the step's division as a reciprocal estimate
 * refined by a Newton step (-ffast-math), and this one as an exact division.
 *
 * Requires k even and n a multiple of 16 (32 with the SiLU epilogue; kernels/linear.py checks;
 * other shapes use oneDNN).
 * Built with -march=native: on a CPU without AVX512-BF16 only gemm_bf16_supported() exists.
 */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
#include <string.h>

#define LANES 16
#define ROWS_PER_TILE 4
#define PANELS_PER_TILE 6

int gemm_bf16_supported(void)
{
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
#include "silu_store.h"

/* w: [n, k] row-major bf16 bits; packed: n * k elements. */
void gemm_bf16_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k)
{
    const int64_t pairs = k / 2;
#pragma omp parallel for schedule(static)
    for (int64_t panel = 0; panel < n / LANES; ++panel)
        for (int64_t pair = 0; pair < pairs; ++pair)
            for (int column = 0; column < LANES; ++column) {
                const uint16_t *src = w + (panel * LANES + column) * k + 2 * pair;
                uint16_t *dst = packed + ((panel * pairs + pair) * LANES + column) * 2;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

/* What a tile requests into L2 as it goes: `lines_per_pair` cache lines per k pair from `start`,
 * up to `bytes` (the part of the next column tile's weights that is this row tile's share). */
typedef struct {
    const char *start;
    int64_t bytes;
    int lines_per_pair;
} Ahead;

/* One tile: `rows` rows of A x `panels` panels; both are constants after inlining, so the
 * loops unroll and the accumulators live in registers. With `silu`, panels come in (gate, up)
 * pairs and the tile writes panels / 2 panels' width of silu(gate) * up. */
static inline __attribute__((always_inline)) void
tile(const int rows, const int panels, const int silu, const uint16_t *restrict a, int64_t lda,
     const uint16_t *restrict b, int64_t panel_stride, int64_t pairs, const float *restrict bias,
     uint16_t *restrict c, int64_t ldc, const Ahead ahead)
{
    int64_t requested = 0;
    __m512 acc[ROWS_PER_TILE][PANELS_PER_TILE];
#pragma GCC unroll 4
    for (int r = 0; r < rows; ++r)
#pragma GCC unroll 6
        for (int p = 0; p < panels; ++p)
            acc[r][p] = _mm512_setzero_ps();
    for (int64_t pair = 0; pair < pairs; ++pair) {
        __m512bh weights[PANELS_PER_TILE];
#pragma GCC unroll 6
        for (int p = 0; p < panels; ++p)
            weights[p] = (__m512bh)_mm512_loadu_si512(b + p * panel_stride + pair * 2 * LANES);
        for (int line = 0; line < ahead.lines_per_pair && requested < ahead.bytes; ++line, requested += 64)
            _mm_prefetch(ahead.start + requested, _MM_HINT_T1);
#pragma GCC unroll 4
        for (int r = 0; r < rows; ++r) {
            int32_t two;
            memcpy(&two, a + r * lda + 2 * pair, sizeof two);
            const __m512bh broadcast = (__m512bh)_mm512_set1_epi32(two);
#pragma GCC unroll 6
            for (int p = 0; p < panels; ++p)
                acc[r][p] = _mm512_dpbf16_ps(acc[r][p], broadcast, weights[p]);
        }
    }
    if (silu) {
#pragma GCC unroll 4
        for (int r = 0; r < rows; ++r)
#pragma GCC unroll 3
            for (int p = 0; p < panels; p += 2)
                silu_mul_store(acc[r][p], acc[r][p + 1], c + r * ldc + p / 2 * LANES);
        return;
    }
#pragma GCC unroll 4
    for (int r = 0; r < rows; ++r)
#pragma GCC unroll 6
        for (int p = 0; p < panels; ++p) {
            const __m512 sum = bias ? _mm512_add_ps(acc[r][p], _mm512_loadu_ps(bias + p * LANES)) : acc[r][p];
            _mm256_storeu_si256((__m256i *)(c + r * ldc + p * LANES), (__m256i)_mm512_cvtneps_pbh(sum));
        }
}

#define TILE(R, P, S) tile((R), (P), (S), a, lda, b, panel_stride, pairs, bias, c, ldc, ahead)
#define BY_ROWS(P, S)                 \
    switch (rows) {                   \
    case 1: TILE(1, P, S); break;     \
    case 2: TILE(2, P, S); break;     \
    case 3: TILE(3, P, S); break;     \
    default: TILE(4, P, S); break;    \
    }

/* Every (rows, panels) shape a call can end with, each its own unrolled copy of the tile; with
 * `silu` the panel count is even. */
static void tile_any(int rows, int panels, int silu, const uint16_t *a, int64_t lda, const uint16_t *b,
                     int64_t panel_stride, int64_t pairs, const float *bias, uint16_t *c, int64_t ldc,
                     const Ahead ahead)
{
    if (silu) {
        switch (panels) {
        case 2: BY_ROWS(2, 1); break;
        case 4: BY_ROWS(4, 1); break;
        default: BY_ROWS(6, 1); break;
        }
        return;
    }
    switch (panels) {
    case 1: BY_ROWS(1, 0); break;
    case 2: BY_ROWS(2, 0); break;
    case 3: BY_ROWS(3, 0); break;
    case 4: BY_ROWS(4, 0); break;
    case 5: BY_ROWS(5, 0); break;
    default: BY_ROWS(6, 0); break;
    }
}

/* The GEMM for both entry points; with `silu`, c is [m, n / 2] (see the SiLU epilogue above). */
static void gemm(const uint16_t *a, int64_t m, int64_t k, const uint16_t *packed, int64_t n, const float *bias,
                 int silu, uint16_t *c)
{
    const int64_t ldc = silu ? n / 2 : n;
    const int64_t pairs = k / 2, num_panels = n / LANES, panel_stride = pairs * 2 * LANES;
    const int64_t num_tiles = (num_panels + PANELS_PER_TILE - 1) / PANELS_PER_TILE;
    const int64_t row_tiles = (m + ROWS_PER_TILE - 1) / ROWS_PER_TILE;
#pragma omp parallel
    {
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first_tile = num_tiles * me / threads, end_tile = num_tiles * (me + 1) / threads;
        for (int64_t t = first_tile; t < end_tile; ++t) {
            const int64_t first_panel = t * PANELS_PER_TILE, left = num_panels - first_panel;
            const int panels = (int)(left < PANELS_PER_TILE ? left : PANELS_PER_TILE);
            const float *tile_bias = bias ? bias + first_panel * LANES : NULL;
            /* One row tile streams its weights from DRAM anyway; requesting the next tile beside it
             * only competes (1-4 rows ran 10-15 % slower with it). */
            const int64_t after = left - panels;
            const int64_t next_panels =
                t + 1 < end_tile && row_tiles > 1 ? (after < PANELS_PER_TILE ? after : PANELS_PER_TILE) : 0;
            const int64_t next_bytes = next_panels * panel_stride * (int64_t)sizeof(uint16_t);
            const int lines_per_pair = (int)((next_bytes / 64 + row_tiles * pairs - 1) / (row_tiles * pairs));
            const int64_t share = (int64_t)lines_per_pair * pairs * 64; /* bytes per row tile */
            for (int64_t row = 0; row < m; row += ROWS_PER_TILE) {
                const int rows = (int)(m - row < ROWS_PER_TILE ? m - row : ROWS_PER_TILE);
                const int64_t done = row / ROWS_PER_TILE * share;
                const Ahead ahead = {(const char *)(packed + (first_panel + panels) * panel_stride) + done,
                                     next_bytes - done, lines_per_pair};
                const int64_t first_column = silu ? first_panel / 2 * LANES : first_panel * LANES;
                tile_any(rows, panels, silu, a + row * k, k, packed + first_panel * panel_stride, panel_stride,
                         pairs, tile_bias, c + row * ldc + first_column, ldc, ahead);
            }
        }
    }
}

/* a: [m, k] bf16 rows of stride k; packed: from gemm_bf16_pack; bias: n fp32 or NULL; c: [m, n] bf16. */
void gemm_bf16(const uint16_t *a, int64_t m, int64_t k, const uint16_t *packed, int64_t n, const float *bias,
               uint16_t *c)
{
    gemm(a, m, k, packed, n, bias, 0, c);
}

/* c: [m, n / 2] = silu(gate) * up, where packed holds [n, k] with gate and up panels alternating
 * (n a multiple of 32) and no bias. */
void gemm_bf16_silu_mul(const uint16_t *a, int64_t m, int64_t k, const uint16_t *packed, int64_t n, uint16_t *c)
{
    gemm(a, m, k, packed, n, NULL, 1, c);
}

#endif
