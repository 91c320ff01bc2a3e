/* One decoder layer of a step, in one call: the steps between the engine's linear and attention
 * kernels, which torch ran as ~25 small operations a layer.
 *
 * A step whose every token is a row of the paged attention kernel (decodes, one per sequence;
 * prompt chunks, a row per token) spends, at a few rows, most of its time not in the matmuls but
 * in dispatching the small operations around them (norms, rotary, cache writes, residual adds,
 * SiLU): about 6 ms of a 15 ms bf16 decode step of SmolLM2-135M on 2 EPYC cores, and at a prompt
 * chunk's hundreds of rows still a few percent. Here they run as plain loops over the rows,
 * and the linear layers and the attention are the engine's own kernels (kernels/linear.c,
 * kernels/paged_attention.c), reached through the function pointers the caller passes,
 * so each keeps its own compile flags.
 *
 * The arithmetic follows services/engine/model.py's torch path operation by operation, rounding
 * to the model's dtype where torch does (bf16: every elementwise result is rounded to bf16, each
 * from a single fp32 operation, so those match torch bit for bit). Two differ in their last fp32
 * bit: an RMSNorm's sum of squares runs in 16 lanes summed in a fixed order (torch's reduction
 * order is its own), and SiLU's exponential is a polynomial (exp_fast, within ~1 ulp). Both are
 * per row, so a row's result does not depend on the other rows of its batch; and the steps that
 * keep torch's operations call the same two (rms_norm_rows, silu_mul_rows, at the end), so it
 * does not depend on the kind of step either.
 *
 * Compiled without -ffast-math and with -ffp-contract=off: a product and a sum stay two roundings,
 * as in torch's elementwise kernels.
 *
 * Layouts (contiguous, row-major; "model dtype" is fp32 or bf16, `bf16` says which):
 *   x           [rows, hidden]           the residual stream, updated in place
 *   cos, sin    [rows, head_dim]         rotary tables at each row's position (sin's first half
 *                                        negated: services/engine/rope.py)
 *   k/v cache   [slots, kv_heads, head_dim], slots[r] is where row r's key and value go
 *   scratch     see struct step
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int (*linear_fn)(const void *w, const void *x, const float *bias, void *y,
                         int64_t M, int64_t N, int64_t K, int threads);
typedef int (*attention_fn)(const float *q, const void *k_cache, const void *v_cache,
                            const int64_t *block_tables, const int64_t *context_lens, float *out,
                            int64_t num_seqs, int64_t kv_heads, int64_t group, int64_t head_dim,
                            int64_t block_size, int64_t max_blocks, float scale, int threads);

struct model {                 /* fixed at load */
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    int64_t bf16;              /* 1: the model dtype is bf16; 0: fp32 */
    linear_fn linear;
    attention_fn attention;
};

struct layer {                 /* fixed at load: a layer's weights */
    const void *input_norm, *post_norm;       /* [hidden], model dtype */
    const void *qkv, *out, *gate_up, *down;   /* packed for `linear` */
    const float *qkv_bias, *out_bias;         /* fp32, or NULL */
};

struct step {                  /* one per step, shared by its layers */
    int64_t rows, block_size, max_blocks;
    void *x;
    const void *cos, *sin;
    const int64_t *slots, *block_tables, *context_lens;
    void *h;                   /* [rows, hidden]: a normed input, then a projection's output */
    void *qkv;                 /* [rows, (heads + 2 kv_heads) head_dim] */
    float *q;                  /* [rows, heads head_dim]: rotated queries, fp32 */
    float *attended32;         /* [rows, heads head_dim]: attention's output, fp32 */
    void *attended;            /* [rows, heads head_dim], model dtype (fp32: unused) */
    void *gate_up;             /* [rows, 2 intermediate] */
    void *mixed;               /* [rows, intermediate] */
    int64_t threads;
};

static inline float from_bf16(uint16_t v) {
    union { uint32_t u; float f; } bits = { .u = (uint32_t)v << 16 };
    return bits.f;
}

/* Round to nearest even, NaN kept quiet: as torch's float -> bfloat16 conversion. */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } bits = { .f = f };
    const uint16_t rounded = (uint16_t)((bits.u + 0x7FFFu + ((bits.u >> 16) & 1u)) >> 16);
    return f != f ? 0x7FC0 : rounded;      /* a select, not a branch: loops over it vectorise */
}

/* Element i of a model-dtype array as float, and a float stored (rounded) into one. `bf16` is a
 * constant at every call site once inlined. */
static inline __attribute__((always_inline)) float get(const void *a, int64_t i, const int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)a)[i]) : ((const float *)a)[i];
}

static inline __attribute__((always_inline)) void put(void *a, int64_t i, float v, const int bf16) {
    if (bf16)
        ((uint16_t *)a)[i] = to_bf16(v);
    else
        ((float *)a)[i] = v;
}

#define LANES 16
#define MAX_HEAD_DIM 256      /* the paged attention kernel's limit, which this layer calls */
#define SILU_PIECE 256        /* values of a row silu_mul takes at a time */

/* out = RMSNorm(x) * weight, row by row. fp32 as F.rms_norm: (x * inv) * w; bf16 as the
 * reference: x * inv in fp32, rounded to bf16, then times the bf16 weight, rounded again. */
static inline __attribute__((always_inline)) void rms_norm(
        const void *x, const void *weight, void *out, int64_t rows, int64_t n, float eps, int threads,
        const int bf16) {
    #pragma omp parallel for num_threads(threads) if (rows >= 8) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float lanes[LANES] = {0};
        const int64_t base = r * n;
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES)
            for (int l = 0; l < LANES; l++) {
                const float v = get(x, base + i + l, bf16);
                lanes[l] += v * v;
            }
        for (int l = 0; i < n; i++, l++) {
            const float v = get(x, base + i, bf16);
            lanes[l] += v * v;
        }
        for (int width = LANES / 2; width > 0; width /= 2)     /* a fixed tree over the lanes */
            for (int l = 0; l < width; l++)
                lanes[l] += lanes[l + width];
        const float inverse = 1.0f / sqrtf(lanes[0] / (float)n + eps);
        #pragma omp simd
        for (int64_t j = 0; j < n; j++) {
            float v = get(x, base + j, bf16) * inverse;
            if (bf16)
                v = from_bf16(to_bf16(v));
            put(out, base + j, v * get(weight, j, bf16), bf16);
        }
    }
}

/* x += y, rounded to the model dtype. */
static inline __attribute__((always_inline)) void add_into(void *x, const void *y, int64_t count,
                                                           const int bf16) {
    #pragma omp simd
    for (int64_t i = 0; i < count; i++)
        put(x, i, get(x, i, bf16) + get(y, i, bf16), bf16);
}

/* One rotated value: x * cosine + partner * sine (the table's signed sine), each product rounded
 * to the model dtype and then their sum, as rope.py's torch operations round. */
static inline __attribute__((always_inline)) float rotate(float x, float cosine, float partner, float sine,
                                                          const int bf16) {
    float a = x * cosine, b = partner * sine;
    if (bf16) {
        a = from_bf16(to_bf16(a));
        b = from_bf16(to_bf16(b));
    }
    const float v = a + b;
    return bf16 ? from_bf16(to_bf16(v)) : v;
}

/* Rotate q and k of every row (x * cos + roll(x, half) * signed_sin, each product rounded, then
 * the sum, as services/engine/rope.py's three torch operations), write each row's key and value to
 * its cache slot (keys transposed within their block, as kernels/paged_attention.c reads them:
 * [block][kv head][dimension][offset]), and the queries, widened to fp32, to step->q. */
static inline __attribute__((always_inline)) void rotate_and_store(
        const struct model *m, const struct step *s, void *k_cache, void *v_cache, const int bf16) {
    const int64_t d = m->head_dim, half = d / 2, slot = m->kv_heads * d;
    const int64_t width = (m->heads + 2 * m->kv_heads) * d;
    #pragma omp parallel for num_threads((int)s->threads) if (s->rows >= 8) schedule(static)
    for (int64_t r = 0; r < s->rows; r++) {
        const int64_t row = r * width;
        const int64_t cache = s->slots[r] * slot;
        const int64_t block = s->slots[r] / s->block_size, offset = s->slots[r] % s->block_size;
        /* Widened into fp32 buffers first, and the two halves apart: each step a plain loop that
         * GCC vectorises (as one loop, bf16 loads, rotation and stores were left scalar). */
        float cosine[MAX_HEAD_DIM], sine[MAX_HEAD_DIM], x[MAX_HEAD_DIM], rotated[MAX_HEAD_DIM];
        for (int64_t j = 0; j < d; j++) {
            cosine[j] = get(s->cos, r * d + j, bf16);
            sine[j] = get(s->sin, r * d + j, bf16);
        }
        for (int64_t h = 0; h < m->heads + m->kv_heads; h++) {
            const int64_t head = row + h * d;
            for (int64_t j = 0; j < d; j++)
                x[j] = get(s->qkv, head + j, bf16);
            for (int64_t j = 0; j < half; j++)
                rotated[j] = rotate(x[j], cosine[j], x[j + half], sine[j], bf16);
            for (int64_t j = half; j < d; j++)
                rotated[j] = rotate(x[j], cosine[j], x[j - half], sine[j], bf16);
            if (h < m->heads) {
                memcpy(s->q + r * m->heads * d + h * d, rotated, sizeof(float) * (size_t)d);
                continue;
            }
            for (int64_t j = 0; j < d; j++)
                put(k_cache, ((block * m->kv_heads + h - m->heads) * d + j) * s->block_size + offset, rotated[j], bf16);
        }
        const int64_t values = row + (m->heads + m->kv_heads) * d;
        const int64_t element = bf16 ? 2 : 4;
        memcpy((char *)v_cache + cache * element, (const char *)s->qkv + values * element,
               (size_t)(slot * element));
    }
}

/* e^x in fp32, branch-free so that loops over it vectorise without -ffast-math (the C library's
 * expf is a call per element: SiLU over a 32-row step took 4-7x torch's vectorised one). Cephes'
 * expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 polynomial, times 2^n; within ~1 ulp,
 * as torch's vectorised exp. Overflows to infinity and underflows to 0 where expf does. */
static inline float exp_fast(float x) {
    const float big = 12582912.0f;                          /* 1.5 * 2^23: rounds to an integer */
    const float clamped = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = (clamped * 1.44269504088896341f + big) - big;
    const float r = (clamped - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t u; float f; } scale = { .u = (uint32_t)((int32_t)n + 127) << 23 };
    const float e = p * scale.f;
    return x > 88.7228f ? __builtin_inff() : (x < -87.3365f ? 0.0f : e);
}

/* out = silu(gate) * up for rows of [gate | up] (each `n` wide): silu in fp32 (x / (1 + e^-x)),
 * rounded, then the product, rounded. */
static inline __attribute__((always_inline)) void silu_mul(const void *gate_up, void *out, int64_t rows,
                                                           int64_t n, int threads, const int bf16) {
    #pragma omp parallel for num_threads(threads) if (rows >= 8) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (!bf16) {
            #pragma omp simd
            for (int64_t j = 0; j < n; j++) {
                const float g = get(gate_up, r * 2 * n + j, 0);
                put(out, r * n + j, g / (1.0f + exp_fast(-g)) * get(gate_up, r * 2 * n + n + j, 0), 0);
            }
            continue;
        }
        /* bf16 in pieces through fp32 buffers, each step a plain loop of its own: GCC did not
         * vectorise the widening loads, the exponential and the narrowing stores as one loop
         * (1.53 ms on [512, 3072] against torch's 0.34; in pieces 0.34, the same bits). */
        for (int64_t j0 = 0; j0 < n; j0 += SILU_PIECE) {
            const int64_t count = n - j0 < SILU_PIECE ? n - j0 : SILU_PIECE;
            float gate[SILU_PIECE], up[SILU_PIECE];
            for (int64_t j = 0; j < count; j++) {
                gate[j] = get(gate_up, r * 2 * n + j0 + j, 1);
                up[j] = get(gate_up, r * 2 * n + n + j0 + j, 1);
            }
            #pragma omp simd
            for (int64_t j = 0; j < count; j++)
                gate[j] = from_bf16(to_bf16(gate[j] / (1.0f + exp_fast(-gate[j])))) * up[j];
            for (int64_t j = 0; j < count; j++)
                put(out, r * n + j0 + j, gate[j], 1);
        }
    }
}

static inline __attribute__((always_inline)) int layer_body(
        const struct model *m, const struct layer *w, const struct step *s, void *k_cache,
        void *v_cache, const int bf16) {
    const int threads = (int)s->threads;
    const int64_t rows = s->rows, hidden = m->hidden, width = m->heads * m->head_dim;
    const int64_t qkv_width = width + 2 * m->kv_heads * m->head_dim;
    int status;
    rms_norm(s->x, w->input_norm, s->h, rows, hidden, m->eps, threads, bf16);
    if ((status = m->linear(w->qkv, s->h, w->qkv_bias, s->qkv, rows, qkv_width, hidden, threads)))
        return status;
    rotate_and_store(m, s, k_cache, v_cache, bf16);
    if (m->attention(s->q, k_cache, v_cache, s->block_tables, s->context_lens, s->attended32, rows,
                     m->kv_heads, m->heads / m->kv_heads, m->head_dim, s->block_size, s->max_blocks,
                     m->scale, threads))
        return -1;
    const void *attended = s->attended32;
    if (bf16) {
        for (int64_t i = 0; i < rows * width; i++)
            ((uint16_t *)s->attended)[i] = to_bf16(s->attended32[i]);
        attended = s->attended;
    }
    if ((status = m->linear(w->out, attended, w->out_bias, s->h, rows, hidden, width, threads)))
        return status;
    add_into(s->x, s->h, rows * hidden, bf16);
    rms_norm(s->x, w->post_norm, s->h, rows, hidden, m->eps, threads, bf16);
    if ((status = m->linear(w->gate_up, s->h, NULL, s->gate_up, rows, 2 * m->intermediate, hidden, threads)))
        return status;
    silu_mul(s->gate_up, s->mixed, rows, m->intermediate, threads, bf16);
    if ((status = m->linear(w->down, s->mixed, NULL, s->h, rows, hidden, m->intermediate, threads)))
        return status;
    add_into(s->x, s->h, rows * hidden, bf16);
    return 0;
}

/* Returns 0; a linear kernel's refusal (its status, > 0); -1 when attention could not allocate. */
int decode_layer(const struct model *m, const struct layer *w, const struct step *s, void *k_cache,
                 void *v_cache) {
    return m->bf16 ? layer_body(m, w, s, k_cache, v_cache, 1) : layer_body(m, w, s, k_cache, v_cache, 0);
}

/* The same norm and SiLU for the steps that keep torch's operations (services/engine/model.py),
 * so that a row is computed alike in every kind of step: a decode's result then does not depend
 * on whether a prompt shared its step. */
void rms_norm_rows(const void *x, const void *weight, void *out, int64_t rows, int64_t n, float eps,
                   int threads, int bf16) {
    if (bf16)
        rms_norm(x, weight, out, rows, n, eps, threads, 1);
    else
        rms_norm(x, weight, out, rows, n, eps, threads, 0);
}

void silu_mul_rows(const void *gate_up, void *out, int64_t rows, int64_t n, int threads, int bf16) {
    if (bf16)
        silu_mul(gate_up, out, rows, n, threads, 1);
    else
        silu_mul(gate_up, out, rows, n, threads, 0);
}
