/* bf16 projections on AMX: C[m, n] = A[m, k] @ W[n, k]^T (+ bias), fp32 accumulation.
 *
 * Why our own GEMM where oneDNN has AMX kernels: oneDNN picks its kernel, and with it the
 * rounding of the sum over k, by the row count, so a row's bits changed with the batch it came
 * in (RULES G18, kernels/linear.py). Running oneDNN in calls of exactly 64 rows restores batch
 * invariance but pays for 64 rows at every decode step: at one row, 2.3x the time of a plain
 * weight stream. Here a row's bits depend on nothing but the row, by construction, and a call
 * costs what its rows need (benchmarks/cpu_gemm.py, benchmarks/README.md).
 *
 * AMX in brief: eight tile registers of up to 16 rows x 64 bytes; TDPBF16PS C += A . B takes A as
 * 16 rows x 32 bf16 (k), B as 16 rows x 16 pairs (k pair, column), and adds to C (16 x 16 fp32)
 *   C[i][j] += A[i][2p] * B[p][j][0] + A[i][2p + 1] * B[p][j][1]   for p = 0 .. 15, in order.
 *
 * Layout. The weight is packed once into B tiles: for each panel of 16 output columns and each
 * step of 32 k, one 1 KB tile, packed[panel][k step][k pair][column][2], the steps of a panel
 * contiguous, so a panel streams from memory in one run. A is read in place (k a multiple of 32).
 *
 * SiLU epilogue (gemm_amx_silu_mul): for an MLP's gate/up projection the weight's panels alternate
 * gate, up (as gemm_bf16.c packs them), so each block's two panels are a (gate, up) pair and it
 * writes silu(gate) * up (silu_store.h, the same arithmetic as gemm_bf16.c's epilogue).
 *
 * Micro-kernel: up to 2 row tiles x 2 column panels (32 x 32 outputs) in four C tiles, two A
 * tiles and two B tiles; each k step is 4 tile loads and 4 TDPBF16PS. Each thread takes a
 * contiguous range of column-panel pairs; within it, rows go in chunks of ROW_CHUNK, so a
 * chunk of A stays in L2 while the thread's panels pass over it.
 *
 * Invariant (G18): an output element is the sum over the k steps in increasing order in one fp32
 * C tile, each step a TDPBF16PS whose result for element (i, j) depends on row i of A and
 * column j of W alone, plus the bias, rounded once to bf16 (ties to even). The number of rows
 * in a tile, the rows beside it and the thread change nothing. (TDPBF16PS flushes denormal
 * inputs and outputs to zero: a difference from F.linear far below bf16's resolution.)
 *
 * Linux hands out the AMX register state on request only (arch_prctl ARCH_REQ_XCOMP_PERM, once
 * per process); gemm_amx_supported asks, and reports 0 where the build or the kernel lacks AMX. */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <omp.h>

#include "amx_tiles.h"

#include "silu_store.h"
#endif

enum { TILE_ROWS = 16, TILE_COLUMNS = 16, K_STEP = 32, ROW_CHUNK = 256 };
int gemm_amx_supported(void)
{
#ifdef HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

/* w [n, k] bf16 (n a multiple of 16, k of 32) into packed (n * k elements), layout above. */
void gemm_amx_pack(const uint16_t *w, uint16_t *packed, int64_t n, int64_t k)
{
    const int64_t steps = k / K_STEP;
    for (int64_t panel = 0; panel < n / TILE_COLUMNS; panel++)
        for (int64_t step = 0; step < steps; step++) {
            uint16_t *tile = packed + (panel * steps + step) * TILE_COLUMNS * K_STEP;
            for (int pair = 0; pair < K_STEP / 2; pair++)
                for (int column = 0; column < TILE_COLUMNS; column++)
                    for (int half = 0; half < 2; half++)
                        tile[(pair * TILE_COLUMNS + column) * 2 + half] =
                            w[(panel * TILE_COLUMNS + column) * k + step * K_STEP + 2 * pair + half];
        }
}

#ifdef HAVE_AMX
/* The tile configuration: tiles 0-3 are C, 4-5 A, 6-7 B; rows0 for the first row tile's C and A
 * tiles, rows1 for the second's. */
static void configure(int rows0, int rows1)
{
    AmxConfig config = amx_full_tiles();
    const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, K_STEP / 2, K_STEP / 2};
    for (int t = 0; t < 8; t++)
        config.rows[t] = (uint8_t)(rows[t] > 0 ? rows[t] : 1);
    amx_load_config(&config);
}

/* rows[r] of the 32 x 32 block in `sums` (fp32, row stride 32) + bias, rounded to bf16, into c;
 * with `silu` the two panels are a (gate, up) pair and c gets silu(gate) * up, 16 columns. */
static void store_block(const float *sums, int rows, int panels, int silu, const float *bias, uint16_t *c,
                        int64_t ldc)
{
    for (int r = 0; r < rows; r++)
        if (silu)
            silu_mul_store(_mm512_loadu_ps(sums + r * 32), _mm512_loadu_ps(sums + r * 32 + TILE_COLUMNS), c + r * ldc);
        else
            for (int p = 0; p < panels; p++) {
                __m512 value = _mm512_loadu_ps(sums + r * 32 + p * TILE_COLUMNS);
                if (bias)
                    value = _mm512_add_ps(value, _mm512_loadu_ps(bias + p * TILE_COLUMNS));
                _mm256_storeu_si256((__m256i *)(c + r * ldc + p * TILE_COLUMNS), (__m256i)_mm512_cvtneps_pbh(value));
            }
}

/* One block: `rows` rows of A (1-32) x `panels` panels (1-2) from panel b0 (b1 = the next). */
static void block(const uint16_t *a, int64_t k, int rows, int panels, int silu, const uint16_t *b0,
                  const uint16_t *b1, const float *bias, uint16_t *c, int64_t ldc)
{
    const int64_t steps = k / K_STEP, lda = k * 2, tile_elements = TILE_COLUMNS * K_STEP;
    const uint16_t *a1 = a + TILE_ROWS * k;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < steps; step++) {
        _tile_loadd(4, a + step * K_STEP, lda);
        _tile_loadd(6, b0 + step * tile_elements, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (panels > 1) {
            _tile_loadd(7, b1 + step * tile_elements, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (rows > TILE_ROWS) {
            _tile_loadd(5, a1 + step * K_STEP, lda);
            _tile_dpbf16ps(2, 5, 6);
            if (panels > 1)
                _tile_dpbf16ps(3, 5, 7);
        }
    }
    float sums[32 * 32];
    _tile_stored(0, sums, 128);
    _tile_stored(1, sums + TILE_COLUMNS, 128);
    _tile_stored(2, sums + TILE_ROWS * 32, 128);
    _tile_stored(3, sums + TILE_ROWS * 32 + TILE_COLUMNS, 128);
    store_block(sums, rows, panels, silu, bias, c, ldc);
}
#endif

#ifdef HAVE_AMX
/* gemm_amx's body; with `silu`, panels come in (gate, up) pairs and c is [m, n / 2]. */
static void gemm(const uint16_t *a, int64_t m, int64_t k, const uint16_t *packed, int64_t n, const float *bias,
                 int silu, uint16_t *c)
{
    const int64_t panel_elements = k * TILE_COLUMNS, panels = n / TILE_COLUMNS, pairs = (panels + 1) / 2;
    const int64_t ldc = silu ? n / 2 : n;
#pragma omp parallel
    {
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t first = pairs * thread / threads, last = pairs * (thread + 1) / threads;
        int rows0 = -1, rows1 = -1;
        for (int64_t chunk = 0; chunk < m; chunk += ROW_CHUNK) {
            const int64_t chunk_end = chunk + ROW_CHUNK < m ? chunk + ROW_CHUNK : m;
            for (int64_t pair = first; pair < last; pair++) {
                const int64_t panel = 2 * pair;
                const int count = panel + 1 < panels ? 2 : 1;
                for (int64_t row = chunk; row < chunk_end; row += 2 * TILE_ROWS) {
                    const int rows = chunk_end - row < 2 * TILE_ROWS ? (int)(chunk_end - row) : 2 * TILE_ROWS;
                    const int want0 = rows < TILE_ROWS ? rows : TILE_ROWS, want1 = rows - want0;
                    if (want0 != rows0 || want1 != rows1) {
                        configure(want0, want1);
                        rows0 = want0;
                        rows1 = want1;
                    }
                    block(a + row * k, k, rows, count, silu, packed + panel * panel_elements,
                          packed + (panel + count - 1) * panel_elements, bias ? bias + panel * TILE_COLUMNS : NULL,
                          c + row * ldc + (silu ? pair : panel) * TILE_COLUMNS, ldc);
                }
            }
        }
        if (rows0 >= 0)
            _tile_release();
    }
}
#endif

/* c [m, n] bf16 = a [m, k] @ w^T (+ bias, fp32 [n] or NULL); packed by gemm_amx_pack. */
void gemm_amx(const uint16_t *a, int64_t m, int64_t k, const uint16_t *packed, int64_t n, const float *bias,
              uint16_t *c)
{
#ifdef HAVE_AMX
    gemm(a, m, k, packed, n, bias, 0, c);
#else
    (void)a, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)c;
#endif
}

/* c [m, n / 2] = silu(gate) * up, where packed holds [n, k] with gate and up panels alternating
 * (n a multiple of 32; kernels/native_gemm.alternate_panels) and no bias. */
void gemm_amx_silu_mul(const uint16_t *a, int64_t m, int64_t k, const uint16_t *packed, int64_t n, uint16_t *c)
{
#ifdef HAVE_AMX
    gemm(a, m, k, packed, n, NULL, 1, c);
#else
    (void)a, (void)m, (void)k, (void)packed, (void)n, (void)c;
#endif
}
