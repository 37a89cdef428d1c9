/* float16 <-> float32 conversion of contiguous arrays for the CPU device's casts.
 *
 * NumPy converts float16 one element at a time here (about 2-3 ns an element, 15-20x a float32
 * add of the same array, measured on an AMD EPYC); the "compute in float32, store in half" rule
 * of backends/base.py converts every operand of every op, so that cost decides whether half
 * storage is worth having on the CPU. Where the CPU has F16C (every x86-64 CPU since about 2012,
 * asked at run time), the conversion runs on VCVTPH2PS / VCVTPS2PH, eight elements at a time,
 * rounding to nearest even; elsewhere on a portable scalar loop with the same results. Both give
 * NumPy's bits for every value except NaN payloads (a NaN stays a NaN of the same sign).
 *
 * widen(src, dst): float16 -> float32; narrow(src, dst): float32 -> float16; widen_bf16 and
 * narrow_bf16 the same for bfloat16 (ml_dtypes converts at 2.5 and 8.7 us for 16K items here,
 * these at about 1). Each argument is a C-contiguous buffer (a NumPy array), dst writable,
 * both of the same number of elements; anything else is a TypeError or ValueError, before
 * anything is written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

static int use_f16c = 0;

static float
scalar_widen(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {                       /* inf, NaN */
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp != 0) {                   /* normal */
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {                   /* zero */
        bits = sign;
    } else {                                 /* subnormal: normalise */
        int shift = 0;
        while (!(man & 0x400)) {
            man <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static uint16_t
scalar_narrow(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t abs = x & 0x7fffffff;
    if (abs > 0x7f800000) {                  /* NaN: quiet, keep the payload's top bits */
        return (uint16_t)(sign | 0x7e00 | ((abs >> 13) & 0x3ff));
    }
    if (abs >= 0x477ff000) {                 /* rounds to 65520 or more: infinity */
        return (uint16_t)(sign | 0x7c00);
    }
    if (abs < 0x38800000) {                  /* below 2**-14: subnormal half (or zero) */
        if (abs < 0x33000000) {              /* at most 2**-25: rounds to zero */
            return sign;
        }
        uint32_t man = (abs & 0x7fffff) | 0x800000;
        int shift = 126 - (int)(abs >> 23);  /* 14 .. 24 */
        uint32_t half = man >> shift;
        uint32_t rest = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) {
            half++;
        }
        return (uint16_t)(sign | half);
    }
    uint32_t rounded = abs - 0x38000000;     /* rebias the exponent 127 -> 15, in place */
    rounded += 0xfff + ((rounded >> 13) & 1);  /* round to nearest even at bit 13 */
    return (uint16_t)(sign | (rounded >> 13));
}

#if HAVE_X86
__attribute__((target("avx,f16c"))) static void
f16c_widen(const uint16_t *src, float *dst, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++) {
        dst[i] = scalar_widen(src[i]);
    }
}

__attribute__((target("avx,f16c"))) static void
f16c_narrow(const float *src, uint16_t *dst, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_loadu_ps(src + i);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) {
        dst[i] = scalar_narrow(src[i]);
    }
}
#endif

/* One conversion loop: n items of src into dst. */
typedef void (*loop_fn)(const void *src, void *dst, Py_ssize_t n);

static int use_avx2 = 0;

static void
widen_loop(const void *src, void *dst, Py_ssize_t n)
{
    const uint16_t *s = src;
    float *d = dst;
#if HAVE_X86
    if (use_f16c) {
        f16c_widen(s, d, n);
        return;
    }
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        d[i] = scalar_widen(s[i]);
    }
}

static void
narrow_loop(const void *src, void *dst, Py_ssize_t n)
{
    const float *s = src;
    uint16_t *d = dst;
#if HAVE_X86
    if (use_f16c) {
        f16c_narrow(s, d, n);
        return;
    }
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        d[i] = scalar_narrow(s[i]);
    }
}

/* bfloat16 is a float's upper 16 bits: widening shifts them back; narrowing rounds to nearest
 * even on bit 16, and a NaN keeps its sign and upper payload with the quiet bit set. */
static void
widen_bf16_loop(const void *src, void *dst, Py_ssize_t n)
{
    const uint16_t *s = src;
    uint32_t *d = dst;
    for (Py_ssize_t i = 0; i < n; i++) {
        d[i] = (uint32_t)s[i] << 16;
    }
}

static inline uint16_t
scalar_narrow_bf16(uint32_t u)
{
    uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    uint32_t nan = (u >> 16) | 0x40;
    return (uint16_t)((u & 0x7fffffff) > 0x7f800000 ? nan : rounded);
}

#if HAVE_X86
__attribute__((target("avx2"), optimize("O3"))) static void
narrow_bf16_avx2(const uint32_t *s, uint16_t *d, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {  /* scalar_narrow_bf16, inlined and vectorised */
        d[i] = scalar_narrow_bf16(s[i]);
    }
}
#endif

static void
narrow_bf16_loop(const void *src, void *dst, Py_ssize_t n)
{
    const uint32_t *s = src;
    uint16_t *d = dst;
#if HAVE_X86
    if (use_avx2) {
        narrow_bf16_avx2(s, d, n);
        return;
    }
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        d[i] = scalar_narrow_bf16(s[i]);
    }
}

/* name(src, dst): checks the two buffers (C-contiguous, item sizes `src_item` and `dst_item`,
 * the same count, dst writable) before writing anything, then runs `loop` without the GIL. */
static PyObject *
convert(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t src_item, Py_ssize_t dst_item,
        const char *name, loop_fn loop)
{
    Py_buffer src, dst;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(src, dst) takes 2 arguments, got %zd", name, nargs);
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t n = src.len / src_item;
    if (src.len % src_item || dst.len % dst_item || n != dst.len / dst_item) {
        PyErr_Format(PyExc_ValueError, "%s: src has %zd bytes and dst %zd: not the same "
                     "number of %zd-byte and %zd-byte items", name, src.len, dst.len,
                     src_item, dst_item);
    } else {
        Py_BEGIN_ALLOW_THREADS
        loop(src.buf, dst.buf, n);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
widen(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return convert(args, nargs, 2, 4, "widen", widen_loop);
}

static PyObject *
narrow(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return convert(args, nargs, 4, 2, "narrow", narrow_loop);
}

static PyObject *
widen_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return convert(args, nargs, 2, 4, "widen_bf16", widen_bf16_loop);
}

static PyObject *
narrow_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return convert(args, nargs, 4, 2, "narrow_bf16", narrow_bf16_loop);
}

/* set_f16c(flag): use F16C (and AVX2 for bfloat16) when flag and the CPU has them (the tests
 * compare both paths);
 * returns whether it is used now. */
static PyObject *
set_f16c(PyObject *self, PyObject *flag)
{
    int want = PyObject_IsTrue(flag);
    if (want < 0) {
        return NULL;
    }
#if HAVE_X86
    use_f16c = want && __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    use_avx2 = want && __builtin_cpu_supports("avx2");
#else
    use_f16c = 0;
#endif
    return PyBool_FromLong(use_f16c);
}

static PyMethodDef methods[] = {
    {"widen", (PyCFunction)(void (*)(void))widen, METH_FASTCALL,
     "widen(src, dst): float16 items of src as float32 into dst (contiguous buffers)."},
    {"narrow", (PyCFunction)(void (*)(void))narrow, METH_FASTCALL,
     "narrow(src, dst): float32 items of src rounded to nearest even float16 into dst."},
    {"widen_bf16", (PyCFunction)(void (*)(void))widen_bf16, METH_FASTCALL,
     "widen_bf16(src, dst): bfloat16 items of src (as uint16) as float32 into dst."},
    {"narrow_bf16", (PyCFunction)(void (*)(void))narrow_bf16, METH_FASTCALL,
     "narrow_bf16(src, dst): float32 items of src rounded to nearest even bfloat16 into dst."},
    {"set_f16c", set_f16c, METH_O,
     "set_f16c(flag): use the CPU's F16C instructions when flag and present; returns whether "
     "they are used."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_halfconv",
    "float16 <-> float32 conversion of contiguous buffers (F16C where the CPU has it).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__halfconv(void)
{
#if HAVE_X86
    __builtin_cpu_init();
    use_f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
