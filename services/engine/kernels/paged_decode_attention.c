/* Decode attention read straight from the paged KV cache (an fp32 or bf16 cache, CPU).
 *
 * One query token per sequence. For each (sequence, kv head) the kv head's query rows are
 * scored against every cached key of the sequence, block by block through its block table, then
 * the softmax-weighted values are summed. K and V are read once, in place: the torch path copies
 * each sequence's blocks into a padded buffer first (index_select) and then runs SDPA over it
 * (services/engine/paged_attention.py has the measurements).
 *
 * Layouts (all contiguous, row-major):
 *   q, out        [num_seqs, kv_heads, group, head_dim]  (query heads of kv head h: h*group ...)
 *   k_cache, v    [num_slots, kv_heads, head_dim]         (slot = block * block_size + offset),
 *                 fp32 (paged_decode_attention) or bf16 (paged_decode_attention_bf16); q, out
 *                 and all arithmetic are fp32 either way
 *   block_tables  [num_seqs, max_blocks] int64
 *   context_lens  [num_seqs] int64: keys 0 .. len-1 are visible (len >= 1)
 *
 * Built with -ffast-math (the dot products and the exponentials vectorise only so): no infinity
 * is used here, the maximum starts from the first score.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* Element i of a cache as a float. `bf16` is a constant at every call (always inlined), so each
 * caller gets its own loop, vectorised for its type. bf16 is the top half of an fp32: exact. */
static inline __attribute__((always_inline)) float load(const void *cache, int64_t i, const int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } v = { .u = (uint32_t)((const uint16_t *)cache)[i] << 16 };
        return v.f;
    }
    return ((const float *)cache)[i];
}

/* One sequence: all its kv heads at once, so that each cached slot (kv_heads * head_dim values)
 * and each block is read front to back, which the hardware prefetcher follows; a task per
 * (sequence, kv head) read one head's slice of each slot (a third, for SmolLM2) and ran 3-4x
 * slower, stalled on its loads. Offsets into the caches count elements. */
static inline __attribute__((always_inline)) void attend(
        const float *restrict q, const void *k_cache, const void *v_cache, const int64_t *restrict table,
        int64_t len, float *restrict out, float *restrict scores, int64_t rows, int64_t group,
        int64_t head_dim, int64_t block_size, float scale, const int bf16) {
    /* rows = kv_heads * group query rows; query row r belongs to kv head r / group. */
    const int64_t slot = rows / group * head_dim;      /* values per cached slot */
    const int64_t element = bf16 ? 2 : 4;
    for (int64_t start = 0, b = 0; start < len; start += block_size, b++) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t keys = table[b] * block_size * slot;
        if (start + block_size < len)
            __builtin_prefetch((const char *)k_cache + table[b + 1] * block_size * slot * element);
        for (int64_t i = 0; i < count; i++) {
            for (int64_t r = 0; r < rows; r++) {
                const int64_t key = keys + i * slot + r / group * head_dim;
                const float *restrict qr = q + r * head_dim;
                float acc = 0.0f;
                for (int64_t d = 0; d < head_dim; d++)
                    acc += qr[d] * load(k_cache, key + d, bf16);
                scores[r * len + start + i] = acc * scale;
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *restrict sr = scores + r * len;
        float best = sr[0];
        for (int64_t t = 1; t < len; t++)
            best = sr[t] > best ? sr[t] : best;
        float sum = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            sr[t] = expf(sr[t] - best);
            sum += sr[t];
        }
        const float inverse = 1.0f / sum;
        for (int64_t t = 0; t < len; t++)
            sr[t] *= inverse;
    }
    for (int64_t i = 0; i < rows * head_dim; i++)
        out[i] = 0.0f;
    for (int64_t start = 0, b = 0; start < len; start += block_size, b++) {
        const int64_t count = len - start < block_size ? len - start : block_size;
        const int64_t values = table[b] * block_size * slot;
        if (start + block_size < len)
            __builtin_prefetch((const char *)v_cache + table[b + 1] * block_size * slot * element);
        for (int64_t i = 0; i < count; i++) {
            for (int64_t r = 0; r < rows; r++) {
                const float p = scores[r * len + start + i];
                const int64_t value = values + i * slot + r / group * head_dim;
                float *restrict o = out + r * head_dim;
                for (int64_t d = 0; d < head_dim; d++)
                    o[d] += p * load(v_cache, value + d, bf16);
            }
        }
    }
}

/* Returns 0, or -1 when a sequence could not get its score buffer (out of memory). `threads` is
 * passed by the caller (torch.get_num_threads()): OpenMP's own default is per calling thread, and
 * the worker steps the engine in a thread of its own. */
static inline __attribute__((always_inline)) int attend_all(
        const float *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
        const int64_t *context_lens, float *out, int64_t num_seqs, int64_t kv_heads, int64_t group,
        int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int threads, const int bf16) {
    int failed = 0;
    const int64_t rows = kv_heads * group;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(|: failed)
    for (int64_t s = 0; s < num_seqs; s++) {
        float *scores = malloc(sizeof(float) * (size_t)(rows * context_lens[s]));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        attend(q + s * rows * head_dim, k_cache, v_cache, block_tables + s * max_blocks, context_lens[s],
               out + s * rows * head_dim, scores, rows, group, head_dim, block_size, scale, bf16);
        free(scores);
    }
    return failed ? -1 : 0;
}

int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, float *out,
                           int64_t num_seqs, int64_t kv_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, float scale, int threads) {
    return attend_all(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, kv_heads, group,
                      head_dim, block_size, max_blocks, scale, threads, 0);
}

int paged_decode_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int64_t *block_tables, const int64_t *context_lens, float *out,
                                int64_t num_seqs, int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t block_size, int64_t max_blocks, float scale, int threads) {
    return attend_all(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, kv_heads, group,
                      head_dim, block_size, max_blocks, scale, threads, 1);
}
