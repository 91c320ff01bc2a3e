/* Prompt attention read straight from the paged KV cache (an fp32 or bf16 cache, CPU).
 *
 * The rows are those of the paged decode kernel (kernels/paged_decode_attention.c): one query
 * token per row, with its sequence's block table and its own context length. A prompt chunk is
 * a run of such rows: the same table, lengths one apart. The decode kernel scores each (query
 * row, key) pair as a dot product ending in a horizontal sum, and reads every key once per query
 * token; over long contexts that is several times slower than SDPA. Here a run's keys are
 * transposed once per call into 16-key tiles ([head_dim][16], fp32), and a micro-tile of MR query
 * rows scores 16 keys with one fused multiply-add per (row, dimension): the scores of a row are a
 * chain over the dimensions in order, in the lanes of one vector, as a matrix product computes
 * them. The weighted values are summed the same way, MR rows x 64 dimensions in registers, the
 * keys in order. The keys are read where they lie in the cache: no gathered copy of the context,
 * which the SDPA path makes in every layer.
 *
 * A row's result depends only on that row (its query, table and length), not on which other rows
 * share its micro-tile or its call: a prompt token's attention is the same bits however its
 * prompt was chunked. It differs in its last bits from the decode kernel's, whose sums run in
 * another order; the engine's batch_invariant setting keeps prompts on the decode kernel.
 *
 * Layouts (all contiguous, row-major), as the decode kernel's:
 *   q, out        [rows, kv_heads, group, head_dim] fp32
 *   k_cache, v    [num_slots, kv_heads, head_dim] fp32 (paged_prompt_attention) or bf16 (_bf16)
 *   block_tables  [rows, max_blocks] int64; context_lens [rows] int64 (>= 1)
 * head_dim must be a multiple of 16 and group at most 16 (else the call returns 2 and does
 * nothing). Built with -ffast-math (the exponentials vectorise only so); no infinity is used.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16        /* keys scored at once: one vector of scores */
#define MR 4            /* query rows a micro-tile keeps in registers */
#define TOKENS 8        /* query tokens of a task (times the group: its rows) */
#define MAX_GROUP 16
#define CHUNK 4         /* vectors of a value row summed at once (64 dimensions) */

typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* Sixteen cache values from element i, widened to fp32 (bf16 is the top half of an fp32: exact). */
static inline __attribute__((always_inline)) v16 load16(const void *cache, int64_t i, const int bf16) {
    v16 out;
    if (bf16) {
        u16x16 half;
        memcpy(&half, (const uint16_t *)cache + i, sizeof half);
        const u32x16 wide = __builtin_convertvector(half, u32x16) << 16;
        memcpy(&out, &wide, sizeof out);
    } else {
        memcpy(&out, (const float *)cache + i, sizeof out);
    }
    return out;
}

struct run {                /* consecutive rows of one sequence */
    int64_t first, tokens;  /* its first row, and how many */
    int64_t len;            /* keys of its last (longest) row */
    int64_t tiles;          /* 16-key tiles covering them */
    float *kt;              /* [kv_heads][tiles][head_dim][16] transposed keys, zero past len */
    int64_t *where;         /* [len] element offset of each key's slot in the caches */
};

/* A 16 x 16 transpose in registers: at s = 8, 4, 2, 1, rows s apart swap the (s x s)-lane blocks
 * that lie off the diagonal of their (2s x 2s) block. */
static inline __attribute__((always_inline)) void transpose16(v16 r[LANES]) {
    for (int i = 0; i < 8; i++) {
        const v16 a = r[i], b = r[i + 8];
        r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        r[i + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < LANES; i++) {
        if (i & 4)
            continue;
        const v16 a = r[i], b = r[i + 4];
        r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
        r[i + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    for (int i = 0; i < LANES; i++) {
        if (i & 2)
            continue;
        const v16 a = r[i], b = r[i + 2];
        r[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
        r[i + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    for (int i = 0; i < LANES; i += 2) {
        const v16 a = r[i], b = r[i + 1];
        r[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        r[i + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
}

/* Keys 16 tile .. 16 tile + 15 of kv head h as kt[d][key] (zero past the run's keys), 16
 * dimensions at a time through registers. */
static inline __attribute__((always_inline)) void transpose_tile(
        const void *k_cache, const struct run *run, int64_t h, int64_t tile, int64_t head_dim,
        float *restrict kt, const int bf16) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += LANES) {
        v16 r[LANES];
        for (int64_t j = 0; j < LANES; j++) {
            const int64_t t = tile * LANES + j;
            r[j] = t < run->len ? load16(k_cache, run->where[t] + h * head_dim + d0, bf16) : (v16){0};
        }
        transpose16(r);
        for (int64_t d = 0; d < LANES; d++)
            memcpy(kt + (d0 + d) * LANES, &r[d], sizeof r[d]);
    }
}

/* Rows of `count` tokens (from token t0 of the run) for kv head h: scores, softmax, values. */
static inline __attribute__((always_inline)) void attend_task(
        const float *q, const void *v_cache, const struct run *run, const int64_t *lens, int64_t t0,
        int64_t count, int64_t h, float *out, float *restrict scores, int64_t kv_heads, int64_t group,
        int64_t head_dim, float scale, const int bf16) {
    const int64_t rows = count * group;
    const int64_t width = (lens[run->first + t0 + count - 1] + LANES - 1) / LANES * LANES;
    const float *qrow[TOKENS * MAX_GROUP];
    float *orow[TOKENS * MAX_GROUP];
    int64_t len[TOKENS * MAX_GROUP];
    float inverse[TOKENS * MAX_GROUP];
    for (int64_t r = 0; r < rows; r++) {          /* token-major, so lengths never decrease */
        const int64_t row = run->first + t0 + r / group;
        const int64_t at = ((row * kv_heads + h) * group + r % group) * head_dim;
        qrow[r] = q + at;
        orow[r] = out + at;
        len[r] = lens[row];
    }
    const float *kt_head = run->kt + h * run->tiles * head_dim * LANES;
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        const int m_rows = rows - r0 < MR ? (int)(rows - r0) : MR;
        /* a short micro-tile repeats its first row in the unused lanes, never stored */
        const float *qm[MR];
        for (int m = 0; m < MR; m++)
            qm[m] = qrow[r0 + (m < m_rows ? m : 0)];
        for (int64_t tile = 0; tile * LANES < len[r0 + m_rows - 1]; tile++) {
            const float *restrict kt = kt_head + tile * head_dim * LANES;
            v16 acc[MR] = {{0}};
            for (int64_t d = 0; d < head_dim; d++) {
                v16 k;
                memcpy(&k, kt + d * LANES, sizeof k);
                for (int m = 0; m < MR; m++)
                    acc[m] += k * qm[m][d];
            }
            for (int m = 0; m < m_rows; m++) {
                const v16 s = acc[m] * scale;
                memcpy(scores + (r0 + m) * width + tile * LANES, &s, sizeof s);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float *restrict sr = scores + r * width;
        float best = sr[0];
        for (int64_t t = 1; t < len[r]; t++)
            best = sr[t] > best ? sr[t] : best;
        float sum = 0.0f;
        for (int64_t t = 0; t < len[r]; t++) {
            sr[t] = expf(sr[t] - best);
            sum += sr[t];
        }
        for (int64_t t = len[r]; t < width; t++)       /* keys past the row's own: weight 0 */
            sr[t] = 0.0f;
        inverse[r] = 1.0f / sum;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        const int m_rows = rows - r0 < MR ? (int)(rows - r0) : MR;
        const float *pm[MR];
        for (int m = 0; m < MR; m++)
            pm[m] = scores + (r0 + (m < m_rows ? m : 0)) * width;
        const int64_t keys = len[r0 + m_rows - 1];
        for (int64_t d0 = 0; d0 < head_dim; d0 += CHUNK * LANES) {
            const int chunks = head_dim - d0 < CHUNK * LANES ? (int)((head_dim - d0) / LANES) : CHUNK;
            v16 o[MR][CHUNK] = {{{0}}};
            for (int64_t t = 0; t < keys; t++) {
                const int64_t value = run->where[t] + h * head_dim + d0;
                v16 v[CHUNK];
                for (int c = 0; c < CHUNK; c++)
                    v[c] = c < chunks ? load16(v_cache, value + c * LANES, bf16) : (v16){0};
                for (int m = 0; m < MR; m++)
                    for (int c = 0; c < CHUNK; c++)
                        o[m][c] += pm[m][t] * v[c];
            }
            for (int m = 0; m < m_rows; m++)
                for (int c = 0; c < chunks; c++) {
                    const v16 result = o[m][c] * inverse[r0 + m];
                    memcpy(orow[r0 + m] + d0 + c * LANES, &result, sizeof result);
                }
        }
    }
}

static inline int64_t tasks_of(const struct run *run) {
    return (run->tokens + TOKENS - 1) / TOKENS;
}

/* Returns 0; 2 for a shape it does not take; -1 when it could not allocate its buffers.
 * `threads` as the decode kernel's (torch.get_num_threads(), passed by the caller). */
static inline __attribute__((always_inline)) int attend_all(
        const float *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
        const int64_t *lens, float *out, int64_t num_rows, int64_t kv_heads, int64_t group,
        int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int threads, const int bf16) {
    if (head_dim % LANES || group > MAX_GROUP || num_rows < 1)
        return num_rows < 1 ? 0 : 2;
    struct run *runs = malloc(sizeof(struct run) * (size_t)num_rows);
    if (runs == NULL)
        return -1;
    int64_t num_runs = 0;
    for (int64_t s = 0; s < num_rows; s++) {
        const int64_t *table = block_tables + s * max_blocks;
        if (num_runs && lens[s] == lens[s - 1] + 1
                && !memcmp(table, table - max_blocks, sizeof(int64_t) * (size_t)max_blocks))
            runs[num_runs - 1].tokens++;
        else
            runs[num_runs++] = (struct run){ .first = s, .tokens = 1 };
    }
    int64_t kt_floats = 0, where_ints = 0, tiles = 0, tasks = 0;
    for (int64_t i = 0; i < num_runs; i++) {
        struct run *run = &runs[i];
        run->len = lens[run->first + run->tokens - 1];
        run->tiles = (run->len + LANES - 1) / LANES;
        kt_floats += kv_heads * run->tiles * head_dim * LANES;
        where_ints += run->len;
        tiles += kv_heads * run->tiles;
        tasks += kv_heads * tasks_of(run);
    }
    float *kt = malloc(sizeof(float) * (size_t)kt_floats);
    int64_t *where = malloc(sizeof(int64_t) * (size_t)where_ints);
    if (kt == NULL || where == NULL) {
        free(runs), free(kt), free(where);
        return -1;
    }
    for (int64_t i = 0, k = 0, w = 0; i < num_runs; i++) {
        struct run *run = &runs[i];
        const int64_t *table = block_tables + run->first * max_blocks;
        run->kt = kt + k;
        run->where = where + w;
        k += kv_heads * run->tiles * head_dim * LANES;
        w += run->len;
        for (int64_t t = 0; t < run->len; t++)
            run->where[t] = (table[t / block_size] * block_size + t % block_size) * kv_heads * head_dim;
    }
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
    for (int64_t u = 0; u < tiles; u++) {
        int64_t i = 0, rest = u;
        while (rest >= kv_heads * runs[i].tiles)
            rest -= kv_heads * runs[i++].tiles;
        transpose_tile(k_cache, &runs[i], rest / runs[i].tiles, rest % runs[i].tiles, head_dim,
                       runs[i].kt + rest * head_dim * LANES, bf16);
    }
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(|: failed)
    for (int64_t task = 0; task < tasks; task++) {
        int64_t i = 0, rest = task;
        while (rest >= kv_heads * tasks_of(&runs[i]))
            rest -= kv_heads * tasks_of(&runs[i++]);
        const struct run *run = &runs[i];
        const int64_t h = rest / tasks_of(run), t0 = rest % tasks_of(run) * TOKENS;
        const int64_t count = run->tokens - t0 < TOKENS ? run->tokens - t0 : TOKENS;
        const int64_t width = (lens[run->first + t0 + count - 1] + LANES - 1) / LANES * LANES;
        float *scores = malloc(sizeof(float) * (size_t)(count * group * width));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        attend_task(q, v_cache, run, lens, t0, count, h, out, scores, kv_heads, group, head_dim, scale, bf16);
        free(scores);
    }
    free(runs), free(kt), free(where);
    return failed ? -1 : 0;
}

int paged_prompt_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, float *out,
                           int64_t num_rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, float scale, int threads) {
    return attend_all(q, k_cache, v_cache, block_tables, context_lens, out, num_rows, kv_heads, group,
                      head_dim, block_size, max_blocks, scale, threads, 0);
}

int paged_prompt_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int64_t *block_tables, const int64_t *context_lens, float *out,
                                int64_t num_rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t block_size, int64_t max_blocks, float scale, int threads) {
    return attend_all(q, k_cache, v_cache, block_tables, context_lens, out, num_rows, kv_heads, group,
                      head_dim, block_size, max_blocks, scale, threads, 1);
}
