/* conduit.semantics._sumtree: the compiled kernels of conduit.semantics.sumtree.CompiledSumTree.
 *
 * A complete binary tree over P >= capacity leaf positions, in two arrays of 2P float64: node i has
 * children 2i and 2i + 1, the leaves sit at P .. P + capacity - 1 (the rest stay 0), the root at 1.
 * `sums` holds each node's sum of weights, `mins` its smallest positive weight (inf for none). A
 * node is always recomputed from its two children, never adjusted by a difference, so the trees
 * depend on the leaves alone (a rebuilt tree equals an updated one) and no rounding accumulates.
 *
 * Every function checks its arguments (buffer sizes; set and set_one also each slot and weight,
 * update each handle and priority) before it writes anything, holds the GIL throughout (a call is
 * atomic to other Python threads) and raises a Python exception instead of touching memory out of
 * range; update instead returns None for input whose refusal the sampler's general path words. build
 * takes the leaves as they are: CompiledSumTree.load checks them before it writes them. Buffers are
 * C-contiguous and native-order, of the type their format says: float64 for weights, priorities and
 * draws, int64 for slots and handles, float32 for the importance weights draw writes.
 *
 * draw and update are a prioritized sampler's draw and priority update in one call each (the
 * sampler's NumPy code does the same on SumTree, and on this tree where update returns None).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

typedef struct {
    Py_buffer view;
    int held;
} Buf;

/* Take a C-contiguous buffer of native-order items of struct format `format` ("d" float64, "f" float32, "q"
 * int64) from `obj` (writable when asked). */
static int take_typed(PyObject *obj, Buf *buf, int writable, const char *name, char format) {
    if (PyObject_GetBuffer(obj, &buf->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        return -1;
    }
    buf->held = 1;
    const char *f = buf->view.format ? buf->view.format : "B";
    if (*f == '@' || *f == '=') {
        f++;
    }
    Py_ssize_t size = format == 'f' ? 4 : 8;
    int same = f[0] != '\0' && f[1] == '\0' && (f[0] == format || (format == 'q' && f[0] == 'l'));
    if (!same || buf->view.itemsize != size || buf->view.len % size != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a native-order %s array", name,
                     format == 'd' ? "float64" : format == 'f' ? "float32" : "int64");
        return -1;
    }
    return 0;
}

/* take_typed for float64. */
static int take(PyObject *obj, Buf *buf, int writable, const char *name) {
    return take_typed(obj, buf, writable, name, 'd');
}

static void give_back(Buf *buf) {
    if (buf->held) {
        PyBuffer_Release(&buf->view);
        buf->held = 0;
    }
}

static Py_ssize_t items(const Buf *buf) { return buf->view.len / buf->view.itemsize; }

/* A tree's buffers, taken from the first five arguments of set, set_one and build. */
typedef struct {
    Buf sums, mins, leaves;
    Py_ssize_t p, cap;
} Tree;

/* The trees (sums, mins: 2P items each) and the leaves (at least `cap` items), with P >= cap >= 1. */
static int take_tree(PyObject *const *args, Tree *t) {
    t->p = PyLong_AsSsize_t(args[3]);
    if (t->p == -1 && PyErr_Occurred()) {
        return -1;
    }
    t->cap = PyLong_AsSsize_t(args[4]);
    if (t->cap == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (take(args[0], &t->sums, 1, "sums") < 0 || take(args[1], &t->mins, 1, "mins") < 0 ||
        take(args[2], &t->leaves, 1, "leaves") < 0) {
        return -1;
    }
    if (t->cap < 1 || t->p < t->cap || t->p > PY_SSIZE_T_MAX / 2 || items(&t->sums) < 2 * t->p ||
        items(&t->mins) < 2 * t->p || items(&t->leaves) < t->cap) {
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
    if (take_tree(args, &t) < 0 || take_typed(args[5], &slots, 0, "slots", 'q') < 0 ||
        take(args[6], &weights, 0, "weights") < 0) {
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
    if (slot == -1 && PyErr_Occurred()) {
        goto done;
    }
    double w = PyFloat_AsDouble(args[6]);
    if ((w == -1.0 && PyErr_Occurred()) || check_slot((long long)slot, t.cap) < 0 || check_weight(w) < 0) {
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

/* The slot i with sum(w[:i]) <= x < sum(w[:i+1]). The descent never enters a subtree of zero weight, so a
 * value at or past the total (rounding) lands on the last positive-weight slot; with no weight at all on 0. */
static Py_ssize_t descend(const double *sm, Py_ssize_t p, Py_ssize_t cap, double x) {
    Py_ssize_t node = 1;
    while (node < p) {
        double left = sm[2 * node];
        if (x < left || !(sm[2 * node + 1] > 0)) {
            node = 2 * node;
        } else {
            x -= left;
            node = 2 * node + 1;
        }
    }
    Py_ssize_t slot = node - p;
    return slot < cap ? slot : cap - 1;
}

/* find(sums, P, capacity, u, out): out[k] = descend(u[k]). */
static PyObject *find(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Buf sums = {0}, u = {0}, out = {0};
    PyObject *result = NULL;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "find(sums, P, capacity, u, out)");
        return NULL;
    }
    Py_ssize_t p = PyLong_AsSsize_t(args[1]);
    if (p == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t cap = PyLong_AsSsize_t(args[2]);
    if (cap == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (take(args[0], &sums, 0, "sums") < 0 || take(args[3], &u, 0, "u") < 0 ||
        take_typed(args[4], &out, 1, "out", 'q') < 0) {
        goto done;
    }
    if (cap < 1 || p < cap || p > PY_SSIZE_T_MAX / 2 || items(&sums) < 2 * p || items(&out) != items(&u)) {
        PyErr_SetString(PyExc_ValueError, "find needs 2P sums, P >= capacity >= 1, and one output per value");
        goto done;
    }
    const double *x = u.view.buf;
    int64_t *o = out.view.buf;
    for (Py_ssize_t k = 0; k < items(&u); k++) {
        o[k] = descend(sums.view.buf, p, cap, x[k]);
    }
    result = Py_NewRef(Py_None);
done:
    give_back(&sums);
    give_back(&u);
    give_back(&out);
    return result;
}

/* x ** e as NumPy's `array ** scalar` computes it: NumPy takes sqrt for 0.5, a product for 2 and x itself for 1
 * (pow's last bit can differ from those), pow otherwise (where NumPy uses Intel's SVML for it, on AVX-512 CPUs,
 * the last bit can differ from pow's). */
static double power(double x, double e) {
    if (e == 1.0) {
        return x;
    }
    if (e == 2.0) {
        return x * x;
    }
    if (e == 0.5) {
        return sqrt(x);
    }
    return pow(x, e);
}

/* draw(sums, mins, leaves, P, capacity, u, beta, oldest, slots, handles, probs, weights): the draws of a
 * prioritized sample for uniforms u[k] in [0, 1): slots[k] = descend(u[k] * total), handles[k] the item's
 * handle in a ring whose oldest live item has handle `oldest` (oldest + (slot - oldest) mod capacity),
 * probs[k] = w / total and weights[k] (float32) = (min / w) ** beta, w the slot's weight, total and min the
 * roots. Returns how many draws landed on a zero weight (rounding at an interval's edge): their probs and
 * weights are 0, and the caller redraws them. */
static PyObject *draw(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Tree t = {0};
    Buf u = {0}, slots = {0}, handles = {0}, probs = {0}, weights = {0};
    PyObject *result = NULL;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError,
                        "draw(sums, mins, leaves, P, capacity, u, beta, oldest, slots, handles, probs, weights)");
        return NULL;
    }
    double beta = PyFloat_AsDouble(args[6]);
    if (beta == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    long long oldest = PyLong_AsLongLong(args[7]);
    if ((oldest == -1 && PyErr_Occurred()) || take_tree(args, &t) < 0 || take(args[5], &u, 0, "u") < 0 ||
        take_typed(args[8], &slots, 1, "slots", 'q') < 0 || take_typed(args[9], &handles, 1, "handles", 'q') < 0 ||
        take(args[10], &probs, 1, "probs") < 0 || take_typed(args[11], &weights, 1, "weights", 'f') < 0) {
        goto done;
    }
    Py_ssize_t n = items(&u);
    if (items(&slots) != n || items(&handles) != n || items(&probs) != n || items(&weights) != n) {
        PyErr_SetString(PyExc_ValueError, "draw needs one slot, handle, probability and weight per uniform");
        goto done;
    }
    if (oldest < 0) {
        PyErr_SetString(PyExc_ValueError, "oldest is a handle (>= 0)");
        goto done;
    }
    long long base = oldest % t.cap; /* the slot of the oldest item */
    const double *sm = t.sums.view.buf, *lv = t.leaves.view.buf, *x = u.view.buf;
    double total = sm[1], least = ((double *)t.mins.view.buf)[1];
    int64_t *o = slots.view.buf, *hd = handles.view.buf;
    double *pr = probs.view.buf;
    float *wt = weights.view.buf;
    Py_ssize_t zeros = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t slot = descend(sm, t.p, t.cap, x[k] * total);
        double w = lv[slot];
        o[k] = slot;
        hd[k] = oldest + (slot >= base ? slot - base : slot - base + t.cap);
        if (w > 0) {
            pr[k] = w / total;
            wt[k] = (float)power(least / w, beta);
        } else {
            pr[k] = 0.0;
            wt[k] = 0.0f;
            zeros++;
        }
    }
    result = PyLong_FromSsize_t(zeros);
done:
    give_back_tree(&t);
    give_back(&u);
    give_back(&slots);
    give_back(&handles);
    give_back(&probs);
    give_back(&weights);
    return result;
}

/* update(sums, mins, leaves, P, capacity, handles, priorities, alpha, oldest, next, log_limit): a priority
 * update by handle. Slot of handle h: h % capacity; handles below `oldest` (evicted) are skipped. Returns
 * (how many were applied, the largest applied priority), or None without writing anything when the general
 * path must answer: a priority NaN, infinite or negative, a handle outside [0, next), a largest priority
 * whose log exceeds log_limit (its ** alpha could overflow the total), or arguments that are not two
 * C-contiguous arrays (int64 handles, float64 priorities) of one length. */
static PyObject *update(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Tree t = {0};
    Buf handles = {0}, prios = {0};
    PyObject *result = NULL;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError,
                        "update(sums, mins, leaves, P, capacity, handles, priorities, alpha, oldest, next, log_limit)");
        return NULL;
    }
    double alpha = PyFloat_AsDouble(args[7]);
    if (alpha == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    long long oldest = PyLong_AsLongLong(args[8]);
    if (oldest == -1 && PyErr_Occurred()) {
        return NULL;
    }
    long long next = PyLong_AsLongLong(args[9]);
    if (next == -1 && PyErr_Occurred()) {
        return NULL;
    }
    double log_limit = PyFloat_AsDouble(args[10]);
    if ((log_limit == -1.0 && PyErr_Occurred()) || take_tree(args, &t) < 0) {
        goto done;
    }
    if (take_typed(args[5], &handles, 0, "handles", 'q') < 0 || take(args[6], &prios, 0, "priorities") < 0 ||
        items(&prios) != items(&handles)) {
        PyErr_Clear();  /* not two flat arrays of one length: the general path converts or refuses them */
        result = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t n = items(&handles);
    const int64_t *h = handles.view.buf;
    const double *pv = prios.view.buf;
    double top = 0.0, top_live = 0.0;
    Py_ssize_t live = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!(pv[k] >= 0) || isinf(pv[k]) || h[k] < 0 || h[k] >= next) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        top = pv[k] > top ? pv[k] : top;
        if (h[k] >= oldest) {
            top_live = pv[k] > top_live ? pv[k] : top_live;
            live++;
        }
    }
    /* every weight written is one set() takes (finite, >= 0): power grows with p for alpha >= 0, so the largest
     * priority's bounds them all; a NaN, negative or infinite alpha is no sampler's (the general path's to refuse) */
    if (!(alpha >= 0) || isinf(alpha) || (top > 0 && alpha != 0 && log(top) > log_limit) || isinf(power(top, alpha))) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (h[k] >= oldest) {
            write_leaf(&t, (Py_ssize_t)(h[k] % t.cap), power(pv[k], alpha));
        }
    }
    result = Py_BuildValue("(nd)", live, top_live);
done:
    give_back_tree(&t);
    give_back(&handles);
    give_back(&prios);
    return result;
}

static PyMethodDef methods[] = {
    {"set", (PyCFunction)(void (*)(void))set, METH_FASTCALL, "set(sums, mins, leaves, P, capacity, slots, weights)"},
    {"set_one", (PyCFunction)(void (*)(void))set_one, METH_FASTCALL,
     "set_one(sums, mins, leaves, P, capacity, slot, weight)"},
    {"build", (PyCFunction)(void (*)(void))build, METH_FASTCALL, "build(sums, mins, leaves, P, capacity)"},
    {"find", (PyCFunction)(void (*)(void))find, METH_FASTCALL, "find(sums, P, capacity, u, out)"},
    {"draw", (PyCFunction)(void (*)(void))draw, METH_FASTCALL,
     "draw(sums, mins, leaves, P, capacity, u, beta, oldest, slots, handles, probs, weights)"},
    {"update", (PyCFunction)(void (*)(void))update, METH_FASTCALL,
     "update(sums, mins, leaves, P, capacity, handles, priorities, alpha, oldest, next, log_limit)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sumtree", "Compiled kernels of conduit.semantics.sumtree.SumTree.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__sumtree(void) { return PyModule_Create(&module); }
