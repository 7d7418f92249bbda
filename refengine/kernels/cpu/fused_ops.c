/* Fused elementwise steps of a decoder layer, float32, on the CPU.
 *
 * Each replaces a chain of small torch ops. On a decode step those tensors are tiny
 * ([batch, 576] for SmolLM2), so the cost of a torch op is its dispatch, allocation
 * and thread fork/join, not its arithmetic; one pass in C per step of the layer
 * removes most of that (and reads the activations once instead of several times).
 *
 * Rows are independent and each row's arithmetic order is fixed, so results do not
 * depend on the batch. Rows run in parallel on torch's OpenMP threads once there
 * is enough work to pay for the fork.
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_MIN_ELEMENTS 65536

/* residual += delta (when delta is not NULL); out = residual / rms(residual) * weight.
 * The residual stream is updated in place, as in vLLM's fused_add_rms_norm. */
void add_rms_norm(float *residual, const float *delta, float *out, const float *weight, int64_t rows, int dim,
                  float eps)
{
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float *x = residual + r * dim;
        float sum_squares = 0.0f;
        if (delta) {
            const float *d = delta + r * dim;
#pragma omp simd reduction(+ : sum_squares)
            for (int i = 0; i < dim; i++) {
                x[i] += d[i];
                sum_squares += x[i] * x[i];
            }
        } else {
#pragma omp simd reduction(+ : sum_squares)
            for (int i = 0; i < dim; i++)
                sum_squares += x[i] * x[i];
        }
        const float inv_rms = 1.0f / sqrtf(sum_squares / dim + eps);
        float *y = out + r * dim;
#pragma omp simd
        for (int i = 0; i < dim; i++)
            y[i] = weight[i] * (x[i] * inv_rms);
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], silu(g) = g / (1 + e^-g). */
void silu_and_mul(const float *gate_up, float *out, int64_t rows, int inter)
{
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter;
        const float *up = gate + inter;
        float *y = out + r * inter;
#pragma omp simd
        for (int i = 0; i < inter; i++)
            y[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* Rotary embedding in place, rotate-half layout (Hugging Face Llama), on the first
 * `heads` heads of each row of x (row r starts at x + r * row_stride):
 *   x[i]        = x[i] * cos[i]        + x[i + half] * signed_sin[i]
 *   x[i + half] = x[i + half] * cos[i + half] + x[i] * signed_sin[i + half]
 * with signed_sin = [-sin_low, sin_high], the tables indexed by position. */
void rotary(float *x, const int64_t *positions, const float *cos_table, const float *signed_sin_table, int64_t rows,
            int heads, int head_dim, int64_t row_stride)
{
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *cos_row = cos_table + positions[r] * head_dim;
        const float *sin_row = signed_sin_table + positions[r] * head_dim;
        for (int h = 0; h < heads; h++) {
            float *v = x + r * row_stride + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float low = v[i], high = v[i + half];
                v[i] = low * cos_row[i] + high * sin_row[i];
                v[i + half] = high * cos_row[i + half] + low * sin_row[i + half];
            }
        }
    }
}
