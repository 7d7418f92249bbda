/* silu(g) = g / (1 + e^-g) in float32, shared by fused_ops.c's SiLU step and gemm_bf16.c's SiLU
 * epilogue, so that the two give the same bits.
 *
 * Under -ffast-math GCC may divide by a reciprocal estimate refined by one Newton step, which
 * turns 1 / inf into NaN: with e^-g overflowing (g below -88.72) the plain formula gave NaN where
 * torch gives 0. So those gates give 0 (as torch's g / inf does), and the exponent is capped
 * below the overflow in the lanes a vector computes and then discards. */
#ifndef REFENGINE_SILU_H
#define REFENGINE_SILU_H
#include <math.h>

#define SILU_ZERO_BELOW -88.72284f
#define SILU_MAX_EXPONENT 88.0f

static inline float silu_of(float g)
{
    return g < SILU_ZERO_BELOW ? 0.0f : g / (1.0f + expf(fminf(-g, SILU_MAX_EXPONENT)));
}
#endif
