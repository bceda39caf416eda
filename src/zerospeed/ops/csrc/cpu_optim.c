/*
 * zerospeed's CPU optimizer kernels: Adam/AdamW, Adagrad and Lion over fp32 arrays, updating the
 * master weights and states and writing the low-precision (bf16/fp16) copy of the parameter in the
 * same pass over memory. Built when the package is installed (never at run time); the functions
 * take raw addresses and release the GIL, so Python threads run them on disjoint chunks in parallel.
 * The arithmetic follows torch.optim's order of operations, so results match it to rounding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

enum { OUT_NONE = 0, OUT_BF16 = 1, OUT_FP16 = 2, OUT_FP32 = 3 };

static inline uint16_t to_bf16(float value) {
    /* round to nearest even; NaN stays a (quiet) NaN. Branch-free, so the loops vectorize it. */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (bits >> 16) | 0x40u;
    return (uint16_t)(((bits & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

#define FP16_BLOCK 64

/* Convert a block of floats to fp16 (round to nearest even): F16C instructions when the build
 * machine has them (GCC does not vectorize _Float16 casts without AVX512-FP16), else scalar. */
static inline void store_fp16(_Float16 *restrict dst, const float *restrict src, int64_t count) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= count; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < count; i++) dst[i] = (_Float16)src[i];
}

static inline void store_out(void *out, int kind, int64_t i, float value) {
    switch (kind) {
    case OUT_BF16: ((uint16_t *)out)[i] = to_bf16(value); break;
    case OUT_FP16: ((_Float16 *)out)[i] = (_Float16)value; break;
    case OUT_FP32: ((float *)out)[i] = value; break;
    default: break;
    }
}

/* One Adam/AdamW step over n elements (torch.optim.Adam / AdamW, amsgrad=False). */
static void adam_kernel(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                        void *out, int kind, int64_t n, float one_minus_beta1, float beta2,
                        float one_minus_beta2, float eps, float weight_decay, int adamw, float decay_factor,
                        float step_size, float bias_correction2_sqrt) {
    /* 1 - beta arrive computed in double and rounded once, as torch.optim computes them */
#define ADAM_RANGE(LO, HI, STORE)                                                          \
    for (int64_t i = (LO); i < (HI); i++) {                                                \
        float grad = g[i], param = p[i];                                                   \
        if (adamw) param = param * decay_factor;                                           \
        else grad = fmaf(param, weight_decay, grad);   /* torch's add(alpha=) is an FMA */ \
        float avg = fmaf(one_minus_beta1, grad - m[i], m[i]); /* torch's lerp_ */           \
        float decayed_sq = v[i] * beta2;                                                   \
        float avg_sq = decayed_sq + one_minus_beta2 * grad * grad;                         \
        float denom = sqrtf(avg_sq) / bias_correction2_sqrt + eps;                         \
        param = param + (-step_size) * (avg / denom);                                      \
        m[i] = avg;                                                                        \
        v[i] = avg_sq;                                                                     \
        p[i] = param;                                                                      \
        STORE;                                                                             \
    }
    switch (kind) {
    case OUT_BF16: { uint16_t *restrict o = out; ADAM_RANGE(0, n, o[i] = to_bf16(param)) break; }
    case OUT_FP16: { /* blocks: the update vectorizes into a buffer, then one fp16 conversion */
        _Float16 *restrict o = out;
        float block[FP16_BLOCK] __attribute__((aligned(64)));
        for (int64_t base = 0; base < n; base += FP16_BLOCK) {
            int64_t end = base + FP16_BLOCK < n ? base + FP16_BLOCK : n;
            ADAM_RANGE(base, end, block[i - base] = param)
            store_fp16(o + base, block, end - base);
        }
        break;
    }
    case OUT_FP32: { float *restrict o = out; ADAM_RANGE(0, n, o[i] = param) break; }
    default: ADAM_RANGE(0, n, (void)0) break;
    }
#undef ADAM_RANGE
}

/* One Adagrad step (torch.optim.Adagrad with lr_decay folded into clr by the caller). */
static void adagrad_kernel(float *restrict p, const float *restrict g, float *restrict s, void *out, int kind,
                           int64_t n, float clr, float eps, float weight_decay) {
    for (int64_t i = 0; i < n; i++) {
        float grad = g[i], param = p[i];
        if (weight_decay != 0.0f) grad = fmaf(param, weight_decay, grad); /* torch's add(alpha=) */
        float sum = s[i] + grad * grad;
        float std = sqrtf(sum) + eps;
        param = param + (-clr) * (grad / std);
        s[i] = sum;
        p[i] = param;
        store_out(out, kind, i, param);
    }
}

/* One Lion step (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2). */
static void lion_kernel(float *restrict p, const float *restrict g, float *restrict m, void *out, int kind,
                        int64_t n, float lr, float beta1, float one_minus_beta1, float beta2,
                        float one_minus_beta2, float decay_factor) {
    for (int64_t i = 0; i < n; i++) {
        float grad = g[i], avg = m[i];
        float c = avg * beta1 + grad * one_minus_beta1;
        float update = (c > 0.0f) ? 1.0f : ((c < 0.0f) ? -1.0f : 0.0f);
        float param = p[i] * decay_factor - lr * update;
        m[i] = fmaf(grad, one_minus_beta2, avg * beta2); /* torch's add_(alpha=) is an FMA */
        p[i] = param;
        store_out(out, kind, i, param);
    }
}

#define PTR(x) ((void *)(uintptr_t)(x))

static PyObject *py_adam(PyObject *self, PyObject *args) {
    unsigned long long p, g, m, v, out;
    int kind, adamw;
    long long n;
    float omb1, beta2, omb2, eps, wd, decay, step_size, bc2;
    if (!PyArg_ParseTuple(args, "KKKKKiLffffffiff", &p, &g, &m, &v, &out, &kind, &n, &omb1, &beta2, &omb2, &eps,
                          &wd, &decay, &adamw, &step_size, &bc2))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    adam_kernel(PTR(p), PTR(g), PTR(m), PTR(v), PTR(out), kind, n, omb1, beta2, omb2, eps, wd, adamw, decay,
                step_size, bc2);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_adagrad(PyObject *self, PyObject *args) {
    unsigned long long p, g, s, out;
    int kind;
    long long n;
    float clr, eps, wd;
    if (!PyArg_ParseTuple(args, "KKKKiLfff", &p, &g, &s, &out, &kind, &n, &clr, &eps, &wd)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    adagrad_kernel(PTR(p), PTR(g), PTR(s), PTR(out), kind, n, clr, eps, wd);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_lion(PyObject *self, PyObject *args) {
    unsigned long long p, g, m, out;
    int kind;
    long long n;
    float lr, beta1, omb1, beta2, omb2, decay;
    if (!PyArg_ParseTuple(args, "KKKKiLffffff", &p, &g, &m, &out, &kind, &n, &lr, &beta1, &omb1, &beta2, &omb2,
                          &decay))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    lion_kernel(PTR(p), PTR(g), PTR(m), PTR(out), kind, n, lr, beta1, omb1, beta2, omb2, decay);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"adam", py_adam, METH_VARARGS, "adam(p, g, m, v, out, kind, n, 1-b1, b2, 1-b2, eps, wd, decay, adamw, step_size, bc2_sqrt)"},
    {"adagrad", py_adagrad, METH_VARARGS, "adagrad(p, g, sum, out, kind, n, clr, eps, wd)"},
    {"lion", py_lion, METH_VARARGS, "lion(p, g, m, out, kind, n, lr, b1, 1-b1, b2, 1-b2, decay)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_optim", "zerospeed CPU optimizer kernels", -1,
                                    methods};

PyMODINIT_FUNC PyInit__cpu_optim(void) { return PyModule_Create(&module); }
