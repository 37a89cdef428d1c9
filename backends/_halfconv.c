/* float16 and bfloat16 <-> float32 conversion for the CPU device's casts, and its arithmetic
 * kernels on half operands (`apply`, below).
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
 * anything is written. apply(code, bf16, out, a[, b]) runs one elementwise kernel on any
 * layout, computing in float32 and rounding once (it says below how). sub_scaled(kind, out, a,
 * b, scale), an optimizer's update out = a - scale * b in one pass, takes every float dtype;
 * float_op(code, kind, out, a[, b]) runs an op (b a bias row too) and sum_rows(kind, out, a)
 * the sum over rows on contiguous float32 and float64 arrays, vectorised loops, with NumPy's
 * bits. Every op's code and loops come from backends/optable.py through the header
 * _optable.h, generated as the extension is built: `ops` names the op of each code.
 * erf_op(kind, out, a) is the CPU's erf (C's, in double; float32 through the polynomials of
 * _erf_table.h with C's bits), gelu_op(kind, out, x[, g, e]) its exact GELU and GELU's
 * gradient in one pass, max_rows(kind, out, a) its maximum over a last axis (NumPy's bits
 * where the maximum is neither NaN nor zero), max_pool and max_pool_backward its max pooling
 * (PyTorch's scan and indices; `numpy_max_pool2d` in backends/base.py is their twin).
 *
 * Most kernels split their work over one pool of threads (backends/_pool.h; Note [one pool for
 * kernels and products] in backends/threads.py), by rows, channels, planes or tiles, with the
 * bits of one thread: threads(n) and tuning(spin_ns, grain) set it, blas_pool(setter, on)
 * hands it OpenBLAS's jobs. set_loop takes NumPy's own exp, log, tanh and add loops (their
 * bits checked by backends/numpy.py), which the chains, gelu_op's gradient and
 * sum_last(kind, out, x), the sum over a contiguous last axis, call from C.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

#include <stdio.h>
#include "_pool.h"

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
/* the erf core's AVX-512 loop (`erf_block`): set_avx512 */
static int use_avx512 = 0;

#if HAVE_X86
/* Whether the CPU has the AVX-512 subsets the erf core's loop is compiled for (ERF_AVX512). */
static int
have_avx512(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#endif

/* The loop NAME (sub_scaled's, float_op's, ...) for T (SUFFIX f32 or f64): the AVX2 variant
 * where the CPU has it. FLOAT_VARIANTS(LOOP) instantiates a loop macro LOOP(T, SUFFIX, ATTR)
 * for each variant PICK chooses among. */
#if HAVE_X86
#define PICK(NAME, SUFFIX) (use_avx2 ? NAME##_##SUFFIX##_avx2 : NAME##_##SUFFIX)
#define FLOAT_VARIANTS(LOOP)                                                                  \
    LOOP(float, f32, )                                                                       \
    LOOP(double, f64, )                                                                      \
    LOOP(float, f32_avx2, __attribute__((target("avx2"))))                                   \
    LOOP(double, f64_avx2, __attribute__((target("avx2"))))
#else
#define PICK(NAME, SUFFIX) NAME##_##SUFFIX
#define FLOAT_VARIANTS(LOOP) LOOP(float, f32, ) LOOP(double, f64, )
#endif

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

static inline uint16_t
scalar_narrow_bf16(uint32_t u)
{
    uint32_t rounded = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
    uint32_t nan = (u >> 16) | 0x40;
    return (uint16_t)((u & 0x7fffffff) > 0x7f800000 ? nan : rounded);
}

#if HAVE_X86
/* scalar_narrow_bf16 on sixteen items at a time; the same bits. A NaN is rare: the quiet
 * NaNs are blended in only where a block holds one. */
__attribute__((target("avx2"))) static void
narrow_bf16_avx2(const uint32_t *s, uint16_t *d, Py_ssize_t n)
{
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x400000);
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i u0 = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i u1 = _mm256_loadu_si256((const __m256i *)(s + i + 8));
        /* NaN: |u| > inf as signed integers (|u| < 2**31) */
        __m256i nan0 = _mm256_cmpgt_epi32(_mm256_and_si256(u0, abs_mask), inf);
        __m256i nan1 = _mm256_cmpgt_epi32(_mm256_and_si256(u1, abs_mask), inf);
        __m256i r0 = _mm256_add_epi32(_mm256_add_epi32(u0, bias),
                                      _mm256_and_si256(_mm256_srli_epi32(u0, 16), one));
        __m256i r1 = _mm256_add_epi32(_mm256_add_epi32(u1, bias),
                                      _mm256_and_si256(_mm256_srli_epi32(u1, 16), one));
        __m256i any = _mm256_or_si256(nan0, nan1);
        if (!_mm256_testz_si256(any, any)) {
            r0 = _mm256_blendv_epi8(r0, _mm256_or_si256(u0, quiet), nan0);
            r1 = _mm256_blendv_epi8(r1, _mm256_or_si256(u1, quiet), nan1);
        }
        /* the upper halves, each below 2**16, packed in order */
        __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(r0, 16),
                                             _mm256_srli_epi32(r1, 16));
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_permute4x64_epi64(packed, 0xd8));
    }
    for (; i < n; i++) {
        d[i] = scalar_narrow_bf16(s[i]);
    }
}

/* bfloat16 -> float32 eight items at a time: zero-extend and shift. */
__attribute__((target("avx2"))) static void
widen_bf16_avx2(const uint16_t *s, uint32_t *d, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
        _mm256_storeu_si256((__m256i *)(d + i), _mm256_slli_epi32(u, 16));
    }
    for (; i < n; i++) {
        d[i] = (uint32_t)s[i] << 16;
    }
}
#endif

static void
widen_bf16_loop(const void *src, void *dst, Py_ssize_t n)
{
    const uint16_t *s = src;
    uint32_t *d = dst;
#if HAVE_X86
    if (use_avx2) {
        widen_bf16_avx2(s, d, n);
        return;
    }
#endif
    for (Py_ssize_t i = 0; i < n; i++) {
        d[i] = (uint32_t)s[i] << 16;
    }
}

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
    use_avx512 = want && have_avx512();
#else
    use_f16c = 0;
#endif
    return PyBool_FromLong(use_f16c);
}

/* set_avx512(flag): the erf core's AVX-512F loop when flag and the CPU has it, else its AVX2
 * one where set_f16c left AVX2 on (the tests compare the paths); returns whether it is used. */
static PyObject *
set_avx512(PyObject *self, PyObject *flag)
{
    int want = PyObject_IsTrue(flag);
    if (want < 0) {
        return NULL;
    }
#if HAVE_X86
    use_avx512 = want && use_avx2 && have_avx512();
#endif
    return PyBool_FromLong(use_avx512);
}

/* ------------------------------------------------------------------ elementwise in float32
 *
 * apply(code, bf16, out, a[, b]): one elementwise op under Note [two-byte floats compute in
 * float32] in backends/base.py, without float32 arrays in between. out and each array operand are
 * buffers of any byte strides, of two-byte items (float16, or bfloat16 where `bf16`) or float32
 * items; an operand broadcasts to out's shape as in NumPy (a zero stride, a missing or length-1
 * dimension); a number operand is a Python float, or a 0-d float32 buffer (a NumPy float32). A row
 * of contiguous halves (numbers and broadcast rows too) takes the vector path where the CPU has
 * one: eight elements widened into registers, the formula's operations one intrinsic each, the
 * result rounded into out. Any other layout is taken in chunks: each operand's chunk is widened
 * into a float32 block, the op runs on the blocks as NumPy's float32 kernels run it, one IEEE
 * single operation per pass (so no compiler contracts a product and a sum into one rounding), and
 * the result block is rounded to out's dtype once. The code `COPY` is a plain conversion (widen or
 * narrow any layout). Returns False, having written nothing, when it cannot take the call (a
 * layout or operand it does not handle: the caller computes another way); raises only for a wrong
 * argument count or an unknown code. */
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

/* The op codes (OP_<NAME>, in the table's order), their arities and names, and each op's
 * loops: Note [one declaration per op] in backends/optable.py. */
#include "_optable.h"
OPTABLE_LOOP(float, sqrtf, fabsf, f32, )
OPTABLE_LOOP(double, sqrt, fabs, f64, )
#if HAVE_X86
OPTABLE_LOOP(float, sqrtf, fabsf, f32_avx2, __attribute__((target("avx2"))))
OPTABLE_LOOP(double, sqrt, fabs, f64_avx2, __attribute__((target("avx2"))))
#endif

#define CHUNK 512
#define MAX_DIMS 32

typedef struct {
    Py_buffer view;
    int held;            /* view holds a buffer to release */
    int is_number;
    float number;
    Py_ssize_t itemsize;  /* 2 or 4 */
    Py_ssize_t strides[MAX_DIMS];
    char *ptr;
} operand;

/* Widen n items at p (stride in bytes) into dst. */
static void
load(const operand *o, const char *p, Py_ssize_t stride, Py_ssize_t n, int bf16, float *dst)
{
    if (o->itemsize == 4) {
        if (stride == 4) {
            memcpy(dst, p, (size_t)n * 4);
        } else {
            for (Py_ssize_t i = 0; i < n; i++) {
                memcpy(dst + i, p + i * stride, 4);
            }
        }
        return;
    }
    if (stride == 2) {
        (bf16 ? widen_bf16_loop : widen_loop)(p, dst, n);
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, p + i * stride, 2);
        if (bf16) {
            uint32_t bits = (uint32_t)h << 16;
            memcpy(dst + i, &bits, 4);
        } else {
            dst[i] = scalar_widen(h);
        }
    }
}

/* Round n floats of src to out's item type into p (stride in bytes). */
static void
store(const float *src, char *p, Py_ssize_t stride, Py_ssize_t n, Py_ssize_t itemsize, int bf16)
{
    if (itemsize == 4) {
        if (stride == 4) {
            memcpy(p, src, (size_t)n * 4);
        } else {
            for (Py_ssize_t i = 0; i < n; i++) {
                memcpy(p + i * stride, src + i, 4);
            }
        }
        return;
    }
    if (stride == 2) {
        (bf16 ? narrow_bf16_loop : narrow_loop)(src, p, n);
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t h;
        if (bf16) {
            uint32_t bits;
            memcpy(&bits, src + i, 4);
            h = scalar_narrow_bf16(bits);
        } else {
            h = scalar_narrow(src[i]);
        }
        memcpy(p + i * stride, &h, 2);
    }
}

/* r = op(a, b) on float32 blocks, one IEEE operation per loop, in the order of the op's
 * formula (`optable_f32`, generated from backends/optable.py). */
static void
compute(int code, const float *a, const float *b, float *r, Py_ssize_t n)
{
    optable_f32(code, r, a, b, 1, n, 0);
}

#if HAVE_X86
/* The vector path of a row whose half operands and out are contiguous: eight elements widened
 * into registers, the same IEEE operations as `compute` (one intrinsic each: no target here
 * has FMA, so none is contracted), rounded into out. Operands are pointers, or NULL for the
 * number in `num`. Returns how many leading elements it did (a multiple of eight). */
#define ROW_BODY(LOAD, STORE)                                                                \
    const __m256 na = _mm256_set1_ps(num[0]), nb = _mm256_set1_ps(num[1]);                  \
    Py_ssize_t i = 0;                                                                        \
    for (; i + 8 <= n; i += 8) {                                                             \
        __m256 va = a ? LOAD(a + i) : na, vb = b ? LOAD(b + i) : nb, r;                      \
        switch (code) {                                                                      \
        OPTABLE_ROW_CASES                                                                    \
        default: return 0;                                                                   \
        }                                                                                    \
        STORE(out + i, r);                                                                   \
    }                                                                                        \
    return i;

__attribute__((target("avx,f16c"))) static inline __m256
load_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

__attribute__((target("avx,f16c"))) static inline void
store_f16(uint16_t *p, __m256 r)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("avx2"))) static inline __m256
load_bf16(const uint16_t *p)
{
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

__attribute__((target("avx2"))) static inline void
store_bf16(uint16_t *p, __m256 r)  /* scalar_narrow_bf16 on eight items */
{
    __m256i u = _mm256_castps_si256(r);
    __m256i rounded = _mm256_add_epi32(
        _mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(rounded, 16), _mm256_setzero_si256());
    packed = _mm256_permute4x64_epi64(packed, 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

__attribute__((target("avx,f16c"))) static Py_ssize_t
row_f16(int code, const uint16_t *a, const uint16_t *b, const float *num, uint16_t *out,
        Py_ssize_t n)
{
    ROW_BODY(load_f16, store_f16)
}

__attribute__((target("avx2"))) static Py_ssize_t
row_bf16(int code, const uint16_t *a, const uint16_t *b, const float *num, uint16_t *out,
         Py_ssize_t n)
{
    ROW_BODY(load_bf16, store_bf16)
}
#undef ROW_BODY
#endif

/* Take an operand: 0 on success, 1 when apply cannot take it (nothing raised); o->held says
 * whether a buffer is to be released either way. */
static int
take(PyObject *obj, operand *o, Py_ssize_t ndim, const Py_ssize_t *shape)
{
    o->held = 0;
    o->is_number = 0;
    if (PyFloat_CheckExact(obj)) {
        double d = PyFloat_AsDouble(obj);
        if (d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        o->is_number = 1;
        o->number = (float)d;  /* NumPy casts a Python number to float32 the same way */
        return 0;
    }
    if (PyObject_GetBuffer(obj, &o->view, PyBUF_STRIDES) < 0) {
        PyErr_Clear();
        return 1;
    }
    o->held = 1;
    if (o->view.ndim == 0 && o->view.itemsize == 4 && ndim != 0) {
        /* a float32 number (NumPy's scalar); a 0-d operand of a 0-d out is an array */
        memcpy(&o->number, o->view.buf, 4);
        o->is_number = 1;
        return 0;
    }
    Py_ssize_t lead = ndim - o->view.ndim;  /* NumPy's broadcasting: aligned on the right */
    if ((o->view.itemsize != 2 && o->view.itemsize != 4) || lead < 0) {
        return 1;
    }
    for (Py_ssize_t d = 0; d < ndim; d++) {
        Py_ssize_t n = d < lead ? 1 : o->view.shape[d - lead];
        if (n != shape[d] && n != 1) {
            return 1;
        }
        o->strides[d] = n == shape[d] && d >= lead ? o->view.strides[d - lead] : 0;
    }
    o->itemsize = o->view.itemsize;
    o->ptr = o->view.buf;
    return 0;
}

static PyObject *
apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_Format(PyExc_TypeError, "apply(code, bf16, out, a[, b]) takes 4 or 5 arguments, "
                     "got %zd", nargs);
        return NULL;
    }
    long code = PyLong_AsLong(args[0]);
    if (code == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (code < 0 || code >= OP_COUNT || op_arity[code] != nargs - 3) {
        PyErr_Format(PyExc_ValueError, "apply: code %ld with %zd operand(s) names no kernel",
                     code, nargs - 3);
        return NULL;
    }
    int bf16 = PyObject_IsTrue(args[1]);
    if (bf16 < 0) {
        return NULL;
    }
    Py_buffer outv;
    if (PyObject_GetBuffer(args[2], &outv, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) {
        PyErr_Clear();  /* read-only or not an array: the caller's own path says why */
        Py_RETURN_FALSE;
    }
    Py_ssize_t ndim = outv.ndim;
    operand ops[2];
    int nops = (int)(nargs - 3), refuse = ndim > MAX_DIMS
        || (outv.itemsize != 2 && outv.itemsize != 4);
    ops[0].held = ops[1].held = 0;
    for (int k = 0; k < nops && !refuse; k++) {
        refuse = take(args[3 + k], &ops[k], ndim, outv.shape) != 0;
    }
    Py_ssize_t total = 1;
    for (Py_ssize_t d = 0; d < ndim && !refuse; d++) {
        total *= outv.shape[d];
        if (outv.strides[d] == 0 && outv.shape[d] > 1) {
            refuse = 1;  /* a broadcast out would be written more than once */
        }
    }
    if (!refuse) {
        /* Merge adjacent dimensions every array walks as one; the last dimension is inner. */
        Py_ssize_t shape[MAX_DIMS], ostr[MAX_DIMS], str[2][MAX_DIMS];
        Py_ssize_t nd = 0;
        for (Py_ssize_t d = 0; d < ndim; d++) {
            int merge = nd > 0 && outv.strides[d] * outv.shape[d] == ostr[nd - 1];
            for (int k = 0; k < nops && merge; k++) {
                merge = ops[k].is_number
                    || ops[k].strides[d] * outv.shape[d] == str[k][nd - 1];
            }
            if (merge) {
                shape[nd - 1] *= outv.shape[d];
                ostr[nd - 1] = outv.strides[d];
                for (int k = 0; k < nops; k++) {
                    str[k][nd - 1] = ops[k].is_number ? 0 : ops[k].strides[d];
                }
            } else {
                shape[nd] = outv.shape[d];
                ostr[nd] = outv.strides[d];
                for (int k = 0; k < nops; k++) {
                    str[k][nd] = ops[k].is_number ? 0 : ops[k].strides[d];
                }
                nd++;
            }
        }
        Py_ssize_t inner = nd ? shape[nd - 1] : 1;
        Py_ssize_t rows = total && inner ? total / inner : 0;
        /* rows of contiguous halves (numbers aside) take the vector path where the CPU has it */
        int vector = code != OP_COPY && nd > 0 && outv.itemsize == 2 && ostr[nd - 1] == 2
            && (bf16 ? use_avx2 : use_f16c);
        float numbers[2] = {0.0f, 0.0f};
        for (int k = 0; k < nops; k++) {
            if (ops[k].is_number) {
                numbers[k] = ops[k].number;
            } else {
                vector = vector && ops[k].itemsize == 2 && str[k][nd - 1] == 2;
            }
        }
        (void)numbers;
        Py_BEGIN_ALLOW_THREADS
        float blocks[3][CHUNK];
        for (int k = 0; k < nops; k++) {
            if (ops[k].is_number) {
                for (int i = 0; i < CHUNK; i++) {
                    blocks[k][i] = ops[k].number;
                }
            }
        }
        Py_ssize_t index[MAX_DIMS] = {0};
        for (Py_ssize_t row = 0; row < rows; row++) {
            /* the byte offset of this row in each array */
            Py_ssize_t off_out = 0, off[2] = {0, 0};
            for (Py_ssize_t d = 0; d + 1 < nd; d++) {
                off_out += index[d] * ostr[d];
                for (int k = 0; k < nops; k++) {
                    off[k] += index[d] * str[k][d];
                }
            }
            Py_ssize_t istr = nd ? ostr[nd - 1] : 0;
            Py_ssize_t done = 0;
#if HAVE_X86
            if (vector) {
                const uint16_t *p[2] = {NULL, NULL};
                for (int k = 0; k < nops; k++) {
                    p[k] = ops[k].is_number ? NULL : (const uint16_t *)(ops[k].ptr + off[k]);
                }
                done = (bf16 ? row_bf16 : row_f16)((int)code, p[0], p[1], numbers,
                                                   (uint16_t *)((char *)outv.buf + off_out),
                                                   inner);
            }
#endif
            for (Py_ssize_t start = done; start < inner; start += CHUNK) {
                Py_ssize_t n = inner - start < CHUNK ? inner - start : CHUNK;
                char *target = (char *)outv.buf + off_out + start * istr;
                /* float32 items in place are read and written where they are */
                float *result = outv.itemsize == 4 && istr == 4 ? (float *)target : blocks[2];
                const float *src[2] = {blocks[0], blocks[1]};
                for (int k = 0; k < nops; k++) {
                    Py_ssize_t s = nd ? str[k][nd - 1] : 0;
                    char *p = ops[k].ptr + off[k] + start * s;
                    if (ops[k].is_number) {
                        continue;
                    } else if (ops[k].itemsize == 4 && s == 4) {
                        src[k] = (const float *)p;
                    } else {
                        load(&ops[k], p, s, n, bf16, code == OP_COPY ? result : blocks[k]);
                        src[k] = code == OP_COPY ? result : blocks[k];
                    }
                }
                if (code != OP_COPY) {
                    compute((int)code, src[0], src[1], result, n);
                } else if (src[0] != result && result == (float *)target) {
                    memcpy(result, src[0], (size_t)n * 4);  /* float32 to float32 */
                }
                if (result != (float *)target) {
                    store(code == OP_COPY ? src[0] : result, target, istr, n, outv.itemsize,
                          bf16);
                }
            }
            for (Py_ssize_t d = nd - 2; d >= 0; d--) {  /* the next row's index */
                if (++index[d] < shape[d]) {
                    break;
                }
                index[d] = 0;
            }
        }
        Py_END_ALLOW_THREADS
    }
    for (int k = 0; k < nops; k++) {
        if (ops[k].held) {
            PyBuffer_Release(&ops[k].view);
        }
    }
    PyBuffer_Release(&outv);
    if (refuse) {
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ------------------------------------------------------------------ the scaled subtraction
 *
 * sub_scaled(kind, out, a, b, scale): out = a - (scale * b), the product rounded to out's dtype
 * before the subtraction, in one pass: bit for bit what the NumPy device's two kernels give,
 * multiply(b, scale) into scratch then subtract(a, scratch) (an optimizer's update p -= lr * g,
 * `Device.sub_scaled`). kind: 0 float32, 1 float64, 2 float16, 3 bfloat16 (two-byte floats in
 * float32, each of the two results rounded to the dtype once: Note [two-byte floats compute in
 * float32] in backends/base.py); scale a number (float32 for every kind but float64). out, a and
 * b are C-contiguous buffers of the kind's item size and of one shape; out may be a or b itself
 * (each chunk is read before it is written). Returns False, having written nothing, for any
 * other layout. Each IEEE operation is a loop of its own over a chunk that stays in L1: no
 * compiler contracts the product and the difference into one fused multiply-add, whatever the
 * target (a vfmadd would round once, not twice). */
#define SUB_CHUNK 256

#define SUB_BODY(T)                                                                          \
    T t[SUB_CHUNK];                                                                          \
    for (Py_ssize_t start = 0; start < n; start += SUB_CHUNK) {                              \
        Py_ssize_t m = n - start < SUB_CHUNK ? n - start : SUB_CHUNK;                        \
        const T *bs = b + start;                                                             \
        for (Py_ssize_t i = 0; i < m; i++) t[i] = bs[i] * s;                                 \
        const T *as = a + start;                                                             \
        T *os = out + start;                                                                 \
        for (Py_ssize_t i = 0; i < m; i++) os[i] = as[i] - t[i];                             \
    }

static void
sub_scaled_f32(float *out, const float *a, const float *b, float s, Py_ssize_t n)
{
    SUB_BODY(float)
}

static void
sub_scaled_f64(double *out, const double *a, const double *b, double s, Py_ssize_t n)
{
    SUB_BODY(double)
}

#if HAVE_X86
/* the same loops in AVX2 registers (the target has no FMA, and the loops are apart anyway) */
__attribute__((target("avx2"))) static void
sub_scaled_f32_avx2(float *out, const float *a, const float *b, float s, Py_ssize_t n)
{
    SUB_BODY(float)
}

__attribute__((target("avx2"))) static void
sub_scaled_f64_avx2(double *out, const double *a, const double *b, double s, Py_ssize_t n)
{
    SUB_BODY(double)
}
#endif
#undef SUB_BODY


/* Two-byte items: the chunk of b widened, multiplied, rounded to the dtype and widened back
 * (the scratch of the two-kernel path, in registers' stead); a's chunk widened; the difference
 * rounded into out. */
static void
sub_scaled_half(uint16_t *out, const uint16_t *a, const uint16_t *b, float s, Py_ssize_t n,
                int bf16)
{
    float ta[SUB_CHUNK], tb[SUB_CHUNK];
    uint16_t rounded[SUB_CHUNK];
    loop_fn widen_fn = bf16 ? widen_bf16_loop : widen_loop;
    loop_fn narrow_fn = bf16 ? narrow_bf16_loop : narrow_loop;
    for (Py_ssize_t start = 0; start < n; start += SUB_CHUNK) {
        Py_ssize_t m = n - start < SUB_CHUNK ? n - start : SUB_CHUNK;
        widen_fn(b + start, tb, m);
        for (Py_ssize_t i = 0; i < m; i++) tb[i] = tb[i] * s;
        narrow_fn(tb, rounded, m);
        widen_fn(rounded, tb, m);
        widen_fn(a + start, ta, m);
        for (Py_ssize_t i = 0; i < m; i++) ta[i] = ta[i] - tb[i];
        narrow_fn(ta, out + start, m);
    }
}

/* A C-contiguous buffer of `obj` into `view` (writable for an output); 0, or 1 having cleared
 * the error where it has none (not contiguous, read-only, not an array: the caller's own path
 * takes it). */
static int
acquire(PyObject *obj, Py_buffer *view, int output)
{
    int flags = output ? PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE : PyBUF_C_CONTIGUOUS;
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        return 1;
    }
    return 0;
}

/* The common prologue of a kernel with one output and one input: `out` acquired writable into
 * views[0], then `in` into views[1]; *held says how many are held. Returns True where one was
 * refused (its layout is not a C-contiguous buffer). */
static int
acquire_pair(PyObject *out, PyObject *in, Py_buffer *views, int *held)
{
    *held = 0;
    if (acquire(out, &views[0], 1)) {
        return 1;
    }
    *held = 1;
    if (acquire(in, &views[1], 0)) {
        return 1;
    }
    *held = 2;
    return 0;
}

/* Whether `v` has `o`'s shape and items of `itemsize` bytes. */
static int
same_shape(const Py_buffer *v, const Py_buffer *o, Py_ssize_t itemsize)
{
    int same = v->itemsize == itemsize && v->ndim == o->ndim;
    for (int d = 0; d < o->ndim && same; d++) {
        same = v->shape[d] == o->shape[d];
    }
    return same;
}

/* `count` buffers of C-contiguous items of `itemsize` bytes and one shape acquired into views,
 * the first writable (out); *held says how many are held. Returns True where one was refused. */
static int
acquire_alike(PyObject *const *arrays, int count, Py_ssize_t itemsize, Py_buffer *views,
              int *held)
{
    int refuse = 0;
    for (*held = 0; *held < count && !refuse;) {
        if ((refuse = acquire(arrays[*held], &views[*held], *held == 0))) {
            break;
        }
        refuse = !same_shape(&views[*held], &views[0], itemsize);
        (*held)++;
    }
    return refuse;
}

/* Whether two buffers share no byte. */
static int
apart(const Py_buffer *a, const Py_buffer *b)
{
    uintptr_t ab = (uintptr_t)a->buf, bb = (uintptr_t)b->buf;
    return ab + (uintptr_t)a->len <= bb || bb + (uintptr_t)b->len <= ab;
}

/* The first `held` buffers released; True, or False where a layout was refused. */
static PyObject *
released(Py_buffer *views, int held, int refuse)
{
    for (int k = 0; k < held; k++) {
        PyBuffer_Release(&views[k]);
    }
    if (refuse) {
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *
sub_scaled(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "sub_scaled(kind, out, a, b, scale) takes 5 arguments, "
                     "got %zd", nargs);
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    if (kind == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (kind < 0 || kind > 3) {
        PyErr_Format(PyExc_ValueError, "sub_scaled: kind %ld names no dtype (0 float32, "
                     "1 float64, 2 float16, 3 bfloat16)", kind);
        return NULL;
    }
    double scale = PyFloat_AsDouble(args[4]);
    if (scale == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    static const Py_ssize_t itemsizes[4] = {4, 8, 2, 2};
    Py_ssize_t itemsize = itemsizes[kind];
    Py_buffer views[3];
    int held, refuse = acquire_alike(args + 1, 3, itemsize, views, &held);
    if (!refuse) {
        Py_ssize_t n = views[0].len / itemsize;
        void *o = views[0].buf;
        const void *x = views[1].buf, *y = views[2].buf;
        Py_BEGIN_ALLOW_THREADS
        if (kind == 0) {
            PICK(sub_scaled, f32)(o, x, y, (float)scale, n);
        } else if (kind == 1) {
            PICK(sub_scaled, f64)(o, x, y, scale, n);
        } else {
            sub_scaled_half(o, x, y, (float)scale, n, kind == 3);
        }
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

/* ------------------------------------------------------------------ float32 and float64 loops
 *
 * float_op(code, kind, out, a[, b]): the op of `code` (OP_<NAME>, this module's `ops`; not
 * copy) on contiguous float32 (kind 0) or float64 (kind 1) operands, by its generated loops
 * (`optable_f32`, `optable_f64`: one loop per IEEE step of the formula, vectorised by the
 * compiler), for the NumPy device's kernels where NumPy is slow (it runs relu as a compare and
 * two masked copies, relu_backward through a boolean temporary and a casting multiply, and an
 * add of a bias row through its broadcasting iterator). One IEEE operation per element and
 * step, so the bits are NumPy's, but for an operation on two NaNs: a NaN, whose payload is one
 * of theirs (C's + commutes, and x86 keeps the first operand's payload; NumPy's own loops are
 * compiled the same way). out and a are C-contiguous of one shape, b likewise or one row of
 * out's last dimension; out may be a or b itself (each element is read before it is written).
 * sum_rows(kind, out, a): the sum of a (rows, cols) over its rows, rows added one after
 * another to +0 in order as np.add.reduce(a, 0) adds them for cols > 1 (for one column NumPy
 * sums pairwise: refused), into out of cols elements (shape (cols,) or (1, cols)), which
 * shares no memory with a. Each returns False, having written nothing, for anything else. */
/* NOTE: on a 64-byte line: the loop's time moved by a fifth with where it happened to fall
 * (a 1024 x 1024 float32 sum, AMD EPYC) */
#if defined(__GNUC__) || defined(__clang__)
#define SUM_ALIGN __attribute__((aligned(64)))
#else
#define SUM_ALIGN
#endif
#define SUM_ROWS(T, SUFFIX, ATTR)                                                             \
    ATTR SUM_ALIGN static void sum_rows_##SUFFIX(T *o, const T *x, Py_ssize_t rows,            \
                                                 Py_ssize_t cols, Py_ssize_t stride)         \
    {                                                                                        \
        /* from +0, as NumPy's sum: a column of -0.0 sums to +0.0 */                         \
        for (Py_ssize_t i = 0; i < cols; i++) o[i] = (T)0 + x[i];                            \
        for (Py_ssize_t r = 1; r < rows; r++) {                                              \
            const T *y = x + r * stride;                                                     \
            for (Py_ssize_t i = 0; i < cols; i++) o[i] = o[i] + y[i];                        \
        }                                                                                    \
    }

FLOAT_VARIANTS(SUM_ROWS)
#undef SUM_ROWS
#undef SUM_ALIGN

/* The kind argument of float_op and sum_rows: its item size, or 0 (an error set). */
static Py_ssize_t
float_kind(PyObject *arg, const char *name, long *kind)
{
    *kind = PyLong_AsLong(arg);
    if (*kind == -1 && PyErr_Occurred()) {
        return 0;
    }
    if (*kind < 0 || *kind > 1) {
        PyErr_Format(PyExc_ValueError, "%s: kind %ld names no dtype (0 float32, 1 float64)",
                     name, *kind);
        return 0;
    }
    return *kind ? 8 : 4;
}

typedef struct {
    int code;
    long kind;
    int row;      /* b is one row of cols */
    size_t size;  /* the item size */
    char *o;
    const char *a, *b;
    Py_ssize_t rows, cols;
} float_op_ctx;

/* A part of float_op: a range of rows, or of a single row's columns (the table's loop walks
 * rows cols apart, so only one row splits by columns). */
static void
float_op_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    float_op_ctx *c = arg;
    Py_ssize_t rows = c->rows, cols = c->cols, lo, hi;
    char *o = c->o;
    const char *a = c->a, *b = c->b;
    if (rows > 1) {
        pool_range(rows, part, parts, 1, &lo, &hi);
        size_t skip = (size_t)(lo * cols) * c->size;
        o += skip;
        a += skip;
        b = b != NULL && !c->row ? b + skip : b;
        rows = hi - lo;
    } else {
        pool_range(cols, part, parts, 16, &lo, &hi);
        size_t skip = (size_t)lo * c->size;
        o += skip;
        a += skip;
        b = b != NULL ? b + skip : b;
        cols = hi - lo;
    }
    if (rows <= 0 || cols <= 0) {
        return;
    }
    if (c->kind) {
        PICK(optable, f64)(c->code, (double *)o, (const double *)a, (const double *)b, rows,
                           cols, c->row);
    } else {
        PICK(optable, f32)(c->code, (float *)o, (const float *)a, (const float *)b, rows, cols,
                           c->row);
    }
}

static PyObject *
float_op(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_Format(PyExc_TypeError, "float_op(code, kind, out, a[, b]) takes 4 or 5 "
                     "arguments, got %zd", nargs);
        return NULL;
    }
    long code = PyLong_AsLong(args[0]), kind;
    if (code == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (code <= OP_COPY || code >= OP_COUNT || op_arity[code] != nargs - 3) {
        PyErr_Format(PyExc_ValueError, "float_op: code %ld with %zd operand(s) names no "
                     "kernel", code, nargs - 3);
        return NULL;
    }
    Py_ssize_t itemsize = float_kind(args[1], "float_op", &kind);
    if (itemsize == 0) {
        return NULL;
    }
    Py_buffer views[3];
    int nviews = (int)nargs - 2, held = 0, refuse = 0, row = 0;
    while (held < nviews && !refuse) {
        if ((refuse = acquire(args[2 + held], &views[held], held == 0))) {
            break;  /* NumPy's own kernel takes it */
        }
        Py_buffer *v = &views[held];
        int same = same_shape(v, &views[0], itemsize);
        if (held == 2 && !same) {  /* a row of out's last dimension */
            row = same = v->itemsize == itemsize && v->ndim == 1 && views[0].ndim >= 1
                && v->shape[0] == views[0].shape[views[0].ndim - 1];
        }
        refuse = !same;
        held++;
    }
    if (!refuse) {
        Py_ssize_t n = views[0].len / itemsize;
        Py_ssize_t cols = row ? views[0].shape[views[0].ndim - 1] : n;
        /* NOTE: b (where given) of out's shape is one row of n */
        float_op_ctx ctx = {(int)code, kind, row, (size_t)itemsize, views[0].buf, views[1].buf,
                            nviews == 3 ? views[2].buf : NULL, row ? (cols ? n / cols : 0) : 1,
                            cols};
        Py_BEGIN_ALLOW_THREADS
        pool_run(float_op_part, &ctx, pool_parts(n * nviews, pool.grain, n));
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

typedef struct {
    long kind;
    size_t size;
    char *o;
    const char *a;
    Py_ssize_t rows, cols;
    Py_ssize_t again[POOL_MAX];  /* max_rows: each part's rows to take again */
} rows_ctx;

/* A part of sum_rows: a range of columns, each summed over every row in order. */
static void
sum_rows_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    rows_ctx *c = arg;
    Py_ssize_t lo, hi;
    pool_range(c->cols, part, parts, 16, &lo, &hi);
    if (lo >= hi) {
        return;
    }
    size_t skip = (size_t)lo * c->size;
    if (c->kind) {
        PICK(sum_rows, f64)((void *)(c->o + skip), (const void *)(c->a + skip), c->rows,
                            hi - lo, c->cols);
    } else {
        PICK(sum_rows, f32)((void *)(c->o + skip), (const void *)(c->a + skip), c->rows,
                            hi - lo, c->cols);
    }
}

static PyObject *
sum_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "sum_rows(kind, out, a) takes 3 arguments, got %zd",
                     nargs);
        return NULL;
    }
    long kind;
    Py_ssize_t itemsize = float_kind(args[0], "sum_rows", &kind);
    if (itemsize == 0) {
        return NULL;
    }
    Py_buffer views[2];
    int held = 0, refuse = acquire_pair(args[1], args[2], views, &held);
    if (!refuse) {  /* (rows, cols) into cols: (cols,) or (1, cols) */
        Py_buffer *o = &views[0], *v = &views[1];
        Py_ssize_t cols = v->ndim == 2 ? v->shape[1] : 0;
        refuse = !(v->itemsize == itemsize && o->itemsize == itemsize && v->ndim == 2
                   && v->shape[0] >= 1 && cols > 1 && o->len == cols * itemsize
                   && o->ndim >= 1 && o->ndim <= 2 && o->shape[o->ndim - 1] == cols);
        /* out shares no memory with a: ops' policy NEVER; checked anyway */
        refuse = refuse || !apart(o, v);
    }
    if (!refuse) {
        rows_ctx ctx = {kind, (size_t)itemsize, views[0].buf, views[1].buf, views[1].shape[0],
                        views[1].shape[1]};
        Py_BEGIN_ALLOW_THREADS
        pool_run(sum_rows_part, &ctx, pool_parts(ctx.rows * ctx.cols, pool.grain, ctx.cols));
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

/* max_rows(kind, out, a): the maximum of each row of a contiguous float32 (kind 0) or float64
 * (kind 1) a over its last axis, into out of one item a row (any shape of that count), which
 * shares no memory with a: NumPy's maximum (a NaN in a row gives NaN), in AVX2 lanes where the
 * CPU has them. NumPy's own reduction over rows this
 * short pays a loop call a row (softmax's max over rows of 128: 0.68 ms for 4 x 12 x 128 x 128
 * float32 on an Intel Xeon). The value is NumPy's wherever it is neither NaN nor zero (the
 * maximum of such a row is one value, whatever order finds it); a NaN's payload and a zero's
 * sign follow the order of the reduction, so the caller takes those rows from NumPy itself
 * (backends/numpy.py): returns how many there are. False, nothing
 * written, for anything else. */
/* NumPy's maximum of m and v: v where v > m or v is NaN (so a NaN, once met, stays). */
#define MAX_STEP(m, v) (((v) > (m)) | ((v) != (v)) ? (v) : (m))
#define MAX_ROWS(T, SUFFIX)                                                                   \
    static Py_ssize_t max_rows_##SUFFIX(T *o, const T *x, Py_ssize_t rows, Py_ssize_t cols)   \
    {                                                                                        \
        Py_ssize_t again = 0;                                                                \
        for (Py_ssize_t r = 0; r < rows; r++) {                                              \
            const T *y = x + r * cols;                                                       \
            T m = y[0];                                                                      \
            for (Py_ssize_t j = 1; j < cols; j++) m = MAX_STEP(m, y[j]);                     \
            o[r] = m;                                                                        \
            again += (m == 0) | (m != m);                                                    \
        }                                                                                    \
        return again;                                                                        \
    }
MAX_ROWS(float, f32)
MAX_ROWS(double, f64)
#undef MAX_ROWS

#if HAVE_X86
/* The same in AVX2 lanes (gcc 12 vectorises neither form of the scalar loop): per row, four
 * vectors of running maxima (four chains, so the blends overlap) by compare and blend (v > m,
 * or v unordered: NaN), then their lanes and the row's tail by MAX_STEP. */
#define MAX_ROWS_AVX2(T, SUFFIX, V, LANES, LOAD, SET1, CMP, OR, BLEND, STORE)                 \
    __attribute__((target("avx2"))) static Py_ssize_t                                         \
    max_rows_##SUFFIX##_avx2(T *o, const T *x, Py_ssize_t rows, Py_ssize_t cols)              \
    {                                                                                        \
        Py_ssize_t again = 0;                                                                \
        for (Py_ssize_t r = 0; r < rows; r++) {                                              \
            const T *y = x + r * cols;                                                       \
            V acc[4] = {SET1(y[0]), SET1(y[0]), SET1(y[0]), SET1(y[0])};                     \
            Py_ssize_t j = 0;                                                                \
            for (; j + 4 * LANES <= cols; j += 4 * LANES) {                                  \
                for (int k = 0; k < 4; k++) {                                                \
                    V v = LOAD(y + j + k * LANES);                                           \
                    V take = OR(CMP(v, acc[k], _CMP_GT_OQ), CMP(v, v, _CMP_UNORD_Q));        \
                    acc[k] = BLEND(acc[k], v, take);                                         \
                }                                                                            \
            }                                                                                \
            for (int k = 1; k < 4; k++) {                                                    \
                V take = OR(CMP(acc[k], acc[0], _CMP_GT_OQ), CMP(acc[k], acc[k], _CMP_UNORD_Q)); \
                acc[0] = BLEND(acc[0], acc[k], take);                                        \
            }                                                                                \
            T lanes[LANES], m;                                                               \
            STORE(lanes, acc[0]);                                                            \
            m = lanes[0];                                                                    \
            for (int k = 1; k < LANES; k++) m = MAX_STEP(m, lanes[k]);                       \
            for (; j < cols; j++) m = MAX_STEP(m, y[j]);                                     \
            o[r] = m;                                                                        \
            again += (m == 0) | (m != m);                                                    \
        }                                                                                    \
        return again;                                                                        \
    }
MAX_ROWS_AVX2(float, f32, __m256, 8, _mm256_loadu_ps, _mm256_set1_ps, _mm256_cmp_ps,
              _mm256_or_ps, _mm256_blendv_ps, _mm256_storeu_ps)
MAX_ROWS_AVX2(double, f64, __m256d, 4, _mm256_loadu_pd, _mm256_set1_pd, _mm256_cmp_pd,
              _mm256_or_pd, _mm256_blendv_pd, _mm256_storeu_pd)
#undef MAX_ROWS_AVX2
#endif

/* A part of max_rows: a range of rows. */
static void
max_rows_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    rows_ctx *c = arg;
    Py_ssize_t lo, hi;
    pool_range(c->rows, part, parts, 1, &lo, &hi);
    void *o = c->o + (size_t)lo * c->size;
    const void *a = c->a + (size_t)(lo * c->cols) * c->size;
    c->again[part] = lo >= hi ? 0 : c->kind ? PICK(max_rows, f64)(o, a, hi - lo, c->cols)
                                            : PICK(max_rows, f32)(o, a, hi - lo, c->cols);
}

static PyObject *
max_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "max_rows(kind, out, a) takes 3 arguments, got %zd",
                     nargs);
        return NULL;
    }
    long kind;
    Py_ssize_t itemsize = float_kind(args[0], "max_rows", &kind);
    if (itemsize == 0) {
        return NULL;
    }
    Py_buffer views[2];
    int held = 0, refuse = acquire_pair(args[1], args[2], views, &held);
    Py_ssize_t cols = 0, rows = 0;
    if (!refuse) {
        Py_buffer *o = &views[0], *v = &views[1];
        cols = v->ndim >= 1 ? v->shape[v->ndim - 1] : 0;
        rows = cols > 0 ? v->len / (cols * itemsize) : 0;
        refuse = !(v->itemsize == itemsize && o->itemsize == itemsize && cols >= 1
                   && rows >= 1 && o->len == rows * itemsize) || !apart(o, v);
    }
    Py_ssize_t again = 0;  /* rows whose maximum is NaN or zero */
    if (!refuse) {
        rows_ctx ctx = {kind, (size_t)itemsize, views[0].buf, views[1].buf, rows, cols};
        Py_ssize_t parts = pool_parts(rows * cols, pool.grain, rows);
        Py_BEGIN_ALLOW_THREADS
        pool_run(max_rows_part, &ctx, parts);
        Py_END_ALLOW_THREADS
        for (Py_ssize_t p = 0; p < parts; p++) {
            again += ctx.again[p];
        }
    }
    PyObject *done = released(views, held, refuse);
    if (done != Py_True) {
        return done;
    }
    Py_DECREF(done);
    return PyLong_FromSsize_t(again);
}

#include "_erf_table.h"

/* C's erf of float32s in double, rounded once to float32, in a fraction of C's time:
 * polynomials of backends/_erf_table.h (at most 3.5e-16 relative error) rounded to float32,
 * and C's erf itself wherever a polynomial's value lies within 2**-40 of a value where the
 * rounding changes (or |x| >= 4, or NaN): C's erf is within an ULP of the exact value, so
 * elsewhere the two round alike (backends/_erf_gen.py; tests/test_halfconv.py holds them
 * equal on 2**24 values, and `python -m backends._erf_gen --check` found them equal on every
 * float32). Two passes over a block: the core polynomial on every element, a loop the
 * compiler vectorises (AVX-512 or AVX2 where the CPU has it; no FMA, so each product and sum
 * rounds as written; AVX-512 took 2.56 against AVX2's 3.30 ms on 1.5M GELU arguments on an
 * Intel Xeon, `lscpu` family 6 model 167), marking the elements it cannot settle; then
 * those, one at a time (their indices gathered first without a branch: 4.27 -> 3.02 ms on a
 * GELU's 1.5M arguments). Both polynomials are evaluated by Estrin's scheme (pairs, then pairs
 * of pairs by powers s^2, s^4, s^8): a chain of 4 dependent steps where Horner's rule has 14,
 * 2.3x faster on the core (measured on an AMD EPYC; FMA gained nothing there). Its rounding
 * differs from Horner's within the 2**-40 the check allows, and `--check` found every float32
 * equal again, on each path. */
#define ERF_NEAR 0x1p-40
#if ERF_CORE_DEGREE != 14 || ERF_DEGREE != 12
#error "ERF_CORE and erf_one below evaluate polynomials of degrees 14 and 12 (Estrin's scheme)"
#endif

#define ERF_CORE(NAME, ATTR)                                                                  \
ATTR static void                                                                              \
NAME(float *out, unsigned char *unsettled, const float *a, Py_ssize_t m)                      \
{                                                                                             \
    for (Py_ssize_t i = 0; i < m; i++) {                                                      \
        double x = a[i], ax = fabs(x), s = x * x, s2 = s * s, s4 = s2 * s2, s8 = s4 * s4;     \
        const double *c = erf_core;                                                           \
        double q = ((c[0] + c[1] * s) + (c[2] + c[3] * s) * s2                                \
                    + ((c[4] + c[5] * s) + (c[6] + c[7] * s) * s2) * s4)                      \
                   + ((c[8] + c[9] * s) + (c[10] + c[11] * s) * s2                            \
                      + ((c[12] + c[13] * s) + c[14] * s2) * s4) * s8;                        \
        double y = ax * q;                                                                    \
        float f = (float)y;                                                                   \
        int settled = (ax < ERF_CORE_END) & ((float)(y * (1.0 - ERF_NEAR)) == f)              \
                      & ((float)(y * (1.0 + ERF_NEAR)) == f);                                 \
        out[i] = copysignf(f, a[i]);                                                          \
        unsettled[i] = (unsigned char)!settled;                                               \
    }                                                                                         \
}
ERF_CORE(erf_core_portable, )
#if HAVE_X86
ERF_CORE(erf_core_avx2, __attribute__((target("avx2"))))
/* NOTE: the core's compares and its byte marks take AVX-512BW, VL and DQ beside F: without them
 * gcc 12 vectorises it in AVX2's width */
#define ERF_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512"
/* NOTE: AVX-512 brings FMA, which gcc would contract a product and a sum into (clang's is off
 * for the whole file, above); eight doubles a vector, each lane the same IEEE steps as the
 * others' paths, so the same bits (`--check` on each path) */
#if defined(__clang__)
ERF_CORE(erf_core_avx512, __attribute__((target(ERF_AVX512))))
#else
ERF_CORE(erf_core_avx512, __attribute__((target(ERF_AVX512),
                                         optimize("fp-contract=off"))))
#endif
#endif
#undef ERF_CORE

/* One element the core left: its piece's polynomial from ERF_CORE_END to 4, else (or near a
 * rounding boundary) C's erf. */
static float
erf_one(float value)
{
    double x = value, ax = fabs(x);
    if (ax >= ERF_CORE_END && ax < ERF_PIECES / (double)ERF_STEPS) {
        int piece = (int)(ax * ERF_STEPS);
        const double *c = erf_pieces[piece - 1];
        double t = ax - (piece + 0.5) / ERF_STEPS, t2 = t * t, t4 = t2 * t2, t8 = t4 * t4;
        double y = ((c[0] + c[1] * t) + (c[2] + c[3] * t) * t2
                    + ((c[4] + c[5] * t) + (c[6] + c[7] * t) * t2) * t4)
                   + ((c[8] + c[9] * t) + (c[10] + c[11] * t) * t2 + c[12] * t4) * t8;
        float f = (float)y;
        if ((float)(y * (1.0 - ERF_NEAR)) == f && (float)(y * (1.0 + ERF_NEAR)) == f) {
            return copysignf(f, value);
        }
    }
    return (float)erf(x);  /* NOTE: C's own value decides */
}

static void
erf_block(float *out, const float *a, Py_ssize_t n)
{
    unsigned char unsettled[256];
    float x[256];  /* NOTE: the block's inputs, kept: out may be a itself */
    for (Py_ssize_t s = 0; s < n; s += 256) {
        Py_ssize_t m = n - s < 256 ? n - s : 256;
        memcpy(x, a + s, (size_t)m * sizeof(float));
#if HAVE_X86
        if (use_avx512) {
            erf_core_avx512(out + s, unsettled, x, m);
        } else if (use_avx2) {
            erf_core_avx2(out + s, unsettled, x, m);
        } else
#endif
        {
            erf_core_portable(out + s, unsettled, x, m);
        }
        /* NOTE: the unsettled ones' indices gathered without a branch: a few percent of a
         * GELU's arguments, at random places, which a branch per element mispredicts */
        short left[256];
        Py_ssize_t count = 0;
        for (Py_ssize_t i = 0; i < m; i++) {
            left[count] = (short)i;
            count += unsettled[i];
        }
        for (Py_ssize_t k = 0; k < count; k++) {
            out[s + left[k]] = erf_one(x[left[k]]);
        }
    }
}

/* erf_op(kind, out, a): C's erf of each element of a contiguous float32 (kind 0: computed in
 * double, rounded once, by `erf_block`) or float64 (kind 1) array into out of its shape (out
 * may be a): the CPU device's erf, the same bits as math.erf (backends/_erf.py); kind 2, the
 * float32 loop on C's erf alone (the specification `erf_block` is held to). False, nothing
 * written, for anything else. */
static PyObject *
erf_op(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "erf_op(kind, out, a) takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    if (kind == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int plain = kind == 2;
    kind = plain ? 0 : kind;
    PyObject *kind_object = PyLong_FromLong(kind);
    if (kind_object == NULL) {
        return NULL;
    }
    Py_ssize_t itemsize = float_kind(kind_object, "erf_op", &kind);
    Py_DECREF(kind_object);
    if (itemsize == 0) {
        return NULL;
    }
    Py_buffer views[2];
    int held, refuse = acquire_alike(args + 1, 2, itemsize, views, &held);
    if (!refuse) {
        Py_ssize_t n = views[0].len / itemsize;
        Py_BEGIN_ALLOW_THREADS
        if (kind) {
            double *o = views[0].buf;
            const double *a = views[1].buf;
            for (Py_ssize_t i = 0; i < n; i++) o[i] = erf(a[i]);
        } else {
            float *o = views[0].buf;
            const float *a = views[1].buf;
            if (plain) {
                for (Py_ssize_t i = 0; i < n; i++) o[i] = (float)erf((double)a[i]);
            } else {
                erf_block(o, a, n);
            }
        }
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

/* NumPy's own ufunc loops for float32 and float64 (a ufunc inner loop: args, dimensions,
 * steps, data): LOOP_EXP, LOOP_LOG, LOOP_TANH and LOOP_ADD, set by backends/numpy.py after it
 * checked each loop's bits against the ufunc's (`set_loop`); NULL where it did not. A chain's
 * link of code OP_COUNT + k runs one-input loop k (k < LOOP_LINKS); gelu_op's gradient runs
 * LOOP_EXP (or takes e from its caller); sum_last runs LOOP_ADD in reduce mode, as NumPy's
 * reduction over a contiguous last axis calls it. */
#define LOOP_EXP 0
#define LOOP_LOG 1
#define LOOP_TANH 2
#define LOOP_LINKS 3
#define LOOP_ADD 3
#define LOOPS 4
typedef void (*numpy_loop)(char **args, const Py_ssize_t *dims, const Py_ssize_t *steps,
                           void *data);
static numpy_loop loops[LOOPS][2];
static void *loop_data[LOOPS][2];

/* loop `which` of `kind` from n items at a to r (r may be a) */
static void
numpy_unary(int which, int kind, void *r, const void *a, Py_ssize_t n, Py_ssize_t itemsize)
{
    char *args[2] = {(char *)a, r};
    Py_ssize_t dims[1] = {n}, steps[2] = {itemsize, itemsize};
    loops[which][kind](args, dims, steps, loop_data[which][kind]);
}

/* gelu_op(kind, out, x[, g[, e]]): backends/optable.py's exact GELU, x * 0.5 * (1 + erf(x *
 * sqrt(1/2))), with out and x alone, or its gradient g * ((1 + erf(x * sqrt(1/2))) * 0.5 + x *
 * (e / sqrt(2 pi))) with g and e = exp((x * -0.5) * x) as well (NumPy's exp: the caller's, or
 * without e NumPy's own loop on each tile, where `set_exp` gave it),
 * over contiguous float32 (kind 0) or float64 (kind 1) arrays of out's shape (out may be one of
 * them), in one pass of 256-item tiles: each operation of the formula in the table's order in
 * the dtype, one rounding each as NumPy's ufuncs round, and the CPU's erf (`erf_block`, C's
 * erf for float64). So the bits are those of the formula run op by op (backends/numpy.py's
 * twin, tests/test_halfconv.py), where that run makes four arrays of out's size and walks
 * them six or eleven times. False, nothing written, for anything else. */
#define GELU_TILE(T, ERF)                                                                     \
    {                                                                                         \
        T *o = (T *)c->out + first;                                                           \
        const T *x = (const T *)c->x + first;                                                 \
        const T *g = c->g ? (const T *)c->g + first : NULL;                                   \
        const T *e = c->e ? (const T *)c->e + first : NULL;                                   \
        int backward = g != NULL;                                                             \
        Py_ssize_t n = last - first;                                                          \
        /* NOTE: the table's constants as Python computes them, then rounded to T */         \
        const T root_half = (T)sqrt(0.5), scale = (T)(1.0 / sqrt(2.0 * 3.141592653589793));   \
        T z[256], r[256], w[256];                                                             \
        for (Py_ssize_t s = 0; s < n; s += 256) {                                             \
            Py_ssize_t m = n - s < 256 ? n - s : 256;                                         \
            for (Py_ssize_t i = 0; i < m; i++) z[i] = x[s + i] * root_half;                   \
            ERF;                                                                              \
            if (backward && e == NULL) {                                                      \
                for (Py_ssize_t i = 0; i < m; i++) w[i] = (x[s + i] * (T)-0.5) * x[s + i];     \
                numpy_unary(LOOP_EXP, (int)c->kind, w, w, m, sizeof(T));                      \
            }                                                                                 \
            if (backward) {                                                                   \
                for (Py_ssize_t i = 0; i < m; i++) {                                          \
                    T cdf = ((T)1 + r[i]) * (T)0.5;                                           \
                    T pdf = (e != NULL ? e[s + i] : w[i]) * scale;                            \
                    o[s + i] = g[s + i] * (cdf + x[s + i] * pdf);                             \
                }                                                                             \
            } else {                                                                          \
                for (Py_ssize_t i = 0; i < m; i++) {                                          \
                    o[s + i] = (x[s + i] * (T)0.5) * ((T)1 + r[i]);                           \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

typedef struct {
    long kind;
    void *out;
    const void *x, *g, *e;  /* g NULL: the forward; e NULL: NumPy's exp loop makes it */
    Py_ssize_t n;
} gelu_ctx;

static void
gelu_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    gelu_ctx *c = arg;
    Py_ssize_t first, last;
    pool_range(c->n, part, parts, 256, &first, &last);
    if (c->kind) {
        GELU_TILE(double, for (Py_ssize_t i = 0; i < m; i++) r[i] = erf(z[i]))
    } else {
        GELU_TILE(float, erf_block(r, z, m))
    }
}

static PyObject *
gelu_op(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 3 || nargs > 5) {
        PyErr_Format(PyExc_TypeError, "gelu_op(kind, out, x[, g[, e]]) takes 3 to 5 arguments, "
                     "got %zd", nargs);
        return NULL;
    }
    long kind;
    Py_ssize_t itemsize = float_kind(args[0], "gelu_op", &kind);
    if (itemsize == 0) {
        return NULL;
    }
    int backward = nargs >= 4;
    if (nargs == 4 && loops[LOOP_EXP][kind] == NULL) {
        Py_RETURN_FALSE;  /* NOTE: no exp of NumPy's here: the caller gives e */
    }
    Py_buffer views[4];
    int held, refuse = acquire_alike(args + 1, (int)nargs - 1, itemsize, views, &held);
    if (!refuse) {
        gelu_ctx ctx = {kind, views[0].buf, views[1].buf, backward ? views[2].buf : NULL,
                        nargs == 5 ? views[3].buf : NULL, views[0].len / itemsize};
        Py_BEGIN_ALLOW_THREADS
        pool_run(gelu_part, &ctx, pool_parts(ctx.n, pool.grain / 8, ctx.n));
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}
#undef GELU_TILE

/* Max pooling, PyTorch's CPU scan (`numpy_max_pool2d` in backends/base.py is its twin and
 * specification): each window's elements of x in row-major order, the padding skipped, a
 * running maximum from -inf, an element taken where it is greater or NaN (the first maximum,
 * or the last NaN), its index h * W + w within the plane starting at the window's first
 * element (a window of -inf). One output row at a time, its running maxima and indices kept
 * in place in out and `where`: for each window offset the loop runs along the row, whose
 * outputs are independent, so their selects overlap in the pipeline (a scan of one window
 * at a time is one chain of dependent selects). The selects are integer masks: written as
 * `take ? v : b`, gcc 12 made them branches, which mispredict on random data (20.8 against
 * 7.8 ms of CPU time for the forward of ResNet-50's pool, AMD EPYC family 25 model 17). */
#define MAX_POOL(T, U, NAME)                                                                  \
static void                                                                                   \
NAME(T *out, int64_t *where, Py_ssize_t row_stride, const T *x, Py_ssize_t planes,           \
     Py_ssize_t h, Py_ssize_t w, Py_ssize_t ho, Py_ssize_t wo, const Py_ssize_t *geometry)   \
{                                                                                             \
    Py_ssize_t kh = geometry[0], kw = geometry[1], sh = geometry[2], sw = geometry[3];        \
    Py_ssize_t ph = geometry[4], pw = geometry[5];                                            \
    for (Py_ssize_t p = 0; p < planes; p++) {                                                 \
        const T *plane = x + p * h * w;                                                       \
        for (Py_ssize_t oy = 0; oy < ho; oy++) {                                              \
            T *restrict best = out + (p * ho + oy) * wo;                                      \
            int64_t *restrict at = where + (p * ho + oy) * row_stride;                        \
            Py_ssize_t y0 = oy * sh - ph, y1 = y0 + kh < h ? y0 + kh : h;                     \
            y0 = y0 < 0 ? 0 : y0;                                                             \
            for (Py_ssize_t ox = 0; ox < wo; ox++) {                                          \
                Py_ssize_t x0 = ox * sw - pw;                                                 \
                best[ox] = -INFINITY;                                                         \
                at[ox] = y0 * w + (x0 < 0 ? 0 : x0);                                          \
            }                                                                                 \
            for (Py_ssize_t y = y0; y < y1; y++) {                                            \
                const T *restrict row = plane + y * w;                                        \
                for (Py_ssize_t j = 0; j < kw; j++) {                                         \
                    /* the outputs whose column ox * sw - pw + j lies in [0, w) */            \
                    /* (a negative last column: none; C's division truncates to 0) */     \
                    Py_ssize_t lo = j >= pw ? 0 : (pw - j + sw - 1) / sw;                     \
                    Py_ssize_t last = w - 1 + pw - j;                                         \
                    Py_ssize_t hi = last < 0 ? 0 : last / sw + 1;                             \
                    hi = hi < wo ? hi : wo;                                                   \
                    for (Py_ssize_t ox = lo; ox < hi; ox++) {                                 \
                        Py_ssize_t c = ox * sw - pw + j;                                      \
                        T v = row[c], b = best[ox];                                           \
                        U vbits, bbits;                                                       \
                        memcpy(&vbits, &v, sizeof v);                                         \
                        memcpy(&bbits, &b, sizeof b);                                         \
                        /* masks of all ones where taken: selects with no branch */           \
                        U take = (U)0 - (U)((v > b) | (v != v));                              \
                        int64_t take_at = -(int64_t)((v > b) | (v != v));                     \
                        bbits = (vbits & take) | (bbits & ~take);                             \
                        memcpy(&best[ox], &bbits, sizeof b);                                  \
                        at[ox] = ((int64_t)(y * w + c) & take_at) | (at[ox] & ~take_at);      \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
}
MAX_POOL(float, uint32_t, max_pool_f32)
MAX_POOL(double, uint64_t, max_pool_f64)
#undef MAX_POOL

/* Max pooling's backward: out = zeros, then grad added at each index, plane by plane, each
 * plane's outputs in row-major order (PyTorch's CPU order). The indices were checked. */
#define MAX_POOL_BACKWARD(T, NAME)                                                            \
static void                                                                                   \
NAME(T *out, const T *grad, const int64_t *indices, Py_ssize_t planes, Py_ssize_t size,       \
     Py_ssize_t count)                                                                        \
{                                                                                             \
    memset(out, 0, (size_t)(planes * size) * sizeof(T));                                      \
    for (Py_ssize_t p = 0; p < planes; p++) {                                                 \
        T *o = out + p * size;                                                                \
        const T *g = grad + p * count;                                                        \
        const int64_t *at = indices + p * count;                                              \
        for (Py_ssize_t i = 0; i < count; i++) {                                              \
            o[at[i]] += g[i];                                                                 \
        }                                                                                     \
    }                                                                                         \
}
MAX_POOL_BACKWARD(float, max_pool_backward_f32)
MAX_POOL_BACKWARD(double, max_pool_backward_f64)
#undef MAX_POOL_BACKWARD

typedef struct {
    long kind;
    void *out;
    int64_t *where;          /* the indices, or a row of scratch a part (row_stride 0) */
    Py_ssize_t row_stride;
    const void *x;
    Py_ssize_t planes, h, w, ho, wo;
    const Py_ssize_t *geometry;
} pool_ctx;

/* A part of max_pool: a range of planes. */
static void
max_pool_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    pool_ctx *c = arg;
    Py_ssize_t p0, p1, out_plane = c->ho * c->wo, in_plane = c->h * c->w;
    pool_range(c->planes, part, parts, 1, &p0, &p1);
    if (p0 >= p1) {
        return;
    }
    int64_t *where = c->row_stride ? c->where + p0 * out_plane : c->where + part * c->wo;
    size_t item = c->kind ? sizeof(double) : sizeof(float);
    void *out = (char *)c->out + (size_t)(p0 * out_plane) * item;
    const void *x = (const char *)c->x + (size_t)(p0 * in_plane) * item;
    if (c->kind) {
        max_pool_f64(out, where, c->row_stride, x, p1 - p0, c->h, c->w, c->ho, c->wo,
                     c->geometry);
    } else {
        max_pool_f32(out, where, c->row_stride, x, p1 - p0, c->h, c->w, c->ho, c->wo,
                     c->geometry);
    }
}

/* A part of max_pool_backward: a range of planes (planes = h, size = w, count = ho). */
static void
max_pool_backward_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    pool_ctx *c = arg;
    Py_ssize_t p0, p1, size = c->w, count = c->ho;
    pool_range(c->planes, part, parts, 1, &p0, &p1);
    if (p0 >= p1) {
        return;
    }
    size_t item = c->kind ? sizeof(double) : sizeof(float);
    void *out = (char *)c->out + (size_t)(p0 * size) * item;
    const void *grad = (const char *)c->x + (size_t)(p0 * count) * item;
    const int64_t *at = c->where + p0 * count;
    if (c->kind) {
        max_pool_backward_f64(out, grad, at, p1 - p0, size, count);
    } else {
        max_pool_backward_f32(out, grad, at, p1 - p0, size, count);
    }
}

/* max_pool(kind, out, indices, x, kh, kw, sh, sw, ph, pw): max pooling of a C-contiguous 4-D
 * float32 (kind 0) or float64 (kind 1) x into out (N, C, Ho, Wo) of its dtype and the int64
 * indices of out's shape (or None); every window holds an element of x (the caller checked
 * the geometry; checked again here). False, nothing written, for anything else. */
static PyObject *
max_pool(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "max_pool(kind, out, indices, x, kh, kw, sh, sw, ph, pw) "
                     "takes 10 arguments, got %zd", nargs);
        return NULL;
    }
    long kind;
    Py_ssize_t itemsize = float_kind(args[0], "max_pool", &kind);
    if (itemsize == 0) {
        return NULL;
    }
    Py_ssize_t geometry[6];
    for (int k = 0; k < 6; k++) {
        geometry[k] = PyLong_AsSsize_t(args[4 + k]);
        if (geometry[k] == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    int want = args[2] != Py_None;
    Py_buffer views[3];  /* out, x, indices */
    int held, refuse = acquire_pair(args[1], args[3], views, &held);
    if (!refuse && want) {
        refuse = acquire(args[2], &views[2], 1);
        held += !refuse;
    }
    if (!refuse) {
        Py_buffer *o = &views[0], *x = &views[1];
        refuse = !(o->itemsize == itemsize && x->itemsize == itemsize && o->ndim == 4
                   && x->ndim == 4 && o->shape[0] == x->shape[0] && o->shape[1] == x->shape[1]
                   && apart(o, x));
        refuse = refuse || (want && !(same_shape(&views[2], o, 8) && apart(&views[2], o)
                                      && apart(&views[2], x)));
        for (int d = 0; d < 2 && !refuse; d++) {
            Py_ssize_t k = geometry[d], s = geometry[2 + d], pad = geometry[4 + d];
            refuse = !(k >= 1 && s >= 1 && pad >= 0 && pad <= k / 2
                       && x->shape[2 + d] + 2 * pad >= k
                       && o->shape[2 + d] == (x->shape[2 + d] + 2 * pad - k) / s + 1);
        }
    }
    if (!refuse) {
        Py_ssize_t planes = views[1].shape[0] * views[1].shape[1];
        Py_ssize_t h = views[1].shape[2], w = views[1].shape[3];
        Py_ssize_t ho = views[0].shape[2], wo = views[0].shape[3];
        Py_ssize_t parts = pool_parts(planes * h * w, pool.grain, planes);
        /* without indices, one row of scratch for them a part, used again for every row */
        int64_t *where = want ? views[2].buf : malloc((size_t)(parts * wo) * sizeof(int64_t));
        pool_ctx ctx = {kind, views[0].buf, where, want ? wo : 0, views[1].buf, planes, h, w,
                        ho, wo, geometry};
        if (where == NULL) {
            refuse = 1;  /* NOTE: the twin runs */
        } else {
            Py_BEGIN_ALLOW_THREADS
            pool_run(max_pool_part, &ctx, parts);
            Py_END_ALLOW_THREADS
            if (!want) {
                free(where);
            }
        }
    }
    return released(views, held, refuse);
}

/* max_pool_backward(kind, out, grad, indices): `max_pool`'s gradient, C-contiguous float32
 * (kind 0) or float64 (kind 1) out (N, C, H, W) and grad (N, C, Ho, Wo), int64 indices of
 * grad's shape, each in [0, H * W) (checked before anything is written). False, nothing
 * written, for anything else. */
static PyObject *
max_pool_backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "max_pool_backward(kind, out, grad, indices) takes 4 "
                     "arguments, got %zd", nargs);
        return NULL;
    }
    long kind;
    Py_ssize_t itemsize = float_kind(args[0], "max_pool_backward", &kind);
    if (itemsize == 0) {
        return NULL;
    }
    Py_buffer views[3];  /* out, grad, indices */
    int held = 0, refuse = 0;
    while (held < 3 && !refuse) {
        if ((refuse = acquire(args[1 + held], &views[held], held == 0))) {
            break;
        }
        held++;
    }
    if (!refuse) {
        Py_buffer *o = &views[0], *g = &views[1], *at = &views[2];
        refuse = !(o->itemsize == itemsize && o->ndim == 4 && g->ndim == 4
                   && g->itemsize == itemsize && same_shape(at, g, 8)
                   && g->shape[0] == o->shape[0] && g->shape[1] == o->shape[1]
                   && apart(o, g) && apart(o, at));
    }
    Py_ssize_t planes = 0, size = 0, count = 0;
    if (!refuse) {
        planes = views[0].shape[0] * views[0].shape[1];
        size = views[0].shape[2] * views[0].shape[3];
        count = views[1].shape[2] * views[1].shape[3];
        const int64_t *at = views[2].buf;
        for (Py_ssize_t i = 0; i < planes * count && !refuse; i++) {
            refuse = at[i] < 0 || at[i] >= size;  /* NOTE: the twin raises, naming it */
        }
    }
    if (!refuse) {
        pool_ctx ctx = {kind, views[0].buf, views[2].buf, 0, views[1].buf, planes, 0, size,
                        count};
        Py_BEGIN_ALLOW_THREADS
        pool_run(max_pool_backward_part, &ctx, pool_parts(planes * size, pool.grain, planes));
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

/* A 2-D transpose in tiles: out (rows, cols) = the transpose of src (cols, rows), both
 * C-contiguous. NumPy's copy of a transposed view walks out in order and reads src a column at
 * a time, one cache line for each element (a (512, 4608) float32 weight gradient: 12 ms, 0.75
 * GB/s, on an AMD EPYC); a tile of TILE x TILE items is read and written in lines. */
#define TILE 16
#define TRANSPOSE(type, name)                                                                \
static void                                                                                  \
name(type *out, const type *src, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t r0,           \
     Py_ssize_t r1)                                                                          \
{                                                                                            \
    for (Py_ssize_t i0 = r0; i0 < r1; i0 += TILE) {                                          \
        Py_ssize_t i1 = i0 + TILE < r1 ? i0 + TILE : r1;                                     \
        for (Py_ssize_t j0 = 0; j0 < cols; j0 += TILE) {                                     \
            Py_ssize_t j1 = j0 + TILE < cols ? j0 + TILE : cols;                             \
            for (Py_ssize_t i = i0; i < i1; i++) {                                           \
                for (Py_ssize_t j = j0; j < j1; j++) {                                       \
                    out[i * cols + j] = src[j * rows + i];                                   \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}
TRANSPOSE(uint16_t, transpose_2)
TRANSPOSE(uint32_t, transpose_4)
TRANSPOSE(uint64_t, transpose_8)

typedef struct {
    size_t size;
    void *out;
    const void *src;
    Py_ssize_t rows, cols;
} transpose_ctx;

/* A part of transpose: a range of out's rows, in whole tiles. */
static void
transpose_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    transpose_ctx *c = arg;
    Py_ssize_t r0, r1;
    pool_range(c->rows, part, parts, TILE, &r0, &r1);
    if (c->size == 2) {
        transpose_2(c->out, c->src, c->rows, c->cols, r0, r1);
    } else if (c->size == 4) {
        transpose_4(c->out, c->src, c->rows, c->cols, r0, r1);
    } else {
        transpose_8(c->out, c->src, c->rows, c->cols, r0, r1);
    }
}
#undef TRANSPOSE
#undef TILE

/* transpose(out, src): out (rows, cols) = src (cols, rows) transposed, both C-contiguous 2-D
 * buffers of 2-, 4- or 8-byte items that share no byte; False, nothing written, otherwise. */
static PyObject *
transpose(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "transpose(out, src) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer views[2];  /* out, src */
    int held, refuse = acquire_pair(args[0], args[1], views, &held);
    if (!refuse) {
        Py_buffer *o = &views[0], *x = &views[1];
        Py_ssize_t size = o->itemsize;
        refuse = !(o->ndim == 2 && x->ndim == 2 && x->itemsize == size
                   && (size == 2 || size == 4 || size == 8) && o->shape[0] == x->shape[1]
                   && o->shape[1] == x->shape[0] && apart(o, x));
    }
    if (!refuse) {
        transpose_ctx ctx = {(size_t)views[0].itemsize, views[0].buf, views[1].buf,
                             views[0].shape[0], views[0].shape[1]};
        Py_BEGIN_ALLOW_THREADS
        pool_run(transpose_part, &ctx, pool_parts(ctx.rows * ctx.cols, pool.grain, ctx.rows));
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

/* Per-channel statistics of a C-contiguous (n, c, s) float32 or float64 x, each channel's
 * sums in double, in one fixed order (the samples in turn, each row of s in eight lanes added
 * in pairs at its end), so a graph's replay gives eager's bits:
 * moments(kind, mean, m2, x): mean[k] = the mean of x[:, k, :]; m2[k] = the sum of
 * (x - mean)**2 over the same elements, a second pass around the mean in double (no
 * cancellation, where E[x**2] - E[x]**2 loses every digit of a large mean);
 * channel_dots(kind, sums, dots, g, y): sums[k] = the sum of g[:, k, :], dots[k] = the sum of
 * g * y (each product in double) there. Outputs are contiguous runs of c items that share no
 * byte with an input. Batch norm's forward and backward statistics (runtime/ops.py). */
#define LANES 8
#define CHANNEL_STATS(T, SUFFIX, ATTR)                                                        \
    ATTR static double row_sum_##SUFFIX(const T *p, Py_ssize_t s, double centre)              \
    {                                                                                        \
        double a[LANES] = {0};                                                               \
        Py_ssize_t j = 0;                                                                    \
        for (; j + LANES <= s; j += LANES)                                                   \
            for (int k = 0; k < LANES; k++) a[k] += (double)p[j + k] - centre;               \
        for (int k = 0; j < s; j++, k++) a[k] += (double)p[j] - centre;                      \
        return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));            \
    }                                                                                        \
    ATTR static double row_squares_##SUFFIX(const T *p, Py_ssize_t s, double centre)          \
    {                                                                                        \
        double a[LANES] = {0};                                                               \
        Py_ssize_t j = 0;                                                                    \
        for (; j + LANES <= s; j += LANES)                                                   \
            for (int k = 0; k < LANES; k++) {                                                \
                double d = (double)p[j + k] - centre;                                        \
                a[k] += d * d;                                                               \
            }                                                                                \
        for (int k = 0; j < s; j++, k++) {                                                   \
            double d = (double)p[j] - centre;                                                \
            a[k] += d * d;                                                                   \
        }                                                                                    \
        return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));            \
    }                                                                                        \
    ATTR static double row_dots_##SUFFIX(const T *p, const T *q, Py_ssize_t s)                \
    {                                                                                        \
        double a[LANES] = {0};                                                               \
        Py_ssize_t j = 0;                                                                    \
        for (; j + LANES <= s; j += LANES)                                                   \
            for (int k = 0; k < LANES; k++) a[k] += (double)p[j + k] * (double)q[j + k];     \
        for (int k = 0; j < s; j++, k++) a[k] += (double)p[j] * (double)q[j];                \
        return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));            \
    }                                                                                        \
    ATTR static void moments_##SUFFIX(T *mean, T *m2, const T *x, Py_ssize_t n,              \
                                      Py_ssize_t c, Py_ssize_t s, Py_ssize_t k0,              \
                                      Py_ssize_t k1)                                          \
    {                                                                                        \
        double count = (double)n * (double)s;                                                \
        for (Py_ssize_t k = k0; k < k1; k++) {                                               \
            double total = 0.0, squares = 0.0;                                               \
            for (Py_ssize_t i = 0; i < n; i++) total += row_sum_##SUFFIX(x + (i * c + k) * s, \
                                                                         s, 0.0);            \
            double centre = total / count;                                                   \
            for (Py_ssize_t i = 0; i < n; i++)                                               \
                squares += row_squares_##SUFFIX(x + (i * c + k) * s, s, centre);             \
            mean[k] = (T)centre;                                                             \
            m2[k] = (T)squares;                                                              \
        }                                                                                    \
    }                                                                                        \
    ATTR static void channel_dots_##SUFFIX(T *sums, T *dots, const T *g, const T *y,         \
                                           Py_ssize_t n, Py_ssize_t c, Py_ssize_t s,          \
                                           Py_ssize_t k0, Py_ssize_t k1)                      \
    {                                                                                        \
        for (Py_ssize_t k = k0; k < k1; k++) {                                               \
            double total = 0.0, dot = 0.0;                                                   \
            for (Py_ssize_t i = 0; i < n; i++) {                                             \
                const T *p = g + (i * c + k) * s, *q = y + (i * c + k) * s;                  \
                total += row_sum_##SUFFIX(p, s, 0.0);                                        \
                dot += row_dots_##SUFFIX(p, q, s);                                           \
            }                                                                                \
            sums[k] = (T)total;                                                              \
            dots[k] = (T)dot;                                                                \
        }                                                                                    \
    }

FLOAT_VARIANTS(CHANNEL_STATS)
#undef CHANNEL_STATS
#undef LANES

/* The (n, c, s) operands of moments / channel_dots: `inputs` buffers of one 3-D shape and
 * item size, then two outputs of c items each, every output apart from every other buffer.
 * Returns the number of buffers held (all, or fewer with *refuse set). */
typedef struct {
    long kind;
    int inputs;
    void *o1, *o2;
    const void *a, *b;
    Py_ssize_t n, c, s;
} stats_ctx;

static void
stats_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    stats_ctx *x = arg;
    Py_ssize_t k0, k1;
    pool_range(x->c, part, parts, 1, &k0, &k1);
    if (x->inputs == 1 && x->kind) {
        PICK(moments, f64)(x->o1, x->o2, x->a, x->n, x->c, x->s, k0, k1);
    } else if (x->inputs == 1) {
        PICK(moments, f32)(x->o1, x->o2, x->a, x->n, x->c, x->s, k0, k1);
    } else if (x->kind) {
        PICK(channel_dots, f64)(x->o1, x->o2, x->a, x->b, x->n, x->c, x->s, k0, k1);
    } else {
        PICK(channel_dots, f32)(x->o1, x->o2, x->a, x->b, x->n, x->c, x->s, k0, k1);
    }
}

static int
stats_views(PyObject *const *args, int inputs, Py_ssize_t itemsize, Py_buffer *views,
            int *refuse)
{
    int held = 0;
    *refuse = 0;
    for (int k = 0; k < 2 + inputs && !*refuse; k++) {
        *refuse = acquire(args[k], &views[k], k < 2);
        held += !*refuse;
    }
    for (int k = 2; k < held && !*refuse; k++) {
        *refuse = !(views[k].itemsize == itemsize && views[k].ndim == 3
                    && same_shape(&views[k], &views[2], itemsize));
    }
    for (int k = 0; k < 2 && !*refuse; k++) {
        *refuse = !(views[k].itemsize == itemsize && views[k].len == views[2].shape[1] * itemsize);
        for (int other = 0; other < held && !*refuse; other++) {
            *refuse = other != k && !apart(&views[k], &views[other]);
        }
    }
    return held;
}

static PyObject *
channel_stats(const char *name, int inputs, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 + inputs) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments, got %zd", name, 3 + inputs, nargs);
        return NULL;
    }
    long kind;
    Py_ssize_t itemsize = float_kind(args[0], name, &kind);
    if (itemsize == 0) {
        return NULL;
    }
    Py_buffer views[4];
    int refuse;
    int held = stats_views(args + 1, inputs, itemsize, views, &refuse);
    if (!refuse) {
        stats_ctx ctx = {kind, inputs, views[0].buf, views[1].buf, views[2].buf,
                         inputs == 2 ? views[3].buf : NULL, views[2].shape[0],
                         views[2].shape[1], views[2].shape[2]};
        Py_ssize_t items = ctx.n * ctx.c * ctx.s * inputs;
        Py_BEGIN_ALLOW_THREADS
        pool_run(stats_part, &ctx, pool_parts(items, pool.grain, ctx.c));
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

static PyObject *
moments(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return channel_stats("moments(kind, mean, m2, x)", 1, args, nargs);
}

static PyObject *
channel_dots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return channel_stats("channel_dots(kind, sums, dots, g, y)", 2, args, nargs);
}

/* chain(plan): a fused chain of the table's ops (a graph's elementwise chain, `Device.fused`)
 * on float32 or float64, in tiles of CHAIN_TILE items: each link's loop is the op's own
 * (`optable_*`, one IEEE operation per step, so every link rounds as its kernel alone would
 * and the chain gives the bits of its links run one by one), its result kept in a tile of
 * scratch, the last link's written into out. `plan` is a contiguous int64 buffer, made by the
 * NumPy device (backends/numpy.py, `_chain_plan`): kind (0 float32, 1 float64), links,
 * operands, ndim (2 to CHAIN_DIMS), out's address; out's dims (out is C-contiguous); each
 * link's code and two references (k >= 0 operand k, k < 0 link -1 - k; the second unread by
 * a unary op); each operand's address and its ndim strides in items over out's dims (zero
 * where it is broadcast). The last two dims are walked in tiles, the others one index at a
 * time. out may be an operand's identical view: each tile is read before it is written. */
#define CHAIN_TILE 512
#define CHAIN_DIMS 8
#define CHAIN_OPERANDS 64
#define CHAIN_RUN(T, SUFFIX, ATTR)                                                            \
    ATTR static void chain_##SUFFIX(const int64_t *head, const int64_t *dims,                 \
                                    const int64_t *links, const int64_t *operands,           \
                                    T *scratch, Py_ssize_t first, Py_ssize_t last)           \
    {                                                                                        \
        Py_ssize_t nlinks = head[1], nops = head[2], ndim = head[3];                         \
        Py_ssize_t mid = dims[ndim - 2], inner = dims[ndim - 1], plane = mid * inner;        \
        Py_ssize_t tiles = (plane + CHAIN_TILE - 1) / CHAIN_TILE, idx[CHAIN_DIMS] = {0};     \
        T *out = (T *)(uintptr_t)head[4];                                                    \
        T *fills = scratch + nlinks * CHAIN_TILE;                                            \
        const T *src[CHAIN_OPERANDS], *filled[CHAIN_OPERANDS] = {NULL};                      \
        Py_ssize_t filled_n[CHAIN_OPERANDS] = {0};                                           \
        const int64_t step = 1 + ndim;                                                       \
        Py_ssize_t o = first / tiles;                                                        \
        for (Py_ssize_t d = ndim - 3, rest = o; d >= 0; d--) { /* o's outer index */         \
            idx[d] = rest % dims[d];                                                         \
            rest /= dims[d];                                                                 \
        }                                                                                    \
        for (Py_ssize_t t = first; t < last; o++) {                                          \
            Py_ssize_t t_end = (o + 1) * tiles < last ? (o + 1) * tiles : last;              \
            for (Py_ssize_t f0 = (t - o * tiles) * CHAIN_TILE; t < t_end;                    \
                 t++, f0 += CHAIN_TILE) {                                                    \
                Py_ssize_t n = plane - f0 < CHAIN_TILE ? plane - f0 : CHAIN_TILE;             \
                for (Py_ssize_t k = 0; k < nops; k++) {                                      \
                    const int64_t *op = operands + step * k;                                 \
                    const T *base = (const T *)(uintptr_t)op[0];                             \
                    for (Py_ssize_t d = 0; d < ndim - 2; d++) base += idx[d] * op[1 + d];    \
                    Py_ssize_t sm = op[ndim - 1], si = op[ndim];                             \
                    if (si == 1 && (sm == inner || mid == 1)) {                              \
                        src[k] = base + f0;                                                  \
                        continue;                                                            \
                    }                                                                        \
                    T *d = fills + k * CHAIN_TILE;                                           \
                    Py_ssize_t m = f0 / inner, i = f0 % inner, left = n;                     \
                    src[k] = d;                                                              \
                    if (si == 0 && i + n <= inner) { /* one value: filled already? */        \
                        const T *p = base + m * sm;                                          \
                        if (filled[k] == p && filled_n[k] >= n) continue;                    \
                        filled[k] = p;                                                       \
                        filled_n[k] = n;                                                     \
                    } else {                                                                 \
                        filled[k] = NULL;                                                    \
                    }                                                                        \
                    while (left > 0) {                                                       \
                        Py_ssize_t run = inner - i < left ? inner - i : left;                \
                        const T *p = base + m * sm + i * si;                                 \
                        if (si == 1) {                                                       \
                            memcpy(d, p, (size_t)run * sizeof(T));                           \
                        } else if (si == 0) {                                                \
                            T v = *p;                                                        \
                            for (Py_ssize_t r = 0; r < run; r++) d[r] = v;                   \
                        } else {                                                             \
                            for (Py_ssize_t r = 0; r < run; r++) d[r] = p[r * si];           \
                        }                                                                    \
                        d += run;                                                            \
                        left -= run;                                                         \
                        m++;                                                                 \
                        i = 0;                                                               \
                    }                                                                        \
                }                                                                            \
                for (Py_ssize_t l = 0; l < nlinks; l++) {                                    \
                    const int64_t *link = links + 3 * l;                                     \
                    T *r = l == nlinks - 1 ? out + o * plane + f0 : scratch + l * CHAIN_TILE; \
                    const T *a = link[1] >= 0 ? src[link[1]]                                 \
                                              : scratch + (-1 - link[1]) * CHAIN_TILE;       \
                    const T *b = link[2] >= 0 ? src[link[2]]                                 \
                                              : scratch + (-1 - link[2]) * CHAIN_TILE;       \
                    if (link[0] == OP_COPY) {                                                \
                        if (r != a) memmove(r, a, (size_t)n * sizeof(T));                    \
                    } else if (link[0] >= OP_COUNT) { /* NumPy's loop: `set_loop` */         \
                        numpy_unary((int)(link[0] - OP_COUNT), (int)head[0], r, a, n,        \
                                    sizeof(T));                                              \
                    } else {                                                                 \
                        optable_##SUFFIX((int)link[0], r, a, b, 1, n, 0);                    \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            for (Py_ssize_t d = ndim - 3; d >= 0; d--) { /* the next outer index */          \
                if (++idx[d] < dims[d]) break;                                               \
                idx[d] = 0;                                                                  \
            }                                                                                \
        }                                                                                    \
    }

FLOAT_VARIANTS(CHAIN_RUN)
#undef CHAIN_RUN

typedef struct {
    const int64_t *plan, *dims, *links, *operands;
    char *scratch;      /* a part's scratch at part * scratch_size */
    size_t scratch_size;
    Py_ssize_t tiles;   /* the chain's tiles: its outer indices times each plane's tiles */
} chain_ctx;

static void
chain_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    chain_ctx *c = arg;
    Py_ssize_t first, last;
    pool_range(c->tiles, part, parts, 1, &first, &last);
    void *scratch = c->scratch + (size_t)part * c->scratch_size;
    if (first >= last) {
        return;
    }
    if (c->plan[0]) {
        PICK(chain, f64)(c->plan, c->dims, c->links, c->operands, scratch, first, last);
    } else {
        PICK(chain, f32)(c->plan, c->dims, c->links, c->operands, scratch, first, last);
    }
}

static PyObject *
chain(PyObject *self, PyObject *plan_obj)
{
    Py_buffer view;
    if (PyObject_GetBuffer(plan_obj, &view, PyBUF_C_CONTIGUOUS) < 0) {
        return NULL;
    }
    const int64_t *plan = view.buf;
    Py_ssize_t count = view.len / (Py_ssize_t)sizeof(int64_t);
    int bad = view.itemsize != 8 || count < 5;
    int64_t nlinks = bad ? 0 : plan[1], nops = bad ? 0 : plan[2], ndim = bad ? 0 : plan[3];
    bad = bad || plan[0] < 0 || plan[0] > 1 || nlinks < 1 || nops < 0 || nops > CHAIN_OPERANDS
        || ndim < 2 || ndim > CHAIN_DIMS
        || count != 5 + ndim + 3 * nlinks + (1 + ndim) * nops;
    for (int64_t d = 0; d < ndim && !bad; d++) {
        bad = plan[5 + d] < 0 || (d == ndim - 1 && plan[5 + d] < 1);
    }
    const int64_t *links = plan + 5 + ndim;
    for (int64_t l = 0; l < nlinks && !bad; l++) {
        const int64_t *link = links + 3 * l;
        bad = link[0] < 0 || link[0] >= OP_COUNT + LOOP_LINKS
            || (link[0] >= OP_COUNT && loops[link[0] - OP_COUNT][plan[0] ? 1 : 0] == NULL);
        int arity = bad ? 0 : link[0] >= OP_COUNT ? 1 : op_arity[link[0]];
        for (int k = 1; k <= arity && !bad; k++) {
            bad = link[k] >= nops || link[k] < -l;  /* an operand, or an earlier link */
        }
    }
    if (bad) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "chain: the plan is malformed");
        return NULL;
    }
    size_t itemsize = plan[0] ? sizeof(double) : sizeof(float);
    void *scratch = malloc((size_t)(nlinks + nops) * CHAIN_TILE * itemsize);
    if (scratch == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    const int64_t *dims = plan + 5, *operands = links + 3 * nlinks;
    chain_ctx ctx = {plan, dims, links, operands, scratch, (size_t)(nlinks + nops) * CHAIN_TILE
                     * itemsize, 1};
    for (int64_t d = 0; d < ndim - 2; d++) {
        ctx.tiles *= dims[d];
    }
    Py_ssize_t plane = dims[ndim - 2] * dims[ndim - 1], items = ctx.tiles * plane;
    ctx.tiles *= (plane + CHAIN_TILE - 1) / CHAIN_TILE;
    Py_ssize_t parts = pool_parts(items * (nops + 1), pool.grain, ctx.tiles);
    if (parts > 1) {
        free(scratch);
        scratch = malloc((size_t)parts * ctx.scratch_size);
        if (scratch == NULL) {
            PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
        ctx.scratch = scratch;
    }
    Py_BEGIN_ALLOW_THREADS
    pool_run(chain_part, &ctx, parts);
    Py_END_ALLOW_THREADS
    free(scratch);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* im2col(columns, x, kh, kw, sh, sw, ph, pw): a convolution's columns, (C*kh*kw, N*Ho*Wo),
 * from a C-contiguous NCHW x of 2-, 4- or 8-byte items (bits moved, any dtype): row (c, i, j),
 * column (n, oh, ow) holds x[n, c, oh*sh + i - ph, ow*sw + j - pw], zero outside x (the
 * padding), written in one pass with no padded copy of x. col2im(kind, out, columns, kh, kw,
 * sh, sw, ph, pw): its adjoint on float32 (kind 0) or float64 (kind 1): out (N, C, H, W)
 * zeroed, then each column's item added where im2col took it from, for each element in the
 * order of (i, j). Each returns False, having written nothing, for anything else. */
/* The outputs ow of a row whose window column j lands inside x: [lo, hi). */
static void
valid_columns(Py_ssize_t j, Py_ssize_t sw, Py_ssize_t pw, Py_ssize_t w, Py_ssize_t wo,
              Py_ssize_t *lo, Py_ssize_t *hi)
{
    Py_ssize_t first = pw - j > 0 ? (pw - j + sw - 1) / sw : 0;
    Py_ssize_t last = w - 1 + pw - j;  /* the last ow * sw that lands inside */
    Py_ssize_t end = last >= 0 ? last / sw + 1 : 0;
    *hi = end < wo ? end : wo;
    *lo = first < *hi ? first : *hi;
}

#define IM2COL(T, SUFFIX)                                                                     \
    static void im2col_##SUFFIX(T *cols, const T *x, const Py_ssize_t *g, Py_ssize_t c0,     \
                                Py_ssize_t c1)                                               \
    {                                                                                        \
        Py_ssize_t n = g[0], c = g[1], h = g[2], w = g[3], kh = g[4], kw = g[5], sh = g[6];   \
        Py_ssize_t sw = g[7], ph = g[8], pw = g[9], ho = g[10], wo = g[11];                  \
        Py_ssize_t positions = n * ho * wo;                                                  \
        for (Py_ssize_t ch = c0; ch < c1; ch++)                                              \
            for (Py_ssize_t i = 0; i < kh; i++)                                              \
                for (Py_ssize_t j = 0; j < kw; j++) {                                        \
                    T *row = cols + ((ch * kh + i) * kw + j) * positions;                    \
                    Py_ssize_t lo, hi;                                                       \
                    valid_columns(j, sw, pw, w, wo, &lo, &hi);                               \
                    for (Py_ssize_t b = 0; b < n; b++) {                                     \
                        const T *plane = x + (b * c + ch) * h * w;                           \
                        for (Py_ssize_t oh = 0; oh < ho; oh++) {                             \
                            T *dst = row + (b * ho + oh) * wo;                               \
                            Py_ssize_t ih = oh * sh + i - ph;                                \
                            if (ih < 0 || ih >= h || lo == hi) {                             \
                                memset(dst, 0, (size_t)wo * sizeof(T));                      \
                                continue;                                                    \
                            }                                                                \
                            const T *src = plane + ih * w + lo * sw + j - pw;                \
                            for (Py_ssize_t ow = 0; ow < lo; ow++) dst[ow] = 0;              \
                            if (sw == 1) {                                                   \
                                memcpy(dst + lo, src, (size_t)(hi - lo) * sizeof(T));        \
                            } else {                                                         \
                                for (Py_ssize_t ow = lo; ow < hi; ow++)                      \
                                    dst[ow] = src[(ow - lo) * sw];                           \
                            }                                                                \
                            for (Py_ssize_t ow = hi; ow < wo; ow++) dst[ow] = 0;             \
                        }                                                                    \
                    }                                                                        \
                }                                                                            \
    }
IM2COL(uint16_t, 2)
IM2COL(uint32_t, 4)
IM2COL(uint64_t, 8)
#undef IM2COL

#define COL2IM(T, SUFFIX)                                                                     \
    static void col2im_##SUFFIX(T *x, const T *cols, const Py_ssize_t *g, Py_ssize_t p0,     \
                                Py_ssize_t p1)                                               \
    {                                                                                        \
        Py_ssize_t n = g[0], c = g[1], h = g[2], w = g[3], kh = g[4], kw = g[5], sh = g[6];   \
        Py_ssize_t sw = g[7], ph = g[8], pw = g[9], ho = g[10], wo = g[11];                  \
        Py_ssize_t positions = n * ho * wo;                                                  \
        (void)n;                                                                             \
        memset(x + p0 * h * w, 0, (size_t)((p1 - p0) * h * w) * sizeof(T));                  \
        for (Py_ssize_t p = p0; p < p1; p++) { /* plane p: image b, channel ch */            \
            Py_ssize_t b = p / c, ch = p % c;                                                \
                T *plane = x + (b * c + ch) * h * w;                                         \
                for (Py_ssize_t i = 0; i < kh; i++)                                          \
                    for (Py_ssize_t j = 0; j < kw; j++) {                                    \
                        const T *row = cols + ((ch * kh + i) * kw + j) * positions           \
                                       + b * ho * wo;                                        \
                        Py_ssize_t lo, hi;                                                   \
                        valid_columns(j, sw, pw, w, wo, &lo, &hi);                           \
                        for (Py_ssize_t oh = 0; oh < ho && lo < hi; oh++) {                  \
                            Py_ssize_t ih = oh * sh + i - ph;                                \
                            if (ih < 0 || ih >= h) continue;                                 \
                            T *dst = plane + ih * w + lo * sw + j - pw;                      \
                            const T *src = row + oh * wo + lo;                               \
                            if (sw == 1) {                                                   \
                                for (Py_ssize_t k = 0; k < hi - lo; k++) dst[k] += src[k];   \
                            } else {                                                         \
                                for (Py_ssize_t k = 0; k < hi - lo; k++)                     \
                                    dst[k * sw] += src[k];                                   \
                            }                                                                \
                        }                                                                    \
                    }                                                                        \
            }                                                                                \
    }
COL2IM(float, f32)
COL2IM(double, f64)
#undef COL2IM

typedef struct {
    int kind;  /* im2col: the item size; col2im: 0 float32, 1 float64 */
    void *out;
    const void *in;
    Py_ssize_t g[12];
} conv_ctx;

static void
im2col_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    conv_ctx *x = arg;
    Py_ssize_t c0, c1;
    pool_range(x->g[1], part, parts, 1, &c0, &c1);
    if (x->kind == 2) {
        im2col_2(x->out, x->in, x->g, c0, c1);
    } else if (x->kind == 4) {
        im2col_4(x->out, x->in, x->g, c0, c1);
    } else {
        im2col_8(x->out, x->in, x->g, c0, c1);
    }
}

static void
col2im_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    conv_ctx *x = arg;
    Py_ssize_t p0, p1;
    pool_range(x->g[0] * x->g[1], part, parts, 1, &p0, &p1);
    if (x->kind) {
        col2im_f64(x->out, x->in, x->g, p0, p1);
    } else {
        col2im_f32(x->out, x->in, x->g, p0, p1);
    }
}

/* The geometry arguments of im2col / col2im (kh, kw, sh, sw, ph, pw) after n, c, h, w of x
 * and before ho, wo, checked against the columns' shape; 0, or -1 with an error set. */
static int
conv_geometry(PyObject *const *args, const Py_buffer *x, const Py_buffer *cols, Py_ssize_t *g)
{
    for (int k = 0; k < 6; k++) {
        g[4 + k] = PyLong_AsSsize_t(args[k]);
        if (g[4 + k] == -1 && PyErr_Occurred()) {
            return -1;
        }
    }
    if (x->ndim != 4 || cols->ndim != 2) {
        return 1;
    }
    for (int d = 0; d < 4; d++) {
        g[d] = x->shape[d];
    }
    Py_ssize_t kh = g[4], kw = g[5], sh = g[6], sw = g[7], ph = g[8], pw = g[9];
    if (kh < 1 || kw < 1 || sh < 1 || sw < 1 || ph < 0 || pw < 0 || g[2] + 2 * ph < kh
        || g[3] + 2 * pw < kw) {
        return 1;
    }
    g[10] = (g[2] + 2 * ph - kh) / sh + 1;
    g[11] = (g[3] + 2 * pw - kw) / sw + 1;
    return !(cols->shape[0] == g[1] * kh * kw && cols->shape[1] == g[0] * g[10] * g[11]);
}

static PyObject *
im2col(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_Format(PyExc_TypeError, "im2col(columns, x, kh, kw, sh, sw, ph, pw) takes 8 "
                     "arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer views[2];  /* columns, x */
    int held, refuse = acquire_pair(args[0], args[1], views, &held);
    Py_ssize_t g[12];
    if (!refuse) {
        int bad = conv_geometry(args + 2, &views[1], &views[0], g);
        if (bad < 0) {
            released(views, held, 1);
            return NULL;
        }
        Py_ssize_t size = views[0].itemsize;
        refuse = bad || views[1].itemsize != size || !(size == 2 || size == 4 || size == 8)
            || !apart(&views[0], &views[1]);
    }
    if (!refuse) {
        conv_ctx ctx = {(int)views[0].itemsize, views[0].buf, views[1].buf};
        memcpy(ctx.g, g, sizeof ctx.g);
        Py_ssize_t parts = pool_parts(views[0].len / views[0].itemsize, pool.grain, g[1]);
        Py_BEGIN_ALLOW_THREADS
        pool_run(im2col_part, &ctx, parts);
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

static PyObject *
col2im(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "col2im(kind, out, columns, kh, kw, sh, sw, ph, pw) takes "
                     "9 arguments, got %zd", nargs);
        return NULL;
    }
    long kind;
    Py_ssize_t itemsize = float_kind(args[0], "col2im", &kind);
    if (itemsize == 0) {
        return NULL;
    }
    Py_buffer views[2];  /* out, columns */
    int held, refuse = acquire_pair(args[1], args[2], views, &held);
    Py_ssize_t g[12];
    if (!refuse) {
        int bad = conv_geometry(args + 3, &views[0], &views[1], g);
        if (bad < 0) {
            released(views, held, 1);
            return NULL;
        }
        refuse = bad || views[0].itemsize != itemsize || views[1].itemsize != itemsize
            || !apart(&views[0], &views[1]);
    }
    if (!refuse) {
        conv_ctx ctx = {(int)kind, views[0].buf, views[1].buf};
        memcpy(ctx.g, g, sizeof ctx.g);
        Py_ssize_t parts = pool_parts(views[1].len / itemsize, pool.grain, g[0] * g[1]);
        Py_BEGIN_ALLOW_THREADS
        pool_run(col2im_part, &ctx, parts);
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

/* set_loop(which, kind, loop, data): NumPy's loop `which` (0 exp, 1 log, 2 tanh, 3 add) for
 * float32 (kind 0) or float64 (kind 1), as the addresses of its inner loop and its data (loop
 * 0 forgets it); returns its chain code, OP_COUNT + which (a link only below LOOP_LINKS). The
 * caller checks its bits. */
static PyObject *
set_loop(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "set_loop(which, kind, loop, data) takes 4 arguments, "
                     "got %zd", nargs);
        return NULL;
    }
    long which = PyLong_AsLong(args[0]), kind;
    if (which == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (which < 0 || which >= LOOPS) {
        PyErr_Format(PyExc_ValueError, "set_loop: loop %ld is not one of 0 to %d", which,
                     LOOPS - 1);
        return NULL;
    }
    if (float_kind(args[1], "set_loop", &kind) == 0) {
        return NULL;
    }
    void *loop = PyLong_AsVoidPtr(args[2]), *data = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    pthread_mutex_lock(&pool.lock);  /* NOTE: not while a chain of the pool runs it */
    memcpy(&loops[which][kind], &loop, sizeof loop);
    loop_data[which][kind] = data;
    pthread_mutex_unlock(&pool.lock);
    return PyLong_FromLong(OP_COUNT + which);
}

typedef struct {
    long kind;
    size_t size;
    char *out;
    const char *x;
    Py_ssize_t rows, n;
} sum_last_ctx;

/* A part of sum_last: a range of rows, each out[r] = 0 then NumPy's add loop in reduce mode. */
static void
sum_last_part(void *arg, Py_ssize_t part, Py_ssize_t parts)
{
    sum_last_ctx *c = arg;
    Py_ssize_t lo, hi, steps[3] = {0, (Py_ssize_t)c->size, 0}, dims[1] = {c->n};
    pool_range(c->rows, part, parts, 1, &lo, &hi);
    for (Py_ssize_t r = lo; r < hi; r++) {
        char *o = c->out + (size_t)r * c->size;
        char *args[3] = {o, (char *)c->x + (size_t)(r * c->n) * c->size, o};
        if (c->kind) {
            *(double *)o = 0.0;
        } else {
            *(float *)o = 0.0f;
        }
        loops[LOOP_ADD][c->kind](args, dims, steps, loop_data[LOOP_ADD][c->kind]);
    }
}

/* sum_last(kind, out, x): the sum over the last axis of a C-contiguous float32 (kind 0) or
 * float64 (kind 1) x into out (its rows, contiguous), each row by NumPy's add loop as its
 * reduction calls it (`set_loop`'s LOOP_ADD), rows split over the pool; False, nothing written,
 * where the loop is not set, a row is longer than NumPy's buffer of 8192 items (NumPy then
 * sums it in pieces) or anything else does not fit. */
static PyObject *
sum_last(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "sum_last(kind, out, x) takes 3 arguments, got %zd",
                     nargs);
        return NULL;
    }
    long kind;
    Py_ssize_t itemsize = float_kind(args[0], "sum_last", &kind);
    if (itemsize == 0) {
        return NULL;
    }
    if (loops[LOOP_ADD][kind] == NULL) {
        Py_RETURN_FALSE;
    }
    Py_buffer views[2];
    int held = 0, refuse = acquire_pair(args[1], args[2], views, &held);
    Py_ssize_t n = 0, rows = 0;
    if (!refuse) {
        Py_buffer *o = &views[0], *v = &views[1];
        n = v->ndim >= 1 ? v->shape[v->ndim - 1] : 0;
        rows = n > 0 ? v->len / (n * itemsize) : 0;
        refuse = !(v->itemsize == itemsize && o->itemsize == itemsize && n >= 1 && n <= 8192
                   && rows >= 1 && o->len == rows * itemsize) || !apart(o, v);
    }
    if (!refuse) {
        sum_last_ctx ctx = {kind, (size_t)itemsize, views[0].buf, views[1].buf, rows, n};
        Py_BEGIN_ALLOW_THREADS
        pool_run(sum_last_part, &ctx, pool_parts(rows * n, pool.grain, rows));
        Py_END_ALLOW_THREADS
    }
    return released(views, held, refuse);
}

/* threads(n): the executors the pool splits a kernel over (the calling thread one of them),
 * 1 to POOL_MAX, or 0 to leave it; returns the count before. */
static PyObject *
threads(PyObject *self, PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0 || n > POOL_MAX) {
        PyErr_Format(PyExc_ValueError, "threads: %ld is not between 1 and %d (0 leaves it)", n,
                     POOL_MAX);
        return NULL;
    }
    int before = pool.threads;
    if (n > 0) {
        pthread_mutex_lock(&pool.lock);
        pool.threads = (int)n;
        pthread_mutex_unlock(&pool.lock);
    }
    return PyLong_FromLong(before);
}

/* tuning(spin_ns, grain): how long an idle worker spins before it sleeps, and the fewest items
 * of memory-bound work a part takes (each -1 to leave it); returns both before. */
static PyObject *
tuning(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "tuning(spin_ns, grain) takes 2 arguments, got %zd",
                     nargs);
        return NULL;
    }
    long long spin = PyLong_AsLongLong(args[0]);
    Py_ssize_t grain = spin == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (spin < -1 || grain < -1 || grain == 0) {
        PyErr_Format(PyExc_ValueError, "tuning: spin_ns %lld and grain %zd must be positive "
                     "(-1 leaves one)", spin, grain);
        return NULL;
    }
    PyObject *before = Py_BuildValue("(Ln)", pool.spin_ns, pool.grain);
    pool.spin_ns = spin >= 0 ? spin : pool.spin_ns;
    pool.grain = grain > 0 ? grain : pool.grain;
    return before;
}

/* blas_pool(setter, on): call OpenBLAS's `openblas_set_threads_callback_function` (its address,
 * an int) with the pool's runner, or with NULL (OpenBLAS's own threads again). */
typedef void (*blas_setter)(void (*)(int, pool_dojob, int, size_t, void *, int));

static PyObject *
blas_pool(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "blas_pool(setter, on) takes 2 arguments, got %zd",
                     nargs);
        return NULL;
    }
    void *address = PyLong_AsVoidPtr(args[0]);
    int on = PyObject_IsTrue(args[1]);
    if (PyErr_Occurred() || on < 0) {
        return NULL;
    }
    if (address == NULL) {
        PyErr_SetString(PyExc_ValueError, "blas_pool: the setter's address is NULL");
        return NULL;
    }
    blas_setter setter;
    memcpy(&setter, &address, sizeof setter);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&pool.lock);  /* NOTE: not while a job of the pool runs */
    setter(on ? pool_blas_jobs : NULL);
    pthread_mutex_unlock(&pool.lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"set_loop", (PyCFunction)(void (*)(void))set_loop, METH_FASTCALL,
     "set_loop(which, kind, loop, data): NumPy's exp (0), log (1) or tanh (2) loop for chains "
     "and gelu_op's gradient, or its add loop (3) for sum_last (loop 0 forgets it); returns "
     "its chain code."},
    {"sum_last", (PyCFunction)(void (*)(void))sum_last, METH_FASTCALL,
     "sum_last(kind, out, x): the sum over x's last axis by NumPy's add loop a row, rows split "
     "over the pool; False where it cannot take the call."},
    {"threads", threads, METH_O,
     "threads(n): the executors the pool splits a kernel over (0 leaves it); the count before."},
    {"tuning", (PyCFunction)(void (*)(void))tuning, METH_FASTCALL,
     "tuning(spin_ns, grain): an idle worker's spin and a part's fewest items (-1 leaves one); "
     "both before."},
    {"blas_pool", (PyCFunction)(void (*)(void))blas_pool, METH_FASTCALL,
     "blas_pool(setter, on): OpenBLAS's threads callback set to the pool (on) or cleared."},
    {"widen", (PyCFunction)(void (*)(void))widen, METH_FASTCALL,
     "widen(src, dst): float16 items of src as float32 into dst (contiguous buffers)."},
    {"narrow", (PyCFunction)(void (*)(void))narrow, METH_FASTCALL,
     "narrow(src, dst): float32 items of src rounded to nearest even float16 into dst."},
    {"widen_bf16", (PyCFunction)(void (*)(void))widen_bf16, METH_FASTCALL,
     "widen_bf16(src, dst): bfloat16 items of src (as uint16) as float32 into dst."},
    {"narrow_bf16", (PyCFunction)(void (*)(void))narrow_bf16, METH_FASTCALL,
     "narrow_bf16(src, dst): float32 items of src rounded to nearest even bfloat16 into dst."},
    {"apply", (PyCFunction)(void (*)(void))apply, METH_FASTCALL,
     "apply(code, bf16, out, a[, b]): one elementwise kernel computed in float32 and rounded "
     "once to out's item type; False when it cannot take the call."},
    {"sub_scaled", (PyCFunction)(void (*)(void))sub_scaled, METH_FASTCALL,
     "sub_scaled(kind, out, a, b, scale): out = a - scale * b with the product rounded to the "
     "dtype first (kind 0 float32, 1 float64, 2 float16, 3 bfloat16; C-contiguous buffers of "
     "one shape); False when it cannot take the call."},
    {"float_op", (PyCFunction)(void (*)(void))float_op, METH_FASTCALL,
     "float_op(code, kind, out, a[, b]): the op of `code` (its position in `ops`) on "
     "contiguous float32 (kind 0) or float64 (kind 1) operands, b possibly a row of out's "
     "last dimension; False when it cannot take the call."},
    {"sum_rows", (PyCFunction)(void (*)(void))sum_rows, METH_FASTCALL,
     "sum_rows(kind, out, a): the sum of a contiguous 2-D float32 (kind 0) or float64 (kind "
     "1) array over its rows, in order; False when it cannot take the call."},
    {"erf_op", (PyCFunction)(void (*)(void))erf_op, METH_FASTCALL,
     "erf_op(kind, out, a): C's erf on a contiguous float32 (kind 0, in double, rounded "
     "once; kind 2 the same on C's erf alone) or float64 (kind 1) array; False when it "
     "cannot take the call."},
    {"transpose", (PyCFunction)(void (*)(void))transpose, METH_FASTCALL,
     "transpose(out, src): out (rows, cols) = src (cols, rows) transposed, in tiles; both "
     "C-contiguous, 2-, 4- or 8-byte items, apart; False when it cannot take the call."},
    {"max_pool", (PyCFunction)(void (*)(void))max_pool, METH_FASTCALL,
     "max_pool(kind, out, indices, x, kh, kw, sh, sw, ph, pw): PyTorch's max pooling of a "
     "contiguous float32 (kind 0) or float64 (kind 1) NCHW x, with int64 indices (or None); "
     "False when it cannot take the call."},
    {"max_pool_backward", (PyCFunction)(void (*)(void))max_pool_backward, METH_FASTCALL,
     "max_pool_backward(kind, out, grad, indices): zeros, then grad added at the indices of "
     "each plane in order; False when it cannot take the call."},
    {"moments", (PyCFunction)(void (*)(void))moments, METH_FASTCALL,
     "moments(kind, mean, m2, x): per channel of a contiguous (n, c, s) float32 (kind 0) or "
     "float64 (kind 1) x, its mean and the sum of squares around it, summed in double; False "
     "when it cannot take the call."},
    {"channel_dots", (PyCFunction)(void (*)(void))channel_dots, METH_FASTCALL,
     "channel_dots(kind, sums, dots, g, y): per channel of contiguous (n, c, s) g and y, the "
     "sum of g and of g * y, in double; False when it cannot take the call."},
    {"im2col", (PyCFunction)(void (*)(void))im2col, METH_FASTCALL,
     "im2col(columns, x, kh, kw, sh, sw, ph, pw): a convolution's (C*kh*kw, N*Ho*Wo) columns "
     "of a contiguous NCHW x of 2-, 4- or 8-byte items, zeros in the padding; False when it "
     "cannot take the call."},
    {"col2im", (PyCFunction)(void (*)(void))col2im, METH_FASTCALL,
     "col2im(kind, out, columns, kh, kw, sh, sw, ph, pw): im2col's adjoint on float32 (kind "
     "0) or float64 (kind 1): out zeroed, each column item added where im2col took it; False "
     "when it cannot take the call."},
    {"chain", chain, METH_O,
     "chain(plan): a fused chain of float32 or float64 links in tiles, each link the op's own "
     "loop (the int64 plan of backends/numpy.py's `_chain_plan`)."},
    {"max_rows", (PyCFunction)(void (*)(void))max_rows, METH_FASTCALL,
     "max_rows(kind, out, a): the maximum of each row of a contiguous float32 (kind 0) or "
     "float64 (kind 1) a over its last axis into out (one item a row); the number of rows "
     "whose maximum is NaN or zero, or False when it cannot take the call."},
    {"gelu_op", (PyCFunction)(void (*)(void))gelu_op, METH_FASTCALL,
     "gelu_op(kind, out, x[, g[, e]]): exact GELU (out, x) or its gradient (out, x, g and e = "
     "exp((x * -0.5) * x), or without e NumPy's exp loop given to set_loop) on contiguous "
     "float32 (kind 0) or float64 (kind 1) arrays of one shape, in one pass, the bits of the "
     "table's formulas; False when it cannot take the call."},
    {"set_avx512", set_avx512, METH_O,
     "set_avx512(flag): the erf core's AVX-512F loop when flag and present; returns whether "
     "it is used."},
    {"set_f16c", set_f16c, METH_O,
     "set_f16c(flag): use the CPU's F16C instructions when flag and present; returns whether "
     "they are used."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_halfconv",
    "float16 and bfloat16 <-> float32 conversion (F16C and AVX2 where the CPU has them), and "
    "elementwise kernels on half operands computed in float32.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__halfconv(void)
{
#if HAVE_X86
    __builtin_cpu_init();
    use_f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    use_avx2 = __builtin_cpu_supports("avx2");
    use_avx512 = have_avx512();
#endif
    pthread_atfork(NULL, NULL, pool_forked);
    PyObject *m = PyModule_Create(&module);
    PyObject *names = m ? PyTuple_New(OP_COUNT) : NULL;
    for (int k = 0; names && k < OP_COUNT; k++) {
        PyObject *name = PyUnicode_FromString(op_names[k]);
        if (name == NULL) {
            Py_CLEAR(names);
            break;
        }
        PyTuple_SET_ITEM(names, k, name);
    }
    /* `ops`: each op's name at its code (apply's and float_op's) */
    if (names == NULL || PyModule_AddObject(m, "ops", names) < 0) {
        Py_XDECREF(names);
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
