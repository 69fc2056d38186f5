/* conduit.semantics._sumtree: the compiled kernels of conduit.semantics.sumtree.CompiledSumTree.
 *
 * A complete binary tree over P >= capacity leaf positions, in two arrays of 2P float64: node i has
 * children 2i and 2i + 1, the leaves sit at P .. P + capacity - 1 (the rest stay 0), the root at 1.
 * `sums` holds each node's sum of weights, `mins` its smallest positive weight (inf for none). A
 * node is always recomputed from its two children, never adjusted by a difference, so the trees
 * depend on the leaves alone (a rebuilt tree equals an updated one) and no rounding accumulates.
 *
 * Every function checks its arguments (buffer sizes; set and set_one also each slot and weight)
 * before it writes anything, holds the GIL throughout (a call is atomic to other Python threads)
 * and raises a Python exception instead of touching memory out of range. build takes the leaves as
 * they are: CompiledSumTree.load checks them before it writes them. Buffers are C-contiguous:
 * float64 for weights and draws, int64 for slots.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

typedef struct {
    Py_buffer view;
    int held;
} Buf;

/* Take a C-contiguous buffer of 8-byte items from `obj` (writable when asked). */
static int take(PyObject *obj, Buf *buf, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, &buf->view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        return -1;
    }
    buf->held = 1;
    if (buf->view.itemsize != 8 || buf->view.len % 8 != 0) {
        PyErr_Format(PyExc_TypeError, "%s must hold 8-byte items (float64 or int64)", name);
        return -1;
    }
    return 0;
}

static void give_back(Buf *buf) {
    if (buf->held) {
        PyBuffer_Release(&buf->view);
        buf->held = 0;
    }
}

static Py_ssize_t items(const Buf *buf) { return buf->view.len / 8; }

/* A tree's buffers, taken from the first five arguments of set, set_one and build. */
typedef struct {
    Buf sums, mins, leaves;
    Py_ssize_t p, cap;
} Tree;

/* The trees (sums, mins: 2P items each) and the leaves (at least `cap` items), with P >= cap >= 1. */
static int take_tree(PyObject *const *args, Tree *t) {
    t->p = PyLong_AsSsize_t(args[3]);
    t->cap = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) {
        return -1;
    }
    if (take(args[0], &t->sums, 1, "sums") < 0 || take(args[1], &t->mins, 1, "mins") < 0 ||
        take(args[2], &t->leaves, 1, "leaves") < 0) {
        return -1;
    }
    if (t->cap < 1 || t->p < t->cap || items(&t->sums) < 2 * t->p || items(&t->mins) < 2 * t->p ||
        items(&t->leaves) < t->cap) {
        PyErr_SetString(PyExc_ValueError, "the trees need 2P items and the leaves capacity items, P >= capacity >= 1");
        return -1;
    }
    return 0;
}

static void give_back_tree(Tree *t) {
    give_back(&t->sums);
    give_back(&t->mins);
    give_back(&t->leaves);
}

static int check_slot(long long slot, Py_ssize_t cap) {
    if (slot < 0 || slot >= (long long)cap) {
        PyErr_Format(PyExc_IndexError, "slot %lld is outside [0, %zd)", slot, cap);
        return -1;
    }
    return 0;
}

static int check_weight(double w) {
    if (!(w >= 0) || isinf(w)) {
        PyErr_SetString(PyExc_ValueError, "a weight is NaN, infinite or negative");
        return -1;
    }
    return 0;
}

/* leaves[slot] = w, and every node above it recomputed from its children. */
static void write_leaf(Tree *t, Py_ssize_t slot, double w) {
    double *sums = t->sums.view.buf, *mins = t->mins.view.buf;
    Py_ssize_t node = t->p + slot;
    ((double *)t->leaves.view.buf)[slot] = w;
    sums[node] = w;
    mins[node] = w > 0 ? w : INFINITY;
    for (node >>= 1; node >= 1; node >>= 1) {
        double a = mins[2 * node], b = mins[2 * node + 1];
        sums[node] = sums[2 * node] + sums[2 * node + 1];
        mins[node] = a < b ? a : b;
    }
}

/* set(sums, mins, leaves, P, capacity, slots, weights): leaves[slots[k]] = weights[k] in order (for a
 * repeated slot the last wins), and the nodes above each. */
static PyObject *set(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Tree t = {0};
    Buf slots = {0}, weights = {0};
    PyObject *result = NULL;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "set(sums, mins, leaves, P, capacity, slots, weights)");
        return NULL;
    }
    if (take_tree(args, &t) < 0 || take(args[5], &slots, 0, "slots") < 0 || take(args[6], &weights, 0, "weights") < 0) {
        goto done;
    }
    Py_ssize_t n = items(&slots);
    const int64_t *s = slots.view.buf;
    const double *w = weights.view.buf;
    if (items(&weights) != n) {
        PyErr_SetString(PyExc_ValueError, "slots and weights differ in length");
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (check_slot((long long)s[k], t.cap) < 0 || check_weight(w[k]) < 0) {
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        write_leaf(&t, (Py_ssize_t)s[k], w[k]);
    }
    result = Py_NewRef(Py_None);
done:
    give_back_tree(&t);
    give_back(&slots);
    give_back(&weights);
    return result;
}

/* set_one(sums, mins, leaves, P, capacity, slot, weight): one leaf (one env step per call is common). */
static PyObject *set_one(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Tree t = {0};
    PyObject *result = NULL;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "set_one(sums, mins, leaves, P, capacity, slot, weight)");
        return NULL;
    }
    if (take_tree(args, &t) < 0) {
        goto done;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[5]);
    double w = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred() || check_slot((long long)slot, t.cap) < 0 || check_weight(w) < 0) {
        goto done;
    }
    write_leaf(&t, slot, w);
    result = Py_NewRef(Py_None);
done:
    give_back_tree(&t);
    return result;
}

/* build(sums, mins, leaves, P, capacity): the trees from the first `capacity` leaves (checked by the caller). */
static PyObject *build(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Tree t = {0};
    PyObject *result = NULL;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "build(sums, mins, leaves, P, capacity)");
        return NULL;
    }
    if (take_tree(args, &t) < 0) {
        goto done;
    }
    double *sm = t.sums.view.buf, *mn = t.mins.view.buf, *lv = t.leaves.view.buf;
    Py_ssize_t p = t.p;
    for (Py_ssize_t k = 0; k < p; k++) {
        double w = k < t.cap ? lv[k] : 0.0;
        sm[p + k] = w;
        mn[p + k] = w > 0 ? w : INFINITY;
    }
    for (Py_ssize_t node = p - 1; node >= 1; node--) {
        double a = mn[2 * node], b = mn[2 * node + 1];
        sm[node] = sm[2 * node] + sm[2 * node + 1];
        mn[node] = a < b ? a : b;
    }
    sm[0] = 0.0;
    mn[0] = INFINITY;
    result = Py_NewRef(Py_None);
done:
    give_back_tree(&t);
    return result;
}

/* find(sums, P, capacity, u, out): for each u[k] the slot i with sum(w[:i]) <= u[k] < sum(w[:i+1]).
 * The descent never enters a subtree of zero weight, so a value at or past the total (rounding) lands
 * on the last positive-weight slot; with no weight at all it lands on slot 0. */
static PyObject *find(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Buf sums = {0}, u = {0}, out = {0};
    PyObject *result = NULL;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "find(sums, P, capacity, u, out)");
        return NULL;
    }
    Py_ssize_t p = PyLong_AsSsize_t(args[1]), cap = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (take(args[0], &sums, 0, "sums") < 0 || take(args[3], &u, 0, "u") < 0 || take(args[4], &out, 1, "out") < 0) {
        goto done;
    }
    if (cap < 1 || p < cap || items(&sums) < 2 * p || items(&out) != items(&u)) {
        PyErr_SetString(PyExc_ValueError, "find needs 2P sums, P >= capacity >= 1, and one output per value");
        goto done;
    }
    const double *sm = sums.view.buf, *x = u.view.buf;
    int64_t *o = out.view.buf;
    for (Py_ssize_t k = 0; k < items(&u); k++) {
        double rest = x[k];
        Py_ssize_t node = 1;
        while (node < p) {
            double left = sm[2 * node];
            if (rest < left || !(sm[2 * node + 1] > 0)) {
                node = 2 * node;
            } else {
                rest -= left;
                node = 2 * node + 1;
            }
        }
        Py_ssize_t slot = node - p;
        o[k] = slot < cap ? slot : cap - 1;
    }
    result = Py_NewRef(Py_None);
done:
    give_back(&sums);
    give_back(&u);
    give_back(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"set", (PyCFunction)(void (*)(void))set, METH_FASTCALL, "set(sums, mins, leaves, P, capacity, slots, weights)"},
    {"set_one", (PyCFunction)(void (*)(void))set_one, METH_FASTCALL,
     "set_one(sums, mins, leaves, P, capacity, slot, weight)"},
    {"build", (PyCFunction)(void (*)(void))build, METH_FASTCALL, "build(sums, mins, leaves, P, capacity)"},
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL, "find(sums, P, capacity, u, out)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sumtree", "Compiled kernels of conduit.semantics.sumtree.SumTree.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__sumtree(void) { return PyModule_Create(&module); }
