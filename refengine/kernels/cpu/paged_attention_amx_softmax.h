/* The AMX form's softmax (paged_attention_amx.h): a key tile's transposed scores into softmax
 * weights and the value pass's B operand, with the vector forms' arithmetic (tile_weights,
 * softmax_update in paged_attention_chunk.h), so a row's weights are the same bits whichever way
 * its item is weighed. Included by paged_attention_amx.h once per instantiation, with its macros. */

/* amx_weights for narrow items: each vector's scores gathered into its row of `rows` and weighed
 * there by tile_weights itself. */
static vec16 KV_NAME(amx_row_weights)(uint32_t *pairs, float *rows, const float *scores, int start, int num_keys,
                                      int padded, VectorState *states, int width)
{
    vec16 rescale = (vec16){0} + 1.0f;
    memset(pairs, 0, sizeof(uint32_t) * padded / 2 * 16);
    for (int v = 0; v < width; v++) {
        float *row = rows + v * KEY_TILE;
        for (int j = 0; j < (num_keys + 15) / 16 * 16; j++)
            row[j] = scores[j * 16 + v];
        rescale[v] = KV_NAME(tile_weights)(row, start, num_keys, &states[v]);
        for (int p = 0; p < (num_keys + 1) / 2; p++) { /* tile_weights zeroed the row to a multiple of 16 */
            uint32_t bits[2];
            memcpy(bits, row + 2 * p, sizeof bits);
            pairs[p * 16 + v] = bits[0] >> 16 | (bits[1] & 0xFFFF0000u);
        }
    }
    return rescale;
}

/* The key tile's scores (transposed, scores[j * 16 + v]) into softmax weights with the vector
 * forms' arithmetic (tile_weights: rounded to bfloat16, 0 past a vector's position; its sums by
 * lane and softmax_update), packed as the value pass's B operand: pairs[p * 16 + v] = the bfloat16
 * weights of positions 2p (low half) and 2p + 1, 0 for padding vectors and up to `padded`
 * positions. Returns each lane's rescale factor (1 for padding).
 *
 * Two ways, the same bits. Wide items (prompt rows): lane by lane, every vector at once, as the
 * scores come; a position's exponentials for all 16 lanes. Narrow items (a decode row's GQA group,
 * 3 of 16 lanes): that would cost 16 / 3 times the exponentials, so each vector's scores are
 * gathered into a row of `rows` and weighed there by tile_weights itself. */
static vec16 KV_NAME(amx_weights)(uint32_t *pairs, float *rows, float *scores, int start, int num_keys,
                                  int padded, VectorState *states, int width)
{
    if (width <= 4)
        return KV_NAME(amx_row_weights)(pairs, rows, scores, start, num_keys, padded, states, width);
    vec16 rescale = (vec16){0} + 1.0f;
    ivec16 position = (ivec16){0} - 1;
    vec16 old_max = (vec16){0} + MASKED_SCORE, tile_max = old_max, partial[16];
    for (int v = 0; v < width; v++) {
        position[v] = states[v].position;
        old_max[v] = states[v].max;
    }
    for (int j = 0; j < num_keys; j++) {
        const vec16 score = load16(scores + j * 16);
        const ivec16 keep = (start + j <= position) & (score > tile_max);
        tile_max = (vec16)(((ivec16)score & keep) | ((ivec16)tile_max & ~keep));
    }
    const ivec16 grows = tile_max > old_max;
    const vec16 new_max = (vec16)(((ivec16)tile_max & grows) | ((ivec16)old_max & ~grows));
    for (int i = 0; i < 16; i++)
        partial[i] = (vec16){0};
    for (int j = num_keys; j < padded; j++)
        store16(scores + j * 16, (vec16){0});
    for (int j = 0; j < num_keys; j++) {
        const ivec16 valid = start + j <= position;
        const vec16 weights =
            (vec16)((ivec16)KV_NAME(value_weight16)(softmax_exp16(load16(scores + j * 16) - new_max)) & valid);
        store16(scores + j * 16, weights);
        partial[j % 16] += weights;
    }
    typedef uint32_t uvec16 __attribute__((vector_size(64)));
    for (int p = 0; p < padded / 2; p++) {
        const uvec16 even = (uvec16)load16(scores + 2 * p * 16), odd = (uvec16)load16(scores + (2 * p + 1) * 16);
        store16((float *)pairs + p * 16, (vec16)((even >> 16) | (odd & 0xFFFF0000u)));
    }
    for (int v = 0; v < width; v++) {
        vec16 sums;
        for (int i = 0; i < 16; i++)
            sums[i] = partial[i][v];
        rescale[v] = softmax_update(&states[v], new_max[v], sums);
    }
    return rescale;
}
