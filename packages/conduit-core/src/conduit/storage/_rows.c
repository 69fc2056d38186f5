/* conduit.storage._rows: the compiled row store of conduit.storage.columnar.ColumnarStorage.append_rows.
 *
 * put(columns, plan, slot, capacity) stores one batch, given as a dict of tensors, into a host ring of
 * contiguous columns: it checks every field first and writes only when all of them can be copied whole, by
 * one memmove per run of rows (two where the batch wraps the ring). A field can be copied when it is a
 * torch.Tensor (not a subclass) of the column's dtype, strided, on the CPU, C-contiguous, without a negative
 * view bit, of the per-item shape the plan names, with as many rows as every other field, 1 <= rows <=
 * capacity; the dict holds exactly the plan's fields. Otherwise put returns -1 with nothing written, and
 * the caller's general path converts the batch or refuses it with a typed error.
 *
 * plan: a tuple with one (name, dtype, item shape tuple, column address, bytes per row) per field. The
 * caller keeps the columns alive and the plan true (host columns are never reallocated). The GIL is held
 * throughout, so no Python thread can resize or free a source tensor during the copy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define MAX_FIELDS 256

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

/* An integer attribute of `o` (called when `call`), or -1 with an exception (or for a value -1). */
static Py_ssize_t size_of(PyObject *o, PyObject *name, int call) {
    PyObject *v = call ? PyObject_CallMethodNoArgs(o, name) : PyObject_GetAttr(o, name);
    if (!v) {
        return -1;
    }
    Py_ssize_t r = PyLong_AsSsize_t(v);
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
    Py_ssize_t nbytes = size_of(c, s_nbytes, 0);
    if (nbytes == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (row < 1 || nbytes / row != n || nbytes % row != 0) {
        return 0;
    }
    PyObject *address = PyObject_CallMethodNoArgs(c, s_data_ptr);
    if (!address) {
        return -1;
    }
    *src = PyLong_AsVoidPtr(address);
    Py_DECREF(address);
    return PyErr_Occurred() ? -1 : n;
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
    Py_ssize_t k = PyTuple_GET_SIZE(plan), n = -1;
    if (cap < 1 || slot < 0 || slot >= cap || k < 1 || k > MAX_FIELDS || PyDict_GET_SIZE(columns) != k) {
        return PyLong_FromLong(-1);
    }
    void *src[MAX_FIELDS];
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *entry = PyTuple_GET_ITEM(plan, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 5 || !PyTuple_Check(PyTuple_GET_ITEM(entry, 2))) {
            PyErr_SetString(PyExc_TypeError, "a plan entry is (name, dtype, item shape tuple, address, row bytes)");
            return NULL;
        }
        PyObject *c = PyDict_GetItemWithError(columns, PyTuple_GET_ITEM(entry, 0));
        if (!c) {
            return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
        }
        Py_ssize_t rows = rows_of(c, entry, &src[i]);
        if (rows < 0) {
            return NULL;
        }
        if (rows == 0 || (n >= 0 && rows != n)) {
            return PyLong_FromLong(-1);
        }
        n = rows;
    }
    if (n > cap) {
        return PyLong_FromLong(-1);
    }
    Py_ssize_t first = cap - slot < n ? cap - slot : n;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *entry = PyTuple_GET_ITEM(plan, i);
        char *base = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 3));
        Py_ssize_t row = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 4));
        if (!base || PyErr_Occurred()) {
            return NULL;
        }
        memmove(base + slot * row, src[i], (size_t)(first * row));
        if (first < n) {
            memmove(base, (char *)src[i] + first * row, (size_t)((n - first) * row));
        }
    }
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"put", (PyCFunction)(void (*)(void))put, METH_FASTCALL, "put(columns, plan, slot, capacity) -> rows or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_rows", "The compiled row store of conduit.storage.columnar.", -1, methods,
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
