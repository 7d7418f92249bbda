/* Chunk attention: the rows of paged_attention.c, a tile of query vectors at a time.
 * Included by paged_attention.c once per KV element type, after paged_attention_kv.h, with the
 * same KV_T / KV_LOAD16 / KV_NAME macros. Same arguments, layouts and causal rule as
 * paged_attention; every key and value is read in place from the paged cache (the step's own
 * keys were stored there first), so a fresh prompt, a chunk continuing a cached context and a
 * decode row are one case, with no gather and no mask tensor.
 *
 * Why tiles: the row kernel reads a sequence's keys and values once per query row. Here one
 * work item is up to TILE query vectors -- (row, head) pairs of one sequence that share a KV
 * head -- and every 16 keys loaded feed one multiply-add per vector (a GEMM micro-kernel: the
 * accumulators stay in registers), so a prompt's KV is read once per tile instead of per row.
 *
 * The softmax is online (flash attention): keys are taken KEY_TILE positions at a time, and
 * each vector keeps its running maximum, sum and unnormalized output, rescaled when the
 * maximum grows. The key tiles start at absolute positions 0, KEY_TILE, 2 KEY_TILE, ..., and a
 * vector's arithmetic never depends on its tile mates (a tile mate only widens the range of key
 * tiles visited, and a key tile past a vector's own position leaves its state bit-identical:
 * its weights are exactly 0 and its rescale factor exactly 1), nor on the tile's width. So a
 * row's result depends on its query, its position and the keys alone: not on the batch, nor on
 * how its prompt was chunked, nor on whether it came as a decode row.
 *
 * Requires head_dim a multiple of 16 up to 256 and block_size a power of two from 16 to 256
 * (chunk_attention_supported); the Python side sends other shapes to the row kernel.
 *
 * With QUERY_PAIRS 3 (the AMX form) an item holds ITEM_VECTORS = 16 vectors, its work is
 * paged_attention_amx.h's attend_tile_any, and of this file it keeps the driver (items, decode
 * rows as one item, threads) and the softmax's arithmetic (tile_weights, softmax_update); the
 * prefetching described below (prefetch_blocks, whole blocks ahead) is the vector forms'.
 */

#ifndef CHUNK_TILE_CONSTANTS
#define CHUNK_TILE_CONSTANTS
enum { ROW_ITEMS_PER_THREAD = 2 };
enum { TILE = 8, KEY_TILE = 256, MAX_HEAD_DIM = 256, PREFETCH_POSITIONS = 64, WHOLE_BLOCKS_AHEAD = 6 };
#define MASKED_SCORE (-1e30f) /* finite, as -ffast-math assumes: exp(MASKED_SCORE - max) is 0 */

int chunk_attention_supported(int head_dim, int block_size)
{
    return head_dim % 16 == 0 && head_dim <= MAX_HEAD_DIM && block_size >= 16 && block_size <= KEY_TILE &&
           (block_size & (block_size - 1)) == 0;
}

/* One word of a tile's packed queries: a float (QUERY_PAIRS 0), or two bfloat16 (QUERY_PAIRS 1). */
typedef union {
    float value;
    uint32_t pair;
} QueryWord;

/* The running state of one query vector. */
typedef struct {
    float max, sum;
    int position; /* the last key position it attends to; -1 = a padding vector */
} VectorState;
#endif

/* Called as the scores reach the block that starts at `position` (keys run to `end`): requests
 * this block's values, read by tile_values after the key tile's scores, and the keys of the
 * block PREFETCH_POSITIONS ahead. A decode item (one KV head of one row) spends only a few
 * hundred cycles on a block, less than a DRAM round trip, so one block ahead is too late.
 *
 * With s->whole_blocks_ahead (set for the first KV head's item of a decode row, in a call with
 * several sequences: chunk_attention, run_item) it also requests the whole block that many
 * ahead, every KV head's keys and values. A decode row's items read each block once, a part of
 * it each (a third with 3 KV heads). With the whole blocks requested early by the first, the
 * others find theirs on chip, and DRAM serves each block as two runs instead of six pieces; in a
 * call of enough rows, one item runs all of a row's KV heads on one core (chunk_attention), so
 * they find them in its own L2. bf16 decode attention over 30 cold layers got 1.04-1.15x faster from 4
 * rows on, a whole decode step 1.00-1.04x (benchmarks/README.md). Prefill items read their keys
 * again and again from the caches and only lost by it (0.92-0.97x); 3 or 10 blocks ahead
 * instead of 6 were slower. */
static inline void KV_NAME(prefetch_blocks)(const KV_T *k_cache, const KV_T *v_cache, const int32_t *block_table,
                                            int position, int end, int kv_head, const Shape *s)
{
    const int head_dim = s->head_dim, block_size = s->block_size;
    const int64_t head_tile = (int64_t)head_dim * block_size, token_stride = (int64_t)s->num_kv_heads * head_dim;
    const int ahead = position + (PREFETCH_POSITIONS > block_size ? PREFETCH_POSITIONS : block_size);
    if (ahead < end)
        prefetch_range(k_cache + (block_table[ahead / block_size] * s->num_kv_heads + kv_head) * head_tile,
                       head_tile * (int64_t)sizeof(KV_T));
    const KV_T *values = v_cache + (int64_t)block_table[position / block_size] * block_size * token_stride +
                         (int64_t)kv_head * head_dim;
    const int count = end - position < block_size ? end - position : block_size;
    for (int t = 0; t < count; t++)
        prefetch_range(values + t * token_stride, head_dim * (int64_t)sizeof(KV_T));
    const int whole = position / block_size + s->whole_blocks_ahead;
    if (s->whole_blocks_ahead && whole <= (end - 1) / block_size) {
        const int64_t block_elements = s->num_kv_heads * head_tile; /* the same for keys and values */
        prefetch_range(k_cache + block_table[whole] * block_elements, block_elements * (int64_t)sizeof(KV_T));
        prefetch_range(v_cache + block_table[whole] * block_elements, block_elements * (int64_t)sizeof(KV_T));
    }
}

#if QUERY_PAIRS == 3
#define ITEM_VECTORS 16 /* AMX_ROWS: paged_attention_amx.h, below */
#else
#include "paged_attention_scores.h" /* pack_queries and tile_scores, per QUERY_PAIRS */
#define ITEM_VECTORS TILE
#endif

#include "paged_attention_values.h" /* value_weight16 and tile_values, per QUERY_PAIRS */

/* exp(x) of 16 lanes, for the softmax's weights (x = score - maximum: valid for x <= 0 only;
 * above about 88 the 2^n below wraps). GCC vectorized expf in tile_weights through libmvec's AVX2
 * form, eight lanes a call (it tunes these loops for 256-bit vectors); this made bf16 prefill
 * attention 1.05-1.16x faster on the AMX Xeon (2,048 tokens: 35.8 -> 33.4-34.3 ms,
 * benchmarks/cpu_attention.py). Here: x = n ln 2 + r with n = x / ln 2 rounded, so |r| <= ln 2 / 2;
 * exp(r) by Cephes' expf polynomial; 2^n put into the exponent bits. One float32 ln 2 is enough
 * (-ffast-math folds a two-part Cody-Waite constant into one anyway): as built, within 1.07 ulp of
 * the exact value over [-10, 0] and 4.5 ulp below, where a weight is under 5e-5 of the maximum's.
 * exp(0) is exactly 1 (n = 0, r = 0); below -87 (where 2^n would leave float32's normal range)
 * the result is exactly 0. NaN scores are outside the contract: the library is built with
 * -ffinite-math-only, and here a NaN gives 0. The lanes' arithmetic is fixed, whatever the vector
 * width the compiler maps vec16 to. */
#ifndef CHUNK_SOFTMAX_EXP
#define CHUNK_SOFTMAX_EXP
typedef int32_t ivec16 __attribute__((vector_size(64)));
static inline vec16 softmax_exp16(vec16 x)
{
    const vec16 lowest = (vec16){0} - 87.0f;
    const ivec16 underflow = x < lowest; /* -1 where the result is 0 */
    const vec16 clamped = (vec16)(((ivec16)x & ~underflow) | ((ivec16)lowest & underflow));
    const vec16 shifted = clamped * 1.44269504088896341f - 0.5f; /* x <= 0: truncation rounds to nearest */
    const ivec16 n = __builtin_convertvector(shifted, ivec16);
    const vec16 whole = __builtin_convertvector(n, vec16);
    const vec16 r = clamped - whole * 0.693147180559945f;
    vec16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const vec16 scale = (vec16)((n + 127) << 23);
    return (vec16)((ivec16)(p * scale) & ~underflow);
}
#endif

#ifndef CHUNK_SOFTMAX_UPDATE
#define CHUNK_SOFTMAX_UPDATE
/* The end of a key tile for one vector: its new maximum, and its weights' sums by lane (lane i
 * holds positions i, i + 16, ...: tile_weights), added across the lanes in a fixed order. Returns
 * the factor its output is rescaled by. Not inlined, so that every caller (tile_weights, and the
 * AMX form's softmax by lanes) runs this same code and gets the same bits. */
static __attribute__((noinline)) float softmax_update(VectorState *state, float new_max, vec16 sums)
{
    float sum = 0.0f;
    for (int i = 0; i < 16; i++)
        sum += sums[i];
    /* libm's expf, once per key tile: expf(0) is exactly 1, so an unchanged maximum leaves the
     * vector's state bit-identical, as the kernel's invariants need. */
    const float rescale = expf(state->max - new_max);
    state->sum = state->sum * rescale + sum;
    state->max = new_max;
    return rescale;
}

/* An item's width vectors before their first key tile; returns the last position any attends to. */
static inline int start_states(VectorState *states, int width)
{
    int last = 0;
    for (int v = 0; v < width; v++) {
        states[v].max = MASKED_SCORE;
        states[v].sum = 0.0f;
        last = states[v].position > last ? states[v].position : last;
    }
    return last;
}
#endif

/* Turns one vector's scores into weights (exp(score - new max); 0 past its position, up to
 * num_keys rounded up to 16), updates its max and sum, and returns the factor its output is
 * rescaled by. The loops run over the vector's own positions rounded up to 16, a count that
 * depends on its position alone, and sum the weights lane-wise then across the 16 lanes in a
 * fixed order: so the result does not depend on the tile mates that set num_keys. */
static float KV_NAME(tile_weights)(float *row, int start, int num_keys, VectorState *state)
{
    const int valid = state->position - start + 1 < num_keys ? state->position - start + 1 : num_keys;
    const int lanes = valid > 0 ? (valid + 15) / 16 * 16 : 0;
    for (int j = lanes; j < (num_keys + 15) / 16 * 16; j++)
        row[j] = 0.0f;
    if (valid <= 0)
        return 1.0f;
    const ivec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vec16 maxima = (vec16){0} + MASKED_SCORE;
    for (int j = 0; j < lanes; j += 16) {
        const vec16 scores = load16(row + j);
        const ivec16 keep = (lane + j < valid) & (scores > maxima);
        maxima = (vec16)(((ivec16)scores & keep) | ((ivec16)maxima & ~keep));
    }
    float tile_max = MASKED_SCORE;
    for (int i = 0; i < 16; i++)
        tile_max = maxima[i] > tile_max ? maxima[i] : tile_max;
    const float new_max = tile_max > state->max ? tile_max : state->max;
    vec16 sums = {0};
    for (int j = 0; j < lanes; j += 16) {
        const ivec16 in_range = lane + j < valid;
        const vec16 weights = (vec16)((ivec16)KV_NAME(value_weight16)(softmax_exp16(load16(row + j) - new_max)) &
                                      in_range);
        store16(row + j, weights);
        sums += weights;
    }
    return softmax_update(state, new_max, sums);
}

#if QUERY_PAIRS != 3
/* One work item: width (1, 2, 3, 4 or 8) (row, head) vectors of one sequence and KV head. queries[v]
 * and outputs[v] are padded with copies of vector 0 (position -1: computed, never stored). Each
 * vector's arithmetic is the same for every width: the width only sets how many run side by side
 * (a decode row of a GQA group of 3 takes width 3, not 8). */
static inline __attribute__((always_inline)) void KV_NAME(attend_tile)(
    float *const *outputs, const Q_T *const *queries, VectorState *states, const KV_T *k_cache,
    const KV_T *v_cache, const int32_t *block_table, int kv_head, const Shape *s, float *scores, float *acc,
    const int width)
{
    const int head_dim = s->head_dim;
    QueryWord packed[MAX_HEAD_DIM * TILE];
    KV_NAME(pack_queries)(packed, queries, head_dim, width);
    const int last = start_states(states, width);
    memset(acc, 0, sizeof(float) * width * head_dim);
    for (int start = 0; start <= last; start += KEY_TILE) {
        const int num_keys = last + 1 - start < KEY_TILE ? last + 1 - start : KEY_TILE;
        KV_NAME(tile_scores)(scores, packed, k_cache, v_cache, block_table, start, num_keys, last + 1, kv_head, s,
                             width);
        for (int v = 0; v < width; v++) {
            const float rescale = KV_NAME(tile_weights)(scores + v * KEY_TILE, start, num_keys, &states[v]);
            for (int d = 0; d < head_dim; d++)
                acc[v * head_dim + d] *= rescale;
        }
        KV_NAME(tile_values)(acc, scores, v_cache, block_table, start, num_keys, kv_head, s, width);
    }
    for (int v = 0; v < width; v++) {
        if (states[v].position < 0)
            continue;
        const float inv_sum = 1.0f / states[v].sum;
        for (int d = 0; d < head_dim; d++)
            outputs[v][d] = acc[v * head_dim + d] * inv_sum;
    }
}

/* attend_tile with width the smallest of 1, 2, 3, 4, 8 that holds num_vectors. */
static void KV_NAME(attend_tile_any)(float *const *outputs, const Q_T *const *queries, VectorState *states,
                                     const KV_T *k_cache, const KV_T *v_cache, const int32_t *block_table,
                                     int kv_head, const Shape *s, float *scores, float *acc, int num_vectors)
{
    if (num_vectors == 1)
        KV_NAME(attend_tile)(outputs, queries, states, k_cache, v_cache, block_table, kv_head, s, scores, acc, 1);
    else if (num_vectors == 2)
        KV_NAME(attend_tile)(outputs, queries, states, k_cache, v_cache, block_table, kv_head, s, scores, acc, 2);
    else if (num_vectors == 3)
        KV_NAME(attend_tile)(outputs, queries, states, k_cache, v_cache, block_table, kv_head, s, scores, acc, 3);
    else if (num_vectors == 4)
        KV_NAME(attend_tile)(outputs, queries, states, k_cache, v_cache, block_table, kv_head, s, scores, acc, 4);
    else
        KV_NAME(attend_tile)(outputs, queries, states, k_cache, v_cache, block_table, kv_head, s, scores, acc, TILE);
}
#else
#include "paged_attention_amx.h" /* attend_tile_any on AMX tiles */
#endif

/* Work item `index` of sequence seq (which has tiles_per_head items per KV head): finds its
 * vectors, their rows, heads and positions, and attends them. */
static void KV_NAME(run_item)(int64_t index, int64_t tiles_per_head, int seq, float *out, const Q_T *q,
                              const KV_T *k_cache, const KV_T *v_cache, const int32_t *block_tables,
                              const int32_t *query_start_loc, const int32_t *seq_lens, int max_blocks,
                              int64_t q_row_stride, const Shape *s, float *scratch)
{
    const int group = s->num_heads / s->num_kv_heads, head_dim = s->head_dim;
    const int kv_head = (int)(index / tiles_per_head);
    const int64_t first_vector = index % tiles_per_head * ITEM_VECTORS;
    const int query_len = query_start_loc[seq + 1] - query_start_loc[seq];
    const Q_T *queries[ITEM_VECTORS];
    float *outputs[ITEM_VECTORS];
    VectorState states[ITEM_VECTORS];
    for (int v = 0; v < ITEM_VECTORS; v++) {
        const int in_range = first_vector + v < (int64_t)query_len * group;
        const int64_t vector = in_range ? first_vector + v : first_vector; /* padding: vector 0 again */
        const int64_t row_in_seq = vector / group;
        const int head = kv_head * group + (int)(vector % group);
        const int64_t row = query_start_loc[seq] + row_in_seq;
        queries[v] = q + row * q_row_stride + (int64_t)head * head_dim;
        outputs[v] = out + (row * s->num_heads + head) * head_dim;
        states[v].position = in_range ? seq_lens[seq] - query_len + (int)row_in_seq : -1;
    }
    const int64_t remaining = (int64_t)query_len * group - first_vector;
    Shape item = *s;
    item.whole_blocks_ahead = query_len == 1 && kv_head == 0 ? s->whole_blocks_ahead : 0; /* see prefetch_blocks */
    KV_NAME(attend_tile_any)(outputs, queries, states, k_cache, v_cache, block_tables + (int64_t)seq * max_blocks,
                             kv_head, &item, scratch, scratch + ITEM_VECTORS * KEY_TILE,
                             remaining < ITEM_VECTORS ? (int)remaining : ITEM_VECTORS);
}

/* Returns 0 on success, -1 if scratch memory could not be allocated, -2 for a shape that
 * chunk_attention_supported refuses. */
int KV_NAME(chunk_attention)(float *out, const Q_T *q, const KV_T *k_cache, const KV_T *v_cache,
                             const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *seq_lens,
                             const int32_t *seq_ids, int num_selected, int num_heads, int num_kv_heads, int head_dim,
                             int block_size, int max_blocks, float scale, int64_t q_row_stride)
{
    if (!chunk_attention_supported(head_dim, block_size))
        return -2;
#if QUERY_PAIRS == 3
    if (head_dim % AMX_STEP)
        return -2;
#endif
    /* Whole blocks ahead for decode rows when there are several sequences (prefetch_blocks): a
     * lone row's three items have no later mate to find the blocks on chip (0.96x at 1 x 1,024). */
    const Shape shape = {num_heads, num_kv_heads, head_dim, block_size, scale,
                         num_selected > 1 ? WHOLE_BLOCKS_AHEAD : 0};
    const int group = num_heads / num_kv_heads;
    /* Items are numbered sequence after sequence, KV head after KV head within one; item_starts[i]
     * is the first of selected sequence i. A sequence has ceil(rows * group / ITEM_VECTORS) per KV
     * head, except a decode row in a call of at least ROW_ITEMS_PER_THREAD rows per thread: one item
     * runs all its KV heads, one after another on one thread. Its first KV head's pass requests
     * whole blocks ahead (prefetch_blocks), so the others read them from this core's L2 instead of
     * another core's requests landing late or twice. bf16 decode attention over 30 cold layers
     * (a step's): 17.2-17.6 -> 14.8-15.3 ms at 64 x 128, 29.6-30.0 -> 26.8-27.3 ms at 16 x 1,024
     * (an AMX Xeon, 2 threads, alternating; benchmarks/README.md). A lone row keeps its items on
     * both threads. Each vector's arithmetic is the same either way: results do not change. */
    const int row_items = num_selected >= ROW_ITEMS_PER_THREAD * omp_get_max_threads();
    int64_t *item_starts = malloc(sizeof(int64_t) * (num_selected + 1));
    if (!item_starts)
        return -1;
    item_starts[0] = 0;
    for (int i = 0; i < num_selected; i++) {
        const int seq = seq_ids[i];
        const int64_t vectors = (int64_t)(query_start_loc[seq + 1] - query_start_loc[seq]) * group;
        const int whole_row = row_items && vectors == group; /* one query row: a decode row */
        const int64_t items = whole_row ? 1 : (vectors + ITEM_VECTORS - 1) / ITEM_VECTORS * num_kv_heads;
        item_starts[i + 1] = item_starts[i] + items;
    }
    const int64_t num_items = item_starts[num_selected];
    int failed = 0;
#pragma omp parallel
    {
#if QUERY_PAIRS
        /* Denormal inputs and results as zero (DAZ, FTZ), as vdpbf16ps treats them whatever the
         * MXCSR says: so the two bf16-query forms agree on every input (paged_attention_scores.h). */
        const unsigned int caller_csr = _mm_getcsr();
        _mm_setcsr(caller_csr | 0x8040u);
#endif
#if QUERY_PAIRS == 3
        amx_configure(block_size < AMX_STEP ? block_size : AMX_STEP);
#endif
        float *scratch = malloc(sizeof(float) * ITEM_VECTORS * (KEY_TILE + head_dim));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            if (!scratch)
                continue;
            const int lo = owner_of(item_starts, num_selected, item), seq = seq_ids[lo];
            const int whole_row = row_items && query_start_loc[seq + 1] - query_start_loc[seq] == 1;
            const int64_t per_head = whole_row ? (group + ITEM_VECTORS - 1) / ITEM_VECTORS
                                               : (item_starts[lo + 1] - item_starts[lo]) / num_kv_heads;
            const int64_t first = whole_row ? 0 : item - item_starts[lo];
            const int64_t last = whole_row ? per_head * num_kv_heads : first + 1;
            for (int64_t sub = first; sub < last; sub++) /* the sequence's own item numbers */
                KV_NAME(run_item)(sub, per_head, seq, out, q, k_cache, v_cache, block_tables, query_start_loc,
                                  seq_lens, max_blocks, q_row_stride, &shape, scratch);
        }
        free(scratch);
#if QUERY_PAIRS == 3
        _tile_release();
#endif
#if QUERY_PAIRS
        _mm_setcsr(caller_csr);
#endif
    }
    free(item_starts);
    return failed ? -1 : 0;
}

#undef ITEM_VECTORS
