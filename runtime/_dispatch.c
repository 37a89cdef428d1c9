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
 * What falls back (None): anything but exact Tensors and plain numbers; a graph capture in this
 * thread; a device without fast kernels (`Capabilities.fast_kernels`; for float16 and bfloat16:
 * `fast_half_kernels`);
 * different devices or dtypes; a non-float dtype (copy excepted); shapes that do not broadcast; a
 * released or unwritten input; an out= that is not a writable, non-self-overlapping Tensor of the
 * result's shape, dtype and device, or that shares a block with an input in any way but the
 * identical view or disjoint bytes; an imported (non-plain) block; a number beyond the dtype;
 * out= while recording gradients; a result of a read-only (constant) block. The Python path then
 * raises the error or takes the slow road, so errors are always the Python path's own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>

#define MAX_OPERANDS 3   /* of an elementwise op (ops._sub_scaled: a, b, scale) */
#define MAX_INPUTS 3     /* of a launch: linear's x, weight, bias */
#define MAX_DIMS 32
#define MAX_EXTRA 4

/* ------------------------------------------------------------------ configuration */
typedef struct {
    Py_ssize_t block, shape, dtype, strides, offset, gen, span, self_overlap, native,
        requires_grad, layout, node, grad, name;
} TensorSlots;

typedef struct {
    Py_ssize_t nbytes, allocator, device, id, generation, version, readonly, on_return, lock,
        exports, allocation, written, refs;
} BlockSlots;

/* Every slot of Tensor and of Block, as the Python classes declare them (`configure` checks):
 * a fresh result sets each one, as `Tensor._fresh` and `Block.__init__` do. */
static const char *tensor_slot_names[] = {
    "block", "shape", "dtype", "strides", "offset", "_gen", "_layout", "_span", "_self_overlap",
    "_native", "_requires_grad", "_node", "_grad", "name", "__weakref__", NULL};
static const char *block_slot_names[] = {
    "nbytes", "allocator", "device", "id", "generation", "version", "readonly", "on_return",
    "lock", "exports", "_allocation", "_written", "_refs", "__weakref__", NULL};

static PyTypeObject *tensor_type = NULL;
static PyTypeObject *block_type = NULL;
static TensorSlots TS;
static BlockSlots BS;
static PyObject *grad_mode = NULL;    /* autograd._mode (threading.local): .enabled */
static PyObject *tape_state = NULL;   /* tape._state (threading.local): .tape */
static PyObject *fp_state = NULL;     /* NumPy's error-state context variable */
static PyObject *fp_ignore = NULL;    /* the value that ignores every floating-point error */
/* np.dtype("float32"), np.dtype("float64"), and where configured float16 and bfloat16, whose
 * kernels are the device's `fast_half_kernels` and whose numbers are float32 */
static PyObject *floats[4] = {NULL, NULL, NULL, NULL};
static int nfloats = 0;
static double largest[4] = {0.0, 0.0, 0.0, 0.0};  /* the numbers' largest finite values */
static PyObject *scalar_types[4] = {NULL, NULL, NULL, NULL};  /* np.float32, np.float64, ... */
static PyObject *fresh = NULL;        /* Tensor._fresh(shape, dtype, allocator) */
static PyObject *record = NULL;       /* ops._record_elementwise(op, out, operands) */
static PyObject *copy_name = NULL;    /* "copy": the one op that takes any dtype */
static PyObject *block_ids = NULL;    /* runtime.block._ids: where a Block's id comes from */
static PyObject *unset = NULL;        /* runtime._tensor._UNSET */
static PyObject *released = NULL;     /* runtime._tensor._RELEASED */
static PyObject *zero = NULL;
/* 1 while the fast path runs: `set_enabled`, called by runtime/fastpath.py once `configure` and
 * `configure_autograd` have run, and cleared inside `fastpath.python_only()`. Until then, and
 * while it is 0, every entry point hands its call back to its Python twin, which its module
 * bound in its place (backends/accelerated.py): elementwise, launch, reduce and backward return
 * None, release calls Tensor.release, record the Python record. */
static int enabled = 0;

static PyObject *s_enabled, *s_tape, *s_fast_kernels, *s_native_on, *s_memory_for_write;
static PyObject *s_fast_half_kernels = NULL, *s_capabilities = NULL;
static PyObject *one = NULL, *s_has_internal_overlap = NULL, *s_allocate = NULL, *s_free = NULL;
static PyObject *s_release = NULL, *s_itemsize = NULL, *s_raw = NULL, *s_offset = NULL,
    *s_array_view = NULL;

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

/* Refuse a class whose __slots__ are not exactly `names` (a slot added in Python and not here
 * would be left unset in a fresh result). */
static int
check_slots(PyObject *cls, const char **names)
{
    PyObject *slots = PyObject_GetAttrString(cls, "__slots__");
    if (slots == NULL)
        return -1;
    PyObject *declared = PySet_New(slots);
    Py_DECREF(slots);
    if (declared == NULL)
        return -1;
    Py_ssize_t count = 0;
    int ok = 1;
    for (; names[count] != NULL && ok; count++) {
        PyObject *name = PyUnicode_FromString(names[count]);
        ok = name != NULL && PySet_Contains(declared, name) == 1;
        Py_XDECREF(name);
    }
    ok = ok && PySet_GET_SIZE(declared) == count;
    if (!ok && !PyErr_Occurred())
        PyErr_Format(PyExc_TypeError, "runtime/_dispatch.c knows other __slots__ than %R has "
                     "(%R): add the new field to its slot table and to fresh_result", cls,
                     declared);
    Py_DECREF(declared);
    return ok ? 0 : -1;
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
        *fresh_fn, *record_fn, *ids, *unset_value, *released_value;
    if (!PyArg_ParseTuple(args, "O!O!OOO!OO!O!O!OOOOO", &PyType_Type, &tensor, &PyType_Type,
                          &block, &mode, &state, &PyContextVar_Type, &fpvar, &fpvalue,
                          &PyTuple_Type, &dtypes, &PyTuple_Type, &types, &PyTuple_Type, &maxima,
                          &fresh_fn, &record_fn, &ids, &unset_value, &released_value))
        return NULL;
    if (check_slots(tensor, tensor_slot_names) < 0 || check_slots(block, block_slot_names) < 0)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(dtypes);
    if ((n != 2 && n != 4) || PyTuple_GET_SIZE(types) != n || PyTuple_GET_SIZE(maxima) != n) {
        PyErr_SetString(PyExc_ValueError, "configure: dtypes, types and maxima hold two (or "
                        "four: float16 and bfloat16 last) each");
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
        || slot_offset(tensor, "_layout", &ts.layout) || slot_offset(tensor, "_node", &ts.node)
        || slot_offset(tensor, "_grad", &ts.grad) || slot_offset(tensor, "name", &ts.name)
        || slot_offset(block, "nbytes", &bs.nbytes) || slot_offset(block, "id", &bs.id)
        || slot_offset(block, "device", &bs.device)
        || slot_offset(block, "allocator", &bs.allocator)
        || slot_offset(block, "generation", &bs.generation)
        || slot_offset(block, "version", &bs.version)
        || slot_offset(block, "readonly", &bs.readonly)
        || slot_offset(block, "on_return", &bs.on_return)
        || slot_offset(block, "lock", &bs.lock) || slot_offset(block, "exports", &bs.exports)
        || slot_offset(block, "_allocation", &bs.allocation)
        || slot_offset(block, "_written", &bs.written) || slot_offset(block, "_refs", &bs.refs))
        return NULL;
    double maxf[4];
    for (int i = 0; i < n; i++) {
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
    for (int i = 0; i < n; i++) {
        set_ref(&floats[i], PyTuple_GET_ITEM(dtypes, i));
        set_ref(&scalar_types[i], PyTuple_GET_ITEM(types, i));
        largest[i] = maxf[i];
    }
    nfloats = (int)n;
    set_ref(&fresh, fresh_fn);
    set_ref(&record, record_fn);
    set_ref(&block_ids, ids);
    set_ref(&unset, unset_value);
    set_ref(&released, released_value);
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
    /* `Tensor._native_on`: device._array_view(raw, byte offset, shape, dtype, byte strides) */
    PyObject *dtype = SLOT(t, TS.dtype), *shape = SLOT(t, TS.shape);
    PyObject *strides = SLOT(t, TS.strides), *offset = SLOT(t, TS.offset);
    PyObject *itemsize = dtype ? PyObject_GetAttr(dtype, s_itemsize) : NULL;
    PyObject *raw = itemsize ? PyObject_GetAttr(allocation, s_raw) : NULL;
    PyObject *base = raw ? PyObject_GetAttr(allocation, s_offset) : NULL;
    PyObject *bytes = NULL, *start = NULL, *byte_strides = NULL, *view = NULL;
    Py_ssize_t item = itemsize ? PyLong_AsSsize_t(itemsize) : -1;
    if (base == NULL || item < 0 || !PyTuple_CheckExact(strides) || shape == NULL
        || offset == NULL)
        goto done;
    bytes = PyNumber_Multiply(offset, itemsize);
    start = bytes ? PyNumber_Add(base, bytes) : NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(strides);
    byte_strides = start ? PyTuple_New(n) : NULL;
    for (Py_ssize_t i = 0; byte_strides != NULL && i < n; i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, i));
        PyObject *value = s == -1 && PyErr_Occurred() ? NULL : PyLong_FromSsize_t(s * item);
        if (value == NULL)
            Py_CLEAR(byte_strides);
        else
            PyTuple_SET_ITEM(byte_strides, i, value);
    }
    if (byte_strides == NULL)
        goto done;
    PyObject *device = SLOT(SLOT(t, TS.block), BS.device);
    PyObject *call[6] = {device, raw, start, shape, dtype, byte_strides};
    view = PyObject_VectorcallMethod(s_array_view, call, 6, NULL);
    if (view != NULL) {
        PyObject *pair = PyTuple_Pack(2, allocation, view);
        if (pair == NULL)
            Py_CLEAR(view);
        else
            Py_XSETREF(SLOT(t, TS.native), pair);
    }
    if (view != NULL && SLOT(t, TS.layout) == Py_None) {  /* `Tensor.layout()`'s cache */
        PyObject *layout = PyTuple_Pack(4, bytes, shape, byte_strides, itemsize);
        if (layout == NULL)
            Py_CLEAR(view);
        else
            Py_XSETREF(SLOT(t, TS.layout), layout);
    }
done:
    Py_XDECREF(itemsize);
    Py_XDECREF(raw);
    Py_XDECREF(base);
    Py_XDECREF(bytes);
    Py_XDECREF(start);
    Py_XDECREF(byte_strides);
    return view;
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

/* local_flag, with an error read as 1 (the caller then hands the op to the Python path). */
static int
flag_or_yes(PyObject *state, PyObject *name, int none_test)
{
    int flag = local_flag(state, name, none_test);
    if (flag < 0)
        PyErr_Clear();
    return flag != 0;
}

/* 1 when a graph capture runs in this thread (or that cannot be told), else 0. */
static int
capturing(void)
{
    return flag_or_yes(tape_state, s_tape, 1);
}

/* 1 when gradients are recorded in this thread (or that cannot be told), else 0. */
static int
grad_enabled(void)
{
    return flag_or_yes(grad_mode, s_enabled, 0);
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
        || SLOT(out_block, BS.device) != device || SLOT(out_block, BS.readonly) != Py_False)
        return 0;
    /* `_prepare_out` refuses out= while recording gradients (the callers checked the inputs) */
    if (SLOT(out, TS.requires_grad) != Py_False && grad_enabled())
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

/* A fresh contiguous result over a new lazy block of `like_block`'s allocator, made as
 * `Tensor._fresh` makes it (every slot of the Block and the Tensor set). */
static PyObject *
fresh_result(const Py_ssize_t *shape, int ndim, PyObject *dtype, PyObject *like_block)
{
    PyObject *allocator = SLOT(like_block, BS.allocator);
    PyObject *itemsize_obj = PyObject_GetAttrString(dtype, "itemsize");
    if (itemsize_obj == NULL)
        return NULL;
    Py_ssize_t itemsize = PyLong_AsSsize_t(itemsize_obj);
    Py_DECREF(itemsize_obj);
    if (itemsize == -1 && PyErr_Occurred())
        return NULL;
    PyObject *shape_tuple = PyTuple_New(ndim), *strides = PyTuple_New(ndim);
    PyObject *nbytes = NULL, *device = NULL, *id = NULL, *block = NULL, *result = NULL;
    if (shape_tuple == NULL || strides == NULL)
        goto done;
    Py_ssize_t count = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        PyObject *n = PyLong_FromSsize_t(shape[d]);
        PyObject *stride = PyLong_FromSsize_t(count);
        if (n == NULL || stride == NULL) {
            Py_XDECREF(n);
            Py_XDECREF(stride);
            goto done;
        }
        PyTuple_SET_ITEM(shape_tuple, d, n);
        PyTuple_SET_ITEM(strides, d, stride);
        count *= shape[d] > 0 ? shape[d] : 1;
    }
    if (itemsize <= 0) {  /* a dtype of no size: as Python makes it */
        PyObject *call[3] = {shape_tuple, dtype, allocator};
        result = PyObject_Vectorcall(fresh, call, 3, NULL);
        goto done;
    }
    Py_ssize_t elements = 1;
    for (int d = 0; d < ndim; d++)
        elements *= shape[d];
    nbytes = PyLong_FromSsize_t(elements * itemsize);
    device = PyObject_GetAttrString(allocator, "device");
    id = nbytes && device ? PyIter_Next(block_ids) : NULL;
    if (id == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the block id counter is exhausted");
        goto done;
    }
    block = block_type->tp_alloc(block_type, 0);
    result = block ? tensor_type->tp_alloc(tensor_type, 0) : NULL;
    if (result == NULL)
        goto done;
    set_ref(&SLOT(block, BS.nbytes), nbytes);
    set_ref(&SLOT(block, BS.allocator), allocator);
    set_ref(&SLOT(block, BS.device), device);
    set_ref(&SLOT(block, BS.id), id);
    set_ref(&SLOT(block, BS.generation), zero);
    set_ref(&SLOT(block, BS.version), zero);
    set_ref(&SLOT(block, BS.readonly), Py_False);
    set_ref(&SLOT(block, BS.on_return), Py_None);
    set_ref(&SLOT(block, BS.lock), Py_None);
    set_ref(&SLOT(block, BS.exports), zero);
    set_ref(&SLOT(block, BS.allocation), Py_None);
    set_ref(&SLOT(block, BS.written), Py_False);
    set_ref(&SLOT(block, BS.refs), one);  /* the result's own reference (acquire) */
    set_ref(&SLOT(result, TS.block), block);
    set_ref(&SLOT(result, TS.shape), shape_tuple);
    set_ref(&SLOT(result, TS.dtype), dtype);
    set_ref(&SLOT(result, TS.strides), strides);
    set_ref(&SLOT(result, TS.offset), zero);
    set_ref(&SLOT(result, TS.gen), zero);
    set_ref(&SLOT(result, TS.layout), Py_None);
    set_ref(&SLOT(result, TS.span), unset);
    set_ref(&SLOT(result, TS.self_overlap), Py_False);
    set_ref(&SLOT(result, TS.native), Py_None);
    set_ref(&SLOT(result, TS.requires_grad), Py_False);
    set_ref(&SLOT(result, TS.node), Py_None);
    set_ref(&SLOT(result, TS.grad), Py_None);
    set_ref(&SLOT(result, TS.name), Py_None);
done:
    Py_XDECREF(shape_tuple);
    Py_XDECREF(strides);
    Py_XDECREF(nbytes);
    Py_XDECREF(device);
    Py_XDECREF(id);
    Py_XDECREF(block);
    return result;
}

/* `block.memory_for_write(op)`: its allocation, made now on first use. For a plain writable
 * block this is `Block._first_allocation` without the lock, which only orders the publishing
 * between threads: here the GIL is held from the allocator's return to the publishing. */
static PyObject *
memory_for_write(PyObject *block, PyObject *op)
{
    PyObject *allocation = SLOT(block, BS.allocation);
    if (allocation != NULL && allocation != Py_None) {
        Py_INCREF(allocation);
        return allocation;
    }
    if (Py_TYPE(block) != block_type || SLOT(block, BS.readonly) != Py_False)
        return PyObject_CallMethodOneArg(block, s_memory_for_write, op);
    PyObject *made = PyObject_CallMethodOneArg(SLOT(block, BS.allocator), s_allocate,
                                               SLOT(block, BS.nbytes));
    if (made == NULL)
        return NULL;
    allocation = SLOT(block, BS.allocation);
    if (allocation == NULL || allocation == Py_None) {  /* publish ours */
        set_ref(&SLOT(block, BS.allocation), made);
        return made;
    }
    /* another thread published first (while the allocator ran): give ours back, use theirs */
    Py_INCREF(allocation);
    PyObject *freed = PyObject_CallMethodOneArg(SLOT(block, BS.allocator), s_free, made);
    Py_DECREF(made);
    if (freed == NULL) {
        Py_DECREF(allocation);
        return NULL;
    }
    Py_DECREF(freed);
    return allocation;
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
        allocation = memory_for_write(SLOT(result, TS.block), op);
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

/* The device's kernel table for the fast path, `device.capabilities.fast_kernels` (with `half`:
 * `fast_half_kernels`), as a new reference; NULL, no error set, where it cannot be read. */
static PyObject *
fast_table(PyObject *device, int half)
{
    PyObject *capabilities = PyObject_GetAttr(device, s_capabilities);
    if (capabilities == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *kernels = PyObject_GetAttr(capabilities, half ? s_fast_half_kernels : s_fast_kernels);
    Py_DECREF(capabilities);
    if (kernels == NULL)
        PyErr_Clear();
    return kernels;
}

/* ------------------------------------------------------------------ elementwise */
static PyObject *
elementwise(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!enabled)
        Py_RETURN_NONE;
    if (nargs != 3 || !PyTuple_CheckExact(args[2]) || tensor_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "elementwise(op, out, operands): not configured, or "
                                         "bad arguments");
        return NULL;
    }
    PyObject *op = args[0], *out = args[1], *operands = args[2];
    PyObject *values[MAX_OPERANDS] = {NULL};  /* the numbers, as dtype scalars */
    PyObject *tensors[MAX_OPERANDS] = {NULL};
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
    int kind = -1;
    for (int i = 0; i < nfloats; i++)
        kind = dtype == floats[i] ? i : kind;
    if (kind < 0 && (numbers || PyUnicode_Compare(op, copy_name) != 0)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    wants_grad = wants_grad && grad_enabled();
    if (out != Py_None && (wants_grad || Py_TYPE(out) != tensor_type))
        Py_RETURN_NONE;
    PyObject *block0 = SLOT(first, TS.block);
    PyObject *device = SLOT(block0, BS.device);
    /* a two-byte float computes by its own kernels (copy moves bits: any dtype's) */
    int half = kind >= 2 && PyUnicode_Compare(op, copy_name) != 0;
    PyObject *kernels = fast_table(device, half);
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
    if (!enabled)
        Py_RETURN_NONE;
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

/* ------------------------------------------------------------------ reduce */
/* reduce(op, x, axis, keepdims, out): `ops._reduce` ("sum", "mean") where nothing is recorded
 * for autograd: the same checks (axis None, an int or a tuple of ints in range without
 * repeats; keepdims True or False), the same result shape, the kernel of the device's table
 * called as kernel(x view, out view, axes, keepdims). The result, or None before anything
 * changed. */
static PyObject *
reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!enabled)
        Py_RETURN_NONE;
    if (nargs != 5 || tensor_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "reduce(op, x, axis, keepdims, out): not configured, "
                                         "or bad arguments");
        return NULL;
    }
    PyObject *op = args[0], *x = args[1], *axis = args[2], *keepdims = args[3], *out = args[4];
    if (!readable(x) || (keepdims != Py_True && keepdims != Py_False) || capturing())
        Py_RETURN_NONE;
    PyObject *dtype = SLOT(x, TS.dtype);
    if (dtype != floats[0] && dtype != floats[1])
        Py_RETURN_NONE;
    if (SLOT(x, TS.requires_grad) == Py_True && grad_enabled())
        Py_RETURN_NONE;  /* recorded: Python */
    Py_ssize_t dims[MAX_DIMS];
    int ndim = read_dims(SLOT(x, TS.shape), dims);
    if (ndim < 0)
        Py_RETURN_NONE;
    int reduced[MAX_DIMS] = {0};
    PyObject *axes = Py_None;
    if (axis == Py_None) {
        for (int d = 0; d < ndim; d++)
            reduced[d] = 1;
    }
    else {
        PyObject *items = PyTuple_CheckExact(axis) ? axis : NULL;
        Py_ssize_t count = items ? PyTuple_GET_SIZE(items) : 1;
        if (count > ndim)
            Py_RETURN_NONE;
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *a = items ? PyTuple_GET_ITEM(items, i) : axis;
            if (!PyLong_CheckExact(a))
                Py_RETURN_NONE;
            long value = PyLong_AsLong(a);
            if (value == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                Py_RETURN_NONE;
            }
            if (value < -ndim || value >= ndim)
                Py_RETURN_NONE;
            value = value < 0 ? value + ndim : value;
            if (reduced[value])
                Py_RETURN_NONE;  /* a repeated axis: Python's error */
            reduced[value] = 1;
        }
        int taken = 0;
        for (int d = 0; d < ndim; d++)
            taken += reduced[d];
        axes = PyTuple_New(taken);
        if (axes == NULL)
            return NULL;
        for (int d = 0, i = 0; d < ndim; d++) {
            if (!reduced[d])
                continue;
            PyObject *n = PyLong_FromLong(d);
            if (n == NULL) {
                Py_DECREF(axes);
                return NULL;
            }
            PyTuple_SET_ITEM(axes, i++, n);
        }
    }
    if (axes == Py_None)
        Py_INCREF(axes);
    Py_ssize_t shape[MAX_DIMS];
    int rank = 0;
    for (int d = 0; d < ndim; d++) {
        if (!reduced[d])
            shape[rank++] = dims[d];
        else if (keepdims == Py_True)
            shape[rank++] = 1;
    }
    PyObject *block = SLOT(x, TS.block), *device = SLOT(block, BS.device);
    PyObject *result = NULL, *kernel = NULL;
    PyObject *kernels = fast_table(device, 0);
    if (kernels == NULL) {
        PyErr_Clear();
        goto fallback;
    }
    kernel = PyDict_Check(kernels) ? PyDict_GetItemWithError(kernels, op) : NULL;
    Py_XINCREF(kernel);
    Py_DECREF(kernels);
    if (kernel == NULL) {
        PyErr_Clear();
        goto fallback;
    }
    if (out != Py_None) {
        if (!out_usable(out, shape, rank, dtype, device, &x, 1, 1))
            goto fallback;
        Py_INCREF(out);
        result = out;
    }
    else {
        if (SLOT(block, BS.readonly) != Py_False)
            goto fallback;
        result = fresh_result(shape, rank, dtype, block);
        if (result == NULL)
            goto error;
    }
    PyObject *extra = PyTuple_Pack(2, axes, keepdims);
    if (extra == NULL)
        goto error;
    int failed = run_kernel(op, kernel, result, &x, NULL, 1, extra) < 0;
    Py_DECREF(extra);
    if (failed)
        goto error;
    Py_DECREF(kernel);
    Py_DECREF(axes);
    return result;
fallback:
    Py_XDECREF(kernel);
    Py_XDECREF(result);
    Py_DECREF(axes);
    Py_RETURN_NONE;
error:
    Py_XDECREF(kernel);
    Py_XDECREF(result);
    Py_DECREF(axes);
    return NULL;
}

/* ------------------------------------------------------------------ release */
/* release(t): `Tensor.release` (called by `Tensor.__del__`): the handle goes stale and drops
 * its reference; the last one gives the block's memory back (`Block._return_memory`). A tensor
 * or block of a subclass, a block with a lock, and an unbalanced count go to Python. */
static PyObject *
release(PyObject *self, PyObject *t)
{
    if (!enabled || Py_TYPE(t) != tensor_type || block_type == NULL)
        goto python;
    PyObject *block = SLOT(t, TS.block), *gen = SLOT(t, TS.gen);
    if (block == NULL || gen == NULL || Py_TYPE(block) != block_type
        || SLOT(block, BS.lock) != Py_None)
        goto python;
    if (gen == released)
        Py_RETURN_NONE;  /* released before: harmless */
    PyObject *refs_obj = SLOT(block, BS.refs), *generation = SLOT(block, BS.generation);
    if (refs_obj == NULL || generation == NULL || !PyLong_CheckExact(refs_obj))
        goto python;
    int current = PyObject_RichCompareBool(gen, generation, Py_EQ);
    if (current < 0)
        return NULL;
    Py_ssize_t refs = PyLong_AsSsize_t(refs_obj);
    if (refs == -1 && PyErr_Occurred())
        return NULL;
    if (current && refs < 1)
        goto python;  /* an unbalanced count: Python raises InvalidFreeError */
    Py_INCREF(block);
    Py_INCREF(gen);
    set_ref(&SLOT(t, TS.gen), released);
    set_ref(&SLOT(t, TS.native), Py_None);
    PyObject *result = Py_None;
    if (current) {
        PyObject *count = PyLong_FromSsize_t(refs - 1);
        if (count == NULL) {
            result = NULL;
            goto out;
        }
        Py_XSETREF(SLOT(block, BS.refs), count);
        if (refs - 1 == 0) {  /* the last reference: Block._return_memory */
            PyObject *allocation = SLOT(block, BS.allocation);
            Py_XINCREF(allocation);
            set_ref(&SLOT(block, BS.allocation), Py_None);
            set_ref(&SLOT(block, BS.written), Py_False);
            PyObject *next = PyNumber_Add(generation, one);
            if (next == NULL) {
                Py_XDECREF(allocation);
                result = NULL;
                goto out;
            }
            Py_XSETREF(SLOT(block, BS.generation), next);
            PyObject *hook = SLOT(block, BS.on_return);
            Py_XINCREF(hook);
            set_ref(&SLOT(block, BS.on_return), Py_None);
            if (allocation != NULL && allocation != Py_None) {
                PyObject *freed = PyObject_CallMethodOneArg(SLOT(block, BS.allocator), s_free,
                                                            allocation);
                if (freed == NULL)
                    result = NULL;
                Py_XDECREF(freed);
            }
            Py_XDECREF(allocation);
            if (result != NULL && hook != NULL && hook != Py_None) {
                PyObject *called = PyObject_CallOneArg(hook, block);
                if (called == NULL)
                    result = NULL;
                Py_XDECREF(called);
            }
            Py_XDECREF(hook);
        }
    }
out:
    Py_DECREF(gen);
    Py_DECREF(block);
    if (result == NULL)
        return NULL;
    Py_RETURN_NONE;
python:
    return PyObject_CallMethodNoArgs(t, s_release);
}

/* ------------------------------------------------------------------ the backward pass */
/* backward(root, gradient, retain_graph): `autograd._run` (Note [the backward engine] in
 * runtime/autograd.py), the same steps in the same order: the nodes in the same topological
 * order, each node's backward function called on the same arguments, the same releases, the
 * same copies and accumulations (through `ops.copy` and `autograd._accumulate`, given to
 * configure_autograd). Returns the list of (leaf, gradient) pairs that `_run` returns. What is
 * rare goes to Python: a freed node, a saved tensor whose version moved on, or saved entries of
 * another form (`Node.unpack` raises the error or unpacks), a gradient of another shape than
 * its input (`autograd._unbroadcast`). */
static PyTypeObject *node_type = NULL;
static struct {
    Py_ssize_t op, inputs, shapes, labels, backward_fn, saved, freed;
} NS;
static PyObject *unbroadcast_fn = NULL, *accumulate_fn = NULL, *copy_fn = NULL, *record_py = NULL;
static PyObject *s_unpack = NULL, *s_free_node = NULL, *s_shape = NULL, *s_block = NULL,
    *s_refs = NULL, *s_detach = NULL, *s_name = NULL, *s_version = NULL;
static const char *node_slot_names[] = {
    "op", "inputs", "shapes", "labels", "backward_fn", "saved", "freed", NULL};

static PyObject *
configure_autograd(PyObject *self, PyObject *args)
{
    PyObject *node, *unbroadcast, *accumulate, *copy, *python_record;
    if (!PyArg_ParseTuple(args, "O!OOOO", &PyType_Type, &node, &unbroadcast, &accumulate,
                          &copy, &python_record))
        return NULL;
    if (check_slots(node, node_slot_names) < 0)
        return NULL;
    if (slot_offset(node, "op", &NS.op) || slot_offset(node, "labels", &NS.labels)
        || slot_offset(node, "inputs", &NS.inputs) || slot_offset(node, "shapes", &NS.shapes)
        || slot_offset(node, "backward_fn", &NS.backward_fn)
        || slot_offset(node, "saved", &NS.saved) || slot_offset(node, "freed", &NS.freed))
        return NULL;
    set_ref((PyObject **)&node_type, node);
    set_ref(&unbroadcast_fn, unbroadcast);
    set_ref(&accumulate_fn, accumulate);
    set_ref(&copy_fn, copy);
    set_ref(&record_py, python_record);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the autograd record */
/* `t.detach()` with `handle.name = t.name`, as `autograd.record` makes a saved handle: a new
 * Tensor on t's block with t's layout and caches, one more reference on the block. NULL and
 * no exception where Python must do it (a stale or released handle: Python raises; a block
 * with a lock; anything unset); NULL and an exception on an error. */
static PyObject *
detached(PyObject *t)
{
    static const Py_ssize_t *copied[] = {&TS.block, &TS.shape, &TS.dtype, &TS.strides,
                                         &TS.offset, &TS.layout, &TS.span, &TS.self_overlap,
                                         &TS.native, &TS.name, NULL};
    if (Py_TYPE(t) != tensor_type)
        return NULL;
    PyObject *block = SLOT(t, TS.block), *gen = SLOT(t, TS.gen);
    if (block == NULL || gen == NULL || gen == released || Py_TYPE(block) != block_type
        || SLOT(block, BS.lock) != Py_None)
        return NULL;
    PyObject *generation = SLOT(block, BS.generation), *refs = SLOT(block, BS.refs);
    if (generation == NULL || refs == NULL || !PyLong_CheckExact(refs))
        return NULL;
    for (int i = 0; copied[i] != NULL; i++)
        if (SLOT(t, *copied[i]) == NULL)
            return NULL;
    int same = PyObject_RichCompareBool(gen, generation, Py_EQ);
    if (same <= 0)
        return NULL;  /* NOTE: an error here (never, for ints) surfaces in Python's detach */
    Py_ssize_t count = PyLong_AsSsize_t(refs);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    PyObject *more = PyLong_FromSsize_t(count + 1);
    PyObject *handle = more == NULL ? NULL : tensor_type->tp_alloc(tensor_type, 0);
    if (handle == NULL) {
        Py_XDECREF(more);
        return NULL;
    }
    for (int i = 0; copied[i] != NULL; i++)
        set_ref(&SLOT(handle, *copied[i]), SLOT(t, *copied[i]));
    set_ref(&SLOT(handle, TS.requires_grad), Py_False);
    set_ref(&SLOT(handle, TS.node), Py_None);
    set_ref(&SLOT(handle, TS.grad), Py_None);
    set_ref(&SLOT(handle, TS.gen), generation);  /* Block.acquire: one more reference */
    Py_XSETREF(SLOT(block, BS.refs), more);
    return handle;
}

/* One (label, value, version) entry of `Node.saved`, as `autograd.record` makes it. */
static PyObject *
saved_entry(PyObject *label, PyObject *value)
{
    if (!PyObject_TypeCheck(value, tensor_type))
        return Py_BuildValue("(OOi)", label, value, -1);
    PyObject *handle = detached(value);
    if (handle == NULL) {
        if (PyErr_Occurred())
            return NULL;
        handle = PyObject_CallMethodNoArgs(value, s_detach);
        PyObject *name = handle == NULL ? NULL : PyObject_GetAttr(value, s_name);
        if (name == NULL || PyObject_SetAttr(handle, s_name, name) < 0) {
            Py_XDECREF(name);
            Py_XDECREF(handle);
            return NULL;
        }
        Py_DECREF(name);
    }
    PyObject *block = PyObject_GetAttr(value, s_block);
    PyObject *version = block == NULL ? NULL : PyObject_GetAttr(block, s_version);
    Py_XDECREF(block);
    PyObject *entry = version == NULL ? NULL : PyTuple_Pack(3, label, handle, version);
    Py_XDECREF(version);
    Py_DECREF(handle);
    return entry;
}

/* record(op, out, inputs, labels, backward_fn, save=()): `autograd.record` (its Python code is
 * the specification, and runs what is not the common case: an out that is not an exact
 * Tensor, inputs or save that are not lists or tuples). */
static PyObject *
record_node(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *inputs = NULL, *saves = NULL, *entries = NULL, *shapes = NULL, *labels = NULL,
        *saved = NULL, *node = NULL;
    if (!enabled || nargs < 5 || nargs > 6 || node_type == NULL
        || Py_TYPE(args[1]) != tensor_type
        || !(PyList_CheckExact(args[2]) || PyTuple_CheckExact(args[2]))
        || (nargs == 6 && !(PyList_CheckExact(args[5]) || PyTuple_CheckExact(args[5]))))
        goto python;
    PyObject *out = args[1];
    inputs = PySequence_Fast(args[2], "record: inputs");
    saves = nargs == 6 ? PySequence_Fast(args[5], "record: save") : PyTuple_New(0);
    if (inputs == NULL || saves == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(saves); i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(saves, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2)
            goto python_clean;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(inputs);
    entries = PyTuple_New(n);
    shapes = PyTuple_New(n);
    if (entries == NULL || shapes == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PySequence_Fast_GET_ITEM(inputs, i), *entry = Py_None, *shape = Py_None;
        if (PyObject_TypeCheck(x, tensor_type)) {
            PyObject *flag = SLOT(x, TS.requires_grad), *made = SLOT(x, TS.node);
            if (flag == NULL || made == NULL || SLOT(x, TS.shape) == NULL)
                goto python_clean;
            int wants = PyObject_IsTrue(flag);
            if (wants < 0)
                goto fail;
            if (wants) {
                entry = made == Py_None ? x : made;
                shape = SLOT(x, TS.shape);
            }
        }
        Py_INCREF(entry);
        PyTuple_SET_ITEM(entries, i, entry);
        Py_INCREF(shape);
        PyTuple_SET_ITEM(shapes, i, shape);
    }
    saved = PyList_New(0);
    labels = PySequence_Tuple(args[3]);
    if (saved == NULL || labels == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(saves); i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(saves, i);
        PyObject *entry = saved_entry(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
        if (entry == NULL || PyList_Append(saved, entry) < 0) {
            Py_XDECREF(entry);
            goto fail;
        }
        Py_DECREF(entry);
    }
    node = node_type->tp_alloc(node_type, 0);
    if (node == NULL)
        goto fail;
    set_ref(&SLOT(node, NS.op), args[0]);
    set_ref(&SLOT(node, NS.inputs), entries);
    set_ref(&SLOT(node, NS.shapes), shapes);
    set_ref(&SLOT(node, NS.labels), labels);
    set_ref(&SLOT(node, NS.backward_fn), args[4]);
    set_ref(&SLOT(node, NS.saved), saved);
    set_ref(&SLOT(node, NS.freed), Py_False);
    Py_XSETREF(SLOT(out, TS.node), node);
    set_ref(&SLOT(out, TS.requires_grad), Py_True);
    Py_DECREF(inputs);
    Py_DECREF(saves);
    Py_DECREF(entries);
    Py_DECREF(shapes);
    Py_DECREF(labels);
    Py_DECREF(saved);
    Py_INCREF(out);
    return out;
fail:
    Py_XDECREF(inputs);
    Py_XDECREF(saves);
    Py_XDECREF(entries);
    Py_XDECREF(shapes);
    Py_XDECREF(labels);
    Py_XDECREF(saved);
    return NULL;
python_clean:
    Py_XDECREF(inputs);
    Py_XDECREF(saves);
    Py_XDECREF(entries);
    Py_XDECREF(shapes);
python:
    if (record_py == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "record: configure_autograd was not called");
        return NULL;
    }
    return PyObject_Vectorcall(record_py, args, nargs, NULL);
}

/* Every node `root` depends on, each after the nodes of its inputs (autograd._topological: an
 * iterative depth-first search over `inputs`, children in order). A new list, or NULL. */
static PyObject *
topological(PyObject *root)
{
    PyObject *order = PyList_New(0), *seen = PySet_New(NULL);
    Py_ssize_t size = 64, depth = 0;
    PyObject **nodes = PyMem_Malloc(size * sizeof(PyObject *));
    Py_ssize_t *next = PyMem_Malloc(size * sizeof(Py_ssize_t));
    if (order == NULL || seen == NULL || nodes == NULL || next == NULL
        || PySet_Add(seen, root) < 0) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto fail;
    }
    nodes[0] = root;  /* NOTE: borrowed: each node is held by its parent's inputs, or the caller */
    next[0] = 0;
    depth = 1;
    while (depth > 0) {
        PyObject *node = nodes[depth - 1];
        PyObject *inputs = SLOT(node, NS.inputs);
        if (inputs == NULL || !PyTuple_Check(inputs)) {
            PyErr_SetString(PyExc_TypeError, "backward: a Node's inputs are not a tuple");
            goto fail;
        }
        PyObject *child = NULL;
        while (next[depth - 1] < PyTuple_GET_SIZE(inputs)) {
            PyObject *candidate = PyTuple_GET_ITEM(inputs, next[depth - 1]);
            next[depth - 1]++;
            if (PyObject_TypeCheck(candidate, node_type)) {
                int known = PySet_Contains(seen, candidate);
                if (known < 0)
                    goto fail;
                if (!known) {
                    child = candidate;
                    break;
                }
            }
        }
        if (child == NULL) {
            if (PyList_Append(order, node) < 0)
                goto fail;
            depth--;
            continue;
        }
        if (PySet_Add(seen, child) < 0)
            goto fail;
        if (depth == size) {
            size *= 2;
            PyObject **more_nodes = PyMem_Realloc(nodes, size * sizeof(PyObject *));
            if (more_nodes == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            nodes = more_nodes;
            Py_ssize_t *more_next = PyMem_Realloc(next, size * sizeof(Py_ssize_t));
            if (more_next == NULL) {
                PyErr_NoMemory();
                goto fail;
            }
            next = more_next;
        }
        nodes[depth] = child;
        next[depth] = 0;
        depth++;
    }
    PyMem_Free(nodes);
    PyMem_Free(next);
    Py_DECREF(seen);
    return order;
fail:
    PyMem_Free(nodes);
    PyMem_Free(next);
    Py_XDECREF(seen);
    Py_XDECREF(order);
    return NULL;
}

/* The arguments of node's backward function, (g, *saved values), after the version checks of
 * `Node.unpack`; anything but the common case calls `node.unpack()` itself. */
static PyObject *
unpacked(PyObject *node, PyObject *g)
{
    PyObject *saved = SLOT(node, NS.saved);
    if (SLOT(node, NS.freed) != Py_False || saved == NULL || !PyList_CheckExact(saved))
        goto python;
    Py_ssize_t n = PyList_GET_SIZE(saved);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(saved, i);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3)
            goto python;
        PyObject *value = PyTuple_GET_ITEM(entry, 1), *version = PyTuple_GET_ITEM(entry, 2);
        if (!PyLong_CheckExact(version))
            goto python;
        long saved_version = PyLong_AsLong(version);
        if (saved_version == -1 && PyErr_Occurred())
            return NULL;
        if (saved_version < 0)
            continue;
        if (Py_TYPE(value) != tensor_type)
            goto python;
        PyObject *block = SLOT(value, TS.block);
        if (block == NULL || Py_TYPE(block) != block_type || SLOT(block, BS.version) == NULL)
            goto python;
        int same = PyObject_RichCompareBool(SLOT(block, BS.version), version, Py_EQ);
        if (same < 0)
            return NULL;
        if (!same)
            goto python;  /* written since it was saved: Node.unpack raises, naming it */
    }
    PyObject *args = PyTuple_New(n + 1);
    if (args == NULL)
        return NULL;
    Py_INCREF(g);
    PyTuple_SET_ITEM(args, 0, g);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyTuple_GET_ITEM(PyList_GET_ITEM(saved, i), 1);
        Py_INCREF(value);
        PyTuple_SET_ITEM(args, i + 1, value);
    }
    return args;
python:;
    PyObject *values = PyObject_CallMethodNoArgs(node, s_unpack);
    if (values == NULL)
        return NULL;
    PyObject *rest = PySequence_Tuple(values);
    Py_DECREF(values);
    if (rest == NULL)
        return NULL;
    PyObject *head = PyTuple_Pack(1, g);
    PyObject *joined = head == NULL ? NULL : PySequence_Concat(head, rest);
    Py_XDECREF(head);
    Py_DECREF(rest);
    return joined;
}

/* `Node.free`: release every saved tensor, forget them; anything but the common case calls
 * `node.free()` itself. 0, or -1 with an exception. */
static int
free_node(PyObject *node)
{
    PyObject *saved = SLOT(node, NS.saved);
    if (saved == NULL || !PyList_CheckExact(saved))
        goto python;
    Py_ssize_t n = PyList_GET_SIZE(saved);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(saved, i);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3
            || !PyLong_CheckExact(PyTuple_GET_ITEM(entry, 2)))
            goto python;
    }
    Py_INCREF(saved);  /* NOTE: a release may run Python (a hook) that touches the node */
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(saved); i++) {
        PyObject *entry = PyList_GET_ITEM(saved, i);
        PyObject *value = PyTuple_GET_ITEM(entry, 1);
        long version = PyLong_AsLong(PyTuple_GET_ITEM(entry, 2));
        if (version == -1 && PyErr_Occurred()) {
            Py_DECREF(saved);
            return -1;
        }
        if (version < 0)
            continue;
        Py_INCREF(entry);
        PyObject *done = release(NULL, value);
        Py_DECREF(entry);
        if (done == NULL) {
            Py_DECREF(saved);
            return -1;
        }
        Py_DECREF(done);
    }
    Py_DECREF(saved);
    PyObject *empty = PyList_New(0);
    if (empty == NULL)
        return -1;
    Py_XSETREF(SLOT(node, NS.saved), empty);
    set_ref(&SLOT(node, NS.freed), Py_True);
    return 0;
python:;
    PyObject *done = PyObject_CallMethodNoArgs(node, s_free_node);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* A new reference to id(x) as a dict key. */
static PyObject *
key_of(PyObject *x)
{
    return PyLong_FromVoidPtr(x);
}

/* `autograd._owned`: grad itself (a new reference) unless it is handed on already or another
 * handle holds its block; then `ops.copy(grad)`. Steals the reference to grad. */
static PyObject *
owned(PyObject *grad, PyObject *handed)
{
    PyObject *key = key_of(grad);
    if (key == NULL)
        goto fail;
    int known = PyDict_Contains(handed, key);
    Py_DECREF(key);
    if (known < 0)
        goto fail;
    int shared = known;
    if (!shared) {
        PyObject *block = PyObject_GetAttr(grad, s_block);
        PyObject *refs = block == NULL ? NULL : PyObject_GetAttr(block, s_refs);
        Py_XDECREF(block);
        if (refs == NULL)
            goto fail;
        shared = PyObject_RichCompareBool(refs, one, Py_GT);
        Py_DECREF(refs);
        if (shared < 0)
            goto fail;
    }
    if (!shared)
        return grad;
    PyObject *copied = PyObject_CallOneArg(copy_fn, grad);
    Py_DECREF(grad);
    return copied;
fail:
    Py_DECREF(grad);
    return NULL;
}

/* handed[id(x)] = x (set) or del handed[id(x)] (x == NULL: remove `of`). 0 or -1. */
static int
hand(PyObject *handed, PyObject *of, int add)
{
    PyObject *key = key_of(of);
    if (key == NULL)
        return -1;
    int result = add ? PyDict_SetItem(handed, key, of) : PyDict_DelItem(handed, key);
    Py_DECREF(key);
    return result;
}

/* One gradient `grad` (a new reference, stolen) reaching `entry` (a Node or a leaf): stored
 * where `_run` stores it, accumulated where one is there already. 0 or -1. */
static int
deliver(PyObject *entry, PyObject *grad, PyObject *grads, PyObject *handed, PyObject *leaves)
{
    PyObject *key = NULL, *held, *previous;
    int leaf = !PyObject_TypeCheck(entry, node_type);
    if (leaf) {
        key = key_of(entry);
        if (key == NULL)
            goto fail;
        held = PyDict_GetItemWithError(leaves, key);  /* borrowed: (leaf, gradient) */
        if (held == NULL && PyErr_Occurred())
            goto fail;
        previous = held == NULL ? NULL : PyTuple_GET_ITEM(held, 1);
    } else {
        previous = PyDict_GetItemWithError(grads, entry);
        if (previous == NULL && PyErr_Occurred())
            goto fail;
    }
    if (previous == NULL) {
        grad = owned(grad, handed);
        if (grad == NULL)
            goto fail_key;
    } else {
        Py_INCREF(previous);
        if (hand(handed, previous, 0) < 0) {
            Py_DECREF(previous);
            goto fail;
        }
        PyObject *sum = PyObject_CallFunctionObjArgs(accumulate_fn, previous, grad, NULL);
        Py_DECREF(previous);
        Py_DECREF(grad);
        grad = sum;
        if (grad == NULL)
            goto fail_key;
    }
    int stored;
    if (leaf) {
        PyObject *pair = PyTuple_Pack(2, entry, grad);
        stored = pair == NULL ? -1 : PyDict_SetItem(leaves, key, pair);
        Py_XDECREF(pair);
    } else {
        stored = PyDict_SetItem(grads, entry, grad);
    }
    if (stored < 0 || hand(handed, grad, 1) < 0)
        goto fail;
    Py_DECREF(grad);
    Py_XDECREF(key);
    return 0;
fail:
    Py_DECREF(grad);
fail_key:
    Py_XDECREF(key);
    return -1;
}

/* One node of the pass: its backward function on its gradient `g` (a new reference, stolen),
 * then each input's gradient delivered. 0 or -1. */
static int
run_node(PyObject *node, PyObject *g, int retain, PyObject *grads, PyObject *handed,
         PyObject *leaves)
{
    PyObject *args = NULL, *results = NULL, *fast = NULL;
    if (hand(handed, g, 0) < 0)
        goto fail;
    args = unpacked(node, g);
    if (args == NULL)
        goto fail;
    PyObject *fn = SLOT(node, NS.backward_fn);
    if (fn == NULL) {
        PyErr_SetString(PyExc_AttributeError, "backward: a Node without backward_fn");
        goto fail;
    }
    Py_INCREF(fn);
    results = PyObject_Call(fn, args, NULL);
    Py_DECREF(fn);
    Py_CLEAR(args);
    if (results == NULL)
        goto fail;
    if (!retain && free_node(node) < 0)
        goto fail;
    fast = PySequence_Fast(results, "backward: a backward function returns a sequence");
    if (fast == NULL)
        goto fail;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    int kept = 0;
    for (Py_ssize_t i = 0; i < count && !kept; i++)
        kept = PySequence_Fast_GET_ITEM(fast, i) == g;
    if (!kept) {  /* NOTE: its memory may serve the gradients computed next */
        PyObject *done = release(NULL, g);
        if (done == NULL)
            goto fail;
        Py_DECREF(done);
    }
    Py_CLEAR(g);
    PyObject *inputs = SLOT(node, NS.inputs), *shapes = SLOT(node, NS.shapes);
    if (inputs == NULL || shapes == NULL || !PyTuple_Check(inputs) || !PyTuple_Check(shapes)) {
        PyErr_SetString(PyExc_TypeError, "backward: a Node's inputs and shapes are tuples");
        goto fail;
    }
    Py_INCREF(inputs);
    Py_INCREF(shapes);
    Py_ssize_t n = PyTuple_GET_SIZE(inputs);
    if (PyTuple_GET_SIZE(shapes) < n)
        n = PyTuple_GET_SIZE(shapes);
    if (count < n)
        n = count;
    int status = 0;
    for (Py_ssize_t i = 0; i < n && status == 0; i++) {
        PyObject *entry = PyTuple_GET_ITEM(inputs, i), *shape = PyTuple_GET_ITEM(shapes, i);
        PyObject *grad = PySequence_Fast_GET_ITEM(fast, i);
        if (entry == Py_None || grad == Py_None)
            continue;
        Py_INCREF(grad);
        PyObject *its = PyObject_GetAttr(grad, s_shape);
        int same = its == NULL ? -1 : PyObject_RichCompareBool(its, shape, Py_EQ);
        Py_XDECREF(its);
        if (same == 0) {
            PyObject *summed = PyObject_CallFunctionObjArgs(unbroadcast_fn, grad, shape, NULL);
            Py_DECREF(grad);
            grad = summed;
            same = summed == NULL ? -1 : 1;
        }
        if (same < 0) {
            Py_XDECREF(grad);
            status = -1;
            break;
        }
        status = deliver(entry, grad, grads, handed, leaves);
    }
    Py_DECREF(inputs);
    Py_DECREF(shapes);
    Py_DECREF(fast);
    Py_DECREF(results);
    return status;
fail:
    Py_XDECREF(g);
    Py_XDECREF(args);
    Py_XDECREF(fast);
    Py_XDECREF(results);
    return -1;
}

static PyObject *
backward(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!enabled)
        Py_RETURN_NONE;  /* autograd._start runs the Python engine */
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "backward(root, gradient, retain_graph)");
        return NULL;
    }
    if (node_type == NULL || tensor_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "backward: configure_autograd was not called");
        return NULL;
    }
    PyObject *root = args[0], *gradient = args[1];
    int retain = PyObject_IsTrue(args[2]);
    if (retain < 0)
        return NULL;
    if (!PyObject_TypeCheck(root, node_type)) {
        PyErr_SetString(PyExc_TypeError, "backward: root is not a Node");
        return NULL;
    }
    PyObject *grads = PyDict_New(), *handed = PyDict_New(), *leaves = PyDict_New();
    PyObject *order = NULL, *result = NULL;
    if (grads == NULL || handed == NULL || leaves == NULL
        || PyDict_SetItem(grads, root, gradient) < 0 || hand(handed, gradient, 1) < 0)
        goto out;
    order = topological(root);
    if (order == NULL)
        goto out;
    for (Py_ssize_t i = PyList_GET_SIZE(order) - 1; i >= 0; i--) {
        PyObject *node = PyList_GET_ITEM(order, i);
        PyObject *g = PyDict_GetItemWithError(grads, node);
        if (g == NULL) {
            if (PyErr_Occurred())
                goto out;
            continue;  /* nothing flowed here */
        }
        Py_INCREF(g);
        if (PyDict_DelItem(grads, node) < 0) {
            Py_DECREF(g);
            goto out;
        }
        if (run_node(node, g, retain, grads, handed, leaves) < 0)
            goto out;
    }
    result = PyDict_Values(leaves);
out:
    Py_XDECREF(order);
    Py_XDECREF(grads);
    Py_XDECREF(handed);
    Py_XDECREF(leaves);
    return result;
}

/* ------------------------------------------------------------------ the switch */
/* set_enabled(flag) -> the previous flag: turn the fast path on (only once configure and
 * configure_autograd have run) or off (`enabled`). */
static PyObject *
set_enabled(PyObject *self, PyObject *flag)
{
    int on = PyObject_IsTrue(flag);
    if (on < 0)
        return NULL;
    if (on && (tensor_type == NULL || node_type == NULL)) {
        PyErr_SetString(PyExc_ValueError, "set_enabled: configure and configure_autograd "
                                          "must run first");
        return NULL;
    }
    int previous = enabled;
    enabled = on;
    return PyBool_FromLong(previous);
}

/* ------------------------------------------------------------------ module */
static PyMethodDef methods[] = {
    {"set_enabled", set_enabled, METH_O,
     "set_enabled(flag) -> the previous flag: while off (and until configured), every function "
     "hands its call back to its Python twin"},
    {"configure", configure, METH_VARARGS,
     "configure(Tensor, Block, grad_mode, tape_state, fp_state, fp_ignore, dtypes, types, "
     "maxima, fresh, record): tell the fast path where the runtime keeps its state"},
    {"elementwise", (PyCFunction)(void (*)(void))elementwise, METH_FASTCALL,
     "elementwise(op, out, operands): the result of the op, or None for the Python path"},
    {"reduce", (PyCFunction)(void (*)(void))reduce, METH_FASTCALL,
     "reduce(op, x, axis, keepdims, out): a sum or mean recording nothing, or None"},
    {"release", release, METH_O,
     "release(tensor): Tensor.release, for Tensor.__del__"},
    {"configure_autograd", configure_autograd, METH_VARARGS,
     "configure_autograd(Node, unbroadcast, accumulate, copy, record): what the backward pass "
     "calls, and the Python record"},
    {"record", (PyCFunction)(void (*)(void))record_node, METH_FASTCALL,
     "record(op, out, inputs, labels, backward_fn, save=()): autograd.record"},
    {"backward", (PyCFunction)(void (*)(void))backward, METH_FASTCALL,
     "backward(root, gradient, retain_graph): autograd._run, the (leaf, gradient) pairs"},
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
    s_fast_kernels = PyUnicode_InternFromString("fast_kernels");
    s_fast_half_kernels = PyUnicode_InternFromString("fast_half_kernels");
    s_capabilities = PyUnicode_InternFromString("capabilities");
    s_native_on = PyUnicode_InternFromString("_native_on");
    s_memory_for_write = PyUnicode_InternFromString("memory_for_write");
    copy_name = PyUnicode_InternFromString("copy");
    one = PyLong_FromLong(1);
    zero = PyLong_FromLong(0);
    s_has_internal_overlap = PyUnicode_InternFromString("has_internal_overlap");
    s_allocate = PyUnicode_InternFromString("allocate");
    s_free = PyUnicode_InternFromString("free");
    s_release = PyUnicode_InternFromString("release");
    s_itemsize = PyUnicode_InternFromString("itemsize");
    s_raw = PyUnicode_InternFromString("raw");
    s_offset = PyUnicode_InternFromString("offset");
    s_array_view = PyUnicode_InternFromString("_array_view");
    s_unpack = PyUnicode_InternFromString("unpack");
    s_free_node = PyUnicode_InternFromString("free");
    s_shape = PyUnicode_InternFromString("shape");
    s_block = PyUnicode_InternFromString("block");
    s_refs = PyUnicode_InternFromString("_refs");
    s_detach = PyUnicode_InternFromString("detach");
    s_name = PyUnicode_InternFromString("name");
    s_version = PyUnicode_InternFromString("version");
    if (!one || !zero || !s_has_internal_overlap || !s_allocate || !s_free || !s_release
        || !s_itemsize || !s_raw || !s_offset || !s_array_view || !s_enabled || !s_tape
        || !s_fast_kernels || !s_fast_half_kernels || !s_capabilities || !s_native_on
        || !s_memory_for_write
        || !copy_name || !s_unpack || !s_free_node || !s_shape || !s_block || !s_refs
        || !s_detach || !s_name || !s_version)
        return NULL;
    return PyModule_Create(&module);
}
