/* The eager fast path of runtime.ops: the common case of an elementwise op in C.
 *
 * Note [the eager fast path] in runtime/fastpath.py says what this covers and why it is safe;
 * in short: `elementwise(op, out, operands)` either runs the op exactly as
 * `runtime.ops._elementwise` would (the same checks, the same kernel on the same views, the
 * same writes) and returns its result, or returns None before it has changed anything, and
 * the Python path runs instead. It reads and writes the `__slots__` of `runtime.Tensor` and
 * `runtime.block.Block` at the offsets their member descriptors give (taken once, in
 * `configure`), so the Python classes stay the one definition of those fields.
 *
 * What falls back (None): anything but exact Tensors and plain numbers; a graph capture in
 * this thread; a device without fast kernels; different devices or dtypes; a non-float dtype
 * (copy excepted); shapes that do not broadcast; a released or unwritten input; an out= that
 * is not a writable, non-self-overlapping Tensor of the result's shape, dtype and device, or
 * that shares a block with an input in any way but the identical view or disjoint bytes; an
 * imported (non-plain) block; a number beyond the dtype; out= while recording gradients; a
 * result of a read-only (constant) block. The Python path then raises the error or takes the
 * slow road, so errors are always the Python path's own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>

#define MAX_OPERANDS 2   /* of an elementwise op */
#define MAX_INPUTS 3     /* of a launch: linear's x, weight, bias */
#define MAX_DIMS 32
#define MAX_EXTRA 4

/* ------------------------------------------------------------------ configuration */
typedef struct {
    Py_ssize_t block, shape, dtype, strides, offset, gen, span, self_overlap, native,
        requires_grad;
} TensorSlots;

typedef struct {
    Py_ssize_t device, allocator, generation, version, readonly, allocation, written;
} BlockSlots;

static PyTypeObject *tensor_type = NULL;
static PyTypeObject *block_type = NULL;
static TensorSlots TS;
static BlockSlots BS;
static PyObject *grad_mode = NULL;    /* autograd._mode (threading.local): .enabled */
static PyObject *tape_state = NULL;   /* tape._state (threading.local): .tape */
static PyObject *fp_state = NULL;     /* NumPy's error-state context variable */
static PyObject *fp_ignore = NULL;    /* the value that ignores every floating-point error */
static PyObject *floats[2] = {NULL, NULL};    /* np.dtype("float32"), np.dtype("float64") */
static double largest[2] = {0.0, 0.0};        /* their largest finite values */
static PyObject *scalar_types[2] = {NULL, NULL};  /* np.float32, np.float64 */
static PyObject *fresh = NULL;        /* Tensor._fresh(shape, dtype, allocator) */
static PyObject *record = NULL;       /* ops._record_elementwise(op, out, operands) */
static PyObject *copy_name = NULL;    /* "copy": the one op that takes any dtype */

static PyObject *s_enabled, *s_tape, *s_fast_kernels, *s_native_on, *s_memory_for_write;
static PyObject *one = NULL, *s_has_internal_overlap = NULL;

#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

static int
slot_offset(PyObject *cls, const char *name, Py_ssize_t *offset)
{
    PyObject *descr = PyObject_GetAttrString(cls, name);
    if (descr == NULL)
        return -1;
    if (Py_TYPE(descr) != &PyMemberDescr_Type) {
        PyErr_Format(PyExc_TypeError, "%R.%s is not a __slots__ member", cls, name);
        Py_DECREF(descr);
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    *offset = member->offset;
    Py_DECREF(descr);
    return 0;
}

static void
set_ref(PyObject **field, PyObject *value)
{
    Py_XINCREF(value);
    Py_XSETREF(*field, value);
}

static PyObject *
configure(PyObject *self, PyObject *args)
{
    PyObject *tensor, *block, *mode, *state, *fpvar, *fpvalue, *dtypes, *types, *maxima,
        *fresh_fn, *record_fn;
    if (!PyArg_ParseTuple(args, "O!O!OOO!OO!O!O!OO", &PyType_Type, &tensor, &PyType_Type,
                          &block, &mode, &state, &PyContextVar_Type, &fpvar, &fpvalue,
                          &PyTuple_Type, &dtypes, &PyTuple_Type, &types, &PyTuple_Type, &maxima,
                          &fresh_fn, &record_fn))
        return NULL;
    if (PyTuple_GET_SIZE(dtypes) != 2 || PyTuple_GET_SIZE(types) != 2
        || PyTuple_GET_SIZE(maxima) != 2) {
        PyErr_SetString(PyExc_ValueError, "configure: dtypes, types and maxima hold two each");
        return NULL;
    }
    TensorSlots ts;
    BlockSlots bs;
    if (slot_offset(tensor, "block", &ts.block) || slot_offset(tensor, "shape", &ts.shape)
        || slot_offset(tensor, "dtype", &ts.dtype) || slot_offset(tensor, "strides", &ts.strides)
        || slot_offset(tensor, "offset", &ts.offset) || slot_offset(tensor, "_gen", &ts.gen)
        || slot_offset(tensor, "_span", &ts.span)
        || slot_offset(tensor, "_self_overlap", &ts.self_overlap)
        || slot_offset(tensor, "_native", &ts.native)
        || slot_offset(tensor, "_requires_grad", &ts.requires_grad)
        || slot_offset(block, "device", &bs.device)
        || slot_offset(block, "allocator", &bs.allocator)
        || slot_offset(block, "generation", &bs.generation)
        || slot_offset(block, "version", &bs.version)
        || slot_offset(block, "readonly", &bs.readonly)
        || slot_offset(block, "_allocation", &bs.allocation)
        || slot_offset(block, "_written", &bs.written))
        return NULL;
    double maxf[2];
    for (int i = 0; i < 2; i++) {
        maxf[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(maxima, i));
        if (maxf[i] == -1.0 && PyErr_Occurred())
            return NULL;
    }
    TS = ts;
    BS = bs;
    set_ref((PyObject **)&tensor_type, tensor);
    set_ref((PyObject **)&block_type, block);
    set_ref(&grad_mode, mode);
    set_ref(&tape_state, state);
    set_ref(&fp_state, fpvar);
    set_ref(&fp_ignore, fpvalue);
    for (int i = 0; i < 2; i++) {
        set_ref(&floats[i], PyTuple_GET_ITEM(dtypes, i));
        set_ref(&scalar_types[i], PyTuple_GET_ITEM(types, i));
        largest[i] = maxf[i];
    }
    set_ref(&fresh, fresh_fn);
    set_ref(&record, record_fn);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ helpers */
/* 1 if the thread-local `obj.name` is true / not None (as asked), 0 if not, -1 on error. */
static int
local_flag(PyObject *obj, PyObject *name, int none_test)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int result = none_test ? value != Py_None : PyObject_IsTrue(value);
    Py_DECREF(value);
    return result;
}

/* The tuple of ints `t` into dims; its length, or -1 if it is not a tuple of small ints. */
static int
read_dims(PyObject *t, Py_ssize_t *dims)
{
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) > MAX_DIMS)
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(t, i);
        if (!PyLong_CheckExact(item))
            return -1;
        dims[i] = PyLong_AsSsize_t(item);
        if (dims[i] == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
    }
    return (int)n;
}

/* A usable Tensor operand: exact type, a plain Block of this generation holding data. */
static int
readable(PyObject *t)
{
    if (Py_TYPE(t) != tensor_type)
        return 0;
    PyObject *block = SLOT(t, TS.block);
    if (block == NULL || Py_TYPE(block) != block_type)
        return 0;
    PyObject *gen = SLOT(t, TS.gen), *generation = SLOT(block, BS.generation);
    if (gen == NULL || generation == NULL)
        return 0;
    int same = PyObject_RichCompareBool(gen, generation, Py_EQ);
    if (same <= 0) {
        PyErr_Clear();
        return 0;
    }
    return SLOT(block, BS.written) == Py_True;
}

/* The native view of tensor `t` over `allocation`, from its cache or `t._native_on`. */
static PyObject *
native_view(PyObject *t, PyObject *allocation)
{
    PyObject *cached = SLOT(t, TS.native);
    if (cached != NULL && PyTuple_CheckExact(cached) && PyTuple_GET_SIZE(cached) == 2
        && PyTuple_GET_ITEM(cached, 0) == allocation) {
        PyObject *view = PyTuple_GET_ITEM(cached, 1);
        Py_INCREF(view);
        return view;
    }
    return PyObject_CallMethodOneArg(t, s_native_on, allocation);
}

/* (start, end) of a cached byte span, or 0 when it is not a cached pair of ints. */
static int
cached_span(PyObject *t, long long *start, long long *end)
{
    PyObject *span = SLOT(t, TS.span);
    if (span == NULL || !PyTuple_CheckExact(span) || PyTuple_GET_SIZE(span) != 2)
        return 0;
    *start = PyLong_AsLongLong(PyTuple_GET_ITEM(span, 0));
    *end = PyLong_AsLongLong(PyTuple_GET_ITEM(span, 1));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* May `out` be written while `t` is read by an elementwise op? Plain blocks never share a
 * byte (Note [blocks that may share memory] in docs/aliasing.md); on one block, the identical
 * view is allowed and disjoint byte spans cannot clash; anything else is for the Python
 * path's exact test. */
static int
no_clash(PyObject *out, PyObject *t)
{
    if (SLOT(out, TS.block) != SLOT(t, TS.block))
        return 1;
    int same = PyObject_RichCompareBool(SLOT(out, TS.offset), SLOT(t, TS.offset), Py_EQ);
    if (same > 0)
        same = PyObject_RichCompareBool(SLOT(out, TS.shape), SLOT(t, TS.shape), Py_EQ);
    if (same > 0)
        same = PyObject_RichCompareBool(SLOT(out, TS.strides), SLOT(t, TS.strides), Py_EQ);
    if (same < 0) {
        PyErr_Clear();
        return 0;
    }
    if (same)
        return 1;
    long long a0, a1, b0, b1;
    if (!cached_span(out, &a0, &a1) || !cached_span(t, &b0, &b1))
        return 0;
    return a1 <= b0 || b1 <= a0;
}

/* ------------------------------------------------------------------ the shared second half */
/* Is `out` a usable out= for a result of `shape` (ndim dims), `dtype` on `device`, read by
 * `inputs` (tensors; NULL entries are numbers) under the op's aliasing policy (`never`: no
 * shared block at all; else the identical view or disjoint spans)? 1 yes, 0 hand back. */
static int
out_usable(PyObject *out, const Py_ssize_t *shape, int ndim, PyObject *dtype, PyObject *device,
           PyObject *const *inputs, Py_ssize_t count, int never)
{
    if (Py_TYPE(out) != tensor_type)
        return 0;
    PyObject *out_block = SLOT(out, TS.block);
    if (out_block == NULL || Py_TYPE(out_block) != block_type || SLOT(out, TS.dtype) != dtype
        || SLOT(out_block, BS.device) != device || SLOT(out_block, BS.readonly) != Py_False
        || SLOT(out, TS.requires_grad) != Py_False)
        return 0;
    Py_ssize_t dims[MAX_DIMS];
    if (read_dims(SLOT(out, TS.shape), dims) != ndim)
        return 0;
    for (int d = 0; d < ndim; d++)
        if (dims[d] != shape[d])
            return 0;
    if (SLOT(out, TS.self_overlap) == Py_None) {  /* not asked yet: ask (it caches) */
        PyObject *flag = PyObject_CallMethodNoArgs(out, s_has_internal_overlap);
        if (flag == NULL)
            PyErr_Clear();
        Py_XDECREF(flag);
    }
    if (SLOT(out, TS.self_overlap) != Py_False)
        return 0;
    int current = PyObject_RichCompareBool(SLOT(out, TS.gen), SLOT(out_block, BS.generation),
                                           Py_EQ);
    if (current <= 0) {
        PyErr_Clear();
        return 0;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (inputs[i] == NULL)
            continue;
        if (never ? SLOT(inputs[i], TS.block) == out_block : !no_clash(out, inputs[i]))
            return 0;
    }
    return 1;
}

/* A fresh contiguous result over a new lazy block of `like_block`'s allocator. */
static PyObject *
fresh_result(const Py_ssize_t *shape, int ndim, PyObject *dtype, PyObject *like_block)
{
    PyObject *shape_tuple = PyTuple_New(ndim);
    if (shape_tuple == NULL)
        return NULL;
    for (int d = 0; d < ndim; d++) {
        PyObject *n = PyLong_FromSsize_t(shape[d]);
        if (n == NULL) {
            Py_DECREF(shape_tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(shape_tuple, d, n);
    }
    PyObject *call[3] = {shape_tuple, dtype, SLOT(like_block, BS.allocator)};
    PyObject *result = PyObject_Vectorcall(fresh, call, 3, NULL);
    Py_DECREF(shape_tuple);
    return result;
}

/* Run kernel(*operand views, result view, *extra) under IEEE results, then mark the result's
 * block written. `operands[i]` is a tensor, or (when values[i] is set) a number. 0 or -1. */
static int
run_kernel(PyObject *op, PyObject *kernel, PyObject *result, PyObject *const *operands,
           PyObject *const *values, Py_ssize_t count, PyObject *extra)
{
    Py_ssize_t nextra = extra == NULL ? 0 : PyTuple_GET_SIZE(extra);
    PyObject *views[MAX_INPUTS + 1 + MAX_EXTRA];
    Py_ssize_t nviews = 0;
    int ok = count + 1 + nextra <= MAX_INPUTS + 1 + MAX_EXTRA;
    if (!ok)
        PyErr_SetString(PyExc_ValueError, "run_kernel: too many arguments");
    for (Py_ssize_t i = 0; i < count && ok; i++) {
        if (values != NULL && values[i] != NULL) {
            Py_INCREF(values[i]);
            views[nviews++] = values[i];
            continue;
        }
        PyObject *view = native_view(operands[i], SLOT(SLOT(operands[i], TS.block),
                                                       BS.allocation));
        ok = view != NULL;
        if (ok)
            views[nviews++] = view;
    }
    PyObject *allocation = NULL;
    if (ok) {
        PyObject *out_block = SLOT(result, TS.block);
        allocation = SLOT(out_block, BS.allocation);
        if (allocation == Py_None || allocation == NULL)
            allocation = PyObject_CallMethodOneArg(out_block, s_memory_for_write, op);
        else
            Py_INCREF(allocation);
        ok = allocation != NULL;
        if (ok) {
            PyObject *view = native_view(result, allocation);
            ok = view != NULL;
            if (ok)
                views[nviews++] = view;
        }
    }
    for (Py_ssize_t i = 0; i < nextra && ok; i++) {
        PyObject *item = PyTuple_GET_ITEM(extra, i);
        Py_INCREF(item);
        views[nviews++] = item;
    }
    PyObject *called = NULL;
    if (ok) {
        PyObject *token = PyContextVar_Set(fp_state, fp_ignore);
        if (token != NULL) {
            called = PyObject_Vectorcall(kernel, views, nviews, NULL);
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            if (PyContextVar_Reset(fp_state, token) < 0)
                Py_CLEAR(called);
            if (type != NULL)
                PyErr_Restore(type, value, tb);
            Py_DECREF(token);
        }
    }
    for (Py_ssize_t i = 0; i < nviews; i++)
        Py_DECREF(views[i]);
    Py_XDECREF(allocation);
    if (called == NULL)
        return -1;
    Py_DECREF(called);
    /* mark_written: the data is readable and the version moves on */
    PyObject *out_block = SLOT(result, TS.block);
    PyObject *version = SLOT(out_block, BS.version);
    PyObject *next = version ? PyNumber_Add(version, one) : NULL;
    if (next == NULL)
        return -1;
    Py_XSETREF(SLOT(out_block, BS.version), next);
    set_ref(&SLOT(out_block, BS.written), Py_True);
    return 0;
}

/* 1 when a graph capture runs in this thread (or that cannot be told), else 0. */
static int
capturing(void)
{
    int flag = local_flag(tape_state, s_tape, 1);
    if (flag < 0)
        PyErr_Clear();
    return flag != 0;
}

/* 1 when gradients are recorded in this thread (errors read as 1: the Python path decides). */
static int
grad_enabled(void)
{
    int flag = local_flag(grad_mode, s_enabled, 0);
    if (flag < 0)
        PyErr_Clear();
    return flag != 0;
}

/* ------------------------------------------------------------------ elementwise */
static PyObject *
elementwise(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_CheckExact(args[2]) || tensor_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "elementwise(op, out, operands): not configured, or "
                                         "bad arguments");
        return NULL;
    }
    PyObject *op = args[0], *out = args[1], *operands = args[2];
    PyObject *values[MAX_OPERANDS] = {NULL, NULL};  /* the numbers, as dtype scalars */
    PyObject *tensors[MAX_OPERANDS] = {NULL, NULL};
    PyObject *kernel = NULL, *result = NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(operands);
    if (count < 1 || count > MAX_OPERANDS || capturing())
        Py_RETURN_NONE;
    /* the operands: tensors (readable, one device and dtype) and plain numbers */
    PyObject *first = NULL;
    int numbers = 0, wants_grad = 0;
    Py_ssize_t dims[MAX_OPERANDS + 1][MAX_DIMS];
    int ndims[MAX_OPERANDS + 1];
    int nshapes = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *x = PyTuple_GET_ITEM(operands, i);
        if (PyFloat_CheckExact(x) || PyLong_CheckExact(x)) {
            numbers++;
            continue;
        }
        if (!readable(x))
            Py_RETURN_NONE;
        if (first == NULL)
            first = x;
        else if (SLOT(SLOT(x, TS.block), BS.device) != SLOT(SLOT(first, TS.block), BS.device)
                 || SLOT(x, TS.dtype) != SLOT(first, TS.dtype))
            Py_RETURN_NONE;
        tensors[i] = x;
        if (SLOT(x, TS.requires_grad) == Py_True)
            wants_grad = 1;
        ndims[nshapes] = read_dims(SLOT(x, TS.shape), dims[nshapes]);
        if (ndims[nshapes] < 0)
            Py_RETURN_NONE;
        nshapes++;
    }
    if (first == NULL)
        Py_RETURN_NONE;
    PyObject *dtype = SLOT(first, TS.dtype);
    int kind = dtype == floats[0] ? 0 : dtype == floats[1] ? 1 : -1;
    if (kind < 0 && (numbers || PyUnicode_Compare(op, copy_name) != 0)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    wants_grad = wants_grad && grad_enabled();
    if (out != Py_None && (wants_grad || Py_TYPE(out) != tensor_type))
        Py_RETURN_NONE;
    PyObject *block0 = SLOT(first, TS.block);
    PyObject *device = SLOT(block0, BS.device);
    PyObject *kernels = PyObject_GetAttr(device, s_fast_kernels);
    if (kernels == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    kernel = PyDict_Check(kernels) ? PyDict_GetItemWithError(kernels, op) : NULL;
    Py_XINCREF(kernel);
    Py_DECREF(kernels);
    if (kernel == NULL) {
        PyErr_Clear();
        goto fallback;
    }
    /* the result's shape: NumPy's broadcasting over the tensors (and out, when given) */
    if (out != Py_None) {
        ndims[nshapes] = read_dims(SLOT(out, TS.shape), dims[nshapes]);
        if (ndims[nshapes] < 0)
            goto fallback;
        nshapes++;
    }
    int ndim = 0;
    for (int i = 0; i < nshapes; i++)
        ndim = ndims[i] > ndim ? ndims[i] : ndim;
    Py_ssize_t shape[MAX_DIMS];
    for (int d = 0; d < ndim; d++)
        shape[d] = 1;
    for (int i = 0; i < nshapes; i++) {
        int lead = ndim - ndims[i];
        for (int d = 0; d < ndims[i]; d++) {
            Py_ssize_t n = dims[i][d];
            if (n == 1)
                continue;
            if (shape[lead + d] != 1 && shape[lead + d] != n)
                goto fallback;
            shape[lead + d] = n;
        }
    }
    /* the numbers, as the Python path makes them: dtype.type(x), within the dtype's range */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *x = PyTuple_GET_ITEM(operands, i);
        if (tensors[i] != NULL)
            continue;
        double value = PyFloat_AsDouble(x);
        if ((value == -1.0 && PyErr_Occurred())
            || (isfinite(value) && fabs(value) > largest[kind])) {
            PyErr_Clear();
            goto fallback;
        }
        values[i] = PyObject_CallOneArg(scalar_types[kind], x);
        if (values[i] == NULL)
            goto error;
    }
    if (out != Py_None) {
        if (!out_usable(out, shape, ndim, dtype, device, tensors, count, 0))
            goto fallback;
        Py_INCREF(out);
        result = out;
    }
    else {
        if (SLOT(block0, BS.readonly) != Py_False)
            goto fallback;  /* a constant's result goes to the default allocator: Python */
        result = fresh_result(shape, ndim, dtype, block0);
        if (result == NULL)
            goto error;
    }
    /* from here on the op runs as the Python path runs it: errors are its errors */
    if (run_kernel(op, kernel, result, &PyTuple_GET_ITEM(operands, 0), values, count, NULL) < 0)
        goto error;
    for (Py_ssize_t i = 0; i < count; i++)
        Py_XDECREF(values[i]);
    Py_DECREF(kernel);
    if (wants_grad) {
        PyObject *call[3] = {op, result, operands};
        PyObject *recorded = PyObject_Vectorcall(record, call, 3, NULL);
        if (recorded == NULL) {
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(recorded);
    }
    return result;

fallback:
    for (Py_ssize_t i = 0; i < count; i++)
        Py_XDECREF(values[i]);
    Py_XDECREF(result);
    Py_XDECREF(kernel);
    Py_RETURN_NONE;
error:
    for (Py_ssize_t i = 0; i < count; i++)
        Py_XDECREF(values[i]);
    Py_XDECREF(result);
    Py_XDECREF(kernel);
    return NULL;
}

/* ------------------------------------------------------------------ launch */
/* launch(op, never, out, shape, dtype, inputs, kernel, extra): the second half of an op whose
 * Python code has checked its operands and worked out the result's shape and dtype (matmul,
 * linear, the reductions): `_prepare_out` and `_launch` of runtime/ops.py for tensors `inputs`
 * read whole, the kernel called as kernel(*input views, out view, *extra). The result, or None
 * before anything changed. No autograd record: the op makes it after. */
static PyObject *
launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8 || !PyTuple_CheckExact(args[3]) || !PyTuple_CheckExact(args[5])
        || !PyTuple_CheckExact(args[7]) || tensor_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "launch(op, never, out, shape, dtype, inputs, kernel, "
                                         "extra): not configured, or bad arguments");
        return NULL;
    }
    PyObject *op = args[0], *out = args[2], *shape_tuple = args[3], *dtype = args[4];
    PyObject *inputs = args[5], *kernel = args[6], *extra = args[7];
    int never = PyObject_IsTrue(args[1]);
    Py_ssize_t count = PyTuple_GET_SIZE(inputs);
    if (never < 0 || count < 1 || count > MAX_INPUTS || capturing()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *first = PyTuple_GET_ITEM(inputs, 0);
    int wants_grad = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *x = PyTuple_GET_ITEM(inputs, i);
        if (!readable(x)
            || SLOT(SLOT(x, TS.block), BS.device) != SLOT(SLOT(first, TS.block), BS.device))
            Py_RETURN_NONE;
        if (SLOT(x, TS.requires_grad) == Py_True)
            wants_grad = 1;
    }
    Py_ssize_t shape[MAX_DIMS];
    int ndim = read_dims(shape_tuple, shape);
    if (ndim < 0)
        Py_RETURN_NONE;
    PyObject *block0 = SLOT(first, TS.block);
    PyObject *result;
    if (out != Py_None) {
        if ((wants_grad && grad_enabled())
            || !out_usable(out, shape, ndim, dtype, SLOT(block0, BS.device),
                           &PyTuple_GET_ITEM(inputs, 0), count, never))
            Py_RETURN_NONE;
        Py_INCREF(out);
        result = out;
    }
    else {
        if (SLOT(block0, BS.readonly) != Py_False)
            Py_RETURN_NONE;
        result = fresh_result(shape, ndim, dtype, block0);
        if (result == NULL)
            return NULL;
    }
    if (run_kernel(op, kernel, result, &PyTuple_GET_ITEM(inputs, 0), NULL, count, extra) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

/* ------------------------------------------------------------------ module */
static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(Tensor, Block, grad_mode, tape_state, fp_state, fp_ignore, dtypes, types, "
     "maxima, fresh, record): tell the fast path where the runtime keeps its state"},
    {"elementwise", (PyCFunction)(void (*)(void))elementwise, METH_FASTCALL,
     "elementwise(op, out, operands): the result of the op, or None for the Python path"},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(op, never, out, shape, dtype, inputs, kernel, extra): the second half of an op, "
     "or None for the Python path"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "runtime._dispatch",
    "The eager fast path of runtime.ops (Note [the eager fast path] in runtime/fastpath.py).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__dispatch(void)
{
    s_enabled = PyUnicode_InternFromString("enabled");
    s_tape = PyUnicode_InternFromString("tape");
    s_fast_kernels = PyUnicode_InternFromString("_fast_kernels");
    s_native_on = PyUnicode_InternFromString("_native_on");
    s_memory_for_write = PyUnicode_InternFromString("memory_for_write");
    copy_name = PyUnicode_InternFromString("copy");
    one = PyLong_FromLong(1);
    s_has_internal_overlap = PyUnicode_InternFromString("has_internal_overlap");
    if (!one || !s_has_internal_overlap || !s_enabled || !s_tape || !s_fast_kernels || !s_native_on || !s_memory_for_write
        || !copy_name)
        return NULL;
    return PyModule_Create(&module);
}
