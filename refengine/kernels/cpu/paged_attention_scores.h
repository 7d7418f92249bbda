/* The scores of a tile of the chunk kernel: included by paged_attention_chunk.h, once per
 * instantiation, with its KV_T / KV_LOAD16 / KV_NAME / Q_T macros and QUERY_PAIRS:
 *   QUERY_PAIRS 0  queries are float32; every product is a float32 multiply-add of the query
 *                  and the key widened to float32 (the float32 and bfloat16 caches);
 *   QUERY_PAIRS 1  queries are bfloat16 as well (the model runs in bfloat16, so q is exactly a
 *                  bfloat16 value), and the scores are vdpbf16ps dot products of (d, d + 1)
 *                  pairs: per pair of dimensions one instruction per query vector, where the
 *                  float32 form needs two multiply-adds and two widenings of the keys. Each
 *                  product of two bfloat16 is exact in float32, and every sum accumulates in
 *                  float32, as in the float32 form. Built only with AVX512-BF16.
 *   QUERY_PAIRS 2  the same bits as 1 from float32 multiply-adds: a vdpbf16ps lane is, bit for
 *                  bit, acc + a[2i+1] b[2i+1] rounded, then + a[2i] b[2i] rounded (all of 32
 *                  million random lanes on this project's AMX Xeon; the other order missed 13 %),
 *                  with denormal inputs and results flushed to zero, which the kernel's DAZ/FTZ
 *                  setting gives the multiply-adds (chunk_attention). The test suite checks the
 *                  two kernels agree bit for bit (test_cpu_paged_attention.py, with denormal
 *                  values and denormal partial sums). On that Xeon
 *                  vdpbf16ps computes half as many products a cycle (0.5 instructions of 32,
 *                  against 2 multiply-adds of 16), and this form made bf16 prefill attention
 *                  1.26-1.31x faster; the backend measures both once (bf16_dot_product_speed)
 *                  and takes the faster.
 *
 * pack_queries lays a tile's queries out [dimension (pair)][vector], so the width broadcasts
 * of one dimension share one address; score16 scores 16 positions of one block, in its
 * form; tile_scores, shared, walks a key tile with it and writes scores[v * KEY_TILE + j] = scale *
 * q_v . key(start + j) for the num_keys keys of one key tile (num_keys rounded up to 16: lanes
 * past it are masked later). Every form sums even and odd dimension pairs in two separate
 * chains per vector, so that the multiply-add latency does not bind at width 1-4, and each
 * vector's sums depend on its query and the keys alone (not on the width or tile mates). */

#if QUERY_PAIRS != 1

/* packed[d * width + v].value = dimension d of query v as a float32 (exact for bfloat16). */
static inline void KV_NAME(pack_queries)(QueryWord *packed, const Q_T *const *queries, int head_dim, int width)
{
    for (int v = 0; v < width; v++)
        for (int d = 0; d < head_dim; d++)
            packed[d * width + v].value = Q_TO_F(queries[v][d]);
}

#endif

#if QUERY_PAIRS == 0

/* Stores scale * q_v . key(j) at scores[v * KEY_TILE + j] for the 16 positions of `keys` (one
 * KV head's keys in a block, [head_dim][block_size], from the first of them). */
static inline __attribute__((always_inline)) void KV_NAME(score16)(float *scores, const QueryWord *packed,
                                                                   const KV_T *keys, const Shape *s, const int width)
{
    const int64_t block_size = s->block_size;
    vec16 even[TILE] = {{0}}, odd[TILE] = {{0}};
    for (int d = 0; d < s->head_dim; d += 2) {
        const vec16 key_even = KV_LOAD16(keys + d * block_size);
        const vec16 key_odd = KV_LOAD16(keys + (d + 1) * block_size);
        for (int v = 0; v < width; v++) {
            even[v] += packed[d * width + v].value * key_even;
            odd[v] += packed[(d + 1) * width + v].value * key_odd;
        }
    }
    for (int v = 0; v < width; v++)
        store16(scores + v * KEY_TILE, (even[v] + odd[v]) * s->scale);
}

#elif QUERY_PAIRS == 1

/* packed[p * width + v].pair = dimensions 2p (low half) and 2p + 1 of query v. */
static inline void KV_NAME(pack_queries)(QueryWord *packed, const Q_T *const *queries, int head_dim, int width)
{
    for (int v = 0; v < width; v++)
        for (int d = 0; d < head_dim; d += 2)
            packed[d / 2 * width + v].pair = (uint32_t)queries[v][d] | (uint32_t)queries[v][d + 1] << 16;
}

/* Lane j of the result holds (key d of position j, key d + 1 of position j): the operand order
 * of vdpbf16ps. A block stores a KV head's keys as [head_dim][block_size] rows of bfloat16. */
static inline __m512bh KV_NAME(key_pairs)(const KV_T *row, int64_t block_size)
{
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i rows = block_size == 16
                             ? _mm512_loadu_si512(row) /* rows d and d + 1 are adjacent */
                             : _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)row)),
                                                  _mm256_loadu_si256((const __m256i *)(row + block_size)), 1);
    return (__m512bh)_mm512_permutexvar_epi16(interleave, rows);
}

/* score16 with vdpbf16ps: pairs (d, d + 1) of dimensions, even pairs and odd pairs in two chains. */
static inline __attribute__((always_inline)) void KV_NAME(score16)(float *scores, const QueryWord *packed,
                                                                   const KV_T *keys, const Shape *s, const int width)
{
    const int64_t block_size = s->block_size;
    __m512 even[TILE], odd[TILE];
    for (int v = 0; v < width; v++)
        even[v] = odd[v] = _mm512_setzero_ps();
    for (int d = 0; d < s->head_dim; d += 4) { /* head_dim is a multiple of 16 */
        const __m512bh keys_even = KV_NAME(key_pairs)(keys + d * block_size, block_size);
        const __m512bh keys_odd = KV_NAME(key_pairs)(keys + (d + 2) * block_size, block_size);
        for (int v = 0; v < width; v++) {
            const __m512bh q_even = (__m512bh)_mm512_set1_epi32((int)packed[d / 2 * width + v].pair);
            const __m512bh q_odd = (__m512bh)_mm512_set1_epi32((int)packed[(d / 2 + 1) * width + v].pair);
            even[v] = _mm512_dpbf16_ps(even[v], keys_even, q_even);
            odd[v] = _mm512_dpbf16_ps(odd[v], keys_odd, q_odd);
        }
    }
    for (int v = 0; v < width; v++)
        store16(scores + v * KEY_TILE, (vec16)_mm512_mul_ps(_mm512_add_ps(even[v], odd[v]), _mm512_set1_ps(s->scale)));
}

#else

/* score16 of QUERY_PAIRS 1 (vdpbf16ps) with float32 multiply-adds, in its order: per pair
 * (d, d + 1), dimension d + 1 first. The four keys rows of a step are widened once for the width
 * vectors; each query dimension is one broadcast operand. */
static inline __attribute__((always_inline)) void KV_NAME(score16)(float *scores, const QueryWord *packed,
                                                                   const KV_T *keys, const Shape *s, const int width)
{
    const int64_t block_size = s->block_size;
    __m512 even[TILE], odd[TILE];
    for (int v = 0; v < width; v++)
        even[v] = odd[v] = _mm512_setzero_ps();
    for (int d = 0; d < s->head_dim; d += 4) {
        __m512 key[4];
        for (int i = 0; i < 4; i++)
            key[i] = (__m512)KV_LOAD16(keys + (d + i) * block_size);
        for (int v = 0; v < width; v++) {
            even[v] = _mm512_fmadd_ps(_mm512_set1_ps(packed[(d + 1) * width + v].value), key[1], even[v]);
            even[v] = _mm512_fmadd_ps(_mm512_set1_ps(packed[d * width + v].value), key[0], even[v]);
            odd[v] = _mm512_fmadd_ps(_mm512_set1_ps(packed[(d + 3) * width + v].value), key[3], odd[v]);
            odd[v] = _mm512_fmadd_ps(_mm512_set1_ps(packed[(d + 2) * width + v].value), key[2], odd[v]);
        }
    }
    for (int v = 0; v < width; v++)
        store16(scores + v * KEY_TILE, (vec16)_mm512_mul_ps(_mm512_add_ps(even[v], odd[v]), _mm512_set1_ps(s->scale)));
}

#endif

/* Every form: the key tile 16 positions at a time, requesting blocks ahead as it enters each. */
static inline __attribute__((always_inline)) void KV_NAME(tile_scores)(
    float *scores, const QueryWord *packed, const KV_T *k_cache, const KV_T *v_cache, const int32_t *block_table,
    int start, int num_keys, int end, int kv_head, const Shape *s, const int width)
{
    const int head_dim = s->head_dim, block_size = s->block_size;
    const int64_t head_tile = (int64_t)head_dim * block_size;
    const int64_t block_stride = s->num_kv_heads * head_tile;
    for (int offset = 0; offset < num_keys; offset += 16) {
        const int position = start + offset;
        const KV_T *keys = k_cache + block_table[position / block_size] * block_stride + kv_head * head_tile +
                           position % block_size;
        if (position % block_size == 0)
            KV_NAME(prefetch_blocks)(k_cache, v_cache, block_table, position, end, kv_head, s);
        KV_NAME(score16)(scores + offset, packed, keys, s, width);
    }
}
