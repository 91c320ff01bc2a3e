/* y = x @ W^T (+ bias) for the model's linear layers on CPU, over a weight packed once at load.
 *
 * A decode step multiplies every weight by a few rows (one per sequence), so it is bound by
 * reading the weights: the packing lets one pass stream each weight front to back with no
 * horizontal sums. W [N, K] is stored as blocks of 16 output rows, interleaved along K
 * (services/engine/linear_kernel.py packs it):
 *   fp32  [N/16][K][16]      one vector = 16 outputs' weights for one input column
 *   bf16  [N/16][K/2][16][2] one vector = 16 outputs' weights for two input columns
 * so a tile's accumulators take one fused multiply-add (fp32) or one bf16 pair dot product
 * (vdpbf16ps, fp32 accumulation) per vector of weights and broadcast input value (pair).
 * A tile is 32 outputs x up to TILE_ROWS input rows (8 with AVX-512; fewer where the registers
 * are fewer, below): each weight vector loaded serves every row, and a tile's weights (32 x K)
 * stay in L2 while the next rows reuse them.
 *
 * With more rows than a tile takes (a batch of decodes, a prompt chunk), the first pass over a
 * tile's rows waited on its weights from memory and the later passes computed on them from L2, one
 * after the other: at 12-32 rows a layer took about the two times added. So in bf16, while a
 * tile's rows are computed, the next tile's weights are asked into L2 (`ahead`), a share in each
 * pass, spread along it. With one pass (2 to TILE_ROWS rows: a batch of a few decodes) the same
 * read-ahead runs 1.09-1.3x at the kernel and 1.18x on batch 8's decodes: a tile reads its two
 * blocks as two streams, and the prefetchers lose them at each tile's end. One row (batch 1) is
 * left without it (0.96-0.99x: its stream is the hardware's to run). In fp32 the engine at batch
 * 32 showed no effect from the same, and with one pass at one row a read-ahead ran 0.93-0.95x:
 * fp32 is as before.
 * Measured: bench/linear_rows.py (the kernel) and bench/engine_paired.py (the engine),
 * docs/performance.md.
 *
 * Every output row is computed the same way whatever the number of rows (each row's sum runs
 * over K in order, with no fast-math reassociation), so a sequence's result does not depend on
 * what else is in its batch.
 *
 * Layouts: x [M, K] and y [M, N] contiguous row-major; bias (optional) fp32 [N]; N padded to a
 * multiple of 32 in the packed weight (the padding is zero and never stored to y).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define LANES 16           /* outputs per block of the packed weight */

/* ---- fp32 (portable: vectors as wide as the flags' registers) ---- */

/* GCC keeps a vector wider than the machine's registers in memory, where every operation on it
 * loads and stores: built for AVX2 with 16-wide vectors this tile ran at 3 GFLOPS, where F.linear
 * runs 56-110. So the vector is the registers' width, a block of 16 outputs is LANES / VEC of
 * them, and a tile takes as many rows as its accumulators leave registers for (AVX-512: 32
 * registers, 8 rows x 4 vectors; AVX2: 16 registers, 3 x 4; SSE and others: 16 of 4 lanes, 1 x 8). */
#if defined(__AVX512F__)
#define VEC 16
#define TILE_ROWS 8
#elif defined(__AVX__)
#define VEC 8
#define TILE_ROWS 3
#else
#define VEC 4
#define TILE_ROWS 1
#endif
#define PARTS (2 * LANES / VEC)    /* vectors across a tile's two blocks (32 outputs) */

typedef float vf __attribute__((vector_size(VEC * 4)));

static inline __attribute__((always_inline)) void tile_f32(
    const float *restrict w0, const float *restrict w1, int64_t K, const float *restrict x,
    const int rows, const float *restrict bias, float *restrict y, int64_t N, int64_t n) {
    vf acc[TILE_ROWS][PARTS];
    for (int m = 0; m < rows; m++)
        for (int p = 0; p < PARTS; p++)
            acc[m][p] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        vf a[PARTS];
        for (int p = 0; p < PARTS / 2; p++) {
            memcpy(&a[p], w0 + k * LANES + p * VEC, sizeof a[p]);
            memcpy(&a[PARTS / 2 + p], w1 + k * LANES + p * VEC, sizeof a[p]);
        }
        for (int m = 0; m < rows; m++) {
            const vf xb = (vf){0} + x[m * K + k];
            for (int p = 0; p < PARTS; p++)
                acc[m][p] += a[p] * xb;
        }
    }
    for (int b = 0; b < 2; b++) {
        const int64_t first = n + b * LANES;
        if (first >= N)
            break;
        const int64_t count = N - first < LANES ? N - first : LANES;
        for (int m = 0; m < rows; m++) {
            float out[LANES];
            memcpy(out, &acc[m][b * PARTS / 2], sizeof out);
            float *dst = y + m * N + first;
            for (int64_t j = 0; j < count; j++)
                dst[j] = bias ? out[j] + bias[first + j] : out[j];
        }
    }
}

int linear_f32(const float *w, const float *x, const float *bias, float *y,
               int64_t M, int64_t N, int64_t K, int threads) {
    const int64_t blocks = (N + LANES - 1) / LANES, tiles = (blocks + 1) / 2;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const float *w0 = w + 2 * t * K * LANES;
        const float *w1 = 2 * t + 1 < blocks ? w0 + K * LANES : w0;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
            const float *xm = x + m0 * K;
            float *ym = y + m0 * N;
            /* one specialised body per row count, so the accumulators stay in registers */
            switch (M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS) {
#define ROWS(r) case r: tile_f32(w0, w1, K, xm, r, bias, ym, N, 2 * t * LANES); break;
                ROWS(1)
#if TILE_ROWS >= 3
                ROWS(2) ROWS(3)
#endif
#if TILE_ROWS >= 8
                ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#endif
#undef ROWS
            }
        }
    }
    return 0;
}

/* ---- bf16 (where the CPU has avx512_bf16; elsewhere the engine keeps oneDNN / F.linear) ---- */

int linear_has_bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
/* The next tile's weights, asked into L2 along a pass over a tile's rows: two 64-byte lines
 * every `every` steps along K (every = the passes over the tile's rows, so that each pass asks
 * for its share of the next tile, at a pace its arithmetic sets). */
struct ahead { const char *next; int64_t every, countdown; };

static inline __attribute__((always_inline)) void ask_ahead(struct ahead *ahead) {
    if (--ahead->countdown > 0)
        return;
    __builtin_prefetch(ahead->next, 0, 2);
    __builtin_prefetch(ahead->next + 64, 0, 2);
    ahead->next += 128, ahead->countdown = ahead->every;
}

/* Pass `pass` of `passes` over a tile's rows, `steps` along K (each reads 128 bytes of the tile's
 * weights): the share of the next tile (at `next`, as many bytes) that it asks for. */
static inline struct ahead ahead_of_pass(const void *next, int64_t steps, int64_t passes, int64_t pass) {
    const int64_t share = (steps + passes - 1) / passes;
    return (struct ahead){ (const char *)next + pass * share * 128, passes, 0 };
}

static inline __attribute__((always_inline)) void tile_bf16(
    const uint16_t *restrict w0, const uint16_t *restrict w1, int64_t pairs,
    const uint16_t *restrict x, int64_t K, const int rows, const float *restrict bias,
    uint16_t *restrict y, int64_t N, int64_t n, struct ahead *ahead) {
    __m512 acc[TILE_ROWS][2];
    for (int m = 0; m < rows; m++)
        acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh a = (__m512bh)_mm512_loadu_si512(w0 + p * 2 * LANES);
        const __m512bh c = (__m512bh)_mm512_loadu_si512(w1 + p * 2 * LANES);
        if (ahead)
            ask_ahead(ahead);
        for (int m = 0; m < rows; m++) {
            uint32_t pair;
            memcpy(&pair, x + m * K + 2 * p, sizeof pair);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, xb);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], c, xb);
        }
    }
    for (int b = 0; b < 2; b++) {
        const int64_t first = n + b * LANES;
        if (first >= N)
            break;
        const int64_t count = N - first < LANES ? N - first : LANES;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
        for (int m = 0; m < rows; m++) {
            /* the bias joins the fp32 sum; one rounding to bf16 (nearest even), as oneDNN does */
            const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][b], add));
            _mm256_mask_storeu_epi16(y + m * N + first, mask, (__m256i)out);
        }
    }
}
#endif

/* K even (the engine keeps oneDNN for a weight with an odd K). */
int linear_bf16(const uint16_t *w, const uint16_t *x, const float *bias, uint16_t *y,
                int64_t M, int64_t N, int64_t K, int threads) {
#if defined(__AVX512BF16__)
    if (K % 2)
        return 2;
    const int64_t pairs = K / 2, blocks = (N + LANES - 1) / LANES, tiles = (blocks + 1) / 2;
    const int64_t passes = (M + TILE_ROWS - 1) / TILE_ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint16_t *w0 = w + 2 * t * pairs * 2 * LANES;
        const uint16_t *w1 = 2 * t + 1 < blocks ? w0 + pairs * 2 * LANES : w0;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
            const uint16_t *xm = x + m0 * K;
            uint16_t *ym = y + m0 * N;
            const int rows = M - m0 < TILE_ROWS ? (int)(M - m0) : TILE_ROWS;
#define ROWS(r, ahead) case r: tile_bf16(w0, w1, pairs, xm, K, r, bias, ym, N, 2 * t * LANES, ahead); break;
#define ALL_ROWS(ahead) ROWS(1, ahead) ROWS(2, ahead) ROWS(3, ahead) ROWS(4, ahead) ROWS(5, ahead) \
                        ROWS(6, ahead) ROWS(7, ahead) ROWS(8, ahead)
            if (M == 1 || t + 1 == tiles) {
                switch (rows) { ALL_ROWS(NULL) }
            } else {
                struct ahead ahead = ahead_of_pass(w0 + 2 * pairs * 2 * LANES, pairs, passes, m0 / TILE_ROWS);
                switch (rows) { ALL_ROWS(&ahead) }
            }
#undef ALL_ROWS
#undef ROWS
        }
    }
    return 0;
#else
    (void)w; (void)x; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)threads;
    return 1;
#endif
}
