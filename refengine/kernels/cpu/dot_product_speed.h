/* bf16_dot_product_speed(): how fast vdpbf16ps computes products of bfloat16 on this core,
 * relative to float32 multiply-adds, both counted in products per second (a vdpbf16ps lane adds
 * two products, a multiply-add lane one); 0 where the library has no vdpbf16ps.
 *
 * Why measure: chunk_attention_bf16q and chunk_attention_bf16qf give the same bits, and which is
 * faster depends on the core. On this project's AMX Xeon vdpbf16ps ran 0.5 instructions a cycle
 * against 2 for multiply-adds (a ratio of 0.5: the multiply-add form's bf16 prefill attention
 * was 1.26-1.31x faster); on Zen 4 a vdpbf16ps costs what a multiply-add does (a ratio near 2).
 * Each is timed on 12 independent chains (more than latency x issue rate on either core), best
 * of 7 alternating rounds of about 0.1 ms, so a slow spell hits both; the backend asks once per
 * process (kernels/attention/cpu_paged.py). */
#include <time.h>

#if defined(__AVX512BF16__)
enum { SPEED_CHAINS = 12, SPEED_ITERATIONS = 8000, SPEED_ROUNDS = 7 };

static double seconds_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec + now.tv_nsec * 1e-9;
}

/* Seconds for SPEED_ITERATIONS x SPEED_CHAINS instructions of one kind (dot: vdpbf16ps, else a
 * multiply-add). The empty asm makes an operand opaque each iteration, so nothing is hoisted. */
static double timed_chains(int dot)
{
    __m512 acc[SPEED_CHAINS];
    for (int i = 0; i < SPEED_CHAINS; i++)
        acc[i] = _mm512_setzero_ps();
    __m512 operand = _mm512_set1_ps(1e-3f);
    const __m512 other = _mm512_set1_ps(1.0f);
    const double started = seconds_now();
    for (int n = 0; n < SPEED_ITERATIONS; n++) {
        __asm__ volatile("" : "+v"(operand));
        if (dot)
            for (int i = 0; i < SPEED_CHAINS; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)operand, (__m512bh)other);
        else
            for (int i = 0; i < SPEED_CHAINS; i++)
                acc[i] = _mm512_fmadd_ps(operand, other, acc[i]);
    }
    for (int i = 0; i < SPEED_CHAINS; i++)
        __asm__ volatile("" : : "v"(acc[i]));
    return seconds_now() - started;
}

double bf16_dot_product_speed(void)
{
    double dot = 1e30, fma = 1e30;
    for (int round = 0; round < SPEED_ROUNDS; round++) {
        const double dot_s = timed_chains(1), fma_s = timed_chains(0);
        dot = dot_s < dot ? dot_s : dot;
        fma = fma_s < fma ? fma_s : fma;
    }
    return 2.0 * fma / dot; /* equal instruction counts: products per second = 2 / dot_s vs 1 / fma_s */
}
#else
double bf16_dot_product_speed(void) { return 0.0; }
#endif
