/* The SiLU epilogue of the bf16 GEMMs (gemm_bf16.c, gemm_amx.c): silu(gate) * up written from a
 * tile's float32 sums, rounding exactly where the separate step (silu_and_mul_bf16,
 * fused_ops_steps.h) rounds on the GEMM's bf16 output, with the same silu_of (silu.h). Needs
 * AVX512-BF16; included only inside the GEMMs' AVX512-BF16 builds. */
#ifndef REFENGINE_SILU_STORE_H
#define REFENGINE_SILU_STORE_H
#include <immintrin.h>
#include <stdint.h>

#include "silu.h"

#define SILU_STORE_LANES 16

static inline __m512 round_to_bf16(__m512 x)
{
    return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x));
}

/* out[0:16] = bf16(round(g / (1 + e^-g)) * u), g and u the sums rounded to bf16 first. */
static inline void silu_mul_store(__m512 gate_sum, __m512 up_sum, uint16_t *out)
{
    float gate[SILU_STORE_LANES], silu[SILU_STORE_LANES];
    _mm512_storeu_ps(gate, round_to_bf16(gate_sum));
#pragma omp simd simdlen(16)
    for (int i = 0; i < SILU_STORE_LANES; ++i)
        silu[i] = silu_of(gate[i]);
    const __m512 product = _mm512_mul_ps(round_to_bf16(_mm512_loadu_ps(silu)), round_to_bf16(up_sum));
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(product));
}
#endif
