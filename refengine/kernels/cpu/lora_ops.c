/* Multi-LoRA deltas of one fused projection, float32, on the CPU: for every adapter token t
 * (row token_indices[i] of x and y, in slot token_slots[i]),
 *
 *     shrunk = A[slot] x[t]                  (num_parts * rank values: all modules share x)
 *     y[t, col_offsets[p] ...] += B_p[slot] shrunk[p * rank ...]     for each module p
 *
 * in one call, instead of a shrink and an expand matmul per module and adapter segment: on a
 * decode step those are tiny (a few rows, rank 16) and cost their dispatch, not their
 * arithmetic. Layouts are the slot buffers' storage (kernels/lora_linear.py):
 *   a_t   [num_slots, in, num_parts * rank]   (A transposed: one x element scales a row of it)
 *   b_t_p [num_slots, rank, out_p]             (B_p transposed: one shrunk value scales a row)
 * so both loops run over contiguous rows and vectorize. A token whose slot is not active for
 * this projection (active[slot] == 0: the adapter does not target it) is skipped.
 *
 * Each token's arithmetic order is fixed and tokens are independent (each y row is written by
 * one token: token_indices holds each row once), so results do not depend on the batch.
 */
#include <stdint.h>
#include <string.h>

#define MAX_PARTS 3
#define PARALLEL_MIN_TOKENS 4

void lora_delta(float *y, const float *x, const int64_t *token_indices, const int32_t *token_slots,
                int64_t num_tokens, const uint8_t *active, const float *a_t, const float *b_t0, const float *b_t1,
                const float *b_t2, const int64_t *out_sizes, const int64_t *col_offsets, int num_parts, int in,
                int rank, int64_t x_row_stride, int64_t y_row_stride)
{
    const float *b_t[MAX_PARTS] = {b_t0, b_t1, b_t2};
    const int width = num_parts * rank;
#pragma omp parallel for schedule(static) if (num_tokens >= PARALLEL_MIN_TOKENS)
    for (int64_t i = 0; i < num_tokens; i++) {
        const int slot = token_slots[i];
        if (!active[slot])
            continue;
        float shrunk[MAX_PARTS * 128];
        memset(shrunk, 0, sizeof(float) * width);
        const float *row = x + token_indices[i] * x_row_stride;
        const float *a = a_t + (int64_t)slot * in * width;
        for (int k = 0; k < in; k++) {
            const float xk = row[k];
            const float *a_k = a + (int64_t)k * width;
#pragma omp simd
            for (int r = 0; r < width; r++)
                shrunk[r] += xk * a_k[r];
        }
        float *out_row = y + token_indices[i] * y_row_stride;
        for (int p = 0; p < num_parts; p++) {
            const int64_t out = out_sizes[p];
            const float *b = b_t[p] + (int64_t)slot * rank * out;
            float *out_p = out_row + col_offsets[p];
            for (int r = 0; r < rank; r++) {
                const float s = shrunk[p * rank + r];
                const float *b_r = b + (int64_t)r * out;
#pragma omp simd
                for (int64_t c = 0; c < out; c++)
                    out_p[c] += s * b_r[c];
            }
        }
    }
}
