/* The CPU kernels of a quantized model's step (docs/design-notes.md, "Native CPU kernels"): products of
 * GGUF-quantized weights as stored with float32 activations ("integer dots": on AVX2 and in the
 * portable loops the activations are quantized to int16 in groups of 32 and summed in integer units;
 * with AVX-512 each weight is decoded to float32 in registers instead), and the operators between them
 * (RMSNorm, SiLU-and-multiply, RoPE with the cache stores, decode attention over a float32 or 8-bit paged
 * cache), each one call where torch runs several.
 *
 * A weight row is groups of 32 codes with one float16 scale d and offset lo each (w = code * d + lo;
 * 8-bit codes, Q8_0's, have no offset; the 6 layout, Q6_K's, is 8-bit codes with a scale per half
 * group of 16 and no offset). Each row of x is quantized per group like the weight:
 * x ~= xq * xs with xq in [-32767, 32767], and xsum = xs * sum(xq). Then, per output,
 *     y = sum over groups of d * xs * (codes . xq) + lo * xsum,
 * where codes . xq is an exact integer sum: the dequantized weight times the quantized activations.
 *
 * Layout: the weight's rows go in blocks of OUT_BLOCK, and a block's groups follow one another, each
 * holding the block's OUT_BLOCK float16 scales, then (4-bit codes) their OUT_BLOCK float16 offsets or
 * (6) their second halves' scales, then each row's codes for the group: 16 bytes for 4 bits (byte j
 * holds code j in its low nibble and code j + 16 in its high one, GGUF's Q4_0/Q4_1 order) or 32 signed
 * bytes. So a block of outputs is one sequential stream of bytes.
 *
 * The AVX2 path widens the codes to int16 and multiplies them by the activations with vpmaddwd; a
 * 32-bit lane sums four products, at most 4 * 128 * 32767 in size. Other CPUs take the portable loops,
 * which give the same integer sums. Past a few rows the integer sums cost as much as float ones (a
 * multiply, a conversion and a scaled add per group and row), so a product of FLOAT_MIN_ROWS rows or
 * more (4 with AVX-512, 8 with AVX2) decodes a group's 32 weights once (code * d + lo: exact in float32
 * but for the add's one rounding) and gives each row fused multiply-adds from its float32 activations;
 * fewer rows, where the integer dots' cheaper decoding wins, keep them, as the 6 layout does at every
 * row count. Threads come from the OpenMP runtime torch has already loaded (the same libgomp.so.1), so
 * they are torch's own. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(ZQ_PORTABLE)
#include <immintrin.h>
#define ZQ_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(ZQ_NO_AVX512)
#define ZQ_AVX512 1
#endif
#endif

#define GROUP 32
#ifdef ZQ_AVX512 /* products of at least this many rows are float ones */
#define FLOAT_MIN_ROWS 4
#else
#define FLOAT_MIN_ROWS 8
#endif
#define OUT_BLOCK 4 /* outputs that share each activation load */
#define CODE_MAX 32767.0f /* the activations' largest code */

/* Weights come in three layouts, by `bits`: 4-bit codes with a scale and an offset per group; 8-bit
 * codes with a scale; 6: 8-bit codes with a scale per half group (16 values: Q6_K's). */
static inline int header_bytes(int bits) { return OUT_BLOCK * 2 * (bits == 8 ? 1 : 2); }
static inline int code_bytes(int bits) { return GROUP * (bits == 4 ? 4 : 8) / 8; }

/* Bytes of one group of a block: float16 scales (two for 6 bits), offsets (4 bits only), codes. */
static inline int64_t group_stride(int bits) { return header_bytes(bits) + OUT_BLOCK * code_bytes(bits); }

int zq_group_stride(int bits) { return (int)group_stride(bits); }

/* The products' instructions: 0 the portable loops, 1 AVX2, 2 AVX-512. */
int zq_vector_path(void) {
#if defined(ZQ_AVX512)
    return 2;
#elif defined(ZQ_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* The fewest rows whose products run on decoded float weights; 0: none do (the portable loops). */
int zq_float_min_rows(void) {
#ifdef ZQ_AVX2
    return FLOAT_MIN_ROWS;
#else
    return 0;
#endif
}

/* Whether the library was built with OpenMP, so that `threads` splits its loops. */
int zq_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Rows of x (m x k floats, k a multiple of 32) quantized per group: codes, scale = amax / 32767, and the
 * sum of the group's quantized values (scale times its codes' sum), so the offset term multiplies the
 * same activations as the codes do and the offset's large share cancels exactly. Rounding is to
 * nearest, ties to even, as torch.round. */
void zq_quantize_rows(const float *x, int64_t m, int64_t k, int16_t *q, float *scale, float *sum) {
    int64_t groups = m * (k / GROUP);
    for (int64_t i = 0; i < groups; i++) {
        const float *v = x + i * GROUP;
        float amax = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        float inv = amax > 0.0f ? CODE_MAX / amax : 0.0f;
        int32_t total = 0;
        for (int j = 0; j < GROUP; j++) {
            q[i * GROUP + j] = (int16_t)nearbyintf(v[j] * inv);
            total += q[i * GROUP + j];
        }
        scale[i] = amax / CODE_MAX;
        sum[i] = (float)total * scale[i];
    }
}

/* IEEE half -> float, bit by bit (what F16C's instruction gives). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#ifdef ZQ_AVX2
static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A row's 32 codes for a group as int16, in two registers: 4-bit ones unpacked from their nibbles. */
static inline void load_codes(const uint8_t *codes, const int bits, __m256i out[2]) {
    if (bits != 4) {
        out[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)codes));
        out[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(codes + 16)));
        return;
    }
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i bytes = _mm_loadu_si128((const __m128i *)codes);
    out[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low4));
    out[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
}

/* codes . x in eight partial sums, as floats. */
static inline __m256 group_products(const __m256i codes[2], const __m256i x[2]) {
    __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(codes[0], x[0]), _mm256_madd_epi16(codes[1], x[1]));
    return _mm256_cvtepi32_ps(sums);
}
#endif

/* Integer sum of one row's codes for values first .. first + count - 1 of a group times activations
 * (the portable path). */
static inline int32_t group_sum(const uint8_t *codes, const int bits, const int16_t *x, int first, int count) {
    int32_t total = 0;
    if (bits == 4) {
        for (int j = 0; j < GROUP / 2; j++) total += (codes[j] & 0x0F) * x[j] + (codes[j] >> 4) * x[j + GROUP / 2];
    } else {
        for (int j = first; j < first + count; j++) total += (int8_t)codes[j] * x[j];
    }
    return total;
}

/* Outputs of one block for activation rows r .. r + rows - 1 (rows: 1 or 2, a constant once inlined,
 * as is bits): each group's codes are loaded once for all the rows. */
static inline __attribute__((always_inline)) void output_block(
        const uint8_t *block, const int bits, int64_t n, int64_t k, const int16_t *xq, const float *xs,
        const float *xsum, int64_t first, int64_t r, const int rows, float *y) {
    const int64_t groups = k / GROUP, stride = group_stride(bits), row_bytes = code_bytes(bits);
    const int header = header_bytes(bits);
    float out[2][OUT_BLOCK];
#ifdef ZQ_AVX2
    __m256 acc[2][OUT_BLOCK];
    __m128 offsets[2];
    for (int i = 0; i < rows; i++) {
        offsets[i] = _mm_setzero_ps();
        for (int j = 0; j < OUT_BLOCK; j++) acc[i][j] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = block + g * stride;
        const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)group));
        float scales[2][OUT_BLOCK], seconds[2][OUT_BLOCK]; /* seconds: 6 bits, the second half's */
        __m256i x[2][2];
        for (int i = 0; i < rows; i++) {
            const int16_t *row = xq + (r + i) * k + g * GROUP;
            x[i][0] = _mm256_loadu_si256((const __m256i *)row);
            x[i][1] = _mm256_loadu_si256((const __m256i *)(row + 16));
            const __m128 xscale = _mm_set1_ps(xs[(r + i) * groups + g]);
            _mm_storeu_ps(scales[i], _mm_mul_ps(d, xscale));
            if (bits != 8) { /* 4 bits: the offsets; 6: the second halves' scales */
                const __m128 second = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(group + OUT_BLOCK * 2)));
                if (bits == 4)
                    offsets[i] = _mm_fmadd_ps(second, _mm_set1_ps(xsum[(r + i) * groups + g]), offsets[i]);
                else
                    _mm_storeu_ps(seconds[i], _mm_mul_ps(second, xscale));
            }
        }
        for (int j = 0; j < OUT_BLOCK; j++) {
            __m256i c[2];
            load_codes(group + header + j * row_bytes, bits, c);
            for (int i = 0; i < rows; i++) {
                if (bits == 6) { /* each half by its own scale */
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(c[0], x[i][0])),
                                                _mm256_broadcast_ss(&scales[i][j]), acc[i][j]);
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(c[1], x[i][1])),
                                                _mm256_broadcast_ss(&seconds[i][j]), acc[i][j]);
                } else {
                    acc[i][j] = _mm256_fmadd_ps(group_products(c, x[i]), _mm256_broadcast_ss(&scales[i][j]),
                                                acc[i][j]);
                }
            }
        }
    }
    for (int i = 0; i < rows; i++) {
        float low[OUT_BLOCK];
        _mm_storeu_ps(low, offsets[i]);
        for (int j = 0; j < OUT_BLOCK; j++) out[i][j] = horizontal_sum(acc[i][j]) + low[j];
    }
#else
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < OUT_BLOCK; j++) {
            float total = 0.0f, low = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *group = block + g * stride, *codes = group + header + j * row_bytes;
                const int16_t *row = xq + (r + i) * k + g * GROUP;
                const float xscale = xs[(r + i) * groups + g];
                uint16_t d, second = 0;
                memcpy(&d, group + 2 * j, 2);
                if (bits != 8) memcpy(&second, group + OUT_BLOCK * 2 + 2 * j, 2); /* 4 bits: the offset; 6: a scale */
                if (bits == 6) {
                    total += (float)group_sum(codes, bits, row, 0, GROUP / 2) * (half_to_float(d) * xscale);
                    total += (float)group_sum(codes, bits, row, GROUP / 2, GROUP / 2) * (half_to_float(second) * xscale);
                    continue;
                }
                total += (float)group_sum(codes, bits, row, 0, GROUP) * (half_to_float(d) * xscale);
                if (bits == 4) low += half_to_float(second) * xsum[(r + i) * groups + g];
            }
            out[i][j] = total + low;
        }
#endif
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < OUT_BLOCK; j++) y[(r + i) * n + first + j] = out[i][j];
}

/* y[m x n] = x @ W.T for W (n x k, n a multiple of OUT_BLOCK) in `bits`-bit codes, blocked as above.
 * Inlined once per width, so the width is a constant in each copy's inner loop. Rows go two at a time
 * (a weight's codes then serve both from one load), an odd last one alone. */
static inline __attribute__((always_inline)) void matmul(
        const uint8_t *weight, const int bits, int64_t n, int64_t k, const int16_t *xq, const float *xs,
        const float *xsum, int64_t m, float *y, int threads) {
    const int64_t block_bytes = (k / GROUP) * group_stride(bits);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < n / OUT_BLOCK; b++) {
        const uint8_t *block = weight + b * block_bytes;
        int64_t r = 0;
        for (; r + 2 <= m; r += 2) output_block(block, bits, n, k, xq, xs, xsum, b * OUT_BLOCK, r, 2, y);
        if (r < m) output_block(block, bits, n, k, xq, xs, xsum, b * OUT_BLOCK, r, 1, y);
    }
}

#ifdef ZQ_AVX2
/* The float products, in 16-lane registers with AVX-512 (32 of them) and 8-lane ones with AVX2 (16):
 * one source, the vector type and the passes' shapes by instruction set. */
#ifdef ZQ_AVX512
typedef __m512 fvec;
#define LANES 16
#define fvec_zero _mm512_setzero_ps
#define fvec_load _mm512_loadu_ps
#define fvec_fmadd _mm512_fmadd_ps
#define fvec_sum _mm512_reduce_add_ps
#define EIGHT_ROW_OUTS 2 /* 8 rows x 2 outputs: 16 accumulators */
#define FOUR_ROW_OUTS 4

/* A row's 32 weights of a group as floats (w = code * d + lo; 8-bit codes: code * d). 4-bit codes
 * index a table of the sixteen values code * d + lo, one fused multiply-add for the row's group (the
 * same single rounding as decoding each weight): a vpermps reads only an index's low four bits, so the
 * low nibbles need no mask. */
static inline void decode_weights(const uint8_t *codes, const int bits, float d, float lo, fvec w[2]) {
    if (bits == 8) {
        for (int half = 0; half < 2; half++) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + 16 * half));
            w[half] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), _mm512_set1_ps(d));
        }
        return;
    }
    const __m512 every_code = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(every_code, _mm512_set1_ps(d), _mm512_set1_ps(lo));
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    w[0] = _mm512_permutexvar_ps(bytes, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}
#else
typedef __m256 fvec;
#define LANES 8
#define fvec_zero _mm256_setzero_ps
#define fvec_load _mm256_loadu_ps
#define fvec_fmadd _mm256_fmadd_ps
#define fvec_sum horizontal_sum
#define EIGHT_ROW_OUTS 1 /* 8 accumulators beside the 4 registers of decoded weights */
#define FOUR_ROW_OUTS 2

/* A row's 32 weights of a group as floats: codes 0-7, 8-15, 16-23 and 24-31 (4 bits: the low nibbles
 * of bytes 0-15, then their high ones). */
static inline void decode_weights(const uint8_t *codes, const int bits, float d, float lo, fvec w[4]) {
    const __m256 scale = _mm256_set1_ps(d);
    if (bits == 8) {
        for (int q = 0; q < 4; q++) {
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(codes + 8 * q));
            w[q] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
        }
        return;
    }
    const __m256 offset = _mm256_set1_ps(lo);
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)codes);
    const __m256i first = _mm256_cvtepu8_epi32(bytes), second = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(first, low4)), scale, offset);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(second, low4)), scale, offset);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), scale, offset);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)), scale, offset);
}
#endif

/* Outputs first + j0 .. first + j0 + outs - 1 of one block for float rows r .. r + rows - 1 (rows and
 * outs constants once inlined: rows x outs accumulators). Each group's float16 header is converted
 * once (a per-output scalar conversion made one row 1.7x slower). A row's sums run in the same order
 * whatever rows it shares a pass with, so its outputs do not depend on the batch. */
static inline __attribute__((always_inline)) void float_outputs(
        const uint8_t *block, const int bits, int64_t n, int64_t k, const float *x, int64_t first, int j0,
        const int outs, int64_t r, const int rows, float *y) {
    const int64_t groups = k / GROUP, stride = group_stride(bits), row_bytes = code_bytes(bits);
    const int header = header_bytes(bits);
    fvec acc[8][4];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < outs; j++) acc[i][j] = fvec_zero();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = block + g * stride;
        float scales[2 * OUT_BLOCK]; /* the block's four scales, then (4 bits) its four offsets */
        if (bits == 4)
            _mm256_storeu_ps(scales, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)group)));
        else
            _mm_storeu_ps(scales, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)group)));
        for (int j = 0; j < outs; j++) {
            fvec w[GROUP / LANES];
            decode_weights(group + header + (j0 + j) * row_bytes, bits, scales[j0 + j],
                           bits == 4 ? scales[OUT_BLOCK + j0 + j] : 0.0f, w);
            for (int i = 0; i < rows; i++) {
                const float *row = x + (r + i) * k + g * GROUP;
                for (int q = 0; q < GROUP / LANES; q++) acc[i][j] = fvec_fmadd(w[q], fvec_load(row + LANES * q), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < outs; j++) y[(r + i) * n + first + j0 + j] = fvec_sum(acc[i][j]);
}

/* y[m x n] = x @ W.T from float rows: eight rows a pass (the block's outputs EIGHT_ROW_OUTS at a time,
 * so the accumulators fit the registers), then 4, 2 and 1 for the rest. */
static inline __attribute__((always_inline)) void float_matmul(
        const uint8_t *weight, const int bits, int64_t n, int64_t k, const float *x, int64_t m, float *y,
        int threads) {
    const int64_t block_bytes = (k / GROUP) * group_stride(bits);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < n / OUT_BLOCK; b++) {
        const uint8_t *block = weight + b * block_bytes;
        const int64_t first = b * OUT_BLOCK;
        int64_t r = 0;
        for (; r + 8 <= m; r += 8)
            for (int j = 0; j < OUT_BLOCK; j += EIGHT_ROW_OUTS)
                float_outputs(block, bits, n, k, x, first, j, EIGHT_ROW_OUTS, r, 8, y);
        if (m - r >= 4) {
            for (int j = 0; j < OUT_BLOCK; j += FOUR_ROW_OUTS)
                float_outputs(block, bits, n, k, x, first, j, FOUR_ROW_OUTS, r, 4, y);
            r += 4;
        }
        if (m - r >= 2) {
            float_outputs(block, bits, n, k, x, first, 0, 4, r, 2, y);
            r += 2;
        }
        if (m - r >= 1) float_outputs(block, bits, n, k, x, first, 0, 4, r, 1, y);
    }
}
#endif

/* y[m x n] = x @ W.T: for at least FLOAT_MIN_ROWS rows (AVX2 or AVX-512) from the float rows themselves
 * (4- and 8-bit layouts); else x (m x k floats) quantized into scratch memory, then the integer
 * products. Returns 0, or -1 where the scratch memory could not be had (y is then untouched). */
int zq_linear(const uint8_t *weight, int bits, int64_t n, int64_t k, const float *x, int64_t m, float *y,
              int threads) {
#ifdef ZQ_AVX2
    if (m >= FLOAT_MIN_ROWS && bits != 6) {
        if (bits == 4)
            float_matmul(weight, 4, n, k, x, m, y, threads);
        else
            float_matmul(weight, 8, n, k, x, m, y, threads);
        return 0;
    }
#endif
    const int64_t groups = m * (k / GROUP);
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(m * k));
    float *xs = malloc(sizeof(float) * (size_t)(2 * groups));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    zq_quantize_rows(x, m, k, xq, xs, xs + groups);
    if (bits == 4)
        matmul(weight, 4, n, k, xq, xs, xs + groups, m, y, threads);
    else if (bits == 6)
        matmul(weight, 6, n, k, xq, xs, xs + groups, m, y, threads);
    else
        matmul(weight, 8, n, k, xq, xs, xs + groups, m, y, threads);
    free(xq);
    free(xs);
    return 0;
}

/* e^x in plain arithmetic, so that the compiler vectorizes the loops around it (libm's expf is one
 * call a value: most of a SiLU's time). x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is
 * exact), e^r by Cephes' polynomial, 2^n from the exponent bits: within 2 ulp of expf over [-87, 88];
 * 0 below -87.3 (e^-inf is 0, as the softmax's masked scores need), and e^88.3 above 88.3. */
static inline float exp_approx(float x) {
    const float clamped = x < 88.3f ? (x > -87.3f ? x : -87.3f) : 88.3f;
    const float n = nearbyintf(clamped * 1.44269504f);
    const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    const float er = poly * (r * r) + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float power;
    memcpy(&power, &bits, sizeof power);
    return x > -87.3f ? er * power : 0.0f;
}

/* a . b over n floats, in eight lanes (which the compiler vectorizes), then those in order. */
static inline float dot_product(const float *a, const float *b, int64_t n) {
    float lanes[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lanes[l] += a[j + l] * b[j + l];
    float total = 0.0f;
    for (int l = 0; l < 8; l++) total += lanes[l];
    for (; j < n; j++) total += a[j] * b[j];
    return total;
}

/* RMSNorm of rows of n floats: out = v * (1 / sqrt(mean(v * v) + eps)) * weight, with v = x + residual
 * (also written to `summed`) when a residual is given, else v = x. */
void zq_rms_norm(const float *x, const float *residual, const float *weight, float eps, int64_t m, int64_t n,
                 float *out, float *summed) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * n;
        const float *v = xr;
        if (residual) {
            float *sr = summed + r * n;
            const float *rr = residual + r * n;
            for (int64_t j = 0; j < n; j++) sr[j] = xr[j] + rr[j];
            v = sr;
        }
        const float inverse = 1.0f / sqrtf(dot_product(v, v, n) / (float)n + eps);
        float *o = out + r * n;
        for (int64_t j = 0; j < n; j++) o[j] = v[j] * inverse * weight[j];
    }
}

/* 8-bit caches (docs/design-notes.md, "KV in 8 bits"): codes, e4m3 (fp8) or int8, one byte per value,
 * with a float32 scale per entry and KV head (value = code * scale), the scales laid out [blocks,
 * kv_heads, block_size]. The same rounding as the PyTorch reference's quantize_rows: scale = amax / top
 * (1 for an all-zero row), value / scale clamped to +-top and rounded to nearest, ties to even. */
enum { ZQ_FLOAT = 0, ZQ_E4M3 = 1, ZQ_INT8 = 2 }; /* a cache's kind */

static float e4m3_values[256];

__attribute__((constructor)) static void fill_e4m3_values(void) {
    for (int c = 0; c < 256; c++) {
        const int e = (c >> 3) & 15, m = c & 7;
        float v = e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m / 8.0f, -6);
        if (e == 15 && m == 7) v = NAN; /* e4m3fn has no infinities: this is its NaN */
        e4m3_values[c] = c & 128 ? -v : v;
    }
}

/* The e4m3 code nearest x (|x| <= 448), ties to even, as torch casts to float8_e4m3fn. */
static inline uint8_t e4m3_code(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 128);
    bits &= 0x7fffffffu;
    float magnitude;
    memcpy(&magnitude, &bits, sizeof magnitude);
    if (magnitude < 0.015625f) /* under the smallest normal, 2^-6: steps of 2^-9 (code 8 is 2^-6 itself) */
        return sign | (uint8_t)nearbyintf(magnitude * 512.0f);
    bits += 0x7ffffu + ((bits >> 20) & 1); /* the mantissa's 23 bits rounded to 3, ties to even */
    return sign | (uint8_t)((((int)(bits >> 23) - 120) << 3) | ((bits >> 20) & 7));
}

static inline float code_value(uint8_t code, int kind) {
    return kind == ZQ_E4M3 ? e4m3_values[code] : (float)(int8_t)code;
}

/* One entry's d values x as codes of `kind`, and their scale. */
static void quantize_entry(const float *x, int64_t d, int kind, uint8_t *codes, float *scale) {
    const float top = kind == ZQ_E4M3 ? 448.0f : 127.0f;
    float amax = 0.0f;
    for (int64_t j = 0; j < d; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
    const float s = amax > 0.0f ? amax / top : 1.0f;
    for (int64_t j = 0; j < d; j++) {
        float v = x[j] / s;
        v = v > top ? top : (v < -top ? -top : v);
        codes[j] = kind == ZQ_E4M3 ? e4m3_code(v) : (uint8_t)(int8_t)nearbyintf(v);
    }
    *scale = s;
}

/* x [d] (a power of 2) times the orthonormal Sylvester-Hadamard matrix, in place: the int8 cache's
 * rotation of q and k heads (butterflies, then 1 / sqrt(d)). */
static void hadamard_rotate(float *x, int64_t d) {
    for (int64_t h = 1; h < d; h *= 2)
        for (int64_t i = 0; i < d; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float norm = 1.0f / sqrtf((float)d);
    for (int64_t j = 0; j < d; j++) x[j] *= norm;
}

/* One KV head's entries of a sequence in an 8-bit cache as float32 values (code * scale, exactly the
 * reference's dequantized values): `codes` and `scales` at the head's first code and scale, entries
 * `entry` codes apart and blocks `scale_block` scales apart; block i of `table` (-1: a hole) lands at
 * rows [i * block_size, d] and row_table[i] = i (or -1; row_table NULL: not written), so attend_head reads them
 * as a float32 cache. */
static void dequantize_sequence(const uint8_t *codes, const float *scales, int kind, const int32_t *table,
                                int64_t length, int64_t block_size, int64_t entry, int64_t scale_block, int64_t d,
                                float *rows, int32_t *row_table) {
    for (int64_t i = 0, t = 0; t < length; i++) {
        const int64_t count = length - t < block_size ? length - t : block_size;
        if (row_table) row_table[i] = table[i] < 0 ? -1 : (int32_t)i;
        if (table[i] >= 0) {
            const uint8_t *c = codes + table[i] * block_size * entry;
            const float *s = scales + table[i] * scale_block;
            float *r = rows + i * block_size * d;
            for (int64_t e = 0; e < count; e++) {
                int64_t j = 0;
#ifdef ZQ_AVX2
                if (kind == ZQ_E4M3) { /* e4m3's bits placed in float16's are the value / 256, exactly */
                    const __m256 scale = _mm256_set1_ps(s[e]), power = _mm256_set1_ps(256.0f);
                    for (; j + 8 <= d; j += 8) {
                        const __m128i wide = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(c + e * entry + j)));
                        const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8),
                                                          _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7f)), 7));
                        _mm256_storeu_ps(r + e * d + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(half), power), scale));
                    }
                }
#endif
                for (; j < d; j++) r[e * d + j] = code_value(c[e * entry + j], kind) * s[e];
            }
        }
        t += count;
    }
}

#ifdef ZQ_AVX2
/* q . k for eight keys `entry` floats apart (d a multiple of 8) as one vector of the eight sums: eight
 * accumulators, then added across in three steps instead of eight horizontal sums. */
static inline __m256 eight_dots(const float *q, const float *k, int64_t entry, int64_t d) {
    __m256 acc[8];
    for (int e = 0; e < 8; e++) acc[e] = _mm256_setzero_ps();
    for (int64_t j = 0; j < d; j += 8) {
        const __m256 qj = _mm256_loadu_ps(q + j);
        for (int e = 0; e < 8; e++) acc[e] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(k + e * entry + j), acc[e]);
    }
    const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67); /* per 128-bit half */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}
#endif

/* One query head's attention over its sequence's entries: k_base and v_base point at the KV head's
 * first float in the caches, `entry` floats apart from one cache slot to the next; table the
 * sequence's blocks (-1: a hole, skipped). Block by block, so the table is read once a block with no
 * division per entry. The output row o [d] is written; scores [length] is scratch. */
static void attend_head(const float *qh, const float *k_base, const float *v_base, int64_t entry,
                        const int32_t *table, int64_t length, int64_t block_size, int64_t d, float scale,
                        float *scores, float *o) {
    float top = -INFINITY;
    for (int64_t i = 0, t = 0; t < length; i++) {
        const int64_t count = length - t < block_size ? length - t : block_size;
        const float *k = k_base + (table[i] < 0 ? 0 : table[i]) * block_size * entry; /* read for no hole */
        int64_t e = 0;
#ifdef ZQ_AVX2
        if (table[i] >= 0 && d % 8 == 0)
            for (; e + 8 <= count; e += 8)
                _mm256_storeu_ps(scores + t + e,
                                 _mm256_mul_ps(eight_dots(qh, k + e * entry, entry, d), _mm256_set1_ps(scale)));
#endif
        for (; e < count; e++) scores[t + e] = table[i] < 0 ? -INFINITY : dot_product(qh, k + e * entry, d) * scale;
        for (e = 0; e < count; e++, t++) top = scores[t] > top ? scores[t] : top;
    }
    float total = 0.0f;
    for (int64_t t = 0; t < length; t++) {
        scores[t] = exp_approx(scores[t] - top); /* holes: e^-inf = 0 */
        total += scores[t];
    }
#ifdef ZQ_AVX2
    if (d % 64 == 0) { /* 64 output values at a time, summed in registers */
        for (int64_t c = 0; c < d; c += 64) {
            __m256 acc[8];
            for (int l = 0; l < 8; l++) acc[l] = _mm256_setzero_ps();
            for (int64_t i = 0, t = 0; t < length; i++) {
                const int64_t count = length - t < block_size ? length - t : block_size;
                if (table[i] >= 0) {
                    const float *v = v_base + table[i] * block_size * entry + c;
                    for (int64_t e = 0; e < count; e++) {
                        const __m256 p = _mm256_broadcast_ss(scores + t + e);
                        for (int l = 0; l < 8; l++)
                            acc[l] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + e * entry + 8 * l), acc[l]);
                    }
                }
                t += count;
            }
            for (int l = 0; l < 8; l++) _mm256_storeu_ps(o + c + 8 * l, acc[l]);
        }
    } else
#endif
    {
        for (int64_t j = 0; j < d; j++) o[j] = 0.0f;
        for (int64_t i = 0, t = 0; t < length; i++) {
            const int64_t count = length - t < block_size ? length - t : block_size;
            if (table[i] >= 0) {
                const float *v = v_base + table[i] * block_size * entry;
                for (int64_t e = 0; e < count; e++)
                    for (int64_t j = 0; j < d; j++) o[j] += scores[t + e] * v[e * entry + j];
            }
            t += count;
        }
    }
    const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t j = 0; j < d; j++) o[j] *= inverse;
}


/* Decode attention of float32 queries [batch, q_heads, d] against a paged cache [blocks, block_size,
 * kv_heads, d] of `kind`: float32 values, or 8-bit codes with their scales k_scales, v_scales [blocks,
 * kv_heads, block_size] (NULL for float32). Each sequence's entries 0 .. context_len - 1 through its row
 * of block_tables [batch, width] (a block of -1 is a hole, skipped), softmax(q . k * scale) . v per query
 * head, the query heads of a KV head sharing its entries. One sequence and KV head per loop turn, so
 * a sequence's output never depends on what it is batched with. Returns 0, -1 without memory, -2 (having
 * read nothing) when a context is longer than its table or names a block past the cache's `blocks`. */
int zq_decode_attention(const float *q, const void *k_cache, const void *v_cache, int kind, const float *k_scales,
                        const float *v_scales, int64_t blocks, const int32_t *block_tables, int64_t width,
                        const int32_t *context_lens, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t d,
                        int64_t block_size, float scale, float *out, int threads) {
    const int64_t group = q_heads / kv_heads;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (context_lens[b] < 0 || context_lens[b] > width * block_size) return -2;
        for (int64_t i = 0; i < (context_lens[b] + block_size - 1) / block_size; i++)
            if (block_tables[b * width + i] >= blocks) return -2;
        longest = context_lens[b] > longest ? context_lens[b] : longest;
    }
    /* scores, then (8-bit codes) the sequence's keys and values as float32 rows and their blocks' table */
    const int64_t span = (longest + block_size - 1) / block_size; /* blocks of the longest context */
    const size_t scratch_floats = (size_t)(longest > 0 ? longest : 1) + (kind ? (size_t)(2 * span * block_size * d + span) : 0);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && batch * kv_heads > 1)
    {
        float *scores = malloc(sizeof(float) * scratch_floats);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < batch * kv_heads; item++) {
            if (!scores) continue;
            const int64_t b = item / kv_heads, h = item % kv_heads, length = context_lens[b];
            const int32_t *table = block_tables + b * width;
            int64_t entry = kv_heads * d; /* values from one cache entry to the next */
            const float *k_base = (const float *)k_cache + h * d, *v_base = (const float *)v_cache + h * d;
            if (kind) { /* the codes read once for the group's query heads, then attended as values */
                float *k_rows = scores + (longest > 0 ? longest : 1), *v_rows = k_rows + span * block_size * d;
                int32_t *rows_table = (int32_t *)(v_rows + span * block_size * d);
                const uint8_t *k_codes = (const uint8_t *)k_cache + h * d, *v_codes = (const uint8_t *)v_cache + h * d;
                dequantize_sequence(k_codes, k_scales + h * block_size, kind, table, length, block_size, entry,
                                    kv_heads * block_size, d, k_rows, rows_table);
                dequantize_sequence(v_codes, v_scales + h * block_size, kind, table, length, block_size, entry,
                                    kv_heads * block_size, d, v_rows, NULL);
                k_base = k_rows;
                v_base = v_rows;
                entry = d;
                table = rows_table;
            }
            for (int64_t g = 0; g < group; g++) {
                const float *qh = q + (b * q_heads + h * group + g) * d;
                float *o = out + (b * q_heads + h * group + g) * d;
                attend_head(qh, k_base, v_base, entry, table, length, block_size, d, scale, scores, o);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* silu(gate) * up for rows [m, 2n] holding gate then up: out [m, n]. */
void zq_silu_and_mul(const float *x, int64_t m, int64_t n, float *out) {
    for (int64_t r = 0; r < m; r++) {
        const float *gate = x + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        for (int64_t j = 0; j < n; j++) o[j] = gate[j] / (1.0f + exp_approx(-gate[j])) * up[j];
    }
}

/* One layer's step from its QKV rows [tokens, (q_heads + 2 * kv_heads) * d] to attention: q and k heads
 * rotated (rotate-half RoPE with each token's cos, sin rows [tokens, d], `table_stride` floats apart;
 * then, with `hadamard`, times the Hadamard matrix: the int8 cache's rotation); q written to q_out
 * [tokens, q_heads, d] and, where query_slots is given and not -1, to that row of query_cache
 * [query_rows, q_heads, d]; k and v written to their slot of the caches [cache_rows, kv_heads, d] (-1
 * skips) as float32 values, or for an 8-bit `kind` as codes with their scales [blocks, kv_heads,
 * block_size]. Returns -1, writing nothing, when a slot or query row is out of range or d is over
 * ZQ_MAX_HEAD; else 0. */
#define ZQ_MAX_HEAD 512
int zq_rope_store(const float *qkv, int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t d,
                  const float *cos, const float *sin, int64_t table_stride, void *k_cache, void *v_cache, int kind,
                  float *k_scales, float *v_scales, int64_t block_size, int hadamard, const int64_t *slots,
                  int64_t cache_rows, float *query_cache, const int64_t *query_slots, int64_t query_rows,
                  float *q_out) {
    const int64_t width = (q_heads + 2 * kv_heads) * d, half = d / 2;
    if (d > ZQ_MAX_HEAD) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < -1 || slots[t] >= cache_rows || (query_slots && (query_slots[t] < -1 || query_slots[t] >= query_rows)))
            return -1;
    float key[ZQ_MAX_HEAD];
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = qkv + t * width, *c = cos + t * table_stride, *s = sin + t * table_stride;
        const int64_t slot = slots[t], block = slot / block_size, offset = slot % block_size;
        for (int64_t h = 0; h < q_heads + kv_heads; h++) {
            const float *x = row + h * d;
            float *o = h < q_heads ? q_out + (t * q_heads + h) * d : (slot < 0 ? NULL : kind ? key
                                     : (float *)k_cache + (slot * kv_heads + h - q_heads) * d);
            if (!o) continue;
            for (int64_t j = 0; j < half; j++) o[j] = x[j] * c[j] - x[j + half] * s[j];
            for (int64_t j = half; j < d; j++) o[j] = x[j] * c[j] + x[j - half] * s[j];
            if (hadamard) hadamard_rotate(o, d);
            if (h >= q_heads && kind) {
                const int64_t kv = h - q_heads;
                quantize_entry(key, d, kind, (uint8_t *)k_cache + (slot * kv_heads + kv) * d,
                               k_scales + (block * kv_heads + kv) * block_size + offset);
            }
        }
        if (slot >= 0 && kind)
            for (int64_t kv = 0; kv < kv_heads; kv++)
                quantize_entry(row + (q_heads + kv_heads + kv) * d, d, kind, (uint8_t *)v_cache + (slot * kv_heads + kv) * d,
                               v_scales + (block * kv_heads + kv) * block_size + offset);
        else if (slot >= 0)
            memcpy((float *)v_cache + slot * kv_heads * d, row + (q_heads + kv_heads) * d,
                   sizeof(float) * (size_t)(kv_heads * d));
        if (query_slots && query_slots[t] >= 0)
            memcpy(query_cache + query_slots[t] * q_heads * d, q_out + t * q_heads * d, sizeof(float) * (size_t)(q_heads * d));
    }
    return 0;
}

/* One decoder layer of a decode step, every operator above in one call (docs/design-notes.md, "Native
 * CPU kernels"): the same functions in the same order as the layer's Python path, so the same bits.
 * The layer's fixed parts (weights, norms, shapes) and the step's (tables, slots, cache pointers) are
 * filled in by the caller; hidden and residual [rows, hidden] are this layer's inputs (residual NULL in
 * the first layer), out and residual_out its outputs. */
typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, intermediate;
    const float *norm1, *norm2;
    float eps, scale;
    const uint8_t *weights[4]; /* qkv, o, gate_up, down, in the integer dots' layout */
    int bits[4];
    const float *biases[4]; /* NULL where a projection has none */
    /* the step's */
    int64_t rows;
    const float *cos, *sin;
    int64_t table_stride;
    void *k_cache, *v_cache;
    int kind, hadamard; /* the caches' (ZQ_FLOAT, ZQ_E4M3, ZQ_INT8); whether q and k heads are rotated */
    float *k_scales, *v_scales; /* 8-bit caches' [blocks, kv_heads, block_size], else NULL */
    int64_t cache_blocks, block_size;
    const int64_t *slots;
    float *query_cache;
    const int64_t *query_slots;
    int64_t query_rows;
    const int32_t *block_tables;
    int64_t table_width;
    const int32_t *context_lens;
    int threads;
} zq_layer;

static int projection(const zq_layer *L, int which, int64_t n, int64_t k, const float *x, float *y) {
    if (zq_linear(L->weights[which], L->bits[which], n, k, x, L->rows, y, L->threads)) return -1;
    if (L->biases[which])
        for (int64_t r = 0; r < L->rows; r++)
            for (int64_t j = 0; j < n; j++) y[r * n + j] += L->biases[which][j];
    return 0;
}

/* Returns 0; -1 without memory, -2 for a table that does not fit the cache, -3 for a slot outside it. */
int zq_decode_layer(const zq_layer *L, const float *hidden, const float *residual, float *out, float *residual_out) {
    const int64_t m = L->rows, H = L->hidden, q_width = L->q_heads * L->head_dim;
    const int64_t qkv_width = q_width + 2 * L->kv_heads * L->head_dim, I = L->intermediate;
    float *scratch = malloc(sizeof(float) * (size_t)(m * (H + qkv_width + 2 * q_width + 3 * I)));
    if (!scratch) return -1;
    float *normed = scratch, *qkv = normed + m * H, *q = qkv + m * qkv_width, *attended = q + m * q_width;
    float *gate_up = attended + m * q_width, *act = gate_up + m * 2 * I;
    int status = 0;
    if (residual) {
        zq_rms_norm(hidden, residual, L->norm1, L->eps, m, H, normed, residual_out);
    } else {
        memcpy(residual_out, hidden, sizeof(float) * (size_t)(m * H));
        zq_rms_norm(hidden, NULL, L->norm1, L->eps, m, H, normed, NULL);
    }
    if ((status = projection(L, 0, qkv_width, H, normed, qkv))) goto done;
    if (zq_rope_store(qkv, m, L->q_heads, L->kv_heads, L->head_dim, L->cos, L->sin, L->table_stride, L->k_cache,
                      L->v_cache, L->kind, L->k_scales, L->v_scales, L->block_size, L->hadamard, L->slots,
                      L->cache_blocks * L->block_size, L->query_cache, L->query_slots, L->query_rows, q)) {
        status = -3;
        goto done;
    }
    if ((status = zq_decode_attention(q, L->k_cache, L->v_cache, L->kind, L->k_scales, L->v_scales, L->cache_blocks,
                                      L->block_tables, L->table_width, L->context_lens, m, L->q_heads, L->kv_heads,
                                      L->head_dim, L->block_size, L->scale, attended, L->threads)))
        goto done;
    /* the attention output's projection lands in `out`, free until the MLP writes it */
    if ((status = projection(L, 1, H, q_width, attended, out))) goto done;
    zq_rms_norm(out, residual_out, L->norm2, L->eps, m, H, normed, residual_out);
    if ((status = projection(L, 2, 2 * I, H, normed, gate_up))) goto done;
    zq_silu_and_mul(gate_up, m, I, act);
    status = projection(L, 3, H, I, act, out);
done:
    free(scratch);
    return status;
}
