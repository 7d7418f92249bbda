/* The kernels of paged_attention.c for one KV element type: included once per type by it, with
 *   KV_T          the cache element type (float, or uint16_t holding bfloat16 or float16 bits),
 *   KV_LOAD16(p)  16 consecutive elements as a vec16 of floats,
 *   KV_TO_F(x)    one element as a float,
 *   KV_NAME(n)    the name of function n for this type (n itself for float).
 * Queries, scores, softmax and accumulators are float32 for every type. */

/* Scaled scores of every query head against every position: scores[h * context_len +
 * position]. A block's keys (all KV heads) are one contiguous 12 KiB run at
 * block_size 16, read front to back. */
static void KV_NAME(key_scores)(const float *q, const KV_T *k_cache, const int32_t *block_table, int context_len,
                       const Shape *s, float *scores)
{
    const int head_dim = s->head_dim, block_size = s->block_size;
    const int group = s->num_heads / s->num_kv_heads;
    const int64_t tile = (int64_t)head_dim * block_size; /* one KV head's keys in one block */
    const int64_t block_stride = s->num_kv_heads * tile;
    for (int start = 0, b = 0; start < context_len; start += block_size, b++) {
        const KV_T *block = k_cache + block_table[b] * block_stride;
        const int count = context_len - start < block_size ? context_len - start : block_size;
        if (start + block_size < context_len)
            prefetch_range(k_cache + block_table[b + 1] * block_stride, block_stride * (int64_t)sizeof(KV_T));
        for (int head = 0; head < s->num_heads; head++) {
            const KV_T *keys = block + (head / group) * tile;
            const float *q_row = q + head * head_dim;
            float *out = scores + (int64_t)head * context_len + start;
            if (block_size == 16) {
                /* Four partial sums over d, so consecutive FMAs do not wait on each other. */
                vec16 acc[4] = {{0}};
                for (int d = 0; d < head_dim; d += 4)
                    for (int u = 0; u < 4 && d + u < head_dim; u++)
                        acc[u] += q_row[d + u] * KV_LOAD16(keys + (d + u) * 16);
                /* A partial last block's lanes past `count` hold stale slots: computed, never stored. */
                const vec16 sum = (acc[0] + acc[1] + acc[2] + acc[3]) * s->scale;
                for (int j = 0; j < count; j++)
                    out[j] = sum[j];
            } else {
                for (int j = 0; j < count; j++)
                    out[j] = 0.0f;
                for (int d = 0; d < head_dim; d++) {
                    const float qd = q_row[d];
                    const KV_T *key_row = keys + (int64_t)d * block_size;
#pragma omp simd
                    for (int j = 0; j < count; j++)
                        out[j] += qd * KV_TO_F(key_row[j]);
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
static inline __attribute__((always_inline)) void KV_NAME(value_sum)(float *out, const float *weights, float inv_sum,
                                                            const KV_T *v_cache, const int32_t *block_table,
                                                            int context_len, int kv_head, const Shape *s,
                                                            const int head_dim)
{
    const int chunks = head_dim / 16;
    const int64_t token_stride = (int64_t)s->num_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)s->block_size * token_stride;
    vec16 even[8] = {{0}}, odd[8] = {{0}};
    for (int start = 0, b = 0; start < context_len; start += s->block_size, b++) {
        const KV_T *values = v_cache + block_table[b] * block_stride + (int64_t)kv_head * head_dim;
        const int count = context_len - start < s->block_size ? context_len - start : s->block_size;
        if (start + s->block_size < context_len) {
            const KV_T *next = v_cache + block_table[b + 1] * block_stride + (int64_t)kv_head * head_dim;
            for (int t = 0; t < s->block_size; t++)
                prefetch_range(next + t * token_stride, head_dim * (int64_t)sizeof(KV_T));
        }
        int j = 0;
        for (; j + 1 < count; j += 2) {
            const float w0 = weights[start + j], w1 = weights[start + j + 1];
            for (int c = 0; c < chunks; c++) {
                even[c] += w0 * KV_LOAD16(values + j * token_stride + 16 * c);
                odd[c] += w1 * KV_LOAD16(values + (j + 1) * token_stride + 16 * c);
            }
        }
        if (j < count)
            for (int c = 0; c < chunks; c++)
                even[c] += weights[start + j] * KV_LOAD16(values + j * token_stride + 16 * c);
    }
    for (int c = 0; c < chunks; c++)
        store16(out + 16 * c, (even[c] + odd[c]) * inv_sum);
}

/* The same for any head_dim, without the register blocking. */
static void KV_NAME(value_sum_any)(float *out, const float *weights, float inv_sum, const KV_T *v_cache,
                          const int32_t *block_table, int context_len, int kv_head, const Shape *s)
{
    const int head_dim = s->head_dim;
    const int64_t token_stride = (int64_t)s->num_kv_heads * head_dim;
    const int64_t block_stride = (int64_t)s->block_size * token_stride;
    for (int d = 0; d < head_dim; d++)
        out[d] = 0.0f;
    for (int start = 0, b = 0; start < context_len; start += s->block_size, b++) {
        const KV_T *values = v_cache + block_table[b] * block_stride + (int64_t)kv_head * head_dim;
        const int count = context_len - start < s->block_size ? context_len - start : s->block_size;
        for (int j = 0; j < count; j++) {
            const float w = weights[start + j];
#pragma omp simd
            for (int d = 0; d < head_dim; d++)
                out[d] += w * KV_TO_F(values[j * token_stride + d]);
        }
    }
    for (int d = 0; d < head_dim; d++)
        out[d] *= inv_sum;
}

static void KV_NAME(attend_row)(float *out, const float *q, const KV_T *k_cache, const KV_T *v_cache,
                       const int32_t *block_table, int context_len, const Shape *s, float *scores)
{
    const int num_heads = s->num_heads, head_dim = s->head_dim;
    const int group = num_heads / s->num_kv_heads;

    KV_NAME(key_scores)(q, k_cache, block_table, context_len, s, scores);

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
            KV_NAME(value_sum)(out + h * head_dim, scores + (int64_t)h * context_len, inv_sums[h], v_cache, block_table,
                      context_len, h / group, s, 64);
        else if (head_dim == 128)
            KV_NAME(value_sum)(out + h * head_dim, scores + (int64_t)h * context_len, inv_sums[h], v_cache, block_table,
                      context_len, h / group, s, 128);
        else
            KV_NAME(value_sum_any)(out + h * head_dim, scores + (int64_t)h * context_len, inv_sums[h], v_cache,
                          block_table, context_len, h / group, s);
    }
}

/* Returns 0 on success, -1 if scratch memory could not be allocated. */
int KV_NAME(paged_attention)(float *out, const float *q, const KV_T *k_cache, const KV_T *v_cache,
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
            const int lo = owner_of(row_starts, num_selected, item);
            const int seq = seq_ids[lo];
            const int row_in_seq = (int)(item - row_starts[lo]);
            const int query_len = query_start_loc[seq + 1] - query_start_loc[seq];
            const int context_len = seq_lens[seq] - query_len + row_in_seq + 1;
            const int64_t row = query_start_loc[seq] + row_in_seq;
            KV_NAME(attend_row)(out + row * num_heads * head_dim, q + row * q_row_stride, k_cache, v_cache,
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
void KV_NAME(store_kv)(KV_T *k_cache, KV_T *v_cache, const KV_T *k, const KV_T *v, const int64_t *slot_mapping,
              int num_tokens, int num_kv_heads, int head_dim, int block_size, int64_t k_row_stride,
              int64_t v_row_stride)
{
    const int64_t token_size = (int64_t)num_kv_heads * head_dim;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < num_tokens; t++) {
        const int64_t block = slot_mapping[t] / block_size, offset = slot_mapping[t] % block_size;
        memcpy(v_cache + (block * block_size + offset) * token_size, v + t * v_row_stride, sizeof(KV_T) * token_size);
        KV_T *keys = k_cache + block * block_size * token_size + offset;
        const KV_T *k_token = k + t * k_row_stride;
        for (int64_t i = 0; i < token_size; i++) /* i = kv_head * head_dim + d */
            keys[i * block_size] = k_token[i];
    }
}
