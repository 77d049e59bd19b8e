/* Attention of decode rows over their keys in the KV pool, for CPUs with AVX2 and FMA, or
 * AVX-512 (and AMX):
 * every row sees every key it is given (no mask): a decode token over its own slots, or the
 * rows of several requests over the prefix they share.
 *
 * Why a kernel of our own: PyTorch's flash kernel for CPUs reaches its speed only when the
 * keys sit in cache. In a decode step they never do (the layer's KV was last read a whole
 * step ago, with all the weights streamed in between), and with few query rows its work
 * splits into one item per KV head (three, on two cores) that each wait on memory. Here the
 * keys are cut into pieces that the cores share evenly, each piece is streamed once with
 * prefetching, and the pieces merge by their log-sum-exp at the end. Two inner loops:
 * chunk_rows (up to MAX_ROWS rows: a dot product per key and row, float32) and, for 5 to 64
 * rows of bf16 (many streams' decode rows over their shared prefix), chunk_amx where the CPU has
 * AMX (tile products) or chunk_dp where it has AVX512-BF16 (register blocks of vdpbf16ps).
 *
 * One call (radix_attention), strides in elements, the last dimension contiguous:
 *   q       token r's M query rows of KV head h at q + h*q_hs + i*q_rs + pos_r*q_ts (i < M),
 *           bf16 or fp32 (grouped query heads folded into the M rows of their KV head)
 *   k, v    [H][S][D] the pool's layer (or a view into it), same dtype as q; keys = S
 *   rows    [nrows][3]   (pack position, first piece, end piece) per token
 *   pieces  [npieces][3] (first key, key count, token): a token's keys, in runs of the pool
 *           cut into chunks; together one key sequence
 *   out     fp32 at out + h*o_hs + i*o_rs + pos*o_ts (D values); lse likewise (one value):
 *           natural log of sum_j exp(scale * q.k_j)
 *   work    fp32 scratch of radix_attn_work_floats(H, M, D, npieces, nrows) floats
 * Returns RADIX_OK, or the code of what it refused (RADIX_E_ATTN_...; nothing written).
 * Products and sums are float32, like the flash kernel's (the AMX path rounds the weights to
 * bf16 before the second product, as the flash kernel does); the result does not depend on
 * the number of threads (the pieces are merged in order). Scratch beyond ``work``: the AMX
 * and dot-product paths keep about 270 KB of staging per thread each (thread-local, allocated once).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../native_abi.h" /* the boundary: constants, refusal codes, structs, prototypes (generated) */

#define MAX_ROWS RADIX_MAX_ROWS
#define MAX_D RADIX_MAX_HEAD_DIM
#define MAX_CHUNK 512

/* Sixteen float32 lanes, the unit every loop below works in: one AVX-512 register, or two
 * AVX2 registers on CPUs without AVX-512 (most laptops; AMD before Zen 4). The AMX path needs
 * AVX-512 and stays below in its own #if. */
#if defined(__AVX512F__)
typedef __m512 vf;
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_sum(vf a) { return _mm512_reduce_add_ps(a); }
/* the first k lanes of x (0 <= k <= 16), zeros after */
static inline vf vf_first(vf x, int k) { return _mm512_maskz_mov_ps((__mmask16)((1u << k) - 1), x); }
/* bf16 -> fp32 of 16 values: the bf16 bits are the high half of the fp32 bits. */
static inline vf vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); } /* p * 2^n */
const char *radix_simd(void) { return "AVX-512"; }
#elif defined(__AVX2__) && defined(__FMA__)
typedef struct {
    __m256 lo, hi;
} vf;
static inline vf vf_make(__m256 lo, __m256 hi) {
    vf r = {lo, hi};
    return r;
}
static inline vf vf_load(const float *p) { return vf_make(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_store(float *p, vf x) {
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
}
static inline vf vf_set1(float a) { return vf_make(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
static inline vf vf_zero(void) { return vf_make(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_add(vf a, vf b) { return vf_make(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline vf vf_sub(vf a, vf b) { return vf_make(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline vf vf_mul(vf a, vf b) { return vf_make(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline vf vf_fmadd(vf a, vf b, vf c) {
    return vf_make(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline float vf_sum(vf a) {
    __m256 s = _mm256_add_ps(a.lo, a.hi);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
static inline vf vf_first(vf x, int k) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), kk = _mm256_set1_epi32(k);
    const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(kk, lane));
    const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(kk, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
    return vf_make(_mm256_and_ps(x.lo, lo), _mm256_and_ps(x.hi, hi));
}
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_load_bf16(const uint16_t *p) { return vf_make(bf16x8(p), bf16x8(p + 8)); }
static inline vf vf_round(vf x) {
    return vf_make(_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                   _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf vf_max(vf a, vf b) { return vf_make(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline __m256 scale2x8(__m256 p, __m256 n) { /* n an integer in [-126, 127] */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vf vf_scale2(vf p, vf n) { return vf_make(scale2x8(p.lo, n.lo), scale2x8(p.hi, n.hi)); }
const char *radix_simd(void) { return "AVX2"; }
#else
#error "decode_attention.c needs AVX2 and FMA, or AVX-512 (the build falls back to PyTorch's kernels)"
#endif

static inline vf load16(const void *p, int bf16) {
    return bf16 ? vf_load_bf16((const uint16_t *)p) : vf_load((const float *)p);
}

static inline float load1(const void *p, int64_t i, int bf16) {
    if (bf16) {
        uint32_t bits = ((uint32_t)((const uint16_t *)p)[i]) << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return ((const float *)p)[i];
}

/* exp(x) for 16 lanes: 2^(x log2 e) split as 2^n * 2^f, f in [-0.5, 0.5], a degree-6
 * polynomial for 2^f (relative error about 2e-7); x below -87 counts as -87 (-inf too), and
 * callers zero what must be zero. */
#if defined(__AVX512F__)
static inline vf exp16(vf x) {
    x = vf_max(x, vf_set1(-87.0f));
    vf t = vf_mul(x, vf_set1(1.44269504088896341f));
    vf n = vf_round(t);
    vf f = vf_sub(t, n);
    vf p = vf_set1(1.5353362e-4f);
    p = vf_fmadd(p, f, vf_set1(1.3398874e-3f));
    p = vf_fmadd(p, f, vf_set1(9.6181291e-3f));
    p = vf_fmadd(p, f, vf_set1(5.5504109e-2f));
    p = vf_fmadd(p, f, vf_set1(2.4022650e-1f));
    p = vf_fmadd(p, f, vf_set1(6.9314718e-1f));
    p = vf_fmadd(p, f, vf_set1(1.0f));
    return vf_scale2(p, n);
}
#else
/* the same operations on eight lanes (AVX2), so 8- and 16-lane loops give the same bits */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5353362e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    return scale2x8(p, n);
}
static inline vf exp16(vf x) { return vf_make(exp8(x.lo), exp8(x.hi)); }
#endif

/* Per (piece, head): M*D partial sums, then M maxima, then M sums of weights; then room for
 * the query rows in bf16, padded to 16, per (token, head) (the AMX path's copy). */
int64_t radix_attn_work_floats(int64_t H, int64_t M, int64_t D, int64_t npieces, int64_t nrows) {
    return H * npieces * (M * D + 2 * M) + nrows * H * ((M + 15) / 16 * 16) * D / 2 + 16;
}

/* ``bytes`` from p, a cache line at a time, to L1 (or to L2 only: ``to_l2``, a constant at each call) */
static inline __attribute__((always_inline)) void prefetch_rows(const char *p, int64_t bytes, int to_l2) {
    for (int64_t o = 0; o < bytes; o += 64) {
        if (to_l2)
            _mm_prefetch(p + o, _MM_HINT_T1);
        else
            _mm_prefetch(p + o, _MM_HINT_T0);
    }
}

#define V_ROWS 3 /* rows per block of the weighted sum of values */

/* Rows [0, mb) of the weights ``w`` (rows MAX_CHUNK apart) times the n values' dims [d0, d0 + 16
 * or 32) (``two``), summed over the keys in order, to out (rows D apart). */
static inline __attribute__((always_inline)) void v_block(const float (*w)[MAX_CHUNK], const char *v, int64_t v_sl,
                                                          int n, int D, int d0, int bf16, int esz, int first,
                                                          float *out, const int mb, const int two) {
    vf acc[V_ROWS][2];
    for (int r = 0; r < mb; r++)
        acc[r][0] = acc[r][1] = vf_zero();
    for (int j = 0; j < n; j++) {
        const char *vj = v + ((int64_t)j * v_sl + d0) * esz;
        if (first && j + 32 < n)
            prefetch_rows(v + (int64_t)(j + 32) * v_sl * esz, (int64_t)D * esz, 0);
        const vf v0 = load16(vj, bf16);
        const vf v1 = two ? load16(vj + 16 * esz, bf16) : v0;
        for (int r = 0; r < mb; r++) {
            const vf p = vf_set1(w[r][j]);
            acc[r][0] = vf_fmadd(p, v0, acc[r][0]);
            if (two)
                acc[r][1] = vf_fmadd(p, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < mb; r++) {
        vf_store(out + (int64_t)r * D, acc[r][0]);
        if (two)
            vf_store(out + (int64_t)r * D + 16, acc[r][1]);
    }
}

/* Rows 0..M-1 over the n keys of one chunk: the partial sums o [M][D] (weights relative to
 * the chunk's own maximum), that maximum [M] and the sum of the weights [M]. */
static inline __attribute__((always_inline)) void chunk_rows_d(const void *q, int64_t q_sm, const char *k,
                                                               int64_t k_sl, const char *v, int64_t v_sl, int M, int n,
                                                               int D, float scale, int bf16, int esz, float *o,
                                                               float *mx, float *sm) {
    float qf[MAX_ROWS][MAX_D];
    float s[MAX_ROWS][MAX_CHUNK];
    const int d16 = D / 16;
    for (int m = 0; m < M; m++)
        for (int d = 0; d < D; d++)
            qf[m][d] = load1(q, (int64_t)m * q_sm + d, bf16);
    for (int j = 0; j < n; j++) {
        const char *kj = k + (int64_t)j * k_sl * esz;
        if (j + 32 < n)
            prefetch_rows(kj + 32 * k_sl * esz, (int64_t)D * esz, 0);
        /* the value row of the same key, to L2, for the pass over values after the scores: two
         * streams from memory while the scores are computed instead of one, where the core's
         * arithmetic otherwise runs without memory in flight (same bits) */
        prefetch_rows(v + (int64_t)j * v_sl * esz, (int64_t)D * esz, 1);
        vf kv[MAX_D / 16];
        for (int c = 0; c < d16; c++)
            kv[c] = load16(kj + (int64_t)c * 16 * esz, bf16);
        for (int m = 0; m < M; m++) {
            vf acc = vf_mul(vf_load(qf[m]), kv[0]);
            for (int c = 1; c < d16; c++)
                acc = vf_fmadd(vf_load(qf[m] + 16 * c), kv[c], acc);
            s[m][j] = vf_sum(acc) * scale;
        }
    }
    for (int m = 0; m < M; m++) {
        /* the row's largest score, sixteen lanes at a time (a NaN score is passed over, as by the
         * scalar comparison: max keeps its second operand when the first is NaN) */
        vf lanes = vf_set1(-INFINITY);
        int j = 0;
        for (; j + 16 <= n; j += 16)
            lanes = vf_max(vf_load(s[m] + j), lanes);
        float part[16], best = -INFINITY;
        vf_store(part, lanes);
        for (int i = 0; i < 16; i++)
            best = part[i] > best ? part[i] : best;
        for (; j < n; j++)
            best = s[m][j] > best ? s[m][j] : best;
        vf b = vf_set1(best), total = vf_zero();
        for (int j = 0; j < n; j += 16) { /* past the last key (within s's row): weights of 0 */
            vf p = exp16(vf_sub(vf_load(s[m] + j), b));
            if (n - j < 16)
                p = vf_first(p, n - j);
            vf_store(s[m] + j, p);
            total = vf_add(total, p);
        }
        mx[m] = best;
        sm[m] = vf_sum(total);
    }
    /* O = P V in blocks of up to three rows by 32 dims: their accumulators (twelve AVX2
     * registers) stay in registers, where a whole 64-dim row block spilled them on every key.
     * Each output still sums its keys in order, as before. */
    for (int m0 = 0; m0 < M; m0 += V_ROWS) {
        const int mb = M - m0 < V_ROWS ? M - m0 : V_ROWS;
        for (int d0 = 0; d0 < D; d0 += 32) {
            const int two = D - d0 >= 32;
            const int first = m0 == 0 && d0 == 0; /* the pass that prefetches whole value rows */
            float *out = o + (int64_t)m0 * D + d0;
            if (mb == 3 && two)
                v_block(s + m0, v, v_sl, n, D, d0, bf16, esz, first, out, 3, 1);
            else if (mb == 3)
                v_block(s + m0, v, v_sl, n, D, d0, bf16, esz, first, out, 3, 0);
            else if (mb == 2 && two)
                v_block(s + m0, v, v_sl, n, D, d0, bf16, esz, first, out, 2, 1);
            else if (mb == 2)
                v_block(s + m0, v, v_sl, n, D, d0, bf16, esz, first, out, 2, 0);
            else if (two)
                v_block(s + m0, v, v_sl, n, D, d0, bf16, esz, first, out, 1, 1);
            else
                v_block(s + m0, v, v_sl, n, D, d0, bf16, esz, first, out, 1, 0);
        }
    }
}

/* chunk_rows_d with the head size a constant for the common sizes, so that the compiler can keep
 * a key's vectors and the accumulators in registers (the same operations in the same order). */
static void chunk_rows(const void *q, int64_t q_sm, const char *k, int64_t k_sl, const char *v, int64_t v_sl,
                       int M, int n, int D, float scale, int bf16, int esz, float *o, float *mx, float *sm) {
    if (D == 64 && !bf16)
        chunk_rows_d(q, q_sm, k, k_sl, v, v_sl, M, n, 64, scale, 0, 4, o, mx, sm);
    else if (D == 64)
        chunk_rows_d(q, q_sm, k, k_sl, v, v_sl, M, n, 64, scale, 1, 2, o, mx, sm);
    else if (D == 128 && !bf16)
        chunk_rows_d(q, q_sm, k, k_sl, v, v_sl, M, n, 128, scale, 0, 4, o, mx, sm);
    else if (D == 128)
        chunk_rows_d(q, q_sm, k, k_sl, v, v_sl, M, n, 128, scale, 1, 2, o, mx, sm);
    else
        chunk_rows_d(q, q_sm, k, k_sl, v, v_sl, M, n, D, scale, bf16, esz, o, mx, sm);
}

/* ---------------------------------------------------------------------------------------------
 * Many bf16 rows without AMX: chunk_dp, on AVX512-BF16's dot products (vdpbf16ps: sixteen float32
 * sums, each of two bf16 products, a register). Where the CPU has AVX512-BF16 but no AMX (AMD's
 * Zen 4), a decode step of many streams over their shared prefix went to PyTorch's flash kernel,
 * whose bf16 products on such a CPU run at float32 speed. The shape of the work is the AMX path's: scores S = Q K^T with K^T
 * gathered in pairs of dims, softmax along each row in float32, then O = P V with P rounded to
 * bf16 (as the flash kernel rounds it) and V regrouped in pairs of keys; the tiles' products
 * are here register blocks of dot products. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DP 1
#define DP_CHUNK RADIX_CHUNK        /* keys per piece (a multiple of 32) */
#define DP_MAX_ROWS RADIX_MANY_ROWS
#define DP_ROW_BLOCK 8  /* rows per block of the scores */

/* Keys j0 .. j0+15 of the n keys (bf16, rows k_sl apart) as K^T in pairs of dims for the dot
 * products: kt[pair][16 keys][2 dims], one gather per pair, zero for keys at or past n; the keys
 * 48 further on prefetched. */
static inline void gather_kt(const uint16_t *k, int64_t k_sl, int j0, int n, int D, uint16_t *kt) {
    const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32((int)(k_sl * 2)));
    const int valid = n - j0 < 16 ? (n - j0 > 0 ? n - j0 : 0) : 16;
    const __mmask16 live = (__mmask16)((1u << valid) - 1);
    const char *base = (const char *)(k + (int64_t)j0 * k_sl);
    if (j0 + 48 < n)
        for (int b = 0; b < 16; b++)
            prefetch_rows((const char *)(k + (int64_t)(j0 + 48 + b) * k_sl), (int64_t)D * 2, 0);
    for (int pr = 0; pr < D / 2; pr++)
        _mm512_store_si512(kt + pr * 32, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows16,
                                                                     base + 4 * pr, 1));
}

/* The n values (bf16, rows v_sl apart) in pairs of keys, 16 dims a row, for the products with
 * pairs of weights: vp[dt][pair][16 dims][2 keys] (zero past the last key). */
static void pair_values(const uint16_t *v, int64_t v_sl, int n, int pairs, int D, uint16_t *vp) {
    const __m512i mix = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                         39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    for (int jp = 0; jp < pairs; jp++) {
        const int j = 2 * jp;
        for (int dt = 0; dt < D / 16; dt++) {
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
            if (j < n)
                a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v + (int64_t)j * v_sl + 16 * dt)));
            if (j + 1 < n)
                b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v + (int64_t)(j + 1) * v_sl + 16 * dt)));
            _mm512_store_si512(vp + ((int64_t)dt * pairs + jp) * 32, _mm512_permutex2var_epi16(a, mix, b));
        }
    }
}

/* Softmax along each of the M rows of raw scores ``sc`` (rows ``stride`` apart, n keys) in float32,
 * times ``scale``: the weights in bf16 to pb (same stride; zero from n up to npad, a multiple of 32),
 * each row's maximum (scaled) to mx and its sum of weights to sm. */
static void softmax_rows(const float *sc, int stride, int M, int n, int npad, float scale, uint16_t *pb, float *mx,
                         float *sm) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int r = 0; r < M; r++) {
        const float *row = sc + r * stride;
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int j = 0; j < n; j += 16) {
            const __mmask16 live = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            best = _mm512_mask_max_ps(best, live, best, _mm512_loadu_ps(row + j));
        }
        const float m = _mm512_reduce_max_ps(best) * scale;
        const __m512 mb = _mm512_set1_ps(m);
        __m512 total = _mm512_setzero_ps();
        for (int j = 0; j < npad; j += 32) {
            __m512 p[2];
            for (int h = 0; h < 2; h++) {
                const int jj = j + 16 * h;
                const __mmask16 live = n - jj >= 16 ? 0xFFFF : n - jj > 0 ? (__mmask16)((1u << (n - jj)) - 1) : 0;
                p[h] = _mm512_maskz_mov_ps(live, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(live, row + jj), s, mb)));
                total = _mm512_add_ps(total, p[h]);
            }
            _mm512_store_si512(pb + r * stride + j, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
        }
        mx[r] = m;
        sm[r] = _mm512_reduce_add_ps(total);
    }
}

/* Scores of R rows (their pairs of dims ``qp``, ``dp`` pairs a row, rows dp apart) for the 16 keys
 * of ``kt`` ([dp][16 keys][2]), to out (rows DP_CHUNK apart). R a constant at each call. */
static inline __attribute__((always_inline)) void dp_scores(const uint16_t *kt, const uint32_t *qp, int dp, const int R,
                                                            float *out) {
    __m512 acc[DP_ROW_BLOCK];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    for (int pr = 0; pr < dp; pr++) {
        const __m512bh kk = (__m512bh)_mm512_load_si512(kt + pr * 32);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)qp[r * dp + pr]), kk);
    }
    for (int r = 0; r < R; r++)
        _mm512_store_ps(out + r * DP_CHUNK, acc[r]);
}

/* R rows of weights (pairs of keys ``pp``, rows DP_CHUNK / 2 apart) times T blocks of 16 dims of the
 * regrouped values ``vd`` ([T][pairs][16 dims][2 keys]), summed over ``pairs``, to out (rows D apart).
 * R and T constants at each call. */
static inline __attribute__((always_inline)) void dp_values(const uint32_t *pp, const uint16_t *vd, int pairs,
                                                            const int R, const int T, float *out, int D) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (int jp = 0; jp < pairs; jp++) {
        __m512bh vv[4];
        for (int t = 0; t < T; t++)
            vv[t] = (__m512bh)_mm512_load_si512(vd + ((int64_t)t * pairs + jp) * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[r * (DP_CHUNK / 2) + jp]);
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], w, vv[t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            _mm512_storeu_ps(out + (int64_t)r * D + 16 * t, acc[r][t]);
}

/* Rows 0..M-1 (bf16, ``q_sm`` apart) over the n (<= DP_CHUNK) keys of one piece: o [M][D] (weights
 * relative to the piece's maximum), that maximum [M] and the sum of the weights [M], as chunk_rows. */
static void chunk_dp(const uint16_t *q, int64_t q_sm, const uint16_t *k, int64_t k_sl, const uint16_t *v, int64_t v_sl,
                     int M, int n, int D, float scale, float *o, float *mx, float *sm) {
    static __thread uint16_t kt[MAX_D / 2 * 16 * 2] __attribute__((aligned(64)));        /* [D/2][16 keys][2] */
    static __thread float sc[DP_MAX_ROWS * DP_CHUNK] __attribute__((aligned(64)));       /* [M][DP_CHUNK] */
    static __thread uint16_t pb[DP_MAX_ROWS * DP_CHUNK] __attribute__((aligned(64)));    /* [M][DP_CHUNK] */
    static __thread uint16_t vp[DP_CHUNK / 2 * MAX_D * 2] __attribute__((aligned(64)));  /* [D/16][n/2][16][2] */
    static __thread uint32_t qp[DP_MAX_ROWS * MAX_D / 2] __attribute__((aligned(64)));   /* [M][D/2] pairs of dims */
    const int npad = (n + 31) / 32 * 32, pairs = npad / 2, dp = D / 2;
    for (int r = 0; r < M; r++)
        memcpy(qp + r * dp, q + (int64_t)r * q_sm, (size_t)D * 2);
    /* scores, 16 keys at a time: K^T for those keys in pairs of dims, then each block of rows times
     * them, a pair of dims a step */
    for (int j0 = 0; j0 < n; j0 += 16) {
        gather_kt(k, k_sl, j0, n, D, kt);
        int r0 = 0;
        for (; r0 + DP_ROW_BLOCK <= M; r0 += DP_ROW_BLOCK)
            dp_scores(kt, qp + r0 * dp, dp, DP_ROW_BLOCK, sc + r0 * DP_CHUNK + j0);
        for (; r0 < M; r0++)
            dp_scores(kt, qp + r0 * dp, dp, 1, sc + r0 * DP_CHUNK + j0);
    }
    pair_values(v, v_sl, n, pairs, D, vp);
    softmax_rows(sc, DP_CHUNK, M, n, npad, scale, pb, mx, sm);
    /* O = P V: four rows (or one) by four blocks of 16 dims a step, a pair of keys per product */
    const uint32_t *pp = (const uint32_t *)pb;
    for (int d0 = 0; d0 < D; d0 += 64) {
        const uint16_t *vd = vp + (int64_t)(d0 / 16) * pairs * 32;
        int r0 = 0;
        if ((D - d0) >= 64) {
            for (; r0 + 4 <= M; r0 += 4)
                dp_values(pp + r0 * (DP_CHUNK / 2), vd, pairs, 4, 4, o + (int64_t)r0 * D + d0, D);
            for (; r0 < M; r0++)
                dp_values(pp + r0 * (DP_CHUNK / 2), vd, pairs, 1, 4, o + (int64_t)r0 * D + d0, D);
        } else {
            for (; r0 < M; r0++)
                dp_values(pp + r0 * (DP_CHUNK / 2), vd, pairs, 1, (D - d0) / 16, o + (int64_t)r0 * D + d0, D);
        }
    }
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Many float32 rows: chunk_fp, on AVX-512's float32 FMAs. Where many streams' decode rows read
 * their shared prefix (48 rows at 16 streams of the embedded model), float32 went to PyTorch's
 * flash kernel, a third of a 16-stream step. Every product stays float32 (nothing is rounded to bf16) and the
 * softmax is the one chunk_rows computes. Scores are computed as S^T = K Q^T: the query rows are
 * the sixteen lanes of a register (Q^T, built once a piece), each key's value for one dim is
 * broadcast straight from its row in the pool (no gathers, no transposes), eight keys by two
 * blocks of sixteen rows (sixteen accumulators) a step; the softmax then runs down the keys, a
 * block of sixteen rows at a time; O = P V in blocks of four rows by four blocks of sixteen dims,
 * each weight broadcast from P^T. */
#if defined(__AVX512F__)
#define HAVE_FP 1
#define FP_CHUNK RADIX_CHUNK       /* keys per piece */
#define FP_MAX_ROWS RADIX_MANY_ROWS /* the many-rows limit in either dtype */
#define FP_AHEAD 32    /* keys ahead whose rows are prefetched */

/* Raw scores of the B (<= 4) blocks of 16 rows from ``r0`` (Q^T ``qt``: [D][mpad]) against the KN
 * (<= 16) keys from ``kj`` (rows k_sl apart), to sc[key][mpad]. B and KN constants at each call. */
static inline __attribute__((always_inline)) void fp_scores(const float *qt, int mpad, int r0, const int B,
                                                            const float *kj, int64_t k_sl, const int KN, int D,
                                                            float *sc) {
    __m512 acc[16][4];
    for (int kk = 0; kk < KN; kk++)
        for (int b = 0; b < B; b++)
            acc[kk][b] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        __m512 qv[4];
        for (int b = 0; b < B; b++)
            qv[b] = _mm512_load_ps(qt + (int64_t)d * mpad + r0 + 16 * b);
        for (int kk = 0; kk < KN; kk++) {
            const __m512 kb = _mm512_set1_ps(kj[kk * k_sl + d]);
            for (int b = 0; b < B; b++)
                acc[kk][b] = _mm512_fmadd_ps(kb, qv[b], acc[kk][b]);
        }
    }
    for (int kk = 0; kk < KN; kk++)
        for (int b = 0; b < B; b++)
            _mm512_store_ps(sc + (int64_t)kk * mpad + r0 + 16 * b, acc[kk][b]);
}

/* keys [j, j + KN) of the n: their rows' prefetches (keys FP_AHEAD on, values now, to L2), then
 * every row's scores against them (all B blocks in one pass: each key's broadcast serves every
 * block); B and KN constants at each call */
static inline __attribute__((always_inline)) void fp_keys(const float *qt, int mpad, const int B, const float *k,
                                                          int64_t k_sl, const float *v, int64_t v_sl, int j, int n,
                                                          const int KN, int D, float *sc) {
    if (j + FP_AHEAD + KN <= n)
        prefetch_rows((const char *)(k + (int64_t)(j + FP_AHEAD) * k_sl), (int64_t)KN * k_sl * 4, 0);
    prefetch_rows((const char *)(v + (int64_t)j * v_sl), (int64_t)KN * v_sl * 4, 1);
    fp_scores(qt, mpad, 0, B, k + (int64_t)j * k_sl, k_sl, KN, D, sc + (int64_t)j * mpad);
}

/* Every row's scores against all n keys, KN keys a pass, then one at a time (B, KN constants) */
static inline __attribute__((always_inline)) void fp_all_keys(const float *qt, int mpad, const int B, const float *k,
                                                              int64_t k_sl, const float *v, int64_t v_sl, int n,
                                                              const int KN, int D, float *sc) {
    int j = 0;
    for (; j + KN <= n; j += KN)
        fp_keys(qt, mpad, B, k, k_sl, v, v_sl, j, n, KN, D, sc);
    for (; j < n; j++)
        fp_keys(qt, mpad, B, k, k_sl, v, v_sl, j, n, 1, D, sc);
}

/* R rows of weights (P^T ``pt``: [n][mpad], from row r0) times T blocks of 16 dims of the n values
 * (rows v_sl apart, from dim d0), to out (rows D apart). R and T constants at each call. */
static inline __attribute__((always_inline)) void fp_values(const float *pt, int mpad, int r0, const int R,
                                                            const float *v, int64_t v_sl, int n, const int T,
                                                            float *out, int D) {
    __m512 acc[6][4];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        __m512 vv[4];
        for (int t = 0; t < T; t++)
            vv[t] = _mm512_loadu_ps(v + (int64_t)j * v_sl + 16 * t);
        for (int r = 0; r < R; r++) {
            const __m512 w = _mm512_set1_ps(pt[(int64_t)j * mpad + r0 + r]);
            for (int t = 0; t < T; t++)
                acc[r][t] = _mm512_fmadd_ps(w, vv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            _mm512_storeu_ps(out + (int64_t)r * D + 16 * t, acc[r][t]);
}

/* Rows 0..M-1 (float32, ``q_sm`` apart) over the n (<= FP_CHUNK) keys of one piece: o [M][D] (weights
 * relative to the piece's maximum), that maximum [M] and the sum of the weights [M], as chunk_rows. */
static void chunk_fp(const float *q, int64_t q_sm, const float *k, int64_t k_sl, const float *v, int64_t v_sl, int M,
                     int n, int D, float scale, float *o, float *mx, float *sm) {
    static __thread float qt[MAX_D * FP_MAX_ROWS] __attribute__((aligned(64)));   /* [D][mpad] */
    static __thread float sc[FP_CHUNK * FP_MAX_ROWS] __attribute__((aligned(64))); /* [n][mpad] */
    const int mpad = (M + 15) / 16 * 16;
    for (int d = 0; d < D; d++)
        for (int r = 0; r < mpad; r++)
            qt[d * mpad + r] = r < M ? q[(int64_t)r * q_sm + d] : 0.0f;
    /* keys a pass: as many as keep 16-24 accumulators (B blocks of rows times the keys) in registers */
    switch (mpad / 16) {
    case 1: fp_all_keys(qt, mpad, 1, k, k_sl, v, v_sl, n, 16, D, sc); break;
    case 2: fp_all_keys(qt, mpad, 2, k, k_sl, v, v_sl, n, 12, D, sc); break;
    case 3: fp_all_keys(qt, mpad, 3, k, k_sl, v, v_sl, n, 8, D, sc); break;
    default: fp_all_keys(qt, mpad, 4, k, k_sl, v, v_sl, n, 6, D, sc); break;
    }
    /* softmax down the keys, sixteen rows a lane each; as chunk_rows: scores scaled, then the
     * maximum (a NaN score passed over), then exp of each score less it */
    const __m512 s = _mm512_set1_ps(scale);
    for (int r0 = 0; r0 < mpad; r0 += 16) {
        __m512 best = _mm512_set1_ps(-INFINITY);
        for (int jj = 0; jj < n; jj++) {
            float *at = sc + (int64_t)jj * mpad + r0;
            const __m512 x = _mm512_mul_ps(_mm512_load_ps(at), s);
            _mm512_store_ps(at, x);
            best = _mm512_max_ps(x, best);
        }
        __m512 total = _mm512_setzero_ps();
        for (int jj = 0; jj < n; jj++) {
            float *at = sc + (int64_t)jj * mpad + r0;
            const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(at), best));
            _mm512_store_ps(at, p);
            total = _mm512_add_ps(total, p);
        }
        float b[16], t[16];
        _mm512_storeu_ps(b, best);
        _mm512_storeu_ps(t, total);
        for (int i = 0; i < 16 && r0 + i < M; i++) {
            mx[r0 + i] = b[i];
            sm[r0 + i] = t[i];
        }
    }
    /* O = P V: four rows (or one) by up to four blocks of 16 dims a step */
    for (int d0 = 0; d0 < D; d0 += 64) {
        const int T = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
        int r0 = 0;
        if (T == 4) {
            for (; r0 + 6 <= M; r0 += 6)
                fp_values(sc, mpad, r0, 6, v + d0, v_sl, n, 4, o + (int64_t)r0 * D + d0, D);
            for (; r0 + 4 <= M; r0 += 4)
                fp_values(sc, mpad, r0, 4, v + d0, v_sl, n, 4, o + (int64_t)r0 * D + d0, D);
            for (; r0 < M; r0++)
                fp_values(sc, mpad, r0, 1, v + d0, v_sl, n, 4, o + (int64_t)r0 * D + d0, D);
        } else {
            for (; r0 < M; r0++)
                for (int t = 0; t < T; t++)
                    fp_values(sc, mpad, r0, 1, v + d0 + 16 * t, v_sl, n, 1, o + (int64_t)r0 * D + d0 + 16 * t, D);
        }
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_MAX_ROWS RADIX_MANY_ROWS /* four tiles of 16 query rows */
#define AMX_MIN_ROWS 5  /* fewer rows: chunk_rows, which streams the keys faster */
#define AMX_CHUNK RADIX_CHUNK /* keys per piece on this path (a multiple of 32) */
#define AMX_CHUNK_ROWS AMX_CHUNK

/* The tile shapes: every tile 16 rows of 64 bytes (16 fp32, or 32 bf16). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Asks the kernel for the AMX tile state (once per process; oneDNN asks too). */
int radix_amx_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        unsigned long bitmask = 0;
        const int ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 &&
                       syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &bitmask) == 0;
        ready = ok && (bitmask & (1ul << 18)) ? 1 : 0;
    }
    return ready;
}

/* Rows 0..M-1 (M <= AMX_MAX_ROWS, bf16) over the n (<= AMX_CHUNK) keys of one piece, with the
 * AMX tiles: scores S = Q K^T (Q rows from ``qa``, the head's rows padded to 16s, K^T in pairs of dims gathered from
 * the pool), softmax along each row in float32, then O = P V (P rounded to bf16, as the flash
 * kernel does; V regrouped in pairs of keys). Same outputs as chunk_rows. */
static void chunk_amx(const uint16_t *qa, const uint16_t *k, int64_t k_sl, const uint16_t *v, int64_t v_sl, int M,
                      int n, int D, float scale, float *o, float *mx, float *sm) {
    static __thread uint16_t kt[MAX_D / 2 * 16 * 2] __attribute__((aligned(64)));          /* [D/2][16 keys][2] */
    static __thread float sc[AMX_MAX_ROWS * AMX_CHUNK] __attribute__((aligned(64)));       /* [M16][AMX_CHUNK] */
    static __thread uint16_t pb[AMX_MAX_ROWS * AMX_CHUNK] __attribute__((aligned(64)));    /* [M16][AMX_CHUNK] */
    static __thread uint16_t vp[AMX_CHUNK / 2 * MAX_D * 2] __attribute__((aligned(64)));   /* [D/16][n/2][16][2] */
    static __thread float ob[16 * 64] __attribute__((aligned(64)));
    const int mt = (M + 15) / 16, npad = (n + 31) / 32 * 32, pairs = npad / 2;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    /* scores, 16 keys at a time: K^T for those keys in pairs of dims */
    for (int j0 = 0; j0 < npad; j0 += 16) {
        gather_kt(k, k_sl, j0, n, D, kt);
        for (int t = 0; t < mt; t++) {
            _tile_zero(2);
            for (int ks = 0; ks < D / 32; ks++) {
                _tile_loadd(0, qa + t * 16 * D + ks * 32, D * 2);
                _tile_loadd(1, kt + ks * 16 * 32, 64);
                _tile_dpbf16ps(2, 0, 1);
            }
            _tile_stored(2, sc + t * 16 * AMX_CHUNK + j0, AMX_CHUNK * 4);
        }
    }
    pair_values(v, v_sl, n, pairs, D, vp);
    softmax_rows(sc, AMX_CHUNK, M, n, npad, scale, pb, mx, sm);
    for (int r = M; r < mt * 16; r++)
        memset(pb + r * AMX_CHUNK, 0, npad * 2);
    /* O = P V: four tiles of 16 dims at a time, 32 keys per product */
    for (int t = 0; t < mt; t++) {
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int tiles = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_zero(7);
            for (int j = 0; j < npad; j += 32) {
                _tile_loadd(0, pb + t * 16 * AMX_CHUNK + j, AMX_CHUNK * 2);
                const int64_t at = (int64_t)(j / 2) * 32;
                _tile_loadd(1, vp + (int64_t)(d0 / 16) * pairs * 32 + at, 64);
                _tile_dpbf16ps(4, 0, 1);
                if (tiles > 1) {
                    _tile_loadd(1, vp + (int64_t)(d0 / 16 + 1) * pairs * 32 + at, 64);
                    _tile_dpbf16ps(5, 0, 1);
                }
                if (tiles > 2) {
                    _tile_loadd(1, vp + (int64_t)(d0 / 16 + 2) * pairs * 32 + at, 64);
                    _tile_dpbf16ps(6, 0, 1);
                }
                if (tiles > 3) {
                    _tile_loadd(1, vp + (int64_t)(d0 / 16 + 3) * pairs * 32 + at, 64);
                    _tile_dpbf16ps(7, 0, 1);
                }
            }
            _tile_stored(4, ob, 64 * 4);
            _tile_stored(5, ob + 16, 64 * 4);
            _tile_stored(6, ob + 32, 64 * 4);
            _tile_stored(7, ob + 48, 64 * 4);
            for (int r = 0; r < 16 && t * 16 + r < M; r++)
                memcpy(o + (int64_t)(t * 16 + r) * D + d0, ob + r * 64, (size_t)tiles * 16 * 4);
        }
    }
    _tile_release();
}
#else
int radix_amx_ready(void) { return 0; }
#define AMX_MAX_ROWS 0
#define AMX_CHUNK_ROWS MAX_CHUNK
#endif
#ifdef HAVE_DP
#define HAVE_DP_ROWS 1
#define DP_MIN_ROWS 5 /* fewer rows: chunk_rows, which streams the keys faster */
#define DP_CHUNK_ROWS DP_CHUNK
#else
#define HAVE_DP_ROWS 0
#define DP_MIN_ROWS (1 << 30)
#define DP_MAX_ROWS 0
#define DP_CHUNK_ROWS MAX_CHUNK
#endif

#ifdef HAVE_FP
#define HAVE_FP_ROWS 1
#define FP_MIN_ROWS 5 /* fewer rows: chunk_rows, which streams the keys faster */
#define FP_CHUNK_ROWS FP_CHUNK
#else
#define HAVE_FP_ROWS 0
#define FP_MIN_ROWS (1 << 30)
#define FP_MAX_ROWS 0
#define FP_CHUNK_ROWS MAX_CHUNK
#endif

/* Which path takes many bf16 rows (AMX_MAX_ROWS at most) here: 2 AMX, 1 AVX512-BF16's dot
 * products, 0 none (up to MAX_ROWS rows only). */
int radix_bf16_rows_path(void) { return radix_amx_ready() ? 2 : HAVE_DP_ROWS; }

/* Whether many float32 rows (FP_MAX_ROWS at most) have a path here (chunk_fp: AVX-512). */
int radix_fp32_rows_path(void) { return HAVE_FP_ROWS; }

/* Rows of several tokens at once: token r (``rows[r]`` = pack position, first piece, end piece)
 * has M query rows per KV head, at q + h*q_hs + i*q_rs + pos*q_ts (i < M), and attends over
 * its own pieces (``pieces[p]`` = first key, key count, row). Writes out and lse at the same
 * places (their own strides). One token with every key of a view is a plain call.
 * ``merge_in``: out and lse already hold these rows' attention over other keys (a normalised
 * output and its log-sum-exp, or lse -inf where there were none); it is merged in as one more
 * piece (weight e^(lse - max), sum 1), so a shared prefix's call needs no merge after it. */
radix_status radix_attention(const void *q, int64_t q_hs, int64_t q_rs, int64_t q_ts, const void *k, int64_t k_sh,
                             int64_t k_sl, const void *v, int64_t v_sh, int64_t v_sl, int64_t keys, const int64_t *rows, int64_t nrows,
                             const int64_t *pieces, int64_t npieces, int64_t H, int64_t M, int64_t D, float scale,
                             int bf16, float *out, int64_t o_hs, int64_t o_rs, int64_t o_ts, float *lse, int64_t l_hs,
                             int64_t l_rs, int64_t l_ts, float *work, int threads, int merge_in) {
    if (D % 16 || D > MAX_D || M < 1 || nrows < 1 || npieces < 1 || H < 1 || threads < 1)
        return RADIX_E_ATTN_SHAPE;
    /* AMX from AMX_MIN_ROWS bf16 rows where it runs; else AVX512-BF16's dot products from
     * DP_MIN_ROWS bf16 rows where the CPU has them; else up to MAX_ROWS rows */
#ifdef HAVE_AMX
    const int amx = M >= AMX_MIN_ROWS && bf16 && D % 32 == 0 && radix_amx_ready();
#else
    const int amx = 0;
#endif
    const int dp = !amx && HAVE_DP_ROWS && M >= DP_MIN_ROWS && bf16 && D % 32 == 0;
    const int fp = HAVE_FP_ROWS && M >= FP_MIN_ROWS && !bf16;
    if (M > (amx ? AMX_MAX_ROWS : dp ? DP_MAX_ROWS : fp ? FP_MAX_ROWS : MAX_ROWS))
        return RADIX_E_ATTN_ROWS;
    const int64_t chunk = amx ? AMX_CHUNK_ROWS : dp ? DP_CHUNK_ROWS : fp ? FP_CHUNK_ROWS : MAX_CHUNK;
    for (int64_t i = 0; i < npieces; i++) {
        const int64_t *pc = pieces + 3 * i;
        if (pc[0] < 0 || pc[1] < 1 || pc[1] > chunk || pc[0] + pc[1] > keys || pc[2] < 0 || pc[2] >= nrows)
            return RADIX_E_ATTN_PIECE;
    }
    for (int64_t r = 0; r < nrows; r++)
        if (rows[3 * r + 1] < 0 || rows[3 * r + 2] > npieces || rows[3 * r + 1] >= rows[3 * r + 2])
            return RADIX_E_ATTN_TOKEN;
    const int esz = bf16 ? 2 : 4;
    const int64_t per = M * D + 2 * M;
#ifdef HAVE_AMX
    /* the AMX path's query rows, after the partial sums in ``work``: per (token, head), the M
     * rows contiguous and zero rows up to a multiple of 16 */
    uint16_t *qa = (uint16_t *)(work + H * npieces * per);
    const int64_t m16 = (M + 15) / 16 * 16;
    if (amx)
        for (int64_t r = 0; r < nrows; r++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < m16; i++)
                    for (int64_t d = 0; d < D; d++)
                        qa[((r * H + h) * m16 + i) * D + d] =
                            i < M ? ((const uint16_t *)q)[h * q_hs + i * q_rs + rows[3 * r] * q_ts + d] : 0;
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) /* as threads come free: see linear_part */
    for (int64_t item = 0; item < H * npieces; item++) {
        const int64_t h = item % H, c = item / H;
        const int64_t j0 = pieces[3 * c], r = pieces[3 * c + 2];
        const int n = (int)pieces[3 * c + 1];
        float *o = work + item * per, *mx = o + M * D, *sm = mx + M;
        const char *qh = (const char *)q + (h * q_hs + rows[3 * r] * q_ts) * esz;
        const char *kh = (const char *)k + (h * k_sh + j0 * k_sl) * esz;
        const char *vh = (const char *)v + (h * v_sh + j0 * v_sl) * esz;
#ifdef HAVE_FP
        if (fp) {
            chunk_fp((const float *)qh, q_rs, (const float *)kh, k_sl, (const float *)vh, v_sl, (int)M, n, (int)D, scale,
                     o, mx, sm);
            continue;
        }
#endif
#ifdef HAVE_DP
        if (dp) {
            chunk_dp((const uint16_t *)qh, q_rs, (const uint16_t *)kh, k_sl, (const uint16_t *)vh, v_sl, (int)M, n, (int)D,
                     scale, o, mx, sm);
            continue;
        }
#endif
#ifdef HAVE_AMX
        if (amx) {
            chunk_amx(qa + (r * H + h) * m16 * D, (const uint16_t *)kh, k_sl, (const uint16_t *)vh, v_sl, (int)M, n,
                      (int)D, scale, o, mx, sm);
            continue;
        }
#endif
        chunk_rows(qh, q_rs, kh, k_sl, vh, v_sl, (int)M, n, (int)D, scale, bf16, esz, o, mx, sm);
    }
    /* merge the pieces of each (token, head, row), in order */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t rhm = 0; rhm < nrows * H * M; rhm++) {
        const int64_t r = rhm / (H * M), h = rhm / M % H, m = rhm % M;
        const int64_t p0 = rows[3 * r + 1], p1 = rows[3 * r + 2], pos = rows[3 * r];
        float *dst = out + h * o_hs + m * o_rs + pos * o_ts, *lp = lse + h * l_hs + m * l_rs + pos * l_ts;
        const float old = merge_in ? *lp : -INFINITY;
        float best = old;
        for (int64_t c = p0; c < p1; c++) {
            const float *mx = work + (c * H + h) * per + M * D;
            best = mx[m] > best ? mx[m] : best;
        }
        float total = 0.0f;
        float acc[MAX_D];
        for (int64_t d = 0; d < D; d++)
            acc[d] = 0.0f;
        if (old > -INFINITY) {
            const float w = expf(old - best);
            total = w;
            for (int64_t d = 0; d < D; d++)
                acc[d] = w * dst[d];
        }
        for (int64_t c = p0; c < p1; c++) {
            const float *o = work + (c * H + h) * per, *mx = o + M * D, *sm = mx + M;
            const float w = expf(mx[m] - best);
            total += w * sm[m];
            for (int64_t d = 0; d < D; d++)
                acc[d] += w * o[m * D + d];
        }
        for (int64_t d = 0; d < D; d++)
            dst[d] = acc[d] / total;
        *lp = best + logf(total);
    }
    return RADIX_OK;
}

/* One layer's call of radix_attention with everything but the layer's keys, values and the query
 * and output buffers fixed (radix_attn_layer, native_abi.h): the fused decode step
 * (engine.model.fused_decode) calls it for each layer from C, through ``radix_attention_layer``'s address. */
radix_status radix_attention_layer(const radix_attn_layer *c, const void *q, const void *k, const void *v, float *out) {
    return radix_attention(q, c->q_hs, c->q_rs, c->q_ts, k, c->k_sh, c->k_sl, v, c->v_sh, c->v_sl, c->keys, c->rows,
                           c->nrows, c->pieces, c->npieces, c->H, c->M, c->D, (float)c->scale, (int)c->bf16, out, c->o_hs,
                           c->o_rs, c->o_ts, c->lse, c->l_hs, c->l_rs, c->l_ts, c->work, (int)c->threads, 0);
}

/* ------------------------------------------------------------------------------------------------
 * Exact attention (issue 44): a token's result depends on its queries and its keys alone.
 *
 * Every path above is fast for its case, and each reduces in its own order: pieces cut where a
 * run of the pool starts, a shared prefix merged apart from the rest, AMX rounding the weights to
 * bf16. So a token's bits depended on its batch, on where the cache ended and on its chunk. Here
 * one order serves every case: token t at position p attends over keys 0..p in blocks of
 * EXACT_BLOCK keys fixed by absolute position ([0, 256), [256, 512), ...; the last one ends at
 * p), and the blocks merge into a running state in block order. Within a block each score is one
 * chain of FMAs down the head's dimensions in order (query rows side by side in the lanes, as
 * chunk_fp lays them), scaled; the block's maximum; the weights exp(score - maximum) summed in key
 * order; each output dimension the weighted values summed in key order. Nothing depends on which
 * slots hold the keys, on the other rows computed beside a row, on the thread or the thread count,
 * so a decode row alone, the same row among sixteen, and the same position inside a prefill chunk
 * over a cached prefix or from nothing give the same bits.
 *
 * Sharing: a work item is one KV head of a chunk of up to EXACT_MAX_CHUNK consecutive tokens. Per
 * block, tokens whose keys there lie in the same slots (a prefill chunk's tokens, decode rows
 * behind one prompt) are computed together, up to EXACT_ROWS query rows: each key's row is read
 * once for all of them. A token whose block ends earlier (the diagonal of a prefill chunk) joins
 * its neighbours with its own key count: its scores past it are never used, its sums stop there.
 *
 * Families (engine.model.families): a sliding window (radix_exact.window) starts token t at
 * lo = p - window + 1; blocks wholly before lo are skipped and the first one it reads masks the keys
 * before lo (their weights 0: the sums are those that start at lo), so its blocks are still fixed by
 * absolute position. A soft-cap (radix_exact.softcap) caps each score on its own before the maximum.
 * Both depend on the position alone: the bits stay independent of the batch, the chunk and the cache.
 *
 * The context (radix_exact): q and out are [ntok][H*G*D] (query head h*G + i reads KV head h,
 * as transformers lays them out), q in the pool's dtype, out float32; k and v one pool layer
 * [H][slots][D]. tok[t] = (position p, first run, end run): token t's runs, in position order,
 * are runs[first..end) = (first position, first slot, length), covering positions 0..p at least.
 * chunks[0..nchunks] are token boundaries (radix_exact, native_abi.h). Returns RADIX_OK, or the code
 * of what it refused (RADIX_E_EXACT_..., RADIX_E_NO_MEMORY). */
#define EXACT_BLOCK RADIX_EXACT_BLOCK
#define EXACT_MAX_G RADIX_EXACT_MAX_G
#define EXACT_MAX_CHUNK RADIX_EXACT_MAX_CHUNK
#define EXACT_ROWS RADIX_EXACT_ROWS /* query rows computed together over a block (four groups of 16 lanes) */
#define EXACT_TILE_KEYS 12 /* AVX2: keys a pass of the scores, with eight rows */

static radix_status exact_check(const radix_exact *c) {
    if (c->D % 16 || c->D > MAX_D || c->D < 16 || c->H < 1 || c->ntok < 1 || c->threads < 1)
        return RADIX_E_EXACT_SHAPE;
    if (c->G < 1 || c->G > EXACT_MAX_G || c->window < 0 || !(c->softcap >= 0.0))
        return RADIX_E_EXACT_GROUP;
    for (int64_t t = 0; t < c->ntok; t++) {
        const int64_t p = c->tok[3 * t], r0 = c->tok[3 * t + 1], r1 = c->tok[3 * t + 2];
        if (p < 0 || r0 < 0 || r1 > c->nruns || r0 >= r1)
            return RADIX_E_EXACT_RUNS;
        int64_t at = 0;
        for (int64_t r = r0; r < r1 && at <= p; r++) {
            const int64_t *run = c->runs + 3 * r;
            if (run[0] != at || run[2] < 1 || run[1] < 0 || run[1] + run[2] > c->slots)
                return RADIX_E_EXACT_RUNS;
            at += run[2];
        }
        if (at <= p)
            return RADIX_E_EXACT_RUNS;
    }
    if (c->nchunks < 1 || c->chunks[0] != 0 || c->chunks[c->nchunks] != c->ntok)
        return RADIX_E_EXACT_CHUNKS;
    for (int64_t i = 0; i < c->nchunks; i++) {
        const int64_t n = c->chunks[i + 1] - c->chunks[i];
        if (n < 1 || n > EXACT_MAX_CHUNK || n * c->G > EXACT_ROWS)
            return RADIX_E_EXACT_CHUNKS;
    }
    return RADIX_OK;
}

/* One thread's scratch for the exact kernel. */
typedef struct {
    float qt[MAX_D * EXACT_ROWS];        /* the group's queries, transposed: [D][rpad] */
    float sc[EXACT_BLOCK * EXACT_ROWS];  /* scores, then weights: [key][rpad] */
    float bm[EXACT_ROWS], bs[EXACT_ROWS];
    float ba[EXACT_ROWS * MAX_D];        /* the block's weighted values per row */
    int nr[EXACT_ROWS];                  /* each row's key count in the block */
    int lo[EXACT_ROWS];                  /* each row's first key in the block (a sliding window's start) */
    const char *kp[EXACT_BLOCK], *vp[EXACT_BLOCK], *gk[EXACT_BLOCK], *gv[EXACT_BLOCK];
    float kw[EXACT_TILE_KEYS * MAX_D];   /* AVX2: a tile's keys, float32 and side by side */
    float state[EXACT_MAX_CHUNK * EXACT_MAX_G * (MAX_D + 2)];
    float block[EXACT_MAX_CHUNK * EXACT_MAX_G * (MAX_D + 2)]; /* one block's partials, before the fold */
} exact_scratch;

#if defined(__AVX512F__)
#define EXACT_FEW_ROWS 8 /* up to this many rows, scores with keys in the lanes */

/* r[i] holds row i (16 floats); afterwards r[j] holds column j (r[j][i] = the old r[i][j]) */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
        t[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xdd);
        t[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
        r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
    }
}

/* The scores of up to EXACT_FEW_ROWS rows (queries in w->qt, [D][rpad]) against the n keys at w->kp, to
 * w->sc ([key][rpad]), sixteen keys a pass with the keys in the lanes: each score is the same chain of
 * FMAs down d in order, from zero, then scaled, as the rows-in-lanes loop makes it (fma(k, q, acc) and
 * fma(q, k, acc) are one rounding of one exact value), so the bits do not depend on which loop ran.
 * A block of 16 keys by 16 dims is loaded as rows and transposed in registers: with one stream's three
 * query rows the rows-in-lanes loop used 3 of 16 lanes. */
static inline __attribute__((always_inline)) void exact_few_scores(exact_scratch *w, int R, int rpad, int n, int D,
                                                                   float scale, int bf16, int esz) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int kn = n - j0 < 16 ? n - j0 : 16;
        for (int jj = 16; jj < 32 && j0 + jj < n; jj++) /* the next pass's keys, to L1 */
            prefetch_rows(w->kp[j0 + jj], (int64_t)D * esz, 0);
        for (int jj = 64; jj < 80 && j0 + jj < n; jj++) { /* keys and values four passes on, to L2 */
            prefetch_rows(w->kp[j0 + jj], (int64_t)D * esz, 1);
            prefetch_rows(w->vp[j0 + jj], (int64_t)D * esz, 1);
        }

        __m512 acc[EXACT_FEW_ROWS];
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_setzero_ps();
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 t[16];
            for (int jj = 0; jj < 16; jj++) /* past the n keys: the first key again (never read after) */
                t[jj] = load16(w->kp[j0 + (jj < kn ? jj : 0)] + (int64_t)d0 * esz, bf16);
            transpose16(t);
            for (int dd = 0; dd < 16; dd++)
                for (int r = 0; r < R; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(w->qt[(d0 + dd) * rpad + r]), t[dd], acc[r]);
        }
        for (int r = 0; r < R; r++) {
            float s16[16];
            _mm512_storeu_ps(s16, _mm512_mul_ps(acc[r], vs));
            for (int jj = 0; jj < kn; jj++)
                w->sc[(int64_t)(j0 + jj) * rpad + r] = s16[jj];
        }
    }
}
#endif

/* Rows r0 .. r0+RB-1 of the weights (sc, [key][rpad]) times T blocks of 16 dims of the value rows from
 * d0, to ba: keys below ``least`` (every row's count) with no test, then up to ``most`` each row to
 * its own count; each sum in key order. RB and T constants at the calls that matter. */
static inline __attribute__((always_inline)) void exact_values(exact_scratch *w, int rpad, int r0, const int RB,
                                                               int least, int most, int d0, const int T, int D,
                                                               int bf16, int esz) {
    vf acc[4][4];
    for (int i = 0; i < RB; i++)
        for (int t = 0; t < T; t++)
            acc[i][t] = vf_zero();
    int j = 0;
    for (; j < least; j++) {
        vf vv[4];
        for (int t = 0; t < T; t++)
            vv[t] = load16(w->vp[j] + (int64_t)(d0 + 16 * t) * esz, bf16);
        const float *p = w->sc + (int64_t)j * rpad + r0;
        for (int i = 0; i < RB; i++) {
            const vf pw = vf_set1(p[i]);
            for (int t = 0; t < T; t++)
                acc[i][t] = vf_fmadd(pw, vv[t], acc[i][t]);
        }
    }
    for (; j < most; j++) {
        vf vv[4];
        for (int t = 0; t < T; t++)
            vv[t] = load16(w->vp[j] + (int64_t)(d0 + 16 * t) * esz, bf16);
        const float *p = w->sc + (int64_t)j * rpad + r0;
        for (int i = 0; i < RB; i++) {
            if (j >= w->nr[r0 + i])
                continue;
            const vf pw = vf_set1(p[i]);
            for (int t = 0; t < T; t++)
                acc[i][t] = vf_fmadd(pw, vv[t], acc[i][t]);
        }
    }
    for (int i = 0; i < RB; i++)
        for (int t = 0; t < T; t++)
            vf_store(w->ba + (int64_t)(r0 + i) * D + d0 + 16 * t, acc[i][t]);
}

/* What a family's attention does to the scores before the softmax (engine.model.families): soft-capping,
 * cap * tanh(score / cap) (Gemma 2), and a sliding window's start, keys before lo[r] out of the row's
 * maximum; each score on its own, so a row's bits stay its own. Nothing for a plain model. */
static void exact_shape_scores(exact_scratch *w, int R, int rpad, int n, float cap) {
    if (cap > 0.0f)
        for (int j = 0; j < n; j++)
            for (int r = 0; r < R; r++) {
                float *at = w->sc + (int64_t)j * rpad + r;
                *at = cap * tanhf(*at / cap);
            }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < w->lo[r]; j++)
            w->sc[(int64_t)j * rpad + r] = -INFINITY;
}

/* the weights of keys before a row's window: 0 (the sums then add +0, as if they started at lo[r]) */
static void exact_window_weights(exact_scratch *w, int R, int rpad) {
    for (int r = 0; r < R; r++)
        for (int j = 0; j < w->lo[r]; j++)
            w->sc[(int64_t)j * rpad + r] = 0.0f;
}

/* R query rows (row r's D values at qr[r], the pool's dtype) over the first nr[r] of the n keys at
 * kp/vp: each row's block maximum bm, sum of weights bs, and weighted values ba [R][D] (weights
 * relative to its maximum). Every row's numbers are those it gets computed alone (top of section). */
static inline __attribute__((always_inline)) void exact_rows_d(exact_scratch *w, const char *const *qr, int R, int n,
                                                               int D, float scale, int bf16, float cap) {
    const int esz = bf16 ? 2 : 4, rpad = (R + 15) / 16 * 16, nb = rpad / 16;
    for (int d = 0; d < D; d++)
        for (int r = 0; r < rpad; r++)
            w->qt[d * rpad + r] = r < R ? load1(qr[r], d, bf16) : 0.0f;
    const vf vs = vf_set1(scale);
    /* memory: the block's first keys and values now (the loops below fetch theirs 64 keys ahead into L2,
     * a few ahead into L1): a decode step's keys come from DRAM, a layer's worth since they were read */
    for (int jj = 0; jj < 64 && jj < n; jj++) {
        prefetch_rows(w->kp[jj], (int64_t)D * esz, jj < 16 ? 0 : 1);
        prefetch_rows(w->vp[jj], (int64_t)D * esz, 1);
    }
    int j = 0;
#if defined(__AVX512F__)
    if (R <= EXACT_FEW_ROWS) { /* few rows: keys in the lanes, the same chains (see exact_few_scores) */
        exact_few_scores(w, R, rpad, n, D, scale, bf16, esz);
        j = n;
    }
#endif
    /* scores: lanes are rows, each a chain of FMAs over d in order; four keys a pass (each query
     * vector loaded once for them), then one at a time: the same chain either way */
    for (; j + 4 <= n; j += 4) {
        for (int kk = 8; kk < 12 && j + kk < n; kk++) /* keys two passes on, to L1 */
            prefetch_rows(w->kp[j + kk], (int64_t)D * esz, 0);
        for (int kk = 64; kk < 68 && j + kk < n; kk++) { /* keys and values sixteen passes on, to L2 */
            prefetch_rows(w->kp[j + kk], (int64_t)D * esz, 1);
            prefetch_rows(w->vp[j + kk], (int64_t)D * esz, 1);
        }
        const char *k0 = w->kp[j], *k1 = w->kp[j + 1], *k2 = w->kp[j + 2], *k3 = w->kp[j + 3];
        vf acc[4][EXACT_ROWS / 16];
        for (int kk = 0; kk < 4; kk++)
            for (int b = 0; b < nb; b++)
                acc[kk][b] = vf_zero();
        for (int d = 0; d < D; d++) {
            const vf kb0 = vf_set1(load1(k0, d, bf16)), kb1 = vf_set1(load1(k1, d, bf16));
            const vf kb2 = vf_set1(load1(k2, d, bf16)), kb3 = vf_set1(load1(k3, d, bf16));
            for (int b = 0; b < nb; b++) {
                const vf qv = vf_load(w->qt + d * rpad + 16 * b);
                acc[0][b] = vf_fmadd(kb0, qv, acc[0][b]);
                acc[1][b] = vf_fmadd(kb1, qv, acc[1][b]);
                acc[2][b] = vf_fmadd(kb2, qv, acc[2][b]);
                acc[3][b] = vf_fmadd(kb3, qv, acc[3][b]);
            }
        }
        for (int kk = 0; kk < 4; kk++)
            for (int b = 0; b < nb; b++)
                vf_store(w->sc + (int64_t)(j + kk) * rpad + 16 * b, vf_mul(acc[kk][b], vs));
    }
    for (; j < n; j++) {
        const char *kj = w->kp[j];
        vf acc[EXACT_ROWS / 16];
        for (int b = 0; b < nb; b++)
            acc[b] = vf_zero();
        for (int d = 0; d < D; d++) {
            const vf kb = vf_set1(load1(kj, d, bf16));
            for (int b = 0; b < nb; b++)
                acc[b] = vf_fmadd(kb, vf_load(w->qt + d * rpad + 16 * b), acc[b]);
        }
        for (int b = 0; b < nb; b++)
            vf_store(w->sc + (int64_t)j * rpad + 16 * b, vf_mul(acc[b], vs));
    }
    exact_shape_scores(w, R, rpad, n, cap);
    for (int r = 0; r < R; r++) /* a row's keys past its own count: out of its maximum */
        for (int j = w->nr[r]; j < n; j++)
            w->sc[(int64_t)j * rpad + r] = -INFINITY;
    for (int b = 0; b < nb; b++) {
        vf best = vf_set1(-INFINITY);
        for (int j = 0; j < n; j++)
            best = vf_max(vf_load(w->sc + (int64_t)j * rpad + 16 * b), best);
        for (int j = 0; j < n; j++) {
            float *at = w->sc + (int64_t)j * rpad + 16 * b;
            vf_store(at, exp16(vf_sub(vf_load(at), best)));
        }
        float top[16];
        vf_store(top, best);
        for (int i = 0; i < 16 && 16 * b + i < R; i++)
            w->bm[16 * b + i] = top[i];
    }
    for (int r = 0; r < R; r++) /* weights past a row's count: 0 (exp16 leaves e^-87) */
        for (int j = w->nr[r]; j < n; j++)
            w->sc[(int64_t)j * rpad + r] = 0.0f;
    exact_window_weights(w, R, rpad);
    for (int b = 0; b < nb; b++) { /* each row's sum of weights, in key order (adding 0 past its count) */
        vf total = vf_zero();
        for (int j = 0; j < n; j++)
            total = vf_add(total, vf_load(w->sc + (int64_t)j * rpad + 16 * b));
        float sum[16];
        vf_store(sum, total);
        for (int i = 0; i < 16 && 16 * b + i < R; i++)
            w->bs[16 * b + i] = sum[i];
    }
    /* weighted values, four rows at a time (each value row read once for them): each dimension
     * summed in key order, up to the row's own count (the keys all four rows reach without a test) */
    for (int r0 = 0; r0 < R; r0 += 4) {
        const int rb = R - r0 < 4 ? R - r0 : 4;
        int most = 0, least = EXACT_BLOCK;
        for (int i = 0; i < rb; i++) {
            most = w->nr[r0 + i] > most ? w->nr[r0 + i] : most;
            least = w->nr[r0 + i] < least ? w->nr[r0 + i] : least;
        }
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int T = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
            if (rb == 4 && T == 4)
                exact_values(w, rpad, r0, 4, least, most, d0, 4, D, bf16, esz);
            else if (rb == 4)
                exact_values(w, rpad, r0, 4, least, most, d0, T, D, bf16, esz);
            else if (rb == 3 && T == 4)
                exact_values(w, rpad, r0, 3, least, most, d0, 4, D, bf16, esz);
            else if (rb == 2 && T == 4)
                exact_values(w, rpad, r0, 2, least, most, d0, 4, D, bf16, esz);
            else if (rb == 1 && T == 4)
                exact_values(w, rpad, r0, 1, least, most, d0, 4, D, bf16, esz);
            else
                exact_values(w, rpad, r0, rb, least, most, d0, T, D, bf16, esz);
        }
    }
}

#if !defined(__AVX512F__)
/* AVX2 (sixteen registers of eight lanes): exact_rows_d's work in tiles that stay in registers.
 * exact_rows_d's 16-lane loops kept 16 to 32 accumulators of two registers each, which spilled on
 * every key (the attention of a decode step at 16 rows took three times the AVX-512 build's);
 * here rows go eight to a register (a stream's three rows fill 3 of 8 lanes, not 3 of 16), a
 * score tile is 6 keys by 16 rows or 12 keys by 8, a value tile 6 rows by 16 dims. Every score
 * and every weighted sum is the same chain as in exact_rows_d, in the same order: the same bits. */

/* keys j .. j+K-1 (K <= EXACT_TILE_KEYS) as float32 rows D apart: in place where they are
 * float32 rows side by side in the pool (one run), else widened or copied to w->kw */
static inline __attribute__((always_inline)) const float *exact_tile_keys(exact_scratch *w, int j, const int K,
                                                                           int D, int bf16) {
    const char *first = w->kp[j];
    if (!bf16 && w->kp[j + K - 1] == first + (int64_t)(K - 1) * D * 4) {
        int apart = 1;
        for (int kk = 1; kk < K - 1 && apart; kk++)
            apart = w->kp[j + kk] == first + (int64_t)kk * D * 4;
        if (apart)
            return (const float *)first;
    }
    for (int kk = 0; kk < K; kk++)
        for (int d = 0; d < D; d += 8)
            _mm256_storeu_ps(w->kw + kk * D + d, bf16 ? bf16x8((const uint16_t *)w->kp[j + kk] + d)
                                                      : _mm256_loadu_ps((const float *)w->kp[j + kk] + d));
    return w->kw;
}

/* scores of keys j .. j+K-1 against the U (1 or 2) eight-row groups of queries from row u0 */
static inline __attribute__((always_inline)) void exact_tile8(exact_scratch *w, int rpad, int u0, int j, const int K,
                                                              const int U, int n, int D, float scale, int bf16,
                                                              int esz) {
    for (int kk = 2 * K; kk < 3 * K && j + kk < n; kk++) /* keys two passes on, to L1 */
        prefetch_rows(w->kp[j + kk], (int64_t)D * esz, 0);
    for (int kk = 64; kk < 64 + K && j + kk < n; kk++) { /* keys and values further on, to L2 */
        prefetch_rows(w->kp[j + kk], (int64_t)D * esz, 1);
        prefetch_rows(w->vp[j + kk], (int64_t)D * esz, 1);
    }
    const float *k = exact_tile_keys(w, j, K, D, bf16);
    __m256 acc[EXACT_TILE_KEYS][2];
    for (int kk = 0; kk < K; kk++)
        acc[kk][0] = acc[kk][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d++) {
        const float *qd = w->qt + d * rpad + u0;
        const __m256 q0 = _mm256_loadu_ps(qd), q1 = U == 2 ? _mm256_loadu_ps(qd + 8) : q0;
        for (int kk = 0; kk < K; kk++) {
            const __m256 kb = _mm256_broadcast_ss(k + kk * D + d);
            acc[kk][0] = _mm256_fmadd_ps(kb, q0, acc[kk][0]);
            if (U == 2)
                acc[kk][1] = _mm256_fmadd_ps(kb, q1, acc[kk][1]);
        }
    }
    const __m256 vs = _mm256_set1_ps(scale);
    for (int kk = 0; kk < K; kk++)
        for (int u = 0; u < U; u++)
            _mm256_storeu_ps(w->sc + (int64_t)(j + kk) * rpad + u0 + 8 * u, _mm256_mul_ps(acc[kk][u], vs));
}

/* rows r0 .. r0+RB-1 (RB <= 6) of the weights times the value rows' dims d0 .. d0+15, each sum in
 * key order up to the row's own count (exact_values' contract) */
static inline __attribute__((always_inline)) void exact_values8(exact_scratch *w, int rpad, int r0, const int RB,
                                                                int least, int most, int d0, int D, int bf16) {
    __m256 acc[6][2];
    for (int i = 0; i < RB; i++)
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    int j = 0;
    for (; j < least; j++) {
        const __m256 v0 = bf16 ? bf16x8((const uint16_t *)w->vp[j] + d0) : _mm256_loadu_ps((const float *)w->vp[j] + d0);
        const __m256 v1 = bf16 ? bf16x8((const uint16_t *)w->vp[j] + d0 + 8)
                               : _mm256_loadu_ps((const float *)w->vp[j] + d0 + 8);
        const float *p = w->sc + (int64_t)j * rpad + r0;
        for (int i = 0; i < RB; i++) {
            const __m256 pw = _mm256_broadcast_ss(p + i);
            acc[i][0] = _mm256_fmadd_ps(pw, v0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(pw, v1, acc[i][1]);
        }
    }
    for (; j < most; j++) {
        const __m256 v0 = bf16 ? bf16x8((const uint16_t *)w->vp[j] + d0) : _mm256_loadu_ps((const float *)w->vp[j] + d0);
        const __m256 v1 = bf16 ? bf16x8((const uint16_t *)w->vp[j] + d0 + 8)
                               : _mm256_loadu_ps((const float *)w->vp[j] + d0 + 8);
        const float *p = w->sc + (int64_t)j * rpad + r0;
        for (int i = 0; i < RB; i++) {
            if (j >= w->nr[r0 + i])
                continue;
            const __m256 pw = _mm256_broadcast_ss(p + i);
            acc[i][0] = _mm256_fmadd_ps(pw, v0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(pw, v1, acc[i][1]);
        }
    }
    for (int i = 0; i < RB; i++) {
        _mm256_storeu_ps(w->ba + (int64_t)(r0 + i) * D + d0, acc[i][0]);
        _mm256_storeu_ps(w->ba + (int64_t)(r0 + i) * D + d0 + 8, acc[i][1]);
    }
}

/* exact_rows_d on AVX2: the same results, rows eight to a register (rpad a multiple of 8) */
static inline __attribute__((always_inline)) void exact_rows8(exact_scratch *w, const char *const *qr, int R, int n,
                                                              int D, float scale, int bf16, float cap) {
    const int esz = bf16 ? 2 : 4, rpad = (R + 7) / 8 * 8;
    for (int d = 0; d < D; d++)
        for (int r = 0; r < rpad; r++)
            w->qt[d * rpad + r] = r < R ? load1(qr[r], d, bf16) : 0.0f;
    for (int jj = 0; jj < 64 && jj < n; jj++) { /* the block's first keys and values (exact_rows_d) */
        prefetch_rows(w->kp[jj], (int64_t)D * esz, jj < 16 ? 0 : 1);
        prefetch_rows(w->vp[jj], (int64_t)D * esz, 1);
    }
    for (int u0 = 0; u0 < rpad; u0 += 16) {
        int j = 0;
        if (rpad - u0 >= 16) {
            for (; j + 6 <= n; j += 6)
                exact_tile8(w, rpad, u0, j, 6, 2, n, D, scale, bf16, esz);
            for (; j < n; j++)
                exact_tile8(w, rpad, u0, j, 1, 2, n, D, scale, bf16, esz);
        } else {
            for (; j + EXACT_TILE_KEYS <= n; j += EXACT_TILE_KEYS)
                exact_tile8(w, rpad, u0, j, EXACT_TILE_KEYS, 1, n, D, scale, bf16, esz);
            for (; j < n; j++)
                exact_tile8(w, rpad, u0, j, 1, 1, n, D, scale, bf16, esz);
        }
    }
    exact_shape_scores(w, R, rpad, n, cap);
    for (int r = 0; r < R; r++) /* a row's keys past its own count: out of its maximum */
        for (int j = w->nr[r]; j < n; j++)
            w->sc[(int64_t)j * rpad + r] = -INFINITY;
    for (int b = 0; b < rpad; b += 8) {
        __m256 best = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < n; j++)
            best = _mm256_max_ps(_mm256_loadu_ps(w->sc + (int64_t)j * rpad + b), best);
        for (int j = 0; j < n; j++) {
            float *at = w->sc + (int64_t)j * rpad + b;
            _mm256_storeu_ps(at, exp8(_mm256_sub_ps(_mm256_loadu_ps(at), best)));
        }
        float top[8];
        _mm256_storeu_ps(top, best);
        for (int i = 0; i < 8 && b + i < R; i++)
            w->bm[b + i] = top[i];
    }
    for (int r = 0; r < R; r++) /* weights past a row's count: 0 */
        for (int j = w->nr[r]; j < n; j++)
            w->sc[(int64_t)j * rpad + r] = 0.0f;
    exact_window_weights(w, R, rpad);
    for (int b = 0; b < rpad; b += 8) { /* each row's sum of weights, in key order */
        __m256 total = _mm256_setzero_ps();
        for (int j = 0; j < n; j++)
            total = _mm256_add_ps(total, _mm256_loadu_ps(w->sc + (int64_t)j * rpad + b));
        float sum[8];
        _mm256_storeu_ps(sum, total);
        for (int i = 0; i < 8 && b + i < R; i++)
            w->bs[b + i] = sum[i];
    }
    for (int r0 = 0; r0 < R; r0 += 6) {
        const int rb = R - r0 < 6 ? R - r0 : 6;
        int most = 0, least = EXACT_BLOCK;
        for (int i = 0; i < rb; i++) {
            most = w->nr[r0 + i] > most ? w->nr[r0 + i] : most;
            least = w->nr[r0 + i] < least ? w->nr[r0 + i] : least;
        }
        for (int d0 = 0; d0 < D; d0 += 16) {
            switch (rb) {
            case 6: exact_values8(w, rpad, r0, 6, least, most, d0, D, bf16); break;
            case 5: exact_values8(w, rpad, r0, 5, least, most, d0, D, bf16); break;
            case 4: exact_values8(w, rpad, r0, 4, least, most, d0, D, bf16); break;
            case 3: exact_values8(w, rpad, r0, 3, least, most, d0, D, bf16); break;
            case 2: exact_values8(w, rpad, r0, 2, least, most, d0, D, bf16); break;
            default: exact_values8(w, rpad, r0, 1, least, most, d0, D, bf16); break;
            }
        }
    }
}
#define EXACT_ROWS_FN exact_rows8 /* the same results in eight-lane tiles */
#else
#define EXACT_ROWS_FN exact_rows_d
#endif

/* exact_rows_d with the head size and dtype constants for the common sizes (the same operations) */
static void exact_rows(exact_scratch *w, const char *const *qr, int R, int n, int D, float scale, int bf16, float cap) {
    if (D == 64 && !bf16)
        EXACT_ROWS_FN(w, qr, R, n, 64, scale, 0, cap);
    else if (D == 64)
        EXACT_ROWS_FN(w, qr, R, n, 64, scale, 1, cap);
    else if (D == 128 && !bf16)
        EXACT_ROWS_FN(w, qr, R, n, 128, scale, 0, cap);
    else if (D == 128)
        EXACT_ROWS_FN(w, qr, R, n, 128, scale, 1, cap);
    else
        EXACT_ROWS_FN(w, qr, R, n, D, scale, bf16, cap);
}

/* token t's first key: 0, or its sliding window's start (keys at positions above p - window) */
static inline int64_t exact_lo(const radix_exact *c, int64_t t) {
    const int64_t p = c->tok[3 * t];
    return c->window > 0 && p - c->window + 1 > 0 ? p - c->window + 1 : 0;
}

/* The running state (m, s, a) of one row merged with a block's (bm, bs, ba): the one place the
 * blocks meet, the same arithmetic for every token and every block after the first. */
static void exact_merge(float *m, float *s, float *a, float bm, float bs, const float *ba, int D) {
    const float top = bm > *m ? bm : *m;
    const float e1 = expf(*m - top), e2 = expf(bm - top);
    const vf v1 = vf_set1(e1), v2 = vf_set1(e2);
    *s = *s * e1 + bs * e2;
    *m = top;
    for (int d0 = 0; d0 < D; d0 += 16)
        vf_store(a + d0, vf_add(vf_mul(vf_load(a + d0), v1), vf_mul(vf_load(ba + d0), v2)));
}

/* key pointers of token t's keys [a0, a0 + n) of head h's rows kh/vh, through its runs */
static void exact_keys(const radix_exact *c, int64_t t, int64_t a0, int n, const char *kh, const char *vh, int esz,
                       const char **kp, const char **vp) {
    int64_t r = c->tok[3 * t + 1];
    const int64_t row = c->D * esz;
    for (int j = 0; j < n; j++) {
        while (c->runs[3 * r] + c->runs[3 * r + 2] <= a0 + j)
            r++;
        const int64_t slot = c->runs[3 * r + 1] + (a0 + j - c->runs[3 * r]);
        kp[j] = kh + slot * row;
        vp[j] = vh + slot * row;
    }
}

/* the slot of token t's key a0 where its keys [a0, a0 + n) lie in one run of the pool, else -1 */
static int64_t exact_base(const radix_exact *c, int64_t t, int64_t a0, int n) {
    for (int64_t r = c->tok[3 * t + 1]; r < c->tok[3 * t + 2]; r++) {
        const int64_t *run = c->runs + 3 * r;
        if (run[0] + run[2] > a0)
            return run[0] + run[2] >= a0 + n ? run[1] + (a0 - run[0]) : -1;
    }
    return -1;
}

/* Block b (keys from a0 = b * EXACT_BLOCK) of the tokens [t0, t1) at KV head h: each token's partial
 * (per query row i: its maximum at part[i], its sum at part[G + i], its weighted values at
 * part[2G + i*D]; ``per`` floats a token, from part for token t0) for the tokens that reach a0;
 * tokens whose keys there lie in the same slots computed together (section comment). */
static void exact_chunk_block(const radix_exact *c, exact_scratch *w, const void *q, int64_t h, int64_t t0,
                              int64_t t1, int64_t b, float *part) {
    const int G = (int)c->G, D = (int)c->D, bf16 = (int)c->bf16, esz = bf16 ? 2 : 4;
    const int64_t row = c->H * G * D, per = (int64_t)G * (D + 2), a0 = b * EXACT_BLOCK;
    const char *kh = (const char *)c->k_now + h * c->slots * D * esz, *vh = (const char *)c->v_now + h * c->slots * D * esz;
    int64_t members[EXACT_MAX_CHUNK];
    /* the group: its tokens, its key count (the longest member's), and its keys: from slot gbase on
     * where they lie in one run (the common case: no pointers built), else the pointers gk/gv */
    int nm = 0, gn = 0;
    int64_t gbase = -1;
    const int64_t rowb = (int64_t)D * esz;
    for (int64_t t = t0; t <= t1; t++) {
        int n = 0, joins = 0;
        int64_t base = -1;
        if (t < t1) {
            const int64_t p = c->tok[3 * t];
            if (p < a0 || exact_lo(c, t) >= a0 + EXACT_BLOCK)
                continue;
            n = (int)(p + 1 - a0 < EXACT_BLOCK ? p + 1 - a0 : EXACT_BLOCK);
            base = exact_base(c, t, a0, n);
            if (nm > 0 && base >= 0 && gbase >= 0) {
                joins = base == gbase;
            } else if (nm > 0) { /* compare key by key */
                exact_keys(c, t, a0, n, kh, vh, esz, w->kp, w->vp);
                if (gbase >= 0)
                    for (int j = 0; j < gn; j++) {
                        w->gk[j] = kh + (gbase + j) * rowb;
                        w->gv[j] = vh + (gbase + j) * rowb;
                    }
                const int common = n < gn ? n : gn;
                joins = 1;
                for (int j = 0; j < common && joins; j++)
                    joins = w->kp[j] == w->gk[j] && w->vp[j] == w->gv[j];
                if (joins)
                    gbase = -1; /* the group's keys are the pointers from now on */
            }
        }
        if (nm > 0 && !joins) { /* the group so far: its rows over its keys */
            const char *qr[EXACT_ROWS];
            for (int m = 0; m < nm; m++) {
                const int64_t pt = c->tok[3 * members[m]], lo = exact_lo(c, members[m]);
                for (int i = 0; i < G; i++) {
                    qr[m * G + i] = (const char *)q + (members[m] * row + (h * G + i) * D) * esz;
                    w->nr[m * G + i] = (int)(pt + 1 - a0 < EXACT_BLOCK ? pt + 1 - a0 : EXACT_BLOCK);
                    w->lo[m * G + i] = (int)(lo > a0 ? lo - a0 : 0);
                }
            }
            if (gbase >= 0)
                for (int j = 0; j < gn; j++) {
                    w->kp[j] = kh + (gbase + j) * rowb;
                    w->vp[j] = vh + (gbase + j) * rowb;
                }
            else {
                memcpy(w->kp, w->gk, sizeof(char *) * gn);
                memcpy(w->vp, w->gv, sizeof(char *) * gn);
            }
            exact_rows(w, qr, nm * G, gn, D, (float)c->scale, bf16, (float)c->softcap);
            for (int m = 0; m < nm; m++) {
                float *dst = part + (members[m] - t0) * per;
                for (int i = 0; i < G; i++) {
                    dst[i] = w->bm[m * G + i];
                    dst[G + i] = w->bs[m * G + i];
                    memcpy(dst + 2 * G + (int64_t)i * D, w->ba + (int64_t)(m * G + i) * D, sizeof(float) * D);
                }
            }
            nm = gn = 0;
            gbase = -1;
        }
        if (t == t1)
            break;
        if (nm == 0) { /* a new group */
            gbase = base;
            if (base < 0)
                exact_keys(c, t, a0, n, kh, vh, esz, w->gk, w->gv);
            gn = n;
        } else if (gbase >= 0) { /* the same run */
            gn = n > gn ? n : gn;
        } else if (n > gn) { /* the token's pointers (in kp) past the group's */
            memcpy(w->gk + gn, w->kp + gn, sizeof(char *) * (n - gn));
            memcpy(w->gv + gn, w->vp + gn, sizeof(char *) * (n - gn));
            gn = n;
        }
        members[nm++] = t;
    }
}

/* token t's rows at head h: the running state st after a block's partial pt (the token's first
 * block's, ``first``, is the state), then, after the last, the output */
static void exact_fold(float *st, const float *pt, int first, int G, int D) {
    for (int i = 0; i < G; i++) {
        if (first) {
            st[i] = pt[i];
            st[G + i] = pt[G + i];
            memcpy(st + 2 * G + (int64_t)i * D, pt + 2 * G + (int64_t)i * D, sizeof(float) * D);
        } else {
            exact_merge(st + i, st + G + i, st + 2 * G + (int64_t)i * D, pt[i], pt[G + i], pt + 2 * G + (int64_t)i * D, D);
        }
    }
}

static void exact_finish(const float *st, float *dst, int G, int D) {
    for (int i = 0; i < G; i++) {
        const vf inv = vf_set1(1.0f / st[G + i]);
        for (int d0 = 0; d0 < D; d0 += 16)
            vf_store(dst + (int64_t)i * D + d0, vf_mul(vf_load(st + 2 * G + (int64_t)i * D + d0), inv));
    }
}

/* Few work items (one stream's decode row: a chunk per head): blocks are split across threads,
 * their partials kept, and each token's folded in block order after (the same arithmetic as the
 * running fold: the same bits). Many: a thread takes a chunk and folds as it goes. */
radix_status radix_exact_attention(const radix_exact *cc, const void *q, const void *k, const void *v, float *out) {
    const radix_status code = exact_check(cc);
    if (code)
        return code;
    radix_exact ctx = *cc;
    ctx.k_now = k;
    ctx.v_now = v;
    const radix_exact *c = &ctx;
    const int G = (int)c->G, D = (int)c->D;
    const int64_t H = c->H, row = H * G * D, per = (int64_t)G * (D + 2);
    const int threads = (int)c->threads;
    int64_t nblk = 0;
    for (int64_t t = 0; t < c->ntok; t++)
        nblk = c->tok[3 * t] / EXACT_BLOCK + 1 > nblk ? c->tok[3 * t] / EXACT_BLOCK + 1 : nblk;
    const int split = H * c->nchunks < 4 * threads && nblk > 1;
    /* the split's partials: this thread's buffer, kept and grown (the one caller, the compute thread) */
    static __thread float *parts = NULL;
    static __thread size_t parts_cap = 0;
    const size_t need = split ? (size_t)(H * c->nchunks * nblk * EXACT_MAX_CHUNK * per) : 0;
    if (need > parts_cap) {
        float *grown = realloc(parts, sizeof(float) * need);
        if (!grown)
            return RADIX_E_NO_MEMORY;
        parts = grown;
        parts_cap = need;
    }
    float *const kept = parts; /* the pool threads see the caller's buffer, not their own (thread-local) */
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* each pool thread's scratch, allocated on its first call and kept (about 1 MB) */
        static __thread exact_scratch *w = NULL;
        if (!w)
            w = aligned_alloc(64, (sizeof(exact_scratch) + 63) / 64 * 64);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed && split) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < H * c->nchunks * nblk; item++) {
                const int64_t b = item % nblk, hc = item / nblk, h = hc % H, ch = hc / H;
                exact_chunk_block(c, w, q, h, c->chunks[ch], c->chunks[ch + 1], b,
                                  kept + item * EXACT_MAX_CHUNK * per);
            }
#pragma omp for schedule(static)
            for (int64_t ht = 0; ht < H * c->ntok; ht++) {
                const int64_t h = ht % H, t = ht / H;
                int64_t ch = 0;
                while (c->chunks[ch + 1] <= t)
                    ch++;
                float *st = w->state;
                const int64_t b0 = exact_lo(c, t) / EXACT_BLOCK;
                for (int64_t b = b0; b * EXACT_BLOCK <= c->tok[3 * t]; b++)
                    exact_fold(st, kept + ((ch * H + h) * nblk + b) * EXACT_MAX_CHUNK * per +
                                           (t - c->chunks[ch]) * per, b == b0, G, D);
                exact_finish(st, out + t * row + h * G * D, G, D);
            }
        } else if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < H * c->nchunks; item++) {
                const int64_t h = item % H, ch = item / H, t0 = c->chunks[ch], t1 = c->chunks[ch + 1];
                int64_t last = 0, first = INT64_MAX;
                for (int64_t t = t0; t < t1; t++) {
                    last = c->tok[3 * t] > last ? c->tok[3 * t] : last;
                    first = exact_lo(c, t) / EXACT_BLOCK < first ? exact_lo(c, t) / EXACT_BLOCK : first;
                }
                for (int64_t b = first; b * EXACT_BLOCK <= last; b++) {
                    exact_chunk_block(c, w, q, h, t0, t1, b, w->block);
                    for (int64_t t = t0; t < t1; t++) {
                        const int64_t b0 = exact_lo(c, t) / EXACT_BLOCK;
                        if (c->tok[3 * t] >= b * EXACT_BLOCK && b >= b0)
                            exact_fold(w->state + (t - t0) * per, w->block + (t - t0) * per, b == b0, G, D);
                    }
                }
                for (int64_t t = t0; t < t1; t++)
                    exact_finish(w->state + (t - t0) * per, out + t * row + h * G * D, G, D);
            }
        }
    }
    return failed ? RADIX_E_NO_MEMORY : RADIX_OK;
}
