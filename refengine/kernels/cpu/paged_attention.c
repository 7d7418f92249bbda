/* Paged attention on the CPU, read straight from the block-paged KV cache.
 *
 * The torch reference gathers a sequence's blocks into a contiguous copy and then
 * runs SDPA over it, so decode (memory-bound) reads every key and value three
 * times. This kernel reads each once, in place.
 *
 * Layouts (float32, contiguous):
 *   q, out            [num_tokens, num_heads, head_dim]
 *   k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, max_blocks_per_seq]      int32
 *   query_start_loc   [num_seqs + 1]                      int32
 *   seq_lens          [num_seqs]                          int32
 *   seq_ids           [num_selected]                      int32, the sequences to compute
 *
 * Sequence i owns query rows query_start_loc[i] .. query_start_loc[i+1]-1; the last
 * of them sits at position seq_lens[i] - 1, and row r attends to positions 0 .. its
 * own (causal). Query head h reads KV head h / (num_heads / num_kv_heads) (GQA).
 *
 * One work item is one query row x one KV head, i.e. the group of query heads that
 * share that KV head, so each key and value row is loaded once for the whole group.
 * Items are independent, so a row's result never depends on what else is in the
 * batch (batch invariance), and each item's arithmetic order is fixed.
 *
 * Built with -ffast-math so the dot products and exp vectorize; that is safe here
 * because only valid positions are visited (no -inf masking) and every softmax
 * subtracts its row maximum first.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Blocks sit at random places in the pool, so the hardware prefetcher loses the
 * stream at every block boundary: while a block's token j is processed, token j of
 * the next block (or, for the last block, of the first value block) is requested. */
static inline void prefetch_token(const float *token, int64_t token_stride)
{
    for (int64_t i = 0; i < token_stride; i += 16)
        __builtin_prefetch(token + i, 0, 3);
}

typedef struct {
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale;
} Shape;

static void attend_row(float *out, const float *q, const float *k_cache, const float *v_cache,
                       const int32_t *block_table, int context_len, const Shape *s, float *scores)
{
    const int num_heads = s->num_heads, head_dim = s->head_dim;
    const int group = num_heads / s->num_kv_heads;
    const int64_t token_stride = (int64_t)s->num_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)s->block_size * token_stride;

    /* Pass 1: scaled scores, scores[h * context_len + position]. A cached token's keys
     * for all KV heads are one contiguous row, read front to back. */
    for (int start = 0, b = 0; start < context_len; start += s->block_size, b++) {
        const float *k_block = k_cache + block_table[b] * block_stride;
        const float *next_block = start + s->block_size < context_len ? k_cache + block_table[b + 1] * block_stride
                                                                      : v_cache + block_table[0] * block_stride;
        const int count = context_len - start < s->block_size ? context_len - start : s->block_size;
        for (int j = 0; j < count; j++) {
            const float *k_token = k_block + j * token_stride;
            prefetch_token(next_block + j * token_stride, token_stride);
            for (int h = 0; h < num_heads; h++) {
                const float *q_row = q + h * head_dim;
                const float *k_row = k_token + (h / group) * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; d++)
                    dot += q_row[d] * k_row[d];
                scores[h * context_len + start + j] = dot * s->scale;
            }
        }
    }

    /* Softmax per query head; the 1/sum is applied once at the end. */
    float inv_sums[num_heads];
    for (int h = 0; h < num_heads; h++) {
        float *row = scores + h * context_len;
        float max_score = row[0];
        for (int p = 1; p < context_len; p++)
            max_score = row[p] > max_score ? row[p] : max_score;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int p = 0; p < context_len; p++) {
            row[p] = expf(row[p] - max_score);
            sum += row[p];
        }
        inv_sums[h] = 1.0f / sum;
    }
    for (int i = 0; i < num_heads * head_dim; i++)
        out[i] = 0.0f;

    /* Pass 2: weighted sum of the values, again one contiguous row per token. */
    for (int start = 0, b = 0; start < context_len; start += s->block_size, b++) {
        const float *v_block = v_cache + block_table[b] * block_stride;
        const int count = context_len - start < s->block_size ? context_len - start : s->block_size;
        for (int j = 0; j < count; j++) {
            const float *v_token = v_block + j * token_stride;
            if (start + s->block_size < context_len)
                prefetch_token(v_cache + block_table[b + 1] * block_stride + j * token_stride, token_stride);
            for (int h = 0; h < num_heads; h++) {
                const float weight = scores[h * context_len + start + j];
                const float *v_row = v_token + (h / group) * head_dim;
                float *o = out + h * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++)
                    o[d] += weight * v_row[d];
            }
        }
    }
    for (int h = 0; h < num_heads; h++)
        for (int d = 0; d < head_dim; d++)
            out[h * head_dim + d] *= inv_sums[h];
}

/* Returns 0 on success, -1 if scratch memory could not be allocated. */
int paged_attention(float *out, const float *q, const float *k_cache, const float *v_cache,
                    const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *seq_lens,
                    const int32_t *seq_ids, int num_selected, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int max_blocks, float scale)
{
    const Shape shape = {num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale};

    /* Work items are numbered sequence after sequence; item_starts[i] is the first of
     * selected sequence i, so an item finds its sequence by binary search. */
    int64_t *item_starts = malloc(sizeof(int64_t) * (num_selected + 1));
    if (!item_starts)
        return -1;
    int max_context = 1;
    item_starts[0] = 0;
    for (int i = 0; i < num_selected; i++) {
        const int seq = seq_ids[i];
        const int query_len = query_start_loc[seq + 1] - query_start_loc[seq];
        item_starts[i + 1] = item_starts[i] + query_len;
        max_context = seq_lens[seq] > max_context ? seq_lens[seq] : max_context;
    }
    const int64_t num_items = item_starts[num_selected];
    int failed = 0;

#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)max_context);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            if (!scores)
                continue;
            int lo = 0, hi = num_selected - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (item_starts[mid] <= item)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            const int seq = seq_ids[lo];
            const int64_t local = item - item_starts[lo];
            const int row_in_seq = (int)local;
            const int query_len = query_start_loc[seq + 1] - query_start_loc[seq];
            const int context_len = seq_lens[seq] - query_len + row_in_seq + 1;
            const int64_t row = query_start_loc[seq] + row_in_seq;
            attend_row(out + row * num_heads * head_dim, q + row * num_heads * head_dim, k_cache, v_cache,
                       block_tables + (int64_t)seq * max_blocks, context_len, &shape, scores);
        }
        free(scores);
    }
    free(item_starts);
    return failed ? -1 : 0;
}
