/* conduit.storage._rows: the compiled row copies of conduit.storage.columnar.ColumnarStorage: put (behind
 * append_rows) and gather (behind gather).
 *
 * put(columns, plan, slot, capacity) stores one batch, given as a dict of tensors, into a host ring of
 * contiguous columns: it checks every field first and writes only when all of them can be copied whole, by
 * one memmove per run of rows (two where the batch wraps the ring). A field can be copied when it is a
 * torch.Tensor (not a subclass) of the column's dtype, strided, on the CPU, C-contiguous, without a negative
 * view bit, of the per-item shape the plan names, with as many rows as every other field, 1 <= rows <=
 * capacity; the dict holds exactly the plan's fields. Otherwise put returns -1 with nothing written, and
 * the caller's general path converts the batch or refuses it with a typed error. Long runs are written with
 * non-temporal stores (0.5-0.7x glibc's memmove for runs of 5-20 MB on a 16 MiB L3; slower than it on a 300 MiB
 * one, which keeps them cached): from 1 MiB, or what streaming() set (conduit.storage.columnar sets it from the
 * machine's last-level cache at import: stream_thresholds).
 *
 * plan: a tuple with one (name, dtype, item shape tuple, column address, bytes per row, column) per field; the
 * caller holds it through the call, so the columns stay alive (and mapped) until the copy ends, and keeps it
 * true (host columns are never reallocated). put holds every field it checked, so Python code its attribute
 * reads may run cannot free one. Copies of 64 KiB or more release the GIL once every field is checked, as
 * torch's own copies do: a source tensor resized by another thread meanwhile is the caller's race, as it is
 * for torch.
 *
 * gather(dst, src, row, slots, n, capacity) copies rows src[slots[i]] to dst[i] by raw addresses the caller
 * checked: every slot is checked against the capacity first (a copy that releases the GIL checks and reads its
 * own copy of the slots, which no other thread can write); a large copy (from 4 MiB, or what streaming()
 * set) uses non-temporal stores (SSE2), so that writing the batch neither first reads each output line nor
 * evicts the cache for rows nobody reads before they are evicted anyway (measured on a 16 MiB L3: about 0.76x
 * the time of torch.index_select for 512 rows of 20 kB); smaller copies are one memcpy per row. Both prefetch
 * the rows ahead; copies of 64 KiB or more release the GIL, as torch's own ops do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define MAX_FIELDS 256
/* Gathers of at least this many bytes write around the caches (non-temporal stores): the rows would evict
 * each other before anyone read them, and a plain store first reads every line it writes. */
static Py_ssize_t stream_min_bytes = (Py_ssize_t)4 << 20;
/* Stores (sequential runs into the ring) of at least this many bytes per run write around the caches: a
 * replay buffer's newest rows are a small part of what it samples, so keeping them cached buys little. */
static Py_ssize_t stream_run_min_bytes = (Py_ssize_t)1 << 20;
/* Copies of at least this many bytes run with the GIL released (as torch's copies and ctypes' memmove do). */
#define RELEASE_MIN_BYTES ((Py_ssize_t)1 << 16)
/* Rows ahead whose first lines are prefetched. */
#define AHEAD 4

/* memmove(dst, src, n), by non-temporal stores from stream_run_min_bytes up where the ranges do not overlap. */
static void copy_run(char *dst, const char *src, Py_ssize_t n) {
#ifdef __SSE2__
    if (n >= stream_run_min_bytes && (dst + n <= src || src + n <= dst)) {
        Py_ssize_t head = (Py_ssize_t)((16 - ((uintptr_t)dst & 15)) & 15);
        memcpy(dst, src, (size_t)head);
        Py_ssize_t m = (n - head) / 16;
        __m128i *d = (__m128i *)(dst + head);
        const char *s = src + head;
        for (Py_ssize_t j = 0; j < m; j++) {
            if ((j & 3) == 0) {
                __builtin_prefetch(s + 16 * j + 1024, 0, 0);
            }
            _mm_stream_si128(d + j, _mm_loadu_si128((const __m128i *)(s + 16 * j)));
        }
        _mm_sfence();
        memcpy(dst + head + 16 * m, s + 16 * m, (size_t)(n - head - 16 * m));
        return;
    }
#endif
    memmove(dst, src, (size_t)n);
}

static PyObject *tensor_type, *strided, *s_dtype, *s_layout, *s_is_cpu, *s_shape, *s_is_contiguous, *s_is_neg,
    *s_nbytes, *s_data_ptr;

/* 1 when attribute `name` of `o` is the object `want`, 0 when not, -1 with an exception. */
static int attr_is(PyObject *o, PyObject *name, PyObject *want) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) {
        return -1;
    }
    int same = v == want;
    Py_DECREF(v);
    return same;
}

/* The truth of attribute `name` of `o` (called when `call`): 1, 0, or -1 with an exception. */
static int truth(PyObject *o, PyObject *name, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(o, name) : PyObject_GetAttr(o, name);
    if (!v) {
        return -1;
    }
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The rows of field `c` when it can be copied as the plan entry describes, 0 when not (-1 with an exception),
 * its data address in *src. */
static Py_ssize_t rows_of(PyObject *c, PyObject *entry, void **src) {
    PyObject *dtype = PyTuple_GET_ITEM(entry, 1), *item = PyTuple_GET_ITEM(entry, 2);
    Py_ssize_t row = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 4));
    if (row == -1 && PyErr_Occurred()) {
        return -1;
    }
    if ((PyObject *)Py_TYPE(c) != tensor_type) {
        return 0;
    }
    int r;
    if ((r = attr_is(c, s_dtype, dtype)) <= 0 || (r = attr_is(c, s_layout, strided)) <= 0 ||
        (r = truth(c, s_is_cpu, 0)) <= 0) {
        return r;
    }
    PyObject *shape = PyObject_GetAttr(c, s_shape);
    if (!shape) {
        return -1;
    }
    Py_ssize_t dims = PyTuple_GET_SIZE(item) + 1, n = 0;
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != dims) {
        Py_DECREF(shape);
        return 0;
    }
    for (Py_ssize_t j = 1; j < dims; j++) {
        r = PyObject_RichCompareBool(PyTuple_GET_ITEM(shape, j), PyTuple_GET_ITEM(item, j - 1), Py_EQ);
        if (r <= 0) {
            Py_DECREF(shape);
            return r;
        }
    }
    n = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, 0));
    Py_DECREF(shape);
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (n < 1 || (r = truth(c, s_is_contiguous, 1)) <= 0) {
        return n < 1 ? 0 : r;
    }
    if ((r = truth(c, s_is_neg, 1)) != 0) {
        return r < 0 ? -1 : 0;
    }
    PyObject *nbytes = PyObject_GetAttr(c, s_nbytes), *address = NULL;
    Py_ssize_t size = nbytes ? PyLong_AsSsize_t(nbytes) : -1;
    Py_XDECREF(nbytes);
    if (size == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (row < 1 || size / row != n || size % row != 0 || !(address = PyObject_CallMethodNoArgs(c, s_data_ptr))) {
        return PyErr_Occurred() ? -1 : 0;
    }
    *src = PyLong_AsVoidPtr(address);
    Py_DECREF(address);
    if (PyErr_Occurred()) {
        return -1;
    }
    return *src ? n : 0; /* (no data pointer for n rows, e.g. a functional tensor: the general path copies it) */
}

/* put(columns, plan, slot, capacity) -> rows stored, or -1 with nothing written (see the top of this file). */
static PyObject *put(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyDict_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "put(columns: dict, plan: tuple, slot, capacity)");
        return NULL;
    }
    PyObject *columns = args[0], *plan = args[1];
    Py_ssize_t slot = PyLong_AsSsize_t(args[2]);
    if (slot == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t cap = PyLong_AsSsize_t(args[3]);
    if (cap == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(plan), n = -1, held = 0;
    if (cap < 1 || slot < 0 || slot >= cap || k < 1 || k > MAX_FIELDS || PyDict_GET_SIZE(columns) != k) {
        return PyLong_FromLong(-1);
    }
    /* every field checked is held until its rows are copied: the checks read attributes, which can run Python code
     * (a torch function mode, a finalizer, another thread) that replaces the dict's entries and frees the old ones */
    PyObject *fields[MAX_FIELDS], *result = NULL;
    void *src[MAX_FIELDS];
    char *dst[MAX_FIELDS];
    Py_ssize_t width[MAX_FIELDS];
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *entry = PyTuple_GET_ITEM(plan, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 6 || !PyTuple_Check(PyTuple_GET_ITEM(entry, 2))) {
            PyErr_SetString(PyExc_TypeError,
                            "a plan entry is (name, dtype, item shape tuple, address, row bytes, column)");
            goto done;
        }
        PyObject *c = PyDict_GetItemWithError(columns, PyTuple_GET_ITEM(entry, 0));
        if (!c) {
            result = PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
            goto done;
        }
        Py_INCREF(c);
        fields[held++] = c;
        Py_ssize_t rows = rows_of(c, entry, &src[i]);
        if (rows < 0) {
            goto done;
        }
        if (rows == 0 || (n >= 0 && rows != n)) {
            result = PyLong_FromLong(-1);
            goto done;
        }
        n = rows;
        dst[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 3));
        width[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 4));  /* (checked >= 1 by rows_of) */
        if (!dst[i] || PyErr_Occurred()) {
            result = PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
            goto done;
        }
    }
    if (n > cap) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    Py_ssize_t first = cap - slot < n ? cap - slot : n, total = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        total += n * width[i];
    }
    PyThreadState *released = total >= RELEASE_MIN_BYTES ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        copy_run(dst[i] + slot * width[i], src[i], first * width[i]);
        if (first < n) {
            copy_run(dst[i], (char *)src[i] + first * width[i], (n - first) * width[i]);
        }
    }
    if (released) {
        PyEval_RestoreThread(released);
    }
    result = PyLong_FromSsize_t(n);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        Py_DECREF(fields[i]);
    }
    return result;
}

static void copy_rows(char *dst, const char *src, Py_ssize_t row, const int64_t *slots, Py_ssize_t n) {
#ifdef __SSE2__
    if (n * row >= stream_min_bytes && row % 16 == 0 && ((uintptr_t)dst & 15) == 0) {
        Py_ssize_t m = row / 16;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i + AHEAD < n) {
                __builtin_prefetch(src + slots[i + AHEAD] * row, 0, 0);
            }
            const __m128i *s = (const __m128i *)(src + slots[i] * row);
            __m128i *d = (__m128i *)(dst + i * row);
            for (Py_ssize_t j = 0; j < m; j++) {
                _mm_stream_si128(d + j, _mm_loadu_si128(s + j));
            }
        }
        _mm_sfence();
        return;
    }
#endif
#define TYPED(T)                                                          \
    for (Py_ssize_t i = 0; i < n; i++) {                                  \
        ((T *)dst)[i] = ((const T *)src)[slots[i]];                       \
    }                                                                     \
    return;
    switch (row) { /* scalar items: one load and store each, which the CPU overlaps (no call per row) */
    case 1:
        TYPED(uint8_t)
    case 2:
        TYPED(uint16_t)
    case 4:
        TYPED(uint32_t)
    case 8:
        TYPED(uint64_t)
    default:
        break;
    }
#undef TYPED
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            __builtin_prefetch(src + slots[i + AHEAD] * row, 0, 0);
        }
        memcpy(dst + i * row, src + slots[i] * row, (size_t)row);
    }
}

/* gather(dst, src, row, slots, n, capacity): the rows src[slots[i]] (row bytes each, 0 <= slots[i] < capacity)
 * to dst[i], for i < n; all addresses raw (the caller checked the tensors behind them and keeps them alive).
 * Every slot is checked before anything is copied (IndexError); large copies release the GIL. */
static PyObject *gather(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "gather(dst, src, row, slots, n, capacity)");
        return NULL;
    }
    char *dst = PyLong_AsVoidPtr(args[0]);
    if (!dst && PyErr_Occurred()) {
        return NULL;
    }
    const char *src = PyLong_AsVoidPtr(args[1]);
    if (!src && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t row = PyLong_AsSsize_t(args[2]);
    if (row == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const int64_t *slots = PyLong_AsVoidPtr(args[3]);
    if (!slots && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[4]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t cap = PyLong_AsSsize_t(args[5]);
    if (cap == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (row < 1 || n < 0 || cap < 1 || (n > 0 && (!dst || !src || !slots))) {
        PyErr_SetString(PyExc_ValueError, "gather needs row >= 1, n >= 0, capacity >= 1 and addresses");
        return NULL;
    }
    int release = n * row >= RELEASE_MIN_BYTES;
    int64_t *own = NULL;
    if (release) { /* the copy reads slots of its own: another thread may write the caller's once the GIL is free */
        if (!(own = PyMem_Malloc((size_t)n * sizeof(int64_t)))) {
            return PyErr_NoMemory();
        }
        memcpy(own, slots, (size_t)n * sizeof(int64_t));
        slots = own;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= cap) {
            PyErr_Format(PyExc_IndexError, "slot %lld is outside [0, %zd)", (long long)slots[i], cap);
            PyMem_Free(own);
            return NULL;
        }
    }
    if (release) {
        Py_BEGIN_ALLOW_THREADS
        copy_rows(dst, src, row, slots, n);
        Py_END_ALLOW_THREADS
        PyMem_Free(own);
    } else {
        copy_rows(dst, src, row, slots, n);
    }
    Py_RETURN_NONE;
}

/* streaming(gather_min, run_min) -> (gather_min, run_min) before: the sizes from which gathers and ring runs use
 * non-temporal stores (bytes; None keeps one). A process-wide setting, for measuring one against the other. */
static PyObject *streaming(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "streaming(gather_min, run_min)");
        return NULL;
    }
    Py_ssize_t want[2] = {stream_min_bytes, stream_run_min_bytes};
    for (int i = 0; i < 2; i++) {
        if (args[i] == Py_None) {
            continue;
        }
        want[i] = PyLong_AsSsize_t(args[i]);
        if (want[i] == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (want[i] < 1) {
            PyErr_SetString(PyExc_ValueError, "streaming needs sizes of at least 1 byte (or None)");
            return NULL;
        }
    }
    PyObject *before = Py_BuildValue("(nn)", stream_min_bytes, stream_run_min_bytes);
    if (before) {
        stream_min_bytes = want[0];
        stream_run_min_bytes = want[1];
    }
    return before;
}

static PyMethodDef methods[] = {
    {"put", (PyCFunction)(void (*)(void))put, METH_FASTCALL, "put(columns, plan, slot, capacity) -> rows or -1"},
    {"gather", (PyCFunction)(void (*)(void))gather, METH_FASTCALL, "gather(dst, src, row, slots, n, capacity)"},
    {"streaming", (PyCFunction)(void (*)(void))streaming, METH_FASTCALL,
     "streaming(gather_min, run_min) -> the non-temporal store thresholds before (bytes; None keeps one)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rows", "The compiled row copies of conduit.storage.columnar.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rows(void) {
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch) {
        return NULL;
    }
    tensor_type = PyObject_GetAttrString(torch, "Tensor");
    strided = PyObject_GetAttrString(torch, "strided");
    Py_DECREF(torch);
    if (!tensor_type || !strided) {
        return NULL;
    }
#define NAME(var, text)                                    \
    if (!(var = PyUnicode_InternFromString(text))) {       \
        return NULL;                                       \
    }
    NAME(s_dtype, "dtype");
    NAME(s_layout, "layout");
    NAME(s_is_cpu, "is_cpu");
    NAME(s_shape, "shape");
    NAME(s_is_contiguous, "is_contiguous");
    NAME(s_is_neg, "is_neg");
    NAME(s_nbytes, "nbytes");
    NAME(s_data_ptr, "data_ptr");
#undef NAME
    return PyModule_Create(&module);
}
