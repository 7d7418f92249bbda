/* Paged attention on the CPU, read straight from the block-paged KV cache.
 *
 * The torch reference gathers a sequence's blocks into a contiguous copy and then
 * runs SDPA over it, so decode (memory-bound) reads every key and value three
 * times. This kernel reads each once, in place.
 *
 * Layouts (float32, contiguous):
 *   q                 [num_tokens, num_heads, head_dim], rows q_row_stride apart
 *   out               [num_tokens, num_heads, head_dim]
 *   k_cache           [num_blocks, num_kv_heads, head_dim, block_size]   keys transposed
 *   v_cache           [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables      [num_seqs, max_blocks_per_seq]      int32
 *   query_start_loc   [num_seqs + 1]                      int32
 *   seq_lens          [num_seqs]                          int32
 *   seq_ids           [num_selected]                      int32, the sequences to compute
 *
 * Sequence i owns query rows query_start_loc[i] .. query_start_loc[i+1]-1; the last
 * of them sits at position seq_lens[i] - 1, and row r attends to positions 0 .. its
 * own (causal). Query head h reads KV head h / (num_heads / num_kv_heads) (GQA).
 *
 * Why keys are stored transposed: with a block's keys of one head as a
 * [head_dim, block_size] tile, the scores of all block_size positions are one
 * vector accumulated over head_dim (acc += q[d] * keys[d][0..15]), with no
 * horizontal sum per position. Values stay row-major: the output is a sum of
 * value rows, which vectorizes over head_dim as it is.
 *
 * One work item is one query row (all heads), so a row's result never depends on
 * what else is in the batch (batch invariance), and its arithmetic order is fixed.
 *
 * Built with -ffast-math so the loops and exp vectorize; that is safe here because
 * only valid positions reach the softmax (no -inf masking) and every softmax
 * subtracts its row maximum first.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* GCC/Clang vector extensions: 16 floats, compiled to whatever vector ISA -march
 * gives (one AVX-512 register, two AVX2 ones). memcpy = an unaligned load/store. */
typedef float vec16 __attribute__((vector_size(64)));
static inline vec16 load16(const float *p)
{
    vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void store16(float *p, vec16 v) { memcpy(p, &v, sizeof v); }

typedef struct {
    int num_heads, num_kv_heads, head_dim, block_size;
    float scale;
} Shape;

/* Blocks sit anywhere in the pool, so the hardware prefetcher loses the stream at
 * every block boundary; the next block is requested while this one is used. */
static inline void prefetch_range(const float *start, int64_t count)
{
    for (int64_t i = 0; i < count; i += 16)
        __builtin_prefetch(start + i, 0, 2); /* into L2: L1 is too small to hold a block ahead */
}

/* Scaled scores of every query head against every position: scores[h * context_len +
 * position]. A block's keys (all KV heads) are one contiguous 12 KiB run at
 * block_size 16, read front to back. */
static void key_scores(const float *q, const float *k_cache, const int32_t *block_table, int context_len,
                       const Shape *s, float *scores)
{
    const int head_dim = s->head_dim, block_size = s->block_size;
    const int group = s->num_heads / s->num_kv_heads;
    const int64_t tile = (int64_t)head_dim * block_size; /* one KV head's keys in one block */
    const int64_t block_stride = s->num_kv_heads * tile;
    for (int start = 0, b = 0; start < context_len; start += block_size, b++) {
        const float *block = k_cache + block_table[b] * block_stride;
        const int count = context_len - start < block_size ? context_len - start : block_size;
        if (start + block_size < context_len)
            prefetch_range(k_cache + block_table[b + 1] * block_stride, block_stride);
        for (int head = 0; head < s->num_heads; head++) {
            const float *keys = block + (head / group) * tile;
            const float *q_row = q + head * head_dim;
            float *out = scores + (int64_t)head * context_len + start;
            if (block_size == 16) {
                /* Four partial sums over d, so consecutive FMAs do not wait on each other. */
                vec16 acc[4] = {{0}};
                for (int d = 0; d < head_dim; d += 4)
                    for (int u = 0; u < 4 && d + u < head_dim; u++)
                        acc[u] += q_row[d + u] * load16(keys + (d + u) * 16);
                /* A partial last block's lanes past `count` hold stale slots: computed, never stored. */
                const vec16 sum = (acc[0] + acc[1] + acc[2] + acc[3]) * s->scale;
                for (int j = 0; j < count; j++)
                    out[j] = sum[j];
            } else {
                for (int j = 0; j < count; j++)
                    out[j] = 0.0f;
                for (int d = 0; d < head_dim; d++) {
                    const float qd = q_row[d];
                    const float *key_row = keys + (int64_t)d * block_size;
#pragma omp simd
                    for (int j = 0; j < count; j++)
                        out[j] += qd * key_row[j];
                }
                for (int j = 0; j < count; j++)
                    out[j] *= s->scale;
            }
        }
    }
}

/* out[0..head_dim) = inv_sum * sum over positions of weights[position] * value row.
 * Inlined with head_dim a constant (64, 128), so the accumulator lives in registers;
 * two positions per iteration, so consecutive FMAs do not wait on each other. */
static inline __attribute__((always_inline)) void value_sum(float *out, const float *weights, float inv_sum,
                                                            const float *v_cache, const int32_t *block_table,
                                                            int context_len, int kv_head, const Shape *s,
                                                            const int head_dim)
{
    const int chunks = head_dim / 16;
    const int64_t token_stride = (int64_t)s->num_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)s->block_size * token_stride;
    vec16 even[8] = {{0}}, odd[8] = {{0}};
    for (int start = 0, b = 0; start < context_len; start += s->block_size, b++) {
        const float *values = v_cache + block_table[b] * block_stride + (int64_t)kv_head * head_dim;
        const int count = context_len - start < s->block_size ? context_len - start : s->block_size;
        if (start + s->block_size < context_len) {
            const float *next = v_cache + block_table[b + 1] * block_stride + (int64_t)kv_head * head_dim;
            for (int t = 0; t < s->block_size; t++)
                prefetch_range(next + t * token_stride, head_dim);
        }
        int j = 0;
        for (; j + 1 < count; j += 2) {
            const float w0 = weights[start + j], w1 = weights[start + j + 1];
            for (int c = 0; c < chunks; c++) {
                even[c] += w0 * load16(values + j * token_stride + 16 * c);
                odd[c] += w1 * load16(values + (j + 1) * token_stride + 16 * c);
            }
        }
        if (j < count)
            for (int c = 0; c < chunks; c++)
                even[c] += weights[start + j] * load16(values + j * token_stride + 16 * c);
    }
    for (int c = 0; c < chunks; c++)
        store16(out + 16 * c, (even[c] + odd[c]) * inv_sum);
}

/* The same for any head_dim, without the register blocking. */
static void value_sum_any(float *out, const float *weights, float inv_sum, const float *v_cache,
                          const int32_t *block_table, int context_len, int kv_head, const Shape *s)
{
    const int head_dim = s->head_dim;
    const int64_t token_stride = (int64_t)s->num_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)s->block_size * token_stride;
    for (int d = 0; d < head_dim; d++)
        out[d] = 0.0f;
    for (int start = 0, b = 0; start < context_len; start += s->block_size, b++) {
        const float *values = v_cache + block_table[b] * block_stride + (int64_t)kv_head * head_dim;
        const int count = context_len - start < s->block_size ? context_len - start : s->block_size;
        for (int j = 0; j < count; j++) {
            const float w = weights[start + j];
#pragma omp simd
            for (int d = 0; d < head_dim; d++)
                out[d] += w * values[j * token_stride + d];
        }
    }
    for (int d = 0; d < head_dim; d++)
        out[d] *= inv_sum;
}

static void attend_row(float *out, const float *q, const float *k_cache, const float *v_cache,
                       const int32_t *block_table, int context_len, const Shape *s, float *scores)
{
    const int num_heads = s->num_heads, head_dim = s->head_dim;
    const int group = num_heads / s->num_kv_heads;

    key_scores(q, k_cache, block_table, context_len, s, scores);

    /* Softmax per query head; the 1/sum is applied once at the end. */
    float inv_sums[num_heads];
    for (int h = 0; h < num_heads; h++) {
        float *row = scores + (int64_t)h * context_len;
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
    for (int h = 0; h < num_heads; h++) {
        if (head_dim == 64)
            value_sum(out + h * head_dim, scores + (int64_t)h * context_len, inv_sums[h], v_cache, block_table,
                      context_len, h / group, s, 64);
        else if (head_dim == 128)
            value_sum(out + h * head_dim, scores + (int64_t)h * context_len, inv_sums[h], v_cache, block_table,
                      context_len, h / group, s, 128);
        else
            value_sum_any(out + h * head_dim, scores + (int64_t)h * context_len, inv_sums[h], v_cache,
                          block_table, context_len, h / group, s);
    }
}

/* Returns 0 on success, -1 if scratch memory could not be allocated. */
int paged_attention(float *out, const float *q, const float *k_cache, const float *v_cache,
                    const int32_t *block_tables, const int32_t *query_start_loc, const int32_t *seq_lens,
                    const int32_t *seq_ids, int num_selected, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int max_blocks, float scale, int64_t q_row_stride)
{
    const Shape shape = {num_heads, num_kv_heads, head_dim, block_size, scale};

    /* Work items (query rows) are numbered sequence after sequence; row_starts[i] is
     * the first of selected sequence i, so an item finds its sequence by binary search. */
    int64_t *row_starts = malloc(sizeof(int64_t) * (num_selected + 1));
    if (!row_starts)
        return -1;
    int max_context = 1;
    row_starts[0] = 0;
    for (int i = 0; i < num_selected; i++) {
        const int seq = seq_ids[i];
        row_starts[i + 1] = row_starts[i] + query_start_loc[seq + 1] - query_start_loc[seq];
        max_context = seq_lens[seq] > max_context ? seq_lens[seq] : max_context;
    }
    const int64_t num_rows = row_starts[num_selected];
    int failed = 0;

#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)max_context);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows; item++) {
            if (!scores)
                continue;
            int lo = 0, hi = num_selected - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (row_starts[mid] <= item)
                    lo = mid;
                else
                    hi = mid - 1;
            }
            const int seq = seq_ids[lo];
            const int row_in_seq = (int)(item - row_starts[lo]);
            const int query_len = query_start_loc[seq + 1] - query_start_loc[seq];
            const int context_len = seq_lens[seq] - query_len + row_in_seq + 1;
            const int64_t row = query_start_loc[seq] + row_in_seq;
            attend_row(out + row * num_heads * head_dim, q + row * q_row_stride, k_cache, v_cache,
                       block_tables + (int64_t)seq * max_blocks, context_len, &shape, scores);
        }
        free(scores);
    }
    free(row_starts);
    return failed ? -1 : 0;
}

/* Stores the step's new keys (transposed) and values at their slots.
 * k, v: [num_tokens, num_kv_heads, head_dim], rows k_row_stride / v_row_stride apart
 * (views into the fused QKV output); slot = block * block_size + offset. */
void store_kv(float *k_cache, float *v_cache, const float *k, const float *v, const int64_t *slot_mapping,
              int num_tokens, int num_kv_heads, int head_dim, int block_size, int64_t k_row_stride,
              int64_t v_row_stride)
{
    const int64_t token_size = (int64_t)num_kv_heads * head_dim;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        const int64_t block = slot_mapping[t] / block_size, offset = slot_mapping[t] % block_size;
        memcpy(v_cache + (block * block_size + offset) * token_size, v + t * v_row_stride, sizeof(float) * token_size);
        float *keys = k_cache + block * block_size * token_size + offset;
        const float *k_token = k + t * k_row_stride;
        for (int64_t i = 0; i < token_size; i++) /* i = kv_head * head_dim + d */
            keys[i * block_size] = k_token[i];
    }
}
