/* y = x W^T (+ b) for a few rows of x: the decode step's linears, for CPUs with AVX2 and FMA
 * (or AVX-512). x, b and y in float32; W in float32 or bfloat16 (widened in registers: the
 * products and sums are float32 either way, as PyTorch's bf16 product computes them).
 *
 * Why a kernel of our own: a decode step multiplies a handful of rows by every weight of the
 * model, so its speed is how fast the weights stream from memory. On an AMD EPYC here MKL's
 * product streamed them at 5-7 GB/s (oneDNN's packed one too) where a plain read gets 14.
 * Here each weight row is read once, by one thread, start to end, while it is multiplied with
 * up to four rows of x at a time, eight float32 lanes at a time, one accumulator per row (more
 * rows: eight weight rows side by side, see block()). A row's result does not depend on which
 * other rows came with it, nor on the thread count
 * (every output is one thread's, summed in one order), so batched decode rows equal lone ones
 * bit for bit.
 *
 *   x     [rows][in]  float32, row stride x_rs (elements)
 *   w     [out][in]   float32 or bf16 (``bf16``), contiguous (nn.Linear's weight)
 *   bias  [out]       float32 or NULL
 *   y     [rows][out] float32, row stride y_rs
 * in must be a multiple of 8. Returns RADIX_OK, or the code of what it refused (nothing written):
 * every function here returns the codes of native_abi.h, the boundary generated from
 * engine/model/native_abi.py (its structs and prototypes too).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_abi.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "native_linear.c needs AVX2 and FMA (the build falls back to PyTorch's linears)"
#endif

#define ROWS 4  /* rows of x per pass over a weight row */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define WROWS 8 /* weight rows side by side in a tile, where there are more than ROWS rows of x */
#define TROWS 2 /* rows of x per pass over a tile */
#define BLOCK 8 /* outputs handed to a thread at a time (a multiple of WROWS) */
#else /* sixteen registers: 6 x 2 accumulators, two of x and a weight (8 x 2 spilled: issue 48) */
#define WROWS 6
#define TROWS 2
#define BLOCK 12
#endif
#define ROW_GROUP 64 /* rows of x whose passes go over the weights together (x stays in L2) */
#define PASS_MAX 4 /* the most rows of x a pass over a tile takes (TROWS, or four: tile4()) */

static inline float sum8(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* eight weights as float32: bf16 is the high half of a float32's bits */
static inline __m256 load_w(const void *w, int64_t i, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return _mm256_loadu_ps((const float *)w + i);
}

/* Every output's sum, whichever path computes it: eight lanes over the input in steps of eight,
 * acc = w * x + acc from zero, then sum8, then the bias (or 0). So one row alone and the same
 * row among others give the same bits.
 *
 * One weight row at a time, start to end: a thread's share of W is then read as one sequential
 * stream, which the hardware prefetcher follows at the speed of a plain read (31-33 GB/s here).
 * Eight weight rows side by side (eight streams at once, the previous one-row pass) streamed
 * 24-28 GB/s on the same machine, two rows by four rows of x 17-19, one row by four 25-27:
 * the short interleaved streams, not the arithmetic, were what the decode step waited on. */

/* Output row w (one weight row) times the R (1..ROWS) rows at xr[0..R), sums into acc[0..R). */
static inline __attribute__((always_inline)) void pass(const float *const *xr, int R, const void *w, int64_t in,
                                                       int bf16, float acc[ROWS]) {
    __m256 a[ROWS];
    for (int r = 0; r < R; r++)
        a[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i += 8) {
        const __m256 v = load_w(w, i, bf16);
        for (int r = 0; r < R; r++)
            a[r] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xr[r] + i), a[r]);
    }
    for (int r = 0; r < R; r++)
        acc[r] = sum8(a[r]);
}

static inline __attribute__((always_inline)) void rows_pass(const float *const *xr, int R, const void *w, int64_t in,
                                                            int bf16, float acc[ROWS]) {
    switch (R) { /* constant row counts: the accumulators stay in registers */
    case 1: pass(xr, 1, w, in, bf16, acc); break;
    case 2: pass(xr, 2, w, in, bf16, acc); break;
    case 3: pass(xr, 3, w, in, bf16, acc); break;
    default: pass(xr, ROWS, w, in, bf16, acc); break;
    }
}

/* Weight rows w[0..WROWS) (row stride in elements) times the R (1..TROWS) rows at xr[0..R), sums
 * into acc[j][r]. Each of the WROWS * R sums is the same sequence of FMAs as pass() makes for it
 * (lanes from zero, the input in steps of eight, then sum8), so the bits do not change; the
 * WROWS * R independent accumulators keep both FMA pipes busy where pass()'s R chains wait on
 * the FMA's latency, and each x load serves WROWS products. */
static inline __attribute__((always_inline)) void tile(const float *const *xr, int R, const char *w, int64_t in,
                                                       int bf16, float acc[WROWS][PASS_MAX], const char *pf,
                                                       int64_t pf_lines) {
    const int64_t esz = bf16 ? 2 : 4;
    __m256 a[WROWS][TROWS];
    for (int j = 0; j < WROWS; j++)
        for (int r = 0; r < R; r++)
            a[j][r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < in; i += 8) {
        __m256 xv[TROWS];
        for (int r = 0; r < R; r++)
            xv[r] = _mm256_loadu_ps(xr[r] + i);
        for (int64_t l = i >> 3; l < pf_lines; l += in >> 3) /* spread over the steps (see block()) */
            _mm_prefetch(pf + l * 64, _MM_HINT_T1);
        for (int j = 0; j < WROWS; j++) {
            __m256 v = load_w(w + j * in * esz, i, bf16);
            if (R > 1) /* one load for the R products, not one folded into each FMA (issue 48) */
                __asm__("" : "+x"(v));
            for (int r = 0; r < R; r++)
                a[j][r] = _mm256_fmadd_ps(v, xv[r], a[j][r]);
        }
    }
    for (int j = 0; j < WROWS; j++)
        for (int r = 0; r < R; r++)
            acc[j][r] = sum8(a[j][r]);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* tile() for four rows of x in two AVX-512 registers, a pair of rows each (its two halves): each
 * half's lanes take the same FMAs, in the same order, as tile()'s eight-lane accumulator for that
 * row, and are summed the same way (sum8 of the half), so the bits are tile()'s; a weight load
 * (to both halves) then serves four rows, and one FMA instruction two. */
static inline __attribute__((always_inline)) void tile4(const float *const *xr, const char *w, int64_t in, int bf16,
                                                        float acc[WROWS][PASS_MAX], const char *pf,
                                                        int64_t pf_lines) {
    const int64_t esz = bf16 ? 2 : 4;
    __m512 a[WROWS][2];
    for (int j = 0; j < WROWS; j++)
        a[j][0] = a[j][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 8) {
        const __m512 x0 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(xr[0] + i)),
                                             _mm256_loadu_ps(xr[1] + i), 1);
        const __m512 x1 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(xr[2] + i)),
                                             _mm256_loadu_ps(xr[3] + i), 1);
        for (int64_t l = i >> 3; l < pf_lines; l += in >> 3)
            _mm_prefetch(pf + l * 64, _MM_HINT_T1);
        for (int j = 0; j < WROWS; j++) {
            const __m256 h = load_w(w + j * in * esz, i, bf16);
            const __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(h), h, 1);
            a[j][0] = _mm512_fmadd_ps(v, x0, a[j][0]);
            a[j][1] = _mm512_fmadd_ps(v, x1, a[j][1]);
        }
    }
    for (int j = 0; j < WROWS; j++) {
        acc[j][0] = sum8(_mm512_castps512_ps256(a[j][0]));
        acc[j][1] = sum8(_mm512_extractf32x8_ps(a[j][0], 1));
        acc[j][2] = sum8(_mm512_castps512_ps256(a[j][1]));
        acc[j][3] = sum8(_mm512_extractf32x8_ps(a[j][1], 1));
    }
}
#define QROWS 4
#else
#define QROWS TROWS
#endif

static inline __attribute__((always_inline)) void rows_tile(const float *const *xr, int R, const char *w, int64_t in,
                                                            int bf16, float acc[WROWS][PASS_MAX], const char *pf,
                                                            int64_t pf_lines) {
    if (R == 1)
        tile(xr, 1, w, in, bf16, acc, pf, pf_lines);
    else
        tile(xr, TROWS, w, in, bf16, acc, pf, pf_lines);
}

/* The rows of x from r0, up to ``most`` (<= ROWS) of them: their pointers (the missing ones repeat
 * the first) */
static inline int x_rows(const float *x, int64_t x_rs, int64_t rows, int64_t r0, int most, const float *xr[ROWS]) {
    const int R = (int)(rows - r0 < most ? rows - r0 : most);
    for (int r = 0; r < ROWS; r++)
        xr[r] = x + (r0 + (r < R ? r : 0)) * x_rs;
    return R;
}

/* This thread's buffer of at least n floats for widened weights (kept, grown as needed: WROWS rows
 * of the widest input, 8 x 1,536 floats = 48 KiB for the embedded model); NULL if it cannot grow. */
static float *widened(int64_t n) {
    static __thread float *buf = NULL;
    static __thread int64_t cap = 0;
    if (n > cap) {
        float *grown = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
        if (!grown)
            return NULL;
        free(buf);
        buf = grown;
        cap = n;
    }
    return buf;
}

/* Outputs [o, o + n) for every row of x. Up to ROWS rows of x: each weight row once, start to end,
 * with all of them (a weight row of a few KiB stays in L1 for the next rows). More rows (a decode
 * step of 5-32 streams) make the arithmetic, not the stream of weights, the step's bound: then
 * WROWS weight rows at a time (tile(): 16 accumulators, eight weight loads and two of x for
 * sixteen FMAs), each group of them read once from memory and again from L1-L2 for every TROWS
 * rows of x (wider tiles of weight rows beat taller tiles of x rows: fewer reloads of x). While a
 * tile's passes run from L1-L2 nothing would come from memory, so each pass also asks for its
 * share of the next tile's cache lines (a prefetch into L2, a line or so per step, so the tile is
 * in by the time its first pass starts; into L1, or further ahead, measured slower). A prefetch
 * changes no arithmetic, and one past the weight's end (the last tile's) faults on nothing.
 * With AVX-512 a pass takes four rows of x (tile4(): two rows a register), same bits again.
 * The measurements behind these choices: docs/CHANGELOG.md and git history. */
static inline __attribute__((always_inline)) void block(const float *x, int64_t x_rs, int64_t rows, const char *w,
                                                        int64_t o, int64_t n, int64_t in, const float *bias, float *y,
                                                        int64_t y_rs, int bf16) {
    const int64_t esz = bf16 ? 2 : 4;
    int64_t j = o;
    if (rows > ROWS)
        for (; j + WROWS <= o + n; j += WROWS) {
            const char *src = w + j * in * esz, *wj = src;
            const int64_t lines = WROWS * in * esz / 64, passes = (rows + QROWS - 1) / QROWS;
            const int64_t share = (lines + passes - 1) / passes; /* the next tile's lines per pass */
            /* bf16 weights that several passes read: widened once into this thread's buffer, so the
             * passes multiply float32 (the same values, the same FMAs: the same bits) instead of each
             * widening them again (four instructions a load, more than the FMAs they feed) */
            int wide = bf16;
            float *buf = bf16 && passes > 1 ? widened(WROWS * in) : NULL;
            if (buf) {
                for (int64_t i = 0; i < WROWS * in; i += 8)
                    _mm256_storeu_ps(buf + i, load_w(src, i, 1));
                wj = (const char *)buf;
                wide = 0;
            }
            for (int64_t r0 = 0; r0 < rows; r0 += QROWS) {
                const float *xr[ROWS];
                const int R = x_rows(x, x_rs, rows, r0, QROWS, xr);
                const int64_t done = r0 / QROWS * share, now = lines - done < share ? lines - done : share;
                const char *pf = src + WROWS * in * esz + done * 64;
                float acc[WROWS][PASS_MAX];
#if QROWS == 4
                if (R > 2) {
                    if (wide)
                        tile4(xr, wj, in, 1, acc, pf, now > 0 ? now : 0);
                    else
                        tile4(xr, wj, in, 0, acc, pf, now > 0 ? now : 0);
                } else
#endif
                if (wide)
                    rows_tile(xr, R, wj, in, 1, acc, pf, now > 0 ? now : 0);
                else
                    rows_tile(xr, R, wj, in, 0, acc, pf, now > 0 ? now : 0);
                for (int jj = 0; jj < WROWS; jj++) {
                    const float b = bias ? bias[j + jj] : 0.0f;
                    for (int r = 0; r < R; r++)
                        y[(r0 + r) * y_rs + j + jj] = acc[jj][r] + b;
                }
            }
        }
    for (; j < o + n; j++) {
        const char *wj = w + j * in * esz;
        const float b = bias ? bias[j] : 0.0f;
        for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
            const float *xr[ROWS];
            const int R = x_rows(x, x_rs, rows, r0, ROWS, xr);
            float acc[ROWS];
            if (bf16)
                rows_pass(xr, R, wj, in, 1, acc);
            else
                rows_pass(xr, R, wj, in, 0, acc);
            for (int r = 0; r < R; r++)
                y[(r0 + r) * y_rs + j] = acc[r] + b;
        }
    }
}

/* This thread's share of y = x W^T (+ b): an orphaned work-sharing loop (no wait at its end),
 * called inside a parallel region; every output is one thread's, computed in one order. Blocks
 * of outputs are handed out as threads come free, in shrinking runs (guided), not split in
 * halves up front: on two cores shared with the HTTP server and its clients, a thread that
 * loses its core for a moment no longer holds the other one at the next barrier, and the long
 * first runs keep each thread's reads sequential (small fixed runs, dynamic 4, streamed 31 GB/s
 * here against 37 for halves or guided). Which thread computes a block does not change its bits. */
static void linear_part(const float *x, int64_t x_rs, int64_t rows, const void *w, int64_t out, int64_t in,
                        const float *bias, float *y, int64_t y_rs, int bf16) {
    const int64_t blocks = (out + BLOCK - 1) / BLOCK;
    for (int64_t g0 = 0; g0 < rows; g0 += ROW_GROUP) {
        const int64_t gr = rows - g0 < ROW_GROUP ? rows - g0 : ROW_GROUP;
#pragma omp for schedule(guided) nowait
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t o = b * BLOCK;
            block(x + g0 * x_rs, x_rs, gr, (const char *)w, o, out - o < BLOCK ? out - o : BLOCK, in, bias,
                  y + g0 * y_rs, y_rs, bf16);
        }
    }
}

static void linear(const float *x, int64_t x_rs, int64_t rows, const void *w, int64_t out, int64_t in,
                   const float *bias, float *y, int64_t y_rs, int bf16, int threads) {
#pragma omp parallel num_threads(threads)
    linear_part(x, x_rs, rows, w, out, in, bias, y, y_rs, bf16);
}

radix_status radix_linear(const float *x, int64_t x_rs, int64_t rows, const void *w, int64_t out, int64_t in,
                          const float *bias, float *y, int64_t y_rs, int bf16, int threads) {
    if (rows < 1 || out < 1 || in < 8 || in % 8 || threads < 1)
        return RADIX_E_LINEAR_SHAPE;
    linear(x, x_rs, rows, w, out, in, bias, y, y_rs, bf16, threads);
    return RADIX_OK;
}

/* ---------------------------------------------------------------------------------------------
 * A decoder layer's work around its attention, in float32 or bfloat16 (engine.model.fused_decode):
 * the RMSNorms, the seven linears, the rotary embedding, the KV written to its pool slots, SiLU (or
 * GELU-tanh) times up, and both residual adds, in two calls per layer (before and after attention)
 * instead of about eighty PyTorch ops. What a family adds to Llama's layer (engine.model.families:
 * norms after attention and the MLP or none before, Gemma's 1 + w, q/k norms, a second rotary
 * table) is a field of radix_layer, tested outside the linears' loops. Every step is per row, so
 * a row's result does not depend on the other rows in the call either.
 *
 * In bfloat16 (``bf16`` set) the weights, the RMSNorm weights and the pool are bf16, and the rows
 * (h, the rotary tables, q, attention's output) are float32 arrays holding bf16 values: every
 * product and sum is float32, rounded to bf16 (to nearest, ties to even, as PyTorch rounds)
 * wherever PyTorch's bf16 forward of the same layer stores a bf16 tensor. So the fused step
 * computes what the unfused one computes, but for the order of the sums inside the linears and
 * the norm.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* a layer's weights by address and its sizes: radix_layer, in native_abi.h */

/* f rounded to the nearest bfloat16 (ties to even), as a float32; NaN stays NaN */
static inline float bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u = 0x7fc00000u;
    else
        u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_value(const void *w, int64_t i) {
    const uint32_t u = (uint32_t)((const uint16_t *)w)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* the bf16 bits of f, which already holds a bf16 value */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static void round_all(float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        y[i] = bf(y[i]);
}

/* y[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), as transformers' Llama RMSNorm in float32; in bf16
 * as the decoder stack's norm: the normalised row rounded, times the weight, rounded */
static void rms_norm(const float *x, int64_t x_rs, int64_t rows, int64_t n, const void *w, double eps, float *y,
                     int bf16) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_rs;
        float *yr = y + r * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++)
            ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + (float)eps);
        if (bf16)
            for (int64_t i = 0; i < n; i++)
                yr[i] = bf(bf16_value(w, i) * bf(xr[i] * inv));
        else
            for (int64_t i = 0; i < n; i++)
                yr[i] = ((const float *)w)[i] * (xr[i] * inv);
    }
}

/* x * cos + rotate_half(x) * sin, in place, for one head of d values (rotate_half: the second
 * half negated, then the first); in bf16 each product and the sum rounded */
static void rotate(float *x, const float *cos, const float *sin, int64_t d, int bf16) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        if (bf16) {
            x[i] = bf(bf(a * cos[i]) - bf(b * sin[i]));
            x[i + half] = bf(bf(b * cos[i + half]) + bf(a * sin[i + half]));
        } else {
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* e^x for eight lanes, x <= 88: 2^(x log2 e) as 2^n 2^f, f in [-0.5, 0.5], a degree-6 polynomial
 * for 2^f (relative error about 2e-7); x below -87 counts as -87 */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
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
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* bf() on eight lanes */
static inline __m256 bf8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd),
                                       _mm256_set1_epi32((int)0xffff0000u));
    const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

/* g = silu(g) * u for n <= 8 values, in place: x / (1 + e^-x) * u (in bf16 each step rounded, as
 * the unfused forward stores it); eight lanes at a time, each value on its own, so a row's bits do
 * not depend on its neighbours */
static inline void silu_mul8(float *g, const float *u, int n, int bf16) {
    float gb[8] = {0}, ub[8] = {0};
    for (int i = 0; i < n; i++) {
        gb[i] = g[i];
        ub[i] = u[i];
    }
    __m256 x = _mm256_loadu_ps(gb), uu = _mm256_loadu_ps(ub);
    if (bf16)
        x = bf8(x);
    __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    __m256 y = bf16 ? bf8(_mm256_mul_ps(bf8(s), bf8(uu))) : _mm256_mul_ps(s, uu);
    _mm256_storeu_ps(gb, y);
    for (int i = 0; i < n; i++)
        g[i] = gb[i];
}

/* The norms a family's recipe asks for (engine.model.families): none (w NULL: the rows copied), the
 * Llama RMSNorm above, or Gemma's (offset: w is float32 holding 1 + w, the normalised row times it
 * rounded once, as transformers' Gemma RMSNorm). y has row stride n; y may be x (each row is read
 * whole before it is written). */
static void norm_rows(const float *x, int64_t x_rs, int64_t rows, int64_t n, const void *w, double eps, float *y,
                      int bf16, int offset) {
    if (!w) {
        for (int64_t r = 0; r < rows; r++)
            if (y + r * n != x + r * x_rs)
                memmove(y + r * n, x + r * x_rs, sizeof(float) * n);
        return;
    }
    if (!offset) {
        rms_norm(x, x_rs, rows, n, w, eps, y, bf16);
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_rs;
        float *yr = y + r * n;
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++)
            ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + (float)eps);
        for (int64_t i = 0; i < n; i++)
            yr[i] = bf16 ? bf(xr[i] * inv * ((const float *)w)[i]) : xr[i] * inv * ((const float *)w)[i];
    }
}

/* g = gelu_tanh(g) * u for n <= 8 values, in place: x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) * u,
 * tanh(y) as 1 - 2 / (1 + e^2y); each value on its own (silu_mul8's contract) */
static inline void gelu_mul8(float *g, const float *u, int n, int bf16) {
    float gb[8] = {0}, ub[8] = {0};
    for (int i = 0; i < n; i++) {
        gb[i] = g[i];
        ub[i] = u[i];
    }
    __m256 x = _mm256_loadu_ps(gb), uu = _mm256_loadu_ps(ub);
    if (bf16)
        x = bf8(x);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                       _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), x),
                                                       _mm256_mul_ps(x, x), x));
    const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f),
                                                       _mm256_add_ps(one, exp8(_mm256_add_ps(inner, inner)))));
    const __m256 s = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, th));
    __m256 y = bf16 ? bf8(_mm256_mul_ps(bf8(s), bf8(uu))) : _mm256_mul_ps(s, uu);
    _mm256_storeu_ps(gb, y);
    for (int i = 0; i < n; i++)
        g[i] = gb[i];
}

/* h[r] += t[r] for each of the rows (the residual add); in bf16 t rounded, then the sum */
static void add_rows(float *h, int64_t h_rs, const float *t, int64_t rows, int64_t n, int bf16) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++)
            h[r * h_rs + i] = bf16 ? bf(h[r * h_rs + i] + bf(t[r * n + i])) : h[r * h_rs + i] + t[r * n + i];
}

/* The rows' RMSNorm alone (the decoder's final norm in an exact forward, issue 44): the same code
 * as every layer's, so a row's bits do not depend on the rows beside it. Returns RADIX_OK, or
 * RADIX_E_NORM_SHAPE for a shape it does not take. */
radix_status radix_rms_norm(const float *x, int64_t x_rs, int64_t rows, int64_t n, const void *w, double eps, float *y,
                            int bf16, int offset) {
    if (rows < 1 || n < 1 || x_rs < n || (bf16 != 0 && bf16 != 1) || (offset != 0 && offset != 1) || !w)
        return RADIX_E_NORM_SHAPE;
    norm_rows(x, x_rs, rows, n, w, eps, y, bf16, offset);
    return RADIX_OK;
}

static int layer_ok(const radix_layer *L, int64_t rows, int threads) {
    return L && rows >= 1 && (L->bf16 == 0 || L->bf16 == 1) && threads >= 1 && L->hidden % 8 == 0 && L->inter % 8 == 0 && L->head_dim % 2 == 0 &&
           (L->q_heads * L->head_dim) % 8 == 0 && L->kv_heads >= 1 && L->q_heads % L->kv_heads == 0 &&
           L->qk_norm >= 0 && L->qk_norm <= 2 && (!L->qk_norm || (L->qnorm && L->knorm)) && L->act >= 0 &&
           L->act <= 1 && L->rope >= 0 && L->rope <= 1 && (L->norm_offset == 0 || L->norm_offset == 1);
}

/* Before attention: q (rotated) of each row to q [rows][q_heads * head_dim]; k (rotated) and v to
 * the pool layer k_pool/v_pool [kv_heads][slots][head_dim] (float32, or bf16 for a bf16 layer) at
 * slot write[r]. h [rows][hidden] (row stride h_rs) is only read; cos/sin [tables][rows][head_dim] are the
 * model's rotary embedding. */
radix_status radix_layer_pre(const radix_layer *L, const float *h, int64_t h_rs, int64_t rows, const float *cos,
                             const float *sin, float *q, void *k_pool, void *v_pool, int64_t pool_slots,
                             const int64_t *write, int threads) {
    if (!layer_ok(L, rows, threads))
        return RADIX_E_LAYER_SHAPE;
    const int64_t hd = L->hidden, d = L->head_dim, nq = L->q_heads * d, nkv = L->kv_heads * d;
    const int bf16 = (int)L->bf16;
    for (int64_t r = 0; r < rows; r++)
        if (write[r] < 0 || write[r] >= pool_slots)
            return RADIX_E_LAYER_SLOT;
    float *x = malloc(sizeof(float) * rows * (hd + 2 * nkv));
    if (!x)
        return RADIX_E_NO_MEMORY;
    float *k = x + rows * hd, *v = k + rows * nkv;
    /* one parallel region for the layer's work: the three linears share it without waiting on
     * each other; the norm before them and the rotation after them are one thread's */
#pragma omp parallel num_threads(threads)
    {
#pragma omp single
        norm_rows(h, h_rs, rows, hd, L->norm1, L->eps1, x, bf16, (int)L->norm_offset);
        linear_part(x, hd, rows, L->wq, nq, hd, L->bq, q, nq, bf16);
        linear_part(x, hd, rows, L->wk, nkv, hd, L->bk, k, nkv, bf16);
        linear_part(x, hd, rows, L->wv, nkv, hd, L->bv, v, nkv, bf16);
#pragma omp barrier
#pragma omp single
        {
            if (bf16) { /* the linears' outputs, stored in bf16 */
                round_all(q, rows * nq);
                round_all(k, rows * 2 * nkv); /* k and v, side by side */
            }
            if (L->qk_norm) { /* per head (rows of head_dim) or over the projection, before the rotation */
                const int per_head = L->qk_norm == 1;
                norm_rows(q, per_head ? d : nq, per_head ? rows * L->q_heads : rows, per_head ? d : nq, L->qnorm,
                          L->qk_eps, q, bf16, (int)L->norm_offset);
                norm_rows(k, per_head ? d : nkv, per_head ? rows * L->kv_heads : rows, per_head ? d : nkv, L->knorm,
                          L->qk_eps, k, bf16, (int)L->norm_offset);
            }
            for (int64_t r = 0; r < rows; r++) {
                const float *c = cos + (L->rope * rows + r) * d, *s = sin + (L->rope * rows + r) * d;
                for (int64_t head = 0; head < L->q_heads; head++)
                    rotate(q + r * nq + head * d, c, s, d, bf16);
                for (int64_t head = 0; head < L->kv_heads; head++) {
                    float *kr = k + r * nkv + head * d;
                    const float *vr = v + r * nkv + head * d;
                    rotate(kr, c, s, d, bf16);
                    const int64_t at = (head * pool_slots + write[r]) * d;
                    if (bf16)
                        for (int64_t i = 0; i < d; i++) {
                            ((uint16_t *)k_pool)[at + i] = bf16_bits(kr[i]);
                            ((uint16_t *)v_pool)[at + i] = bf16_bits(vr[i]);
                        }
                    else
                        for (int64_t i = 0; i < d; i++) {
                            ((float *)k_pool)[at + i] = kr[i];
                            ((float *)v_pool)[at + i] = vr[i];
                        }
                }
            }
        }
    }
    free(x);
    return RADIX_OK;
}

/* After attention: h += o(a); h += down(silu(gate(x)) * up(x)) with x = norm2(h), in place.
 * a [rows][q_heads * head_dim] is attention's output, heads side by side (in bf16: rounded to
 * bf16 first, as the unfused forward stores it). */
radix_status radix_layer_post(const radix_layer *L, float *h, int64_t h_rs, int64_t rows, const float *a, int threads) {
    if (!layer_ok(L, rows, threads))
        return RADIX_E_LAYER_SHAPE;
    const int64_t hd = L->hidden, ni = L->inter, nq = L->q_heads * L->head_dim;
    const int bf16 = (int)L->bf16;
    float *t = malloc(sizeof(float) * rows * (hd + 2 * ni + (bf16 ? nq : 0)));
    if (!t)
        return RADIX_E_NO_MEMORY;
    float *g = t + rows * hd, *u = g + rows * ni;
    const int64_t n_gu = rows * ni;
    if (bf16) {
        float *ab = u + n_gu;
        for (int64_t i = 0; i < rows * nq; i++)
            ab[i] = bf(a[i]);
        a = ab;
    }
#pragma omp parallel num_threads(threads)
    {
        linear_part(a, nq, rows, L->wo, hd, nq, L->bo, t, hd, bf16);
#pragma omp barrier
#pragma omp single
        {
            if (L->norm3) { /* a norm after attention (Gemma 2/3, OLMo 2): of o's output, as stored */
                if (bf16)
                    round_all(t, rows * hd);
                norm_rows(t, hd, rows, hd, L->norm3, L->eps3, t, bf16, (int)L->norm_offset);
            }
            add_rows(h, h_rs, t, rows, hd, bf16);
            norm_rows(h, h_rs, rows, hd, L->norm2, L->eps2, t, bf16, (int)L->norm_offset);
        }
        linear_part(t, hd, rows, L->wg, ni, hd, L->bg, g, ni, bf16);
        linear_part(t, hd, rows, L->wu, ni, hd, L->bu, u, ni, bf16);
#pragma omp barrier
        if (L->act == 1) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n_gu; j += 8)
                gelu_mul8(g + j, u + j, n_gu - j < 8 ? (int)(n_gu - j) : 8, bf16);
        } else {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n_gu; j += 8)
                silu_mul8(g + j, u + j, n_gu - j < 8 ? (int)(n_gu - j) : 8, bf16);
        }
        linear_part(g, ni, rows, L->wd, hd, ni, L->bd, t, hd, bf16);
#pragma omp barrier
#pragma omp single
        {
            if (L->norm4) { /* a norm after the MLP (Gemma 2/3, OLMo 2) */
                if (bf16)
                    round_all(t, rows * hd);
                norm_rows(t, hd, rows, hd, L->norm4, L->eps4, t, bf16, (int)L->norm_offset);
            }
            add_rows(h, h_rs, t, rows, hd, bf16);
        }
    }
    free(t);
    return RADIX_OK;
}

/* Every layer of a decode step of a few rows, with attention in between through ``attend``
 * (decode_attention.c's radix_attention_layer and each layer's fixed arguments ``ctxs[i]``): the same three
 * calls a layer as engine.model.decoder_stack makes from Python, without the Python between them.
 * q [rows][q_heads*head_dim] and a (attention's output, the same shape) are the caller's float32
 * scratch, and q16 (the same shape, bf16; NULL in float32) the queries as attention reads them in
 * bf16; k_pools/v_pools the layers' pool tensors [kv_heads][pool_slots][head_dim]. Returns RADIX_OK,
 * or the code of the call that refused (a layer half's, attention's, or RADIX_E_LAYER_Q16), with
 * that layer's index in *failed_layer (the layers before it are done). */
radix_status radix_layers(const radix_layer *const *layers, int64_t n_layers, float *h, int64_t h_rs, int64_t rows,
                          const float *cos, const float *sin, void *const *k_pools, void *const *v_pools,
                          int64_t pool_slots, const int64_t *write, float *q, uint16_t *q16, float *a,
                          radix_attend_fn attend, const void *const *ctxs, int threads, int64_t *failed_layer) {
    for (int64_t i = 0; i < n_layers; i++) {
        const radix_layer *L = layers[i];
        radix_status code = radix_layer_pre(L, h, h_rs, rows, cos, sin, q, k_pools[i], v_pools[i], pool_slots, write,
                                            threads);
        const void *qa = q;
        if (!code && L->bf16) {
            if (q16) {
                const int64_t n = rows * L->q_heads * L->head_dim;
                for (int64_t j = 0; j < n; j++)
                    q16[j] = bf16_bits(q[j]);
                qa = q16;
            } else
                code = RADIX_E_LAYER_Q16;
        }
        if (!code)
            code = attend(ctxs[i], qa, k_pools[i], v_pools[i], a);
        if (!code)
            code = radix_layer_post(L, h, h_rs, rows, a, threads);
        if (code) {
            if (failed_layer)
                *failed_layer = i;
            return code;
        }
    }
    return RADIX_OK;
}
