/* Fused elementwise steps of a decoder layer on the CPU, float32 and bfloat16.
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
#include <string.h>

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

/* bfloat16 variants: each rounds to bfloat16 exactly where the torch form of the step
 * (kernels/fused.py) does, and computes in float32 between the roundings, so it gives the
 * torch form's result except where a float32 reduction or expf differs in its last bit
 * and that difference crosses a bfloat16 rounding boundary. Tensors hold bfloat16 bits. */

static inline float bf16_to_float(uint16_t x)
{
    const uint32_t wide = (uint32_t)x << 16;
    float f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

/* Round to nearest, ties to even (as torch rounds); NaN stays a (quiet) NaN. */
static inline uint16_t float_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* torch form: residual.add_(delta) (rounded), x32 = residual / rms(residual) in float32,
 * out = weight * bf16(x32) (rounded). */
void add_rms_norm_bf16(uint16_t *residual, const uint16_t *delta, uint16_t *out, const uint16_t *weight,
                       int64_t rows, int dim, float eps)
{
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *x = residual + r * dim;
        float sum_squares = 0.0f;
        if (delta) {
            const uint16_t *d = delta + r * dim;
#pragma omp simd
            for (int i = 0; i < dim; i++)
                x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(d[i]));
        }
#pragma omp simd reduction(+ : sum_squares)
        for (int i = 0; i < dim; i++) {
            const float value = bf16_to_float(x[i]);
            sum_squares += value * value;
        }
        const float inv_rms = 1.0f / sqrtf(sum_squares / dim + eps);
        uint16_t *y = out + r * dim;
#pragma omp simd
        for (int i = 0; i < dim; i++)
            y[i] = float_to_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(x[i]) * inv_rms));
    }
}

/* torch form: bf16(silu(gate)) * up, rounded. */
void silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int inter)
{
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter;
        const uint16_t *up = gate + inter;
        uint16_t *y = out + r * inter;
#pragma omp simd
        for (int i = 0; i < inter; i++) {
            const float g = bf16_to_float(gate[i]);
            y[i] = float_to_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_float(up[i]));
        }
    }
}

/* torch form: addcmul(bf16(x * cos), roll(x), signed_sin), i.e. one rounding of the
 * product with cos, one of the sum (addcmul computes in float32). Tables in bfloat16. */
void rotary_bf16(uint16_t *x, const int64_t *positions, const uint16_t *cos_table,
                 const uint16_t *signed_sin_table, int64_t rows, int heads, int head_dim, int64_t row_stride)
{
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *cos_row = cos_table + positions[r] * head_dim;
        const uint16_t *sin_row = signed_sin_table + positions[r] * head_dim;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = x + r * row_stride + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float low = bf16_to_float(v[i]), high = bf16_to_float(v[i + half]);
                const float low_cos = round_bf16(low * bf16_to_float(cos_row[i]));
                const float high_cos = round_bf16(high * bf16_to_float(cos_row[i + half]));
                v[i] = float_to_bf16(low_cos + high * bf16_to_float(sin_row[i]));
                v[i + half] = float_to_bf16(high_cos + low * bf16_to_float(sin_row[i + half]));
            }
        }
    }
}
