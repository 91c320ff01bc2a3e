/* Attention read straight from the paged KV cache (an fp32 or bf16 cache, CPU): decodes and prompt
 * chunks alike.
 *
 * Every query token is a row with its sequence's block table and its own context length: a
 * decode is one row, a prompt chunk a run of rows (the same table, lengths one apart). A
 * micro-tile of MR query rows scores a tile of up to TILE keys with a fused multiply-add per
 * (row, dimension, vector): the scores of a row are a chain over the dimensions in order, in the
 * lanes of the tile's vectors, as a matrix product computes them. This needs the keys transposed,
 * and the cache keeps them so: each block's keys are stored [kv_heads][head_dim][block_size] (the
 * engine writes them that way: services/engine/kv_cache.py, kernels/decode_layer.c), so a tile is
 * one or two vector loads per dimension. The weighted values are summed the same way, MR rows x
 * CHUNK vectors in registers, the keys in order. K and V are read where they lie: no gathered
 * copy of the context, which the SDPA path makes in every layer.
 *
 * A row's result depends only on that row (its query, table and length), not on which other rows
 * share its micro-tile, its task or its call: the softmax is one copy of machine code per cache
 * dtype whichever path feeds it; a row's scores and value sums are the same chain of fused
 * multiply-adds (over the dimensions, over the keys in order) whichever micro-tile copy computes
 * them (one per row count: ROW_COUNTS) and whatever the tile's width; and a decode's value sums
 * (values_heads_*) are the same operations in the same order as a prompt row's (values_*). So a
 * token's attention is the same bits whether it is a decode or inside a prompt, however its
 * prompt was chunked, whatever else shares its step, and when it is recomputed (after a
 * preemption or a failover).
 *
 * Layouts (all contiguous, row-major):
 *   q, out        [rows, kv_heads, group, head_dim] fp32
 *   k_cache       [num_blocks, kv_heads, head_dim, block_size] fp32 (paged_attention) or bf16
 *                 (paged_attention_bf16): keys transposed within each block
 *   v_cache       [num_blocks * block_size, kv_heads, head_dim], same dtype (slot = block *
 *                 block_size + offset)
 *   block_tables  [rows, max_blocks] int64; context_lens [rows] int64 (>= 1)
 * head_dim must be a multiple of 16 up to 256 and group at most 16 (else the call returns 2 and
 * does nothing). Built with -ffast-math (the exponentials vectorise only so); no infinity is used.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A vector (LANES floats) is as wide as the flags' registers: GCC keeps a vector wider than the
 * registers in memory, where every operation loads and stores (built for AVX2 with 16-wide
 * vectors, prompt chunks ran at a quarter of their speed with 8-wide ones, and decodes at a third
 * of the dot-product kernel's this one replaced). A tile of keys (TILE) is one vector with
 * AVX-512, two otherwise, so that each query value broadcast serves 16 keys (8 without AVX):
 * 1.04-1.17x on AVX2 builds' decodes and prompt chunks, against 8-key tiles. The per-lane
 * arithmetic is the same at every width, so on each build a row's result does not depend on its
 * tile, and batch invariance holds. */
#if defined(__AVX512F__)
#define LANES 16
#define TILE 16
#elif defined(__AVX__)
#define LANES 8
#define TILE 16
#else
#define LANES 4
#define TILE 8
#endif
#define TV (TILE / LANES)         /* vectors of a tile */
#define MR 4            /* query rows a micro-tile keeps in registers */
/* A copy of a micro-tile function per row count up to MR (name_1 .. name_4), so a micro-tile with
 * fewer rows (a decode of a group under MR: SmolLM2's 3, a model without grouped queries' 1; a
 * chunk's last rows) does the arithmetic of its rows only, where it repeated its first row. */
#define ROW_COUNTS(macro, name, bf16) macro(name##_1, bf16, 1) macro(name##_2, bf16, 2) \
                                      macro(name##_3, bf16, 3) macro(name##_4, bf16, 4)
#define TOKENS 8        /* query tokens of a task (times the group: its rows) */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define SEGMENT 256     /* keys whose values are summed before the next kv head's */
#define HG 4            /* kv heads whose values a decode sums in one pass */
/* Value vectors summed at once: MR x CHUNK = 16 accumulators, half of AVX-512's registers and
 * all of AVX2's (there 4 ran 1.1-1.2x faster than 2 on prompts, with half the passes over the
 * values; without AVX 1.1x too). */
#define CHUNK 4

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
/* chunks in a 64-byte cache line */
#define LINE_CHUNKS(bf16) (64 / (LANES * ((bf16) ? 2 : 4)) > 1 ? 64 / (LANES * ((bf16) ? 2 : 4)) : 1)

/* LANES cache values from element i, widened to fp32 (bf16 is the top half of an fp32: exact). */
static inline __attribute__((always_inline)) vf load_lanes(const void *cache, int64_t i, const int bf16) {
    vf out;
    if (bf16) {
        vh half;
        memcpy(&half, (const uint16_t *)cache + i, sizeof half);
        const vu wide = __builtin_convertvector(half, vu) << 16;
        memcpy(&out, &wide, sizeof out);
    } else {
        memcpy(&out, (const float *)cache + i, sizeof out);
    }
    return out;
}

struct run {                /* consecutive rows of one sequence */
    int64_t first, tokens;  /* its first row, and how many */
    int64_t len;            /* keys of its last (longest) row */
    const int64_t *table;   /* its block table */
    int64_t *where;         /* [len] element offset of each key's slot in the value cache */
};

/* Scores of R query rows against a TILE-key tile of one kv head (kt: its dimension-0 keys; those of
 * dimension d lie d * stride elements further), each a chain of fused multiply-adds over the
 * dimensions in order, times the scale. Never inlined: every path calls these few copies (one per
 * dtype and row count), each lane the same chain, so a row's scores are the same bits whichever
 * computes it (the batch-invariance tests hold a decode, R = its group, to its token in a chunk). */
#define SCORES_OF(name, bf16, R)                                                                      \
static __attribute__((noinline)) void name(const void *kt, int64_t stride, const float *const qm[MR], \
                                           int64_t head_dim, float scale, float out[MR][TILE]) {      \
    vf acc[R][TV] = {{{0}}};                                                                          \
    for (int64_t d = 0; d < head_dim; d++) {                                                          \
        vf k[TV];                                                                                     \
        for (int j = 0; j < TV; j++)                                                                  \
            k[j] = load_lanes(kt, d * stride + j * LANES, bf16);                                      \
        for (int m = 0; m < R; m++)                                                                   \
            for (int j = 0; j < TV; j++)                                                              \
                acc[m][j] += k[j] * qm[m][d];                                                         \
    }                                                                                                 \
    for (int m = 0; m < R; m++)                                                                       \
        for (int j = 0; j < TV; j++) {                                                                \
            const vf scaled = acc[m][j] * scale;                                                      \
            memcpy(out[m] + j * LANES, &scaled, sizeof scaled);                                       \
        }                                                                                             \
}
typedef void (*scores_fn)(const void *, int64_t, const float *const [MR], int64_t, float, float [MR][TILE]);
ROW_COUNTS(SCORES_OF, scores_f32, 0)
ROW_COUNTS(SCORES_OF, scores_bf16, 1)
static const scores_fn SCORES_F32[MR + 1] = { NULL, scores_f32_1, scores_f32_2, scores_f32_3, scores_f32_4 };
static const scores_fn SCORES_BF16[MR + 1] = { NULL, scores_bf16_1, scores_bf16_2, scores_bf16_3, scores_bf16_4 };

/* Softmax of a row's scores over its `len` keys in place, zero up to `width`; returns 1 / sum.
 * Not inlined, as the scores. */
static __attribute__((noinline)) float softmax_row(float *restrict sr, int64_t len, int64_t width) {
    float best = sr[0];
    for (int64_t t = 1; t < len; t++)
        best = sr[t] > best ? sr[t] : best;
    float sum = 0.0f;
    for (int64_t t = 0; t < len; t++) {
        sr[t] = expf(sr[t] - best);
        sum += sr[t];
    }
    for (int64_t t = len; t < width; t++)       /* keys past the row's own: weight 0 */
        sr[t] = 0.0f;
    return 1.0f / sum;
}

/* o[m] = sum over keys t of p[m][t] * value t (`chunks` vectors from offset), keys in order,
 * for R rows at once; with `ahead`, the lines it reads are prefetched a tile ahead. Not inlined,
 * as the scores; one copy per cache dtype and row count. */
#define VALUES(name, bf16, R)                                                                         \
static __attribute__((noinline)) void name(const float *const pm[MR], int64_t keys,                   \
        const int64_t *restrict where, const void *v_cache, int64_t offset, int chunks, int ahead,    \
        vf o[MR][CHUNK]) {                                                                            \
    for (int m = 0; m < R; m++)                                                                       \
        for (int c = 0; c < CHUNK; c++)                                                               \
            o[m][c] = (vf){0};                                                                        \
    for (int64_t t = 0; t < keys; t++) {                                                              \
        if (ahead && t + TILE < keys)  /* a tile ahead, every line read: across the jumps to other    \
                                           blocks and heads, which the hardware's prefetch misses */  \
            for (int c = 0; c < chunks; c += LINE_CHUNKS(bf16))     /* a 64-byte line at a time */    \
                __builtin_prefetch((const char *)v_cache + (where[t + TILE] + offset + c * LANES) * (bf16 ? 2 : 4)); \
        vf v[CHUNK];                                                                                  \
        for (int c = 0; c < CHUNK; c++)                                                               \
            v[c] = c < chunks ? load_lanes(v_cache, where[t] + offset + c * LANES, bf16) : (vf){0};   \
        for (int m = 0; m < R; m++)                                                                   \
            for (int c = 0; c < CHUNK; c++)                                                           \
                o[m][c] += pm[m][t] * v[c];                                                           \
    }                                                                                                 \
}
typedef void (*values_fn)(const float *const [MR], int64_t, const int64_t *, const void *, int64_t, int, int,
                          vf [MR][CHUNK]);
ROW_COUNTS(VALUES, values_f32, 0)
ROW_COUNTS(VALUES, values_bf16, 1)
static const values_fn VALUES_F32[MR + 1] = { NULL, values_f32_1, values_f32_2, values_f32_3, values_f32_4 };
static const values_fn VALUES_BF16[MR + 1] = { NULL, values_bf16_1, values_bf16_2, values_bf16_3, values_bf16_4 };

/* The same sums for up to HG heads' micro-tiles at once (o[h][m], values at offset[h] of each
 * slot), keys in order: a decode reads each slot's heads side by side in one pass, where a pass
 * per head read a third of every slot and streamed the cache at two thirds of the speed (fp32,
 * a sequence's blocks side by side). Each sum is the same operations in the same order as in
 * values_*, so a row's values are the same bits on either path (the tests hold a token alone,
 * which takes this one, to the same token in a chunk, which takes the other). */
#define VALUES_HEADS(name, bf16, R)                                                                   \
static __attribute__((noinline)) void name(const float *const pm[HG][MR], int nh, int64_t keys,       \
        const int64_t *restrict where, const void *v_cache, const int64_t offset[HG], int chunks,     \
        vf o[HG][MR][CHUNK]) {                                                                        \
    for (int h = 0; h < nh; h++)                                                                      \
        for (int m = 0; m < R; m++)                                                                   \
            for (int c = 0; c < CHUNK; c++)                                                           \
                o[h][m][c] = (vf){0};                                                                 \
    for (int64_t t = 0; t < keys; t++) {                                                              \
        if (t + TILE < keys)                                                                          \
            for (int h = 0; h < nh; h++)                                                              \
                for (int c = 0; c < chunks; c += LINE_CHUNKS(bf16))                                   \
                    __builtin_prefetch((const char *)v_cache + (where[t + TILE] + offset[h] + c * LANES) * (bf16 ? 2 : 4)); \
        for (int h = 0; h < nh; h++) {                                                                \
            vf v[CHUNK];                                                                              \
            for (int c = 0; c < CHUNK; c++)                                                           \
                v[c] = c < chunks ? load_lanes(v_cache, where[t] + offset[h] + c * LANES, bf16) : (vf){0}; \
            for (int m = 0; m < R; m++)                                                               \
                for (int c = 0; c < CHUNK; c++)                                                       \
                    o[h][m][c] += pm[h][m][t] * v[c];                                                 \
        }                                                                                             \
    }                                                                                                 \
}
typedef void (*values_heads_fn)(const float *const [HG][MR], int, int64_t, const int64_t *, const void *,
                                const int64_t [HG], int, vf [HG][MR][CHUNK]);
ROW_COUNTS(VALUES_HEADS, values_heads_f32, 0)
ROW_COUNTS(VALUES_HEADS, values_heads_bf16, 1)
static const values_heads_fn VALUES_HEADS_F32[MR + 1] = { NULL, values_heads_f32_1, values_heads_f32_2,
                                                          values_heads_f32_3, values_heads_f32_4 };
static const values_heads_fn VALUES_HEADS_BF16[MR + 1] = { NULL, values_heads_bf16_1, values_heads_bf16_2,
                                                           values_heads_bf16_3, values_heads_bf16_4 };

/* A segment's sums into a row's output (dimensions d0 ..): the first segment stores, the later ones
 * add, in order, on both paths. */
static inline __attribute__((always_inline)) void add_segment(float *o_row, const vf o[CHUNK], int chunks,
                                                              int first_segment) {
    for (int c = 0; c < chunks; c++) {
        vf sum = o[c];
        if (!first_segment) {
            vf before;
            memcpy(&before, o_row + c * LANES, sizeof before);
            sum = before + sum;
        }
        memcpy(o_row + c * LANES, &sum, sizeof sum);
    }
}

/* The keys of the block KEYS_AHEAD on in a row's table (index `at` + KEYS_AHEAD, at most `last`),
 * asked into L2 where it does not follow its predecessor in memory. The hardware's prefetchers
 * stream a sequence's blocks while they lie side by side in order, but not across a jump to
 * another block: with a sequence's blocks scattered in the pool, as a cache that has served for
 * a while lays them, decodes read their keys 1.4x slower than side by side. The values are
 * read a tile ahead already (values_*). */
#define KEYS_AHEAD 2
static inline __attribute__((always_inline)) void keys_ahead(
        const void *k_cache, const int64_t *table, int64_t at, int64_t last, int64_t h0, int64_t heads,
        int64_t kv_heads, int64_t head_bytes) {
    const int64_t next = at + KEYS_AHEAD;
    if (next > last || table[next] == table[next - 1] + 1)
        return;
    const char *first = (const char *)k_cache + (table[next] * kv_heads + h0) * head_bytes;
    for (int64_t line = 0; line < heads * head_bytes; line += 64)
        __builtin_prefetch(first + line, 0, 2);
}

/* Rows of `count` tokens (from token t0 of the run) for kv heads h0 .. h0 + heads - 1: scores,
 * softmax, values. Every head's scores are taken tile by tile (a block's keys, all heads side by
 * side, are read front to back) and its values segment by segment, so that a long context is
 * read while in cache; a segment's sums are added to the output in order, the same for every
 * path. `scores` holds heads x rows x width floats and then heads x rows more (the softmax sums). */
static inline __attribute__((always_inline)) void attend_task(
        const float *q, const void *k_cache, const void *v_cache, const struct run *run,
        const int64_t *lens, int64_t t0, int64_t count, int64_t h0, int64_t heads, float *out,
        float *restrict scores, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
        float scale, const int bf16) {
    const int64_t rows = count * group;
    const int64_t keys = lens[run->first + t0 + count - 1];
    const int64_t width = (keys + TILE - 1) / TILE * TILE;
    float *inverse = scores + heads * rows * width;
    int64_t len[TOKENS * MAX_GROUP];
    const int64_t element = bf16 ? 2 : 4;
    _Alignas(64) char local[MAX_HEAD_DIM * TILE * 4];    /* a tile of fewer than TILE keys, zero-padded */
    for (int64_t r = 0; r < rows; r++)               /* token-major, so lengths never decrease */
        len[r] = lens[run->first + t0 + r / group];
    /* row r of kv head h, in q and out */
#define AT(h, r) ((((run->first + t0 + (r) / group) * kv_heads + (h)) * group + (r) % group) * head_dim)
#define SCORES(h, r) (scores + (((h) - h0) * rows + (r)) * width)
    /* Tiles of up to TILE keys inside one block: TILE whenever the block size is a multiple of it. */
    for (int64_t start = 0, lanes; start < keys; start += lanes) {
        const int64_t offset = start % block_size, block = run->table[start / block_size];
        if (offset == 0)
            keys_ahead(k_cache, run->table, start / block_size, (keys - 1) / block_size, h0, heads, kv_heads,
                       head_dim * block_size * element);
        lanes = block_size - offset < TILE ? block_size - offset : TILE;
        const int64_t stored = keys - start < lanes ? keys - start : lanes;
        for (int64_t h = h0; h < h0 + heads; h++) {
            const char *kt = (const char *)k_cache + (((block * kv_heads + h) * head_dim) * block_size + offset) * element;
            int64_t stride = block_size;
            if (lanes < TILE) {          /* zero-padded to TILE: the same arithmetic per lane */
                memset(local, 0, (size_t)(head_dim * TILE * element));
                for (int64_t d = 0; d < head_dim; d++)
                    memcpy(local + d * TILE * element, kt + d * block_size * element, (size_t)(lanes * element));
                kt = local, stride = TILE;
            }
            for (int64_t r0 = 0; r0 < rows; r0 += MR) {
                const int m_rows = rows - r0 < MR ? (int)(rows - r0) : MR;
                if (start >= len[r0 + m_rows - 1])
                    continue;
                /* a micro-tile of m_rows rows (pointers past them, never read, set to its first row) */
                const float *qm[MR];
                for (int m = 0; m < MR; m++)
                    qm[m] = q + AT(h, r0 + (m < m_rows ? m : 0));
                float s[MR][TILE];
                (bf16 ? SCORES_BF16 : SCORES_F32)[m_rows](kt, stride, qm, head_dim, scale, s);
                for (int m = 0; m < m_rows; m++)
                    memcpy(SCORES(h, r0 + m) + start, s[m], sizeof(float) * (size_t)stored);
            }
        }
    }
    for (int64_t h = h0; h < h0 + heads; h++)
        for (int64_t r = 0; r < rows; r++)
            inverse[(h - h0) * rows + r] = softmax_row(SCORES(h, r), len[r], width);
    if (rows <= MR && heads > 1) {      /* a decode: its heads' values in one pass over the keys */
        for (int64_t first = 0; first < keys; first += SEGMENT) {
            const int64_t end = keys < first + SEGMENT ? keys : first + SEGMENT;
            for (int64_t g = h0; g < h0 + heads; g += HG) {
                const int nh = h0 + heads - g < HG ? (int)(h0 + heads - g) : HG;
                for (int64_t d0 = 0; d0 < head_dim; d0 += CHUNK * LANES) {
                    const int chunks = head_dim - d0 < CHUNK * LANES ? (int)((head_dim - d0) / LANES) : CHUNK;
                    const float *pm[HG][MR];
                    int64_t offset[HG];
                    for (int i = 0; i < nh; i++) {
                        offset[i] = (g + i) * head_dim + d0;
                        for (int m = 0; m < MR; m++)
                            pm[i][m] = SCORES(g + i, m < rows ? m : 0) + first;
                    }
                    vf o[HG][MR][CHUNK];
                    (bf16 ? VALUES_HEADS_BF16 : VALUES_HEADS_F32)[rows](pm, nh, end - first, run->where + first,
                                                                        v_cache, offset, chunks, o);
                    for (int i = 0; i < nh; i++)
                        for (int m = 0; m < rows; m++)
                            add_segment(out + AT(g + i, m) + d0, o[i][m], chunks, first == 0);
                }
            }
        }
    } else {                            /* a head at a time, MR rows at a time */
        for (int64_t first = 0; first < keys; first += SEGMENT)
            for (int64_t h = h0; h < h0 + heads; h++)
                for (int64_t r0 = 0; r0 < rows; r0 += MR) {
                    const int m_rows = rows - r0 < MR ? (int)(rows - r0) : MR;
                    const int64_t last = len[r0 + m_rows - 1];
                    const int64_t end = last < first + SEGMENT ? last : first + SEGMENT;
                    if (end <= first)
                        continue;
                    const float *pm[MR];
                    for (int m = 0; m < MR; m++)
                        pm[m] = SCORES(h, r0 + (m < m_rows ? m : 0)) + first;
                    for (int64_t d0 = 0; d0 < head_dim; d0 += CHUNK * LANES) {
                        const int chunks = head_dim - d0 < CHUNK * LANES ? (int)((head_dim - d0) / LANES) : CHUNK;
                        vf o[MR][CHUNK];
                        /* the first micro-tile's pass prefetches; the others find the values in cache */
                        (bf16 ? VALUES_BF16 : VALUES_F32)[m_rows](pm, end - first, run->where + first, v_cache,
                                                                  h * head_dim + d0, chunks, r0 == 0, o);
                        for (int m = 0; m < m_rows; m++)
                            if (len[r0 + m] > first)        /* else none of this segment is the row's */
                                add_segment(out + AT(h, r0 + m) + d0, o[m], chunks, first == 0);
                    }
                }
    }
    for (int64_t h = h0; h < h0 + heads; h++)
        for (int64_t r = 0; r < rows; r++) {
            float *o_row = out + AT(h, r);
            const float factor = inverse[(h - h0) * rows + r];
            for (int64_t d = 0; d < head_dim; d++)
                o_row[d] *= factor;
        }
#undef AT
#undef SCORES
}

struct task { int64_t run, h0, heads, t0, count; };

/* Returns 0; 2 for a shape it does not take; -1 when it could not allocate its buffers.
 * `threads`: torch.get_num_threads(), passed by the caller (OpenMP's own default is per calling
 * thread, and the worker steps the engine in a thread of its own). */
static inline __attribute__((always_inline)) int attend_all(
        const float *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
        const int64_t *lens, float *out, int64_t num_rows, int64_t kv_heads, int64_t group,
        int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int threads, const int bf16) {
    if (head_dim % LANES || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || num_rows < 1)
        return num_rows < 1 ? 0 : 2;
    struct run *runs = malloc(sizeof(struct run) * (size_t)num_rows);
    struct task *tasks = malloc(sizeof(struct task) * (size_t)(num_rows * kv_heads));
    if (runs == NULL || tasks == NULL) {
        free(runs), free(tasks);
        return -1;
    }
    int64_t num_runs = 0;
    for (int64_t s = 0; s < num_rows; s++) {
        const int64_t *table = block_tables + s * max_blocks;
        if (num_runs && lens[s] == lens[s - 1] + 1
                && !memcmp(table, table - max_blocks, sizeof(int64_t) * (size_t)max_blocks))
            runs[num_runs - 1].tokens++;
        else
            runs[num_runs++] = (struct run){ .first = s, .tokens = 1 };
    }
    /* A run of up to TOKENS tokens is one task over all kv heads, reading each block's keys and each
     * cached slot's values front to back (a task per head read a third of each slot, and stalled
     * on its loads); a longer one is a task per (kv head, TOKENS tokens). */
    int64_t where_ints = 0, num_tasks = 0;
    for (int64_t i = 0; i < num_runs; i++) {
        struct run *run = &runs[i];
        run->len = lens[run->first + run->tokens - 1];
        run->table = block_tables + run->first * max_blocks;
        where_ints += run->len;
        if (run->tokens <= TOKENS) {
            tasks[num_tasks++] = (struct task){ i, 0, kv_heads, 0, run->tokens };
            continue;
        }
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t t0 = 0; t0 < run->tokens; t0 += TOKENS)
                tasks[num_tasks++] = (struct task){ i, h, 1, t0,
                                                    run->tokens - t0 < TOKENS ? run->tokens - t0 : TOKENS };
    }
    int64_t *where = malloc(sizeof(int64_t) * (size_t)where_ints);
    if (where == NULL) {
        free(runs), free(tasks);
        return -1;
    }
    for (int64_t i = 0, w = 0; i < num_runs; i++) {
        struct run *run = &runs[i];
        run->where = where + w;
        w += run->len;
        for (int64_t t = 0; t < run->len; t++)
            run->where[t] = (run->table[t / block_size] * block_size + t % block_size) * kv_heads * head_dim;
    }
    int failed = 0;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(|: failed)
    for (int64_t i = 0; i < num_tasks; i++) {
        const struct task *task = &tasks[i];
        const struct run *run = &runs[task->run];
        const int64_t width = (lens[run->first + task->t0 + task->count - 1] + TILE - 1) / TILE * TILE;
        float *scores = malloc(sizeof(float) * (size_t)(task->heads * task->count * group * (width + 1)));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        attend_task(q, k_cache, v_cache, run, lens, task->t0, task->count, task->h0, task->heads, out, scores,
                    kv_heads, group, head_dim, block_size, scale, bf16);
        free(scores);
    }
    free(runs), free(tasks), free(where);
    return failed ? -1 : 0;
}

int paged_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int64_t *block_tables, const int64_t *context_lens, float *out,
                           int64_t num_rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                           int64_t block_size, int64_t max_blocks, float scale, int threads) {
    return attend_all(q, k_cache, v_cache, block_tables, context_lens, out, num_rows, kv_heads, group,
                      head_dim, block_size, max_blocks, scale, threads, 0);
}

int paged_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int64_t *block_tables, const int64_t *context_lens, float *out,
                                int64_t num_rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                                int64_t block_size, int64_t max_blocks, float scale, int threads) {
    return attend_all(q, k_cache, v_cache, block_tables, context_lens, out, num_rows, kv_heads, group,
                      head_dim, block_size, max_blocks, scale, threads, 1);
}
