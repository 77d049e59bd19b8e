/* Attention of a few query rows over one run of keys in the KV pool, for CPUs with AVX-512:
 * the shared prefix of one or two requests in a decode step (every row sees every key; no
 * mask).
 *
 * Why a kernel of our own: PyTorch's flash kernel for CPUs reaches its speed only when the
 * keys sit in cache. In a decode step they never do (the layer's KV was last read a whole
 * step ago, with all the weights streamed in between), and with a handful of query rows its
 * work splits into one item per KV head (three, on two cores) that each wait on memory. Here
 * the keys are cut into chunks that the cores share evenly, each chunk is streamed once with
 * prefetching, and the chunks merge by their log-sum-exp at the end. With more rows the
 * arithmetic dominates and the flash kernel is the faster one; the caller picks.
 *
 * Layout (strides in elements; the last dimension is contiguous):
 *   q      [H][M][D]  bf16 or fp32 (grouped query heads folded into the M rows of their KV head)
 *   k, v   [H][S][D]  same dtype as q: the pool's layer (or a view into it)
 *   pieces [npieces][2]  (first key, key count <= MAX_CHUNK): the keys attended, in runs of
 *                     the pool cut into chunks; together they are one key sequence
 *   out    [H][M][D]  fp32, contiguous
 *   lse    [H][M]     fp32: natural log of sum_j exp(scale * q.k_j)
 *   work              fp32 scratch of radix_attn_work_floats(H, M, D, npieces) floats
 * Products and sums are float32, like the flash kernel's; the result does not depend on the
 * number of threads (the pieces are merged in order).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef __AVX512F__
#error "decode_attention.c needs AVX-512 (the build falls back to PyTorch's kernels)"
#endif

#define MAX_ROWS 8
#define MAX_D 256
#define MAX_CHUNK 512

/* bf16 -> fp32 of 16 values: the bf16 bits are the high half of the fp32 bits. */
static inline __m512 load16(const void *p, int bf16) {
    if (bf16) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    return _mm512_loadu_ps((const float *)p);
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
 * polynomial for 2^f (relative error about 2e-7), -inf -> 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    x = _mm512_max_ps(x, lo);
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5353362e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Per (head, piece): M*D partial sums, then M maxima, then M sums of weights. */
int64_t radix_attn_work_floats(int64_t H, int64_t M, int64_t D, int64_t npieces) {
    return H * npieces * (M * D + 2 * M);
}

static inline void prefetch_rows(const char *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64)
        _mm_prefetch(p + o, _MM_HINT_T0);
}

/* Rows 0..M-1 over the n keys of one chunk: the partial sums o [M][D] (weights relative to
 * the chunk's own maximum), that maximum [M] and the sum of the weights [M]. */
static void chunk_rows(const void *q, int64_t q_sm, const char *k, int64_t k_sl, const char *v, int64_t v_sl,
                        int M, int n, int D, float scale, int bf16, int esz, float *o, float *mx, float *sm) {
    float qf[MAX_ROWS][MAX_D];
    float s[MAX_ROWS][MAX_CHUNK];
    const int d16 = D / 16;
    for (int m = 0; m < M; m++)
        for (int d = 0; d < D; d++)
            qf[m][d] = load1(q, (int64_t)m * q_sm + d, bf16);
    for (int j = 0; j < n; j++) {
        const char *kj = k + (int64_t)j * k_sl * esz;
        if (j + 32 < n)
            prefetch_rows(kj + 32 * k_sl * esz, (int64_t)D * esz);
        __m512 kv[MAX_D / 16];
        for (int c = 0; c < d16; c++)
            kv[c] = load16(kj + (int64_t)c * 16 * esz, bf16);
        for (int m = 0; m < M; m++) {
            __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf[m]), kv[0]);
            for (int c = 1; c < d16; c++)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf[m] + 16 * c), kv[c], acc);
            s[m][j] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    for (int m = 0; m < M; m++) {
        float best = -INFINITY;
        for (int j = 0; j < n; j++)
            best = s[m][j] > best ? s[m][j] : best;
        __m512 b = _mm512_set1_ps(best), total = _mm512_setzero_ps();
        int j = 0;
        for (; j + 16 <= n; j += 16) {
            __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s[m] + j), b));
            _mm512_storeu_ps(s[m] + j, p);
            total = _mm512_add_ps(total, p);
        }
        if (j < n) {
            __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
            __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s[m] + j), b));
            p = _mm512_maskz_mov_ps(tail, p);
            _mm512_mask_storeu_ps(s[m] + j, tail, p);
            total = _mm512_add_ps(total, p);
        }
        mx[m] = best;
        sm[m] = _mm512_reduce_add_ps(total);
    }
    for (int m0 = 0; m0 < M; m0 += 4) {
        int mb = M - m0 < 4 ? M - m0 : 4;
        __m512 acc[4][MAX_D / 16];
        for (int r = 0; r < mb; r++)
            for (int c = 0; c < d16; c++)
                acc[r][c] = _mm512_setzero_ps();
        for (int j = 0; j < n; j++) {
            const char *vj = v + (int64_t)j * v_sl * esz;
            if (m0 == 0 && j + 32 < n)
                prefetch_rows(vj + 32 * v_sl * esz, (int64_t)D * esz);
            __m512 vv[MAX_D / 16];
            for (int c = 0; c < d16; c++)
                vv[c] = load16(vj + (int64_t)c * 16 * esz, bf16);
            for (int r = 0; r < mb; r++) {
                __m512 p = _mm512_set1_ps(s[m0 + r][j]);
                for (int c = 0; c < d16; c++)
                    acc[r][c] = _mm512_fmadd_ps(p, vv[c], acc[r][c]);
            }
        }
        for (int r = 0; r < mb; r++)
            for (int c = 0; c < d16; c++)
                _mm512_storeu_ps(o + (int64_t)(m0 + r) * D + 16 * c, acc[r][c]);
    }
}

int radix_decode_attention(const void *q, int64_t q_sh, int64_t q_sm, const void *k, int64_t k_sh, int64_t k_sl,
                           const void *v, int64_t v_sh, int64_t v_sl, const int64_t *pieces, int64_t npieces,
                           int64_t H, int64_t M, int64_t D, float scale, int bf16, float *out, float *lse,
                           float *work, int threads) {
    if (D % 16 || D > MAX_D || M < 1 || M > MAX_ROWS || npieces < 1 || H < 1 || threads < 1)
        return 1;
    for (int64_t i = 0; i < npieces; i++)
        if (pieces[2 * i] < 0 || pieces[2 * i + 1] < 1 || pieces[2 * i + 1] > MAX_CHUNK)
            return 1;
    const int esz = bf16 ? 2 : 4;
    const int64_t per = M * D + 2 * M;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < H * npieces; item++) {
        const int64_t h = item / npieces, c = item % npieces;
        const int64_t j0 = pieces[2 * c];
        const int n = (int)pieces[2 * c + 1];
        float *o = work + item * per, *mx = o + M * D, *sm = mx + M;
        const char *qh = (const char *)q + h * q_sh * esz;
        const char *kh = (const char *)k + (h * k_sh + j0 * k_sl) * esz;
        const char *vh = (const char *)v + (h * v_sh + j0 * v_sl) * esz;
        chunk_rows(qh, q_sm, kh, k_sl, vh, v_sl, (int)M, n, (int)D, scale, bf16, esz, o, mx, sm);
    }
    /* merge the pieces of each (head, row), in order */
    for (int64_t hm = 0; hm < H * M; hm++) {
        const int64_t h = hm / M, m = hm % M;
        float best = -INFINITY;
        for (int64_t c = 0; c < npieces; c++) {
            const float *mx = work + (h * npieces + c) * per + M * D;
            best = mx[m] > best ? mx[m] : best;
        }
        float total = 0.0f;
        float acc[MAX_D];
        for (int64_t d = 0; d < D; d++)
            acc[d] = 0.0f;
        for (int64_t c = 0; c < npieces; c++) {
            const float *o = work + (h * npieces + c) * per, *mx = o + M * D, *sm = mx + M;
            const float w = expf(mx[m] - best);
            total += w * sm[m];
            for (int64_t d = 0; d < D; d++)
                acc[d] += w * o[m * D + d];
        }
        float *dst = out + (h * M + m) * D;
        for (int64_t d = 0; d < D; d++)
            dst[d] = acc[d] / total;
        lse[h * M + m] = best + logf(total);
    }
    return 0;
}
