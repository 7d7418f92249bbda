/* A work item of the chunk kernel on AMX tiles (chunk_attention_bf16amx: bfloat16 queries on a
 * bfloat16 cache). Included by paged_attention_chunk.h with QUERY_PAIRS 3, in place of
 * paged_attention_scores.h; the driver (items, rows, threads) is the chunk kernel's, and so are
 * its invariants.
 *
 * Transposed products. An AMX tile product C += A . B pairs up its reduction dimension in B (B row
 * p holds elements 2p and 2p + 1 of each column, interleaved), and the cache holds neither keys nor
 * values that way. So the keys are the A operand and the queries the B operand, the other way
 * round from the vector forms:
 *   scores   S^T[position][vector] = sum over 32-dimension steps of keys (16 positions x 32
 *            dimensions, straight from the cache) . query pairs (packed once per item);
 *   values   O^T[dimension][vector] += values^T (16 dimensions x K positions, straight from the
 *            cache) . weight pairs (packed per key tile: one shift-and-mask per pair of positions).
 * For this the form has its own cache layout, the vector forms' two swapped (the backend stores
 * it by swapping the store's arguments, kernels/attention/cpu_paged.py):
 *   k_cache  [num_blocks, block_size, num_kv_heads, head_dim]   keys row-major
 *   v_cache  [num_blocks, num_kv_heads, head_dim, block_size]   values transposed
 * Nothing is repacked from the cache, and a 16-row tile is full even for a decode row: its 16 rows
 * are positions or dimensions, the item's vectors are the columns. The softmax has the vector
 * forms' arithmetic (tile_weights), run lane by lane on S^T's rows for wide items and row by row
 * for narrow ones (amx_weights).
 *
 * Why the bits do not depend on scheduling, though a TDPBF16PS sum is not a chain of vdpbf16ps
 * (it keeps more precision inside; paged_attention.c): element (i, j) of a TDPBF16PS result
 * depends on row i of A, column j of B and C[i][j] alone (the AMX GEMM rests on the same fact,
 * gemm_amx.c; test_amx_gemm.py checks it bit for bit). Every row, a prompt's and a decode row's
 * alike, takes this path: a vector's scores are the same keys against its own query column, in
 * the same 32-dimension steps; its softmax adds exactly 0 for a position past its own, in either
 * way amx_weights takes; its value sums take K-position steps at absolute positions (key tiles
 * start at multiples of KEY_TILE), and a step past its own position multiplies weights of exactly
 * 0, which leaves the sum as it is (a C tile starts at +0, and +0 plus a zero sum stays +0).
 * Values past the item's last position are copied as zeros, never read: a freed slot may hold a
 * NaN, and 0 x NaN is NaN. Which positions a narrow item requests ahead into L1 changes no bits.
 *
 * Tiles (amx_configure): 0 scores (C), 1 keys (A), 2 query pairs (B); 3 and 4 the output (C, 16
 * dimensions each), 5 and 7 values^T (A, K positions wide), 6 weight pairs (B, K / 2 rows). K is
 * 32 positions, or 16 where a block has 16 (a tile's rows lie in one block).
 */

#ifndef CHUNK_AMX_CONSTANTS
#define CHUNK_AMX_CONSTANTS
#include "amx_tiles.h"

enum { AMX_ROWS = 16, AMX_STEP = 32, AMX_MAX_STEPS = MAX_HEAD_DIM / AMX_STEP };

/* A tile load from memory this code has just written. GCC's _tile_loadd is an asm statement that
 * does not say it reads memory, so without the barrier the compiler may sink or drop the stores
 * that filled it (it did, in a first version that packed key tiles on the stack: the scores came
 * out as zeros or NaN). */
#define AMX_LOAD(tile, base, stride)                                                                   \
    do {                                                                                               \
        __asm__ volatile("" ::: "memory");                                                             \
        _tile_loadd(tile, base, stride);                                                               \
    } while (0)

/* The tiles of the header comment, for value steps of `value_step` positions. */
static void amx_configure(int value_step)
{
    AmxConfig config = amx_full_tiles();
    config.colsb[5] = config.colsb[7] = (uint16_t)(value_step * 2);
    config.rows[6] = (uint8_t)(value_step / 2);
    amx_load_config(&config);
}

#endif

/* pairs[step * 256 + p * 16 + v] = dimensions 32 step + 2p (low half) and + 2p + 1 of query v,
 * for the width vectors; 0 in the other columns. */
static void KV_NAME(amx_pack_queries)(uint32_t *pairs, const Q_T *const *queries, int head_dim, int width)
{
    memset(pairs, 0, sizeof(uint32_t) * head_dim / 2 * 16); /* padding columns: zeros, finite */
    for (int v = 0; v < width; v++)
        for (int d = 0; d < head_dim; d += 2)
            pairs[d / AMX_STEP * 256 + d % AMX_STEP / 2 * 16 + v] =
                (uint32_t)queries[v][d] | (uint32_t)queries[v][d + 1] << 16;
}

/* Where this layout keeps a KV head's keys from `position` on (rows token_stride apart), and its
 * values^T of dimension lo on from `position` (rows block_size apart). */
static inline const KV_T *KV_NAME(amx_keys_at)(const KV_T *k_cache, const int32_t *block_table, int position,
                                               int kv_head, const Shape *s)
{
    const int64_t block = block_table[position / s->block_size];
    return k_cache + (block * s->block_size + position % s->block_size) * s->num_kv_heads * s->head_dim +
           (int64_t)kv_head * s->head_dim;
}

static inline const KV_T *KV_NAME(amx_values_at)(const KV_T *v_cache, const int32_t *block_table, int position,
                                                 int kv_head, int lo, const Shape *s)
{
    const int64_t block = block_table[position / s->block_size];
    return v_cache + ((block * s->num_kv_heads + kv_head) * s->head_dim + lo) * s->block_size +
           position % s->block_size;
}

/* Requests the keys and values^T of this KV head in the block after the one at `position`. */
static inline void KV_NAME(amx_prefetch)(const KV_T *k_cache, const KV_T *v_cache, const int32_t *block_table,
                                         int position, int end, int kv_head, const Shape *s)
{
    const int first = (position / s->block_size + 1) * s->block_size;
    if (first >= end)
        return;
    const KV_T *keys = KV_NAME(amx_keys_at)(k_cache, block_table, first, kv_head, s);
    for (int t = 0; t < s->block_size; t++)
        prefetch_range(keys + (int64_t)t * s->num_kv_heads * s->head_dim, s->head_dim * (int64_t)sizeof(KV_T));
    prefetch_range(KV_NAME(amx_values_at)(v_cache, block_table, first, kv_head, 0, s),
                   (int64_t)s->head_dim * s->block_size * sizeof(KV_T));
}

/* Requests `rows` rows of `bytes` each, `stride` elements apart, into L1: a narrow item's next
 * tile of keys or values^T, while this one computes. Decode attention waits on its tile loads
 * (about 55 % of the kernel's samples in a perf profile), and the block-ahead requests only reach
 * L2: 30 layers of bf16 decode attention got 1.02-1.13x faster (64 x 128 to 16 x 1,024; a lone
 * row 0.96-1.02x). Wide items (prompt rows) find their keys in cache already and lost 2-3 %, so
 * only narrow items (ahead set) ask. */
static inline void KV_NAME(amx_rows_to_l1)(const KV_T *first, int64_t stride, int rows, int64_t bytes)
{
    for (int r = 0; r < rows; r++)
        for (int64_t b = 0; b < bytes; b += 64)
            __builtin_prefetch((const char *)(first + r * stride) + b, 0, 3);
}

/* scores[j * 16 + v] = scale * q_v . key(start + j) for the key tile's positions, 16 at a time
 * (num_keys rounded up to 16; rows past it are masked by amx_weights). */
static void KV_NAME(amx_scores)(float *scores, const uint32_t *query_pairs, const KV_T *k_cache,
                                const KV_T *v_cache, const int32_t *block_table, int start, int num_keys, int end,
                                int kv_head, const Shape *s, int ahead)
{
    const int head_dim = s->head_dim, block_size = s->block_size;
    const int64_t token_stride = (int64_t)s->num_kv_heads * head_dim;
    for (int offset = 0; offset < num_keys; offset += 16) {
        const int position = start + offset;
        const KV_T *keys = KV_NAME(amx_keys_at)(k_cache, block_table, position, kv_head, s);
        if (position % block_size == 0)
            KV_NAME(amx_prefetch)(k_cache, v_cache, block_table, position, end, kv_head, s);
        if (ahead && offset + 16 < num_keys) {
            const KV_T *next = KV_NAME(amx_keys_at)(k_cache, block_table, position + 16, kv_head, s);
            KV_NAME(amx_rows_to_l1)(next, token_stride, 16, head_dim * (int64_t)sizeof(KV_T));
        }
        _tile_zero(0);
        for (int step = 0; step < head_dim / AMX_STEP; step++) {
            AMX_LOAD(1, keys + step * AMX_STEP, token_stride * sizeof(KV_T));
            AMX_LOAD(2, query_pairs + step * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, scores + offset * 16, 64);
    }
    const vec16 scale = (vec16){0} + s->scale;
    for (int j = 0; j < (num_keys + 15) / 16 * 16; j++)
        store16(scores + j * 16, load16(scores + j * 16) * scale);
}

#include "paged_attention_amx_softmax.h" /* amx_weights: the scores into the value pass's weight pairs */

/* sums[d * 16 + v] = sum over the key tile's positions of weight(v, j) * value(start + j)[d], in
 * value steps of K positions, 32 dimensions a pass; pairs as amx_weights packs them. */
static void KV_NAME(amx_values)(float *sums, const uint32_t *pairs, const KV_T *v_cache, const int32_t *block_table,
                                int start, int num_keys, int end, int kv_head, const Shape *s, int value_step,
                                int ahead)
{
    const int head_dim = s->head_dim, block_size = s->block_size;
    const int rows = (num_keys + value_step - 1) / value_step * value_step;
    uint16_t masked[32 * AMX_STEP] __attribute__((aligned(64)));
    for (int lo = 0; lo < head_dim; lo += 32) {
        _tile_zero(3);
        _tile_zero(4);
        for (int step = 0; step < rows; step += value_step) {
            const int position = start + step;
            const KV_T *values = KV_NAME(amx_values_at)(v_cache, block_table, position, kv_head, lo, s);
            if (ahead && step + value_step < rows) {
                const KV_T *next = KV_NAME(amx_values_at)(v_cache, block_table, position + value_step, kv_head, lo, s);
                KV_NAME(amx_rows_to_l1)(next, block_size, 32, value_step * (int64_t)sizeof(KV_T));
            }
            int64_t stride = block_size * sizeof(KV_T);
            if (position + value_step > end) { /* the item's last positions: the slots past them unread */
                /* value_step <= 32 positions a row: one masked load (a mask of n low bits, n < 32) */
                const __mmask32 kept = (1u << (end - position)) - 1u, row = (uint32_t)(((uint64_t)1 << value_step) - 1);
                for (int d = 0; d < 32; d++)
                    _mm512_mask_storeu_epi16(masked + d * value_step, row,
                                             _mm512_maskz_loadu_epi16(kept, values + d * block_size));
                values = masked;
                stride = value_step * sizeof(KV_T);
            }
            AMX_LOAD(6, pairs + step / 2 * 16, 64);
            AMX_LOAD(5, values, stride);
            _tile_dpbf16ps(3, 5, 6);
            AMX_LOAD(7, values + 16 * stride / sizeof(KV_T), stride);
            _tile_dpbf16ps(4, 7, 6);
        }
        _tile_stored(3, sums + lo * 16, 64);
        _tile_stored(4, sums + (lo + 16) * 16, 64);
    }
}

/* The AMX form of attend_tile (paged_attention_chunk.h): the same arguments, the item's vectors as
 * the tiles' 16 columns (padded with copies of vector 0, position -1), width of them real.
 * `scores` holds the narrow path's weight rows, acc the output transposed ([head_dim][16]); the
 * transposed scores and the packed operands are on the stack. */
static void KV_NAME(attend_tile_any)(float *const *outputs, const Q_T *const *queries, VectorState *states,
                                     const KV_T *k_cache, const KV_T *v_cache, const int32_t *block_table,
                                     int kv_head, const Shape *s, float *scores, float *acc, int width)
{
    const int head_dim = s->head_dim, value_step = s->block_size < AMX_STEP ? s->block_size : AMX_STEP;
    uint32_t query_pairs[AMX_MAX_STEPS * 256] __attribute__((aligned(64)));
    float transposed[KEY_TILE * 16] __attribute__((aligned(64)));
    uint32_t pairs[KEY_TILE / 2 * 16] __attribute__((aligned(64)));
    float sums[MAX_HEAD_DIM * 16] __attribute__((aligned(64)));
    KV_NAME(amx_pack_queries)(query_pairs, queries, head_dim, width);
    const int last = start_states(states, width);
    memset(acc, 0, sizeof(float) * head_dim * 16);
    for (int start = 0; start <= last; start += KEY_TILE) {
        const int num_keys = last + 1 - start < KEY_TILE ? last + 1 - start : KEY_TILE;
        const int padded = (num_keys + value_step - 1) / value_step * value_step;
        KV_NAME(amx_scores)(transposed, query_pairs, k_cache, v_cache, block_table, start, num_keys, last + 1, kv_head,
                            s, width <= 4);
        const vec16 rescale = KV_NAME(amx_weights)(pairs, scores, transposed, start, num_keys, padded, states, width);
        KV_NAME(amx_values)(sums, pairs, v_cache, block_table, start, num_keys, last + 1, kv_head, s, value_step,
                            width <= 4);
        for (int d = 0; d < head_dim; d++)
            store16(acc + d * 16, load16(acc + d * 16) * rescale + load16(sums + d * 16));
    }
    for (int v = 0; v < width; v++) {
        if (states[v].position < 0)
            continue;
        const float inverse = 1.0f / states[v].sum;
        for (int d = 0; d < head_dim; d++)
            outputs[v][d] = acc[d * 16 + v] * inverse;
    }
}
