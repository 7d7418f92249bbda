/* The steps of fused_ops.c for one element type: included twice by it, with
 *   ELEM_T        the tensors' element type (float, or uint16_t holding bfloat16 bits),
 *   TO_F(x)       one element as a float,
 *   FROM_F(f)     a float rounded to one element,
 *   ROUND(f)      a float rounded to the element type and back (where the torch form rounds
 *                 an intermediate; the identity for float),
 *   STEP_NAME(n)  the name of function n for this type (n itself for float).
 * Arithmetic is float32 for both. */

/* residual += delta (when delta is not NULL); out = residual / rms(residual) * weight.
 * The residual stream is updated in place, as in vLLM's fused_add_rms_norm. torch form:
 * the add rounded, the normalization in float32, rounded, then the product with weight. */
void STEP_NAME(add_rms_norm)(ELEM_T *residual, const ELEM_T *delta, ELEM_T *out, const ELEM_T *weight,
                             int64_t rows, int dim, float eps)
{
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        ELEM_T *x = residual + r * dim;
        float sum_squares = 0.0f;
        if (delta) {
            const ELEM_T *d = delta + r * dim;
#pragma omp simd
            for (int i = 0; i < dim; i++)
                x[i] = FROM_F(TO_F(x[i]) + TO_F(d[i]));
        }
#pragma omp simd reduction(+ : sum_squares)
        for (int i = 0; i < dim; i++) {
            const float value = TO_F(x[i]);
            sum_squares += value * value;
        }
        const float inv_rms = 1.0f / sqrtf(sum_squares / dim + eps);
        ELEM_T *y = out + r * dim;
#pragma omp simd
        for (int i = 0; i < dim; i++)
            y[i] = FROM_F(TO_F(weight[i]) * ROUND(TO_F(x[i]) * inv_rms));
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], silu(g) = g / (1 + e^-g);
 * torch form: silu rounded, then the product (silu_of: silu.h). */
void STEP_NAME(silu_and_mul)(const ELEM_T *gate_up, ELEM_T *out, int64_t rows, int inter)
{
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const ELEM_T *gate = gate_up + r * 2 * inter;
        const ELEM_T *up = gate + inter;
        ELEM_T *y = out + r * inter;
#pragma omp simd
        for (int i = 0; i < inter; i++) {
            const float g = TO_F(gate[i]);
            y[i] = FROM_F(ROUND(silu_of(g)) * TO_F(up[i]));
        }
    }
}

/* Rotary embedding in place, rotate-half layout (Hugging Face Llama), on the first
 * `heads` heads of each row of x (row r starts at x + r * row_stride):
 *   x[i]        = x[i] * cos[i]        + x[i + half] * signed_sin[i]
 *   x[i + half] = x[i + half] * cos[i + half] + x[i] * signed_sin[i + half]
 * with signed_sin = [-sin_low, sin_high], the tables indexed by position. torch form:
 * addcmul(x * cos, roll(x), signed_sin), the product with cos rounded, then the sum
 * (addcmul computes in float32). Returns -1, with x untouched, when a position is outside the
 * tables' num_positions rows (the caller then runs the torch form, whose indexing raises IndexError
 * past the tables and wraps a negative position); 0 when done. Checked here, one integer compare a
 * row, as a max over the positions in torch would cost a reduction's dispatch on every call. */
int STEP_NAME(rotary)(ELEM_T *x, const int64_t *positions, const ELEM_T *cos_table,
                      const ELEM_T *signed_sin_table, int64_t rows, int heads, int head_dim, int64_t row_stride,
                      int64_t num_positions)
{
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= num_positions)
            return -1;
    const int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const ELEM_T *cos_row = cos_table + positions[r] * head_dim;
        const ELEM_T *sin_row = signed_sin_table + positions[r] * head_dim;
        for (int h = 0; h < heads; h++) {
            ELEM_T *v = x + r * row_stride + (int64_t)h * head_dim;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float low = TO_F(v[i]), high = TO_F(v[i + half]);
                const float low_cos = ROUND(low * TO_F(cos_row[i]));
                const float high_cos = ROUND(high * TO_F(cos_row[i + half]));
                v[i] = FROM_F(low_cos + high * TO_F(sin_row[i]));
                v[i + half] = FROM_F(high_cos + low * TO_F(sin_row[i + half]));
            }
        }
    }
    return 0;
}
