/*
 * zerospeed's int8 x float kernels for weight-only quantized linears on the CPU.
 *
 * Weights are int8 ``q[N, K]`` (row n = output feature n) with one fp32 scale per group of
 * ``group`` consecutive input elements, ``s[N, ceil(K / group)]`` (the last group may be shorter).
 * The dequantized weight is ``q[n, k] * s[n, k / group]`` rounded once to fp32, the same product the
 * PyTorch fallback forms; ``dequantize`` writes exactly those fp32 rows for callers that hand large M
 * (prefill) to an sgemm, so that path and the fallback give identical results.
 *
 * ``int8_linear`` computes ``y[M, N] = x[M, K] W^T (+ bias)`` directly for a few rows of x (decode), where
 * the work is bound by reading the weights: reading 1 byte per weight instead of 4 is the speed-up. It
 * sums ``q x`` over a group (q converted to fp32 exactly) and scales the sum once, ``sum(q x) s``: the
 * same value as ``sum((q s) x)`` up to rounding, one multiply fewer per weight.
 * Both take raw addresses (contiguous tensors), release the GIL and split the output rows over
 * ``threads`` OpenMP threads (the OpenMP runtime is the one torch loaded: same soname). Built when the
 * package is installed, never at run time; AVX2+FMA intrinsics when the build machine has them,
 * portable C otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ZS_AVX2 1
#endif

#define PTR(x) ((void *)(uintptr_t)(x))
#define MR_MAX 4 /* rows of x handled together: each weight row is read once per 4 rows of x */

/* Dot products of one weight row with ``mr`` rows of x, scale applied per group, written as
 * y[i * ldy] for i < mr (plus bias). */
static inline __attribute__((always_inline)) void row_dots(const float *restrict x, int64_t ldx, int mr,
                     const int8_t *restrict q, const float *restrict s, int64_t K, int64_t group, float bias,
                     float *restrict y, int64_t ldy) {
    /* Per group, the integer weights (converted to fp32, exact) are dotted with x in 2-4 independent
     * chains per row of x; the group's sum is then scaled once: q * (x . 1) * s = sum(q x) * s. */
    float tail[MR_MAX] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef ZS_AVX2
    __m256 tot[MR_MAX];
    for (int i = 0; i < MR_MAX; i++) tot[i] = _mm256_setzero_ps();
#else
    float acc[MR_MAX][8];
    memset(acc, 0, sizeof acc);
#endif
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, gi++) {
        int64_t end = g0 + group < K ? g0 + group : K;
        float scale = s[gi];
        int64_t k = g0;
#ifdef ZS_AVX2
        __m256 a0[MR_MAX], a1[MR_MAX], a2[MR_MAX], a3[MR_MAX];
        for (int i = 0; i < MR_MAX; i++) a0[i] = a1[i] = a2[i] = a3[i] = _mm256_setzero_ps();
        if (mr <= 2)
            for (; k + 32 <= end; k += 32) {
                __m128i lo = _mm_loadu_si128((const __m128i *)(q + k));
                __m128i hi = _mm_loadu_si128((const __m128i *)(q + k + 16));
                __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
                __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
                __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
                __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
                for (int i = 0; i < mr; i++) {
                    const float *xi = x + i * ldx + k;
                    a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), a0[i]);
                    a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), a1[i]);
                    a2[i] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xi + 16), a2[i]);
                    a3[i] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xi + 24), a3[i]);
                }
            }
        for (; k + 16 <= end; k += 16) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(q + k));
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
            __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
            for (int i = 0; i < mr; i++) {
                a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * ldx + k), a0[i]);
                a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * ldx + k + 8), a1[i]);
            }
        }
        for (; k + 8 <= end; k += 8) {
            __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + k))));
            for (int i = 0; i < mr; i++) a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * ldx + k), a0[i]);
        }
        __m256 vs = _mm256_set1_ps(scale);
        for (int i = 0; i < mr; i++)
            tot[i] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_add_ps(a0[i], a1[i]), _mm256_add_ps(a2[i], a3[i])), vs, tot[i]);
#else
        for (; k + 8 <= end; k += 8) {
            float w[8];
            for (int l = 0; l < 8; l++) w[l] = (float)q[k + l] * scale;
            for (int i = 0; i < mr; i++)
                for (int l = 0; l < 8; l++) acc[i][l] += w[l] * x[i * ldx + k + l];
        }
#endif
        for (; k < end; k++) {
            float w = (float)q[k] * scale;
            for (int i = 0; i < mr; i++) tail[i] += w * x[i * ldx + k];
        }
    }
    for (int i = 0; i < mr; i++) {
#ifdef ZS_AVX2
        __m256 v = tot[i];
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        float total = _mm_cvtss_f32(h);
#else
        float total = 0.0f;
        for (int l = 0; l < 8; l++) total += acc[i][l];
#endif
        y[i * ldy] = total + tail[i] + bias;
    }
}

static void linear_kernel(const float *x, int64_t M, int64_t K, const int8_t *q, const float *s, int64_t G,
                          int64_t group, const float *bias, float *y, int64_t N, int threads) {
    /* Output rows of W are split over the threads in blocks (each thread streams its own weights). */
    int64_t blocks = (N + 15) / 16;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n_end = (b + 1) * 16 < N ? (b + 1) * 16 : N;
        for (int64_t n = b * 16; n < n_end; n++) {
            for (int64_t m = 0; m < M; m += MR_MAX) {
                const float *xm = x + m * K, *sn = s + n * G;
                const int8_t *qn = q + n * K;
                float b0 = bias ? bias[n] : 0.0f, *ym = y + m * N + n;
                switch (M - m < MR_MAX ? M - m : MR_MAX) { /* constant mr: accumulators stay in registers */
                case 1: row_dots(xm, K, 1, qn, sn, K, group, b0, ym, N); break;
                case 2: row_dots(xm, K, 2, qn, sn, K, group, b0, ym, N); break;
                case 3: row_dots(xm, K, 3, qn, sn, K, group, b0, ym, N); break;
                default: row_dots(xm, K, 4, qn, sn, K, group, b0, ym, N); break;
                }
            }
        }
    }
}

static void dequantize_kernel(const int8_t *q, const float *s, int64_t rows, int64_t K, int64_t G, int64_t group,
                              float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n = 0; n < rows; n++) {
        const int8_t *qr = q + n * K;
        float *o = out + n * K;
        for (int64_t g0 = 0, gi = 0; g0 < K; g0 += group, gi++) {
            int64_t end = g0 + group < K ? g0 + group : K;
            float scale = s[n * G + gi];
            int64_t k = g0;
#ifdef ZS_AVX2
            __m256 vs = _mm256_set1_ps(scale);
            for (; k + 8 <= end; k += 8)
                _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                          _mm_loadl_epi64((const __m128i *)(qr + k)))), vs));
#endif
            for (; k < end; k++) o[k] = (float)qr[k] * scale;
        }
    }
}

static PyObject *py_int8_linear(PyObject *self, PyObject *args) {
    unsigned long long x, q, s, bias, y;
    long long M, K, G, group, N;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKKLLKKLi", &x, &M, &K, &q, &s, &G, &group, &bias, &y, &N, &threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    linear_kernel(PTR(x), M, K, PTR(q), PTR(s), G, group, PTR(bias), PTR(y), N, threads < 1 ? 1 : threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    unsigned long long q, s, out;
    long long rows, K, G, group;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLLLKi", &q, &s, &rows, &K, &G, &group, &out, &threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    dequantize_kernel(PTR(q), PTR(s), rows, K, G, group, PTR(out), threads < 1 ? 1 : threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_features(PyObject *self, PyObject *args) {
    (void)args;
#ifdef ZS_AVX2
    const char *isa = "avx2+fma";
#else
    const char *isa = "portable C";
#endif
#ifdef _OPENMP
    return Py_BuildValue("(si)", isa, 1);
#else
    return Py_BuildValue("(si)", isa, 0);
#endif
}

static PyMethodDef methods[] = {
    {"int8_linear", py_int8_linear, METH_VARARGS, "int8_linear(x, M, K, q, s, G, group, bias, y, N, threads)"},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(q, s, rows, K, G, group, out, threads)"},
    {"features", py_features, METH_NOARGS, "features() -> (instruction set, built with OpenMP)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8_gemm", "zerospeed int8 x float kernels", -1,
                                    methods};

PyMODINIT_FUNC PyInit__int8_gemm(void) { return PyModule_Create(&module); }
