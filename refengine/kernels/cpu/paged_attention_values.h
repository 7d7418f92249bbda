/* The values of a tile of the chunk kernel: included by paged_attention_chunk.h, once per
 * instantiation, after paged_attention_scores.h, with the same macros. tile_values adds, for each
 * vector v of a tile, the sum over the key tile's positions j of weights[v * KEY_TILE + j] *
 * value(start + j) to acc[v] (head_dim floats: the vector's running output, which the caller
 * rescales). Two forms:
 *   QUERY_PAIRS 0  every product is a float32 multiply-add of the weight and the value widened to
 *                  float32;
 *   QUERY_PAIRS 1  (a bfloat16 model on a bfloat16 cache) the weights are rounded to bfloat16 and
 *                  each pair of positions (j, j + 1) is one vdpbf16ps per vector and 16
 *                  dimensions, where the float32 form takes two multiply-adds and two widenings
 *                  of the values: the value pass does half the arithmetic. GPU flash attention
 *                  rounds its P the same way before the P.V product. The softmax's maximum and
 *                  exponentials stay float32; its sum adds the rounded weights (value_weight16 is
 *                  applied as tile_weights makes them), so the output stays a weighted average
 *                  of the values with weights that sum to 1. (Normalized by the unrounded sum,
 *                  equal values came out scaled by up to 1 +- 2^-9, and on the golden prompts,
 *                  teacher-forced against float32 transformers, 13 of 384 top-1 tokens differed
 *                  where the float32 value pass had 6; with the rounded sum 7 do, and the mean KL
 *                  divergence is 1.11e-3 against 1.09e-3.) A product of two bfloat16 is exact in
 *                  float32, and every sum is float32. A head_dim 16 past a multiple of 32 takes
 *                  the float32 form for its last 16 dimensions.
 *   QUERY_PAIRS 2  the bits of QUERY_PAIRS 1 from float32 multiply-adds (paged_attention_scores.h):
 *                  per pair of positions (j, j + 1), position j + 1's product first, as a
 *                  vdpbf16ps lane adds them; no pair interleaving of the values is needed.
 * In all, each lane sums its own dimension over the positions (pairs) in increasing order, so a
 * vector's result depends on its weights and the values alone: not on the width, its tile mates
 * or the pass width (the chunk kernel's invariants, paged_attention_chunk.h). */

/* acc[v][lo .. lo + 16 * chunks) += sum over the tile's keys of weight * value. The width x
 * chunks accumulators stay in registers while each value row loaded feeds width of them. Keys go
 * block by block, so a block's address is computed once per block. */
static inline __attribute__((always_inline)) void KV_NAME(tile_values_part)(
    float *acc, const float *weights, const KV_T *v_cache, const int32_t *block_table, int start, int num_keys,
    int kv_head, const Shape *s, int lo, const int width, const int chunks)
{
    const int head_dim = s->head_dim, block_size = s->block_size;
    const int64_t token_stride = (int64_t)s->num_kv_heads * head_dim;
    vec16 out[TILE][4];
    for (int v = 0; v < width; v++)
        for (int c = 0; c < chunks; c++)
            out[v][c] = load16(acc + v * head_dim + lo + 16 * c);
    for (int offset = 0; offset < num_keys; offset += block_size) {
        const int position = start + offset;
        const KV_T *values = v_cache + (int64_t)block_table[position / block_size] * block_size * token_stride +
                             (int64_t)kv_head * head_dim + lo;
        const int count = num_keys - offset < block_size ? num_keys - offset : block_size;
        for (int j = 0; j < count; j++) {
            vec16 value[4];
            for (int c = 0; c < chunks; c++)
                value[c] = KV_LOAD16(values + j * token_stride + 16 * c);
            for (int v = 0; v < width; v++)
                for (int c = 0; c < chunks; c++)
                    out[v][c] += weights[v * KEY_TILE + offset + j] * value[c];
        }
    }
    for (int v = 0; v < width; v++)
        for (int c = 0; c < chunks; c++)
            store16(acc + v * head_dim + lo + 16 * c, out[v][c]);
}

#if QUERY_PAIRS == 0

/* The weights the value pass multiplies by: the float32 weights themselves. */
static inline vec16 KV_NAME(value_weight16)(vec16 weights) { return weights; }

/* The whole head_dim, 64 dimensions (four registers per vector) at a time for tiles of up to 4
 * vectors (more independent sums, fewer passes over the values), else 32 (two registers): each
 * lane sums its own dimension, so the pass width does not change any result. */
static inline __attribute__((always_inline)) void KV_NAME(tile_values)(
    float *acc, const float *weights, const KV_T *v_cache, const int32_t *block_table, int start, int num_keys,
    int kv_head, const Shape *s, const int width)
{
    int lo = 0;
    if (width <= 4)
        for (; lo + 64 <= s->head_dim; lo += 64)
            KV_NAME(tile_values_part)(acc, weights, v_cache, block_table, start, num_keys, kv_head, s, lo, width, 4);
    for (; lo + 32 <= s->head_dim; lo += 32)
        KV_NAME(tile_values_part)(acc, weights, v_cache, block_table, start, num_keys, kv_head, s, lo, width, 2);
    if (lo < s->head_dim)
        KV_NAME(tile_values_part)(acc, weights, v_cache, block_table, start, num_keys, kv_head, s, lo, width, 1);
}

#else

/* The weights the value pass multiplies by: each rounded to the nearest bfloat16 (ties to even),
 * kept as a float32, whose high 16 bits are then that bfloat16 exactly. Weights are finite and >= 0. */
static inline vec16 KV_NAME(value_weight16)(vec16 weights)
{
    typedef uint32_t uvec16 __attribute__((vector_size(64)));
    const uvec16 bits = (uvec16)weights;
    return (vec16)((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
}

#if QUERY_PAIRS == 1

/* vdpbf16ps over two value rows unpacked by 16-bit words pairs up, in each 128-bit lane L,
 * dimensions 8L .. 8L + 3 (the "low" register, its lanes 4L .. 4L + 3) and 8L + 4 .. 8L + 7 (the
 * "high" one). These move 32 floats of acc between that order and acc's own, once per pass. */
static inline void KV_NAME(to_pair_order)(const float *natural, __m512 *low, __m512 *high)
{
    const __m512 first = _mm512_loadu_ps(natural), second = _mm512_loadu_ps(natural + 16);
    const __m512i low_lanes = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i high_lanes = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    *low = _mm512_permutex2var_ps(first, low_lanes, second);
    *high = _mm512_permutex2var_ps(first, high_lanes, second);
}

static inline void KV_NAME(from_pair_order)(float *natural, __m512 low, __m512 high)
{
    const __m512i first_lanes = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second_lanes = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    _mm512_storeu_ps(natural, _mm512_permutex2var_ps(low, first_lanes, high));
    _mm512_storeu_ps(natural + 16, _mm512_permutex2var_ps(low, second_lanes, high));
}

/* acc[v][lo .. lo + 32 * groups) += the tile's weighted values, a pair of positions at a time:
 * weight_pairs[v * KEY_TILE / 2 + j / 2] holds the bfloat16 weights of positions j and j + 1. A
 * block's odd last position pairs with zero (the slot past it may hold a stale value, and its
 * weight, 0, must not meet a NaN there). */
static inline __attribute__((always_inline)) void KV_NAME(pair_values_part)(
    float *acc, const uint32_t *weight_pairs, const KV_T *v_cache, const int32_t *block_table, int start,
    int num_keys, int kv_head, const Shape *s, int lo, const int width, const int groups)
{
    const int head_dim = s->head_dim, block_size = s->block_size;
    const int64_t token_stride = (int64_t)s->num_kv_heads * head_dim;
    __m512 low[TILE][2], high[TILE][2];
    for (int v = 0; v < width; v++)
        for (int g = 0; g < groups; g++)
            KV_NAME(to_pair_order)(acc + v * head_dim + lo + 32 * g, &low[v][g], &high[v][g]);
    for (int offset = 0; offset < num_keys; offset += block_size) {
        const int position = start + offset;
        const KV_T *values = v_cache + (int64_t)block_table[position / block_size] * block_size * token_stride +
                             (int64_t)kv_head * head_dim + lo;
        const int count = num_keys - offset < block_size ? num_keys - offset : block_size;
        for (int j = 0; j < count; j += 2) {
            __m512bh pair_low[2], pair_high[2];
            for (int g = 0; g < groups; g++) {
                const __m512i first = _mm512_loadu_si512(values + j * token_stride + 32 * g);
                const __m512i second = j + 1 < count ? _mm512_loadu_si512(values + (j + 1) * token_stride + 32 * g)
                                                     : _mm512_setzero_si512();
                pair_low[g] = (__m512bh)_mm512_unpacklo_epi16(first, second);
                pair_high[g] = (__m512bh)_mm512_unpackhi_epi16(first, second);
            }
            for (int v = 0; v < width; v++) {
                const uint32_t pair = weight_pairs[v * KEY_TILE / 2 + (offset + j) / 2];
                const __m512bh weight = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int g = 0; g < groups; g++) {
                    low[v][g] = _mm512_dpbf16_ps(low[v][g], pair_low[g], weight);
                    high[v][g] = _mm512_dpbf16_ps(high[v][g], pair_high[g], weight);
                }
            }
        }
    }
    for (int v = 0; v < width; v++)
        for (int g = 0; g < groups; g++)
            KV_NAME(from_pair_order)(acc + v * head_dim + lo + 32 * g, low[v][g], high[v][g]);
}

/* The weights (bfloat16 values already, value_weight16) as bfloat16 pairs: each one's high 16 bits.
 * Then the whole head_dim: 64 dimensions at a time for tiles of up to 4 vectors, else 32, as in
 * the float32 form. */
static inline __attribute__((always_inline)) void KV_NAME(tile_values)(
    float *acc, const float *weights, const KV_T *v_cache, const int32_t *block_table, int start, int num_keys,
    int kv_head, const Shape *s, const int width)
{
    uint32_t weight_pairs[TILE * KEY_TILE / 2];
    const int rounded = (num_keys + 15) / 16 * 16; /* tile_weights zeroed the lanes past num_keys */
    for (int v = 0; v < width; v++)
        for (int j = 0; j < rounded; j += 16) {
            const __m512i bits = _mm512_srli_epi32(_mm512_loadu_si512(weights + v * KEY_TILE + j), 16);
            _mm256_storeu_si256((__m256i *)(weight_pairs + v * KEY_TILE / 2 + j / 2), _mm512_cvtepi32_epi16(bits));
        }
    int lo = 0;
    if (width <= 4)
        for (; lo + 64 <= s->head_dim; lo += 64)
            KV_NAME(pair_values_part)(acc, weight_pairs, v_cache, block_table, start, num_keys, kv_head, s, lo,
                                      width, 2);
    for (; lo + 32 <= s->head_dim; lo += 32)
        KV_NAME(pair_values_part)(acc, weight_pairs, v_cache, block_table, start, num_keys, kv_head, s, lo, width, 1);
    if (lo < s->head_dim)
        KV_NAME(tile_values_part)(acc, weights, v_cache, block_table, start, num_keys, kv_head, s, lo, width, 1);
}

#elif QUERY_PAIRS == 2

/* acc[v][lo .. lo + 16 * chunks) += the tile's weighted values, as pair_values_part of
 * QUERY_PAIRS 1 sums them with vdpbf16ps: for each pair of positions (j, j + 1), weight(j + 1) *
 * value(j + 1) first, then weight(j) * value(j), each rounded into the sum. A block's odd last
 * position has no partner: vdpbf16ps adds 0 * weight there first, which leaves the sum as it is. */
static inline __attribute__((always_inline)) void KV_NAME(fma_pair_values_part)(
    float *acc, const float *weights, const KV_T *v_cache, const int32_t *block_table, int start, int num_keys,
    int kv_head, const Shape *s, int lo, const int width, const int chunks)
{
    const int head_dim = s->head_dim, block_size = s->block_size;
    const int64_t token_stride = (int64_t)s->num_kv_heads * head_dim;
    __m512 out[TILE][4];
    for (int v = 0; v < width; v++)
        for (int c = 0; c < chunks; c++)
            out[v][c] = _mm512_loadu_ps(acc + v * head_dim + lo + 16 * c);
    for (int offset = 0; offset < num_keys; offset += block_size) {
        const int position = start + offset;
        const KV_T *values = v_cache + (int64_t)block_table[position / block_size] * block_size * token_stride +
                             (int64_t)kv_head * head_dim + lo;
        const int count = num_keys - offset < block_size ? num_keys - offset : block_size;
        for (int j = 0; j < count; j += 2) {
            const int pair = j + 1 < count;
            __m512 first[4], second[4];
            for (int c = 0; c < chunks; c++) {
                first[c] = (__m512)KV_LOAD16(values + j * token_stride + 16 * c);
                second[c] = pair ? (__m512)KV_LOAD16(values + (j + 1) * token_stride + 16 * c) : _mm512_setzero_ps();
            }
            for (int v = 0; v < width; v++) {
                const __m512 weight = _mm512_set1_ps(weights[v * KEY_TILE + offset + j]);
                const __m512 next_weight = _mm512_set1_ps(pair ? weights[v * KEY_TILE + offset + j + 1] : 0.0f);
                for (int c = 0; c < chunks; c++)
                    out[v][c] = _mm512_fmadd_ps(weight, first[c], _mm512_fmadd_ps(next_weight, second[c], out[v][c]));
            }
        }
    }
    for (int v = 0; v < width; v++)
        for (int c = 0; c < chunks; c++)
            _mm512_storeu_ps(acc + v * head_dim + lo + 16 * c, out[v][c]);
}

/* The whole head_dim: 64 dimensions at a time for tiles of up to 4 vectors, else 32, and a last
 * 16 in the float32 form, where QUERY_PAIRS 1 takes it too. */
static inline __attribute__((always_inline)) void KV_NAME(tile_values)(
    float *acc, const float *weights, const KV_T *v_cache, const int32_t *block_table, int start, int num_keys,
    int kv_head, const Shape *s, const int width)
{
    int lo = 0;
    if (width <= 4)
        for (; lo + 64 <= s->head_dim; lo += 64)
            KV_NAME(fma_pair_values_part)(acc, weights, v_cache, block_table, start, num_keys, kv_head, s, lo, width,
                                          4);
    for (; lo + 32 <= s->head_dim; lo += 32)
        KV_NAME(fma_pair_values_part)(acc, weights, v_cache, block_table, start, num_keys, kv_head, s, lo, width, 2);
    if (lo < s->head_dim)
        KV_NAME(tile_values_part)(acc, weights, v_cache, block_table, start, num_keys, kv_head, s, lo, width, 1);
}

#endif
#endif
