/*
 * zephon_torch._native.binpack: the placement kernel of the packers.
 *
 * One `State` is one lane's open bins. `State.place(lengths)` places a run of
 * documents (their token counts, int64) and returns the bins that went out
 * while doing so; `State.flush()` emits what is still open and leaves the
 * state fresh. The kernel knows nothing of records: a document is its
 * sequence number since the last reset, a piece is (document, start, stop,
 * child) and a bin that goes out is a run of pieces. The pure-Python twin in
 * zephon_torch/ops/_binpack.py makes exactly the same decisions and documents
 * the rules; keep the two in step (tests/test_binpack.py compares them).
 *
 * Results come back as four bytes objects of native int64:
 *   row_offsets (rows + 1), row_used (rows), row_after (rows),
 *   pieces (4 per piece: doc, start, stop, child).
 * The placement loops run with the GIL released; a state refuses a second
 * caller while one is inside it.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FIRST_FIT = 0, BEST_FIT = 1, WRAP = 2, BFD = 3, N_ALGORITHMS = 4 };
static const char *const ALGORITHM_NAMES[N_ALGORITHMS] = {
    "first_fit", "best_fit", "wrap", "best_fit_decreasing"};

typedef struct {
    int64_t doc, start, stop, child;
} Piece;

typedef struct {
    int64_t used;
    Py_ssize_t n, cap;
    Piece *pieces;
} Bin;

typedef struct {
    int64_t *data;
    Py_ssize_t n, cap;
} Vec;

typedef struct {
    Vec offsets, used, after, pieces;
} Out;

typedef struct {
    PyObject_HEAD
    int algorithm;
    int64_t max_length, num_bins, min_room, window;
    /* Open bins in opening order; slots [nbins, capbins) keep the piece
     * buffers of bins that went out, for reuse. */
    Bin *bins;
    Py_ssize_t nbins, capbins;
    int64_t admitted; /* documents placed since the last reset */
    Vec win;          /* best_fit_decreasing: the window's document lengths */
    int busy;         /* a call is inside (the GIL may be released) */
    int broken;       /* a MemoryError left the state half-updated */
} State;

/* ------------------------------------------------------------------ buffers */

static int vec_reserve(Vec *v, Py_ssize_t extra) {
    if (v->n + extra <= v->cap) return 0;
    Py_ssize_t cap = v->cap ? v->cap : 16;
    while (cap < v->n + extra) cap *= 2;
    int64_t *data = (int64_t *)realloc(v->data, (size_t)cap * sizeof(int64_t));
    if (!data) return -1;
    v->data = data;
    v->cap = cap;
    return 0;
}

static int vec_push(Vec *v, int64_t x) {
    if (vec_reserve(v, 1) < 0) return -1;
    v->data[v->n++] = x;
    return 0;
}

static void vec_free(Vec *v) {
    free(v->data);
    v->data = NULL;
    v->n = v->cap = 0;
}

static int bin_add(Bin *b, Piece p) {
    if (b->n == b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 4;
        Piece *pieces = (Piece *)realloc(b->pieces, (size_t)cap * sizeof(Piece));
        if (!pieces) return -1;
        b->pieces = pieces;
        b->cap = cap;
    }
    b->pieces[b->n++] = p;
    b->used += p.stop - p.start;
    return 0;
}

static int out_row(Out *out, const Piece *pieces, Py_ssize_t n, int64_t used, int64_t after) {
    if (vec_reserve(&out->pieces, 4 * n) < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t *slot = out->pieces.data + out->pieces.n;
        slot[0] = pieces[i].doc;
        slot[1] = pieces[i].start;
        slot[2] = pieces[i].stop;
        slot[3] = pieces[i].child;
        out->pieces.n += 4;
    }
    if (vec_push(&out->offsets, out->pieces.n / 4) < 0) return -1;
    if (vec_push(&out->used, used) < 0) return -1;
    return vec_push(&out->after, after);
}

static void out_free(Out *out) {
    vec_free(&out->offsets);
    vec_free(&out->used);
    vec_free(&out->after);
    vec_free(&out->pieces);
}

/* ------------------------------------------------------------------ open bins */

/* Open a bin at the end (the newest); its index, or -1 when out of memory. */
static Py_ssize_t open_bin(State *s) {
    if (s->nbins == s->capbins) {
        Py_ssize_t cap = s->capbins ? s->capbins * 2 : 8;
        Bin *bins = (Bin *)realloc(s->bins, (size_t)cap * sizeof(Bin));
        if (!bins) return -1;
        memset(bins + s->capbins, 0, (size_t)(cap - s->capbins) * sizeof(Bin));
        s->bins = bins;
        s->capbins = cap;
    }
    Bin *b = &s->bins[s->nbins];
    b->used = 0;
    b->n = 0;
    return s->nbins++;
}

/* Take bin `index` out of the open list, keeping the others in opening order. */
static void drop_bin(State *s, Py_ssize_t index) {
    Bin gone = s->bins[index];
    memmove(s->bins + index, s->bins + index + 1,
            (size_t)(s->nbins - index - 1) * sizeof(Bin));
    s->nbins--;
    s->bins[s->nbins] = gone; /* its buffer is reused by a later bin */
}

static int emit_bin(State *s, Out *out, Py_ssize_t index, int64_t after) {
    Bin *b = &s->bins[index];
    if (out_row(out, b->pieces, b->n, b->used, after) < 0) return -1;
    drop_bin(s, index);
    return 0;
}

static void clear_bins(State *s) {
    s->nbins = 0;
}

/* ------------------------------------------------------------------ streaming */

/* First or best fit one piece into the open bins, emitting what goes out. */
static int place_piece(State *s, Out *out, Piece p, int64_t after) {
    const int64_t size = p.stop - p.start, max = s->max_length;
    Py_ssize_t index = -1;
    if (s->algorithm == BEST_FIT) {
        int64_t best_room = max + 1;
        for (Py_ssize_t i = 0; i < s->nbins; i++) {
            int64_t room = max - s->bins[i].used;
            if (size <= room && room < best_room) { /* strict: ties keep the earliest */
                index = i;
                best_room = room;
            }
        }
    } else {
        for (Py_ssize_t i = 0; i < s->nbins; i++) {
            if (max - s->bins[i].used >= size) {
                index = i;
                break;
            }
        }
    }
    if (index < 0) {
        if (max - size < s->min_room) /* a row on its own: no open bin is pushed out */
            return out_row(out, &p, 1, size, after);
        if (s->nbins >= s->num_bins) {
            Py_ssize_t fullest = 0;
            int64_t most = -1;
            for (Py_ssize_t i = 0; i < s->nbins; i++) {
                if (s->bins[i].used > most) { /* strict: ties keep the earliest */
                    fullest = i;
                    most = s->bins[i].used;
                }
            }
            if (emit_bin(s, out, fullest, after) < 0) return -1;
        }
        index = open_bin(s);
        if (index < 0) return -1;
    }
    if (bin_add(&s->bins[index], p) < 0) return -1;
    if (max - s->bins[index].used < s->min_room) return emit_bin(s, out, index, after);
    return 0;
}

static int place_fit(State *s, Out *out, int64_t doc, int64_t length) {
    int64_t child = 0;
    for (int64_t start = 0; start < length; start += s->max_length, child++) {
        int64_t stop = length - start > s->max_length ? start + s->max_length : length;
        Piece p = {doc, start, stop, child};
        if (place_piece(s, out, p, doc) < 0) return -1;
    }
    return 0;
}

static int place_wrap(State *s, Out *out, int64_t doc, int64_t length) {
    int64_t start = 0, child = 0;
    while (start < length) {
        if (s->nbins == 0 && open_bin(s) < 0) return -1;
        Bin *row = &s->bins[0];
        int64_t room = s->max_length - row->used;
        int64_t stop = length - start > room ? start + room : length;
        Piece p = {doc, start, stop, child};
        if (bin_add(row, p) < 0) return -1;
        if (s->max_length - row->used < s->min_room && emit_bin(s, out, 0, doc) < 0) return -1;
        start = stop;
        child++;
    }
    return 0;
}

/* ------------------------------------------------------------------ best fit decreasing */

typedef struct {
    int64_t size, order;
    Piece piece;
} Item;

static int by_size_then_order(const void *a, const void *b) {
    const Item *x = (const Item *)a, *y = (const Item *)b;
    if (x->size != y->size) return x->size > y->size ? -1 : 1;
    return x->order < y->order ? -1 : (x->order > y->order);
}

/* First candidate at or after (room, index) in the (room, index)-sorted list. */
static Py_ssize_t lower_bound(const int64_t *rooms, const int64_t *ids, Py_ssize_t n,
                              int64_t room, int64_t index) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (rooms[mid] < room || (rooms[mid] == room && ids[mid] < index))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Pack the window's documents by best-fit decreasing and emit its bins. */
static int pack_window(State *s, Out *out, int64_t after) {
    const int64_t max = s->max_length, first = s->admitted - s->win.n;
    Py_ssize_t count = 0;
    for (Py_ssize_t j = 0; j < s->win.n; j++) count += (Py_ssize_t)((s->win.data[j] + max - 1) / max);
    Item *items = (Item *)malloc((size_t)(count ? count : 1) * sizeof(Item));
    int64_t *rooms = (int64_t *)malloc((size_t)(count ? count : 1) * sizeof(int64_t));
    int64_t *ids = (int64_t *)malloc((size_t)(count ? count : 1) * sizeof(int64_t));
    int rc = -1;
    if (!items || !rooms || !ids) goto done;
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j < s->win.n; j++) {
        int64_t length = s->win.data[j], child = 0;
        for (int64_t start = 0; start < length; start += max, child++, k++) {
            int64_t stop = length - start > max ? start + max : length;
            items[k].size = stop - start;
            items[k].order = k;
            items[k].piece = (Piece){first + j, start, stop, child};
        }
    }
    qsort(items, (size_t)count, sizeof(Item), by_size_then_order);
    /* Bins that can still take a piece, sorted by (room, opening index): the
     * first with room >= size is the best fit, ties going to the earliest. */
    Py_ssize_t ncand = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t size = items[i].size;
        Py_ssize_t at = lower_bound(rooms, ids, ncand, size, -1), index;
        if (at < ncand) {
            index = (Py_ssize_t)ids[at];
            memmove(rooms + at, rooms + at + 1, (size_t)(ncand - at - 1) * sizeof(int64_t));
            memmove(ids + at, ids + at + 1, (size_t)(ncand - at - 1) * sizeof(int64_t));
            ncand--;
        } else {
            index = open_bin(s);
            if (index < 0) goto done;
        }
        if (bin_add(&s->bins[index], items[i].piece) < 0) goto done;
        int64_t room = max - s->bins[index].used;
        if (room >= s->min_room) { /* else the bin is closed: it takes nothing more */
            Py_ssize_t pos = lower_bound(rooms, ids, ncand, room, index);
            memmove(rooms + pos + 1, rooms + pos, (size_t)(ncand - pos) * sizeof(int64_t));
            memmove(ids + pos + 1, ids + pos, (size_t)(ncand - pos) * sizeof(int64_t));
            rooms[pos] = room;
            ids[pos] = index;
            ncand++;
        }
    }
    for (Py_ssize_t i = 0; i < s->nbins; i++) { /* the window's bins in opening order */
        Bin *b = &s->bins[i];
        if (out_row(out, b->pieces, b->n, b->used, after) < 0) goto done;
    }
    clear_bins(s);
    s->win.n = 0;
    rc = 0;
done:
    free(items);
    free(rooms);
    free(ids);
    return rc;
}

/* ------------------------------------------------------------------ the State type */

static int check_free(State *s) {
    if (s->max_length < 1) {
        PyErr_SetString(PyExc_RuntimeError, "this placement state was never initialised");
        return -1;
    }
    if (s->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this placement state is in use by another thread; give each thread "
                        "its own state (State.copy())");
        return -1;
    }
    return 0;
}

static int enter(State *s) {
    if (check_free(s) < 0) return -1;
    if (s->broken) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this placement state ran out of memory in the middle of a call and is "
                        "no longer consistent; reset() it or make a new one");
        return -1;
    }
    s->busy = 1;
    return 0;
}

static PyObject *vec_bytes(const Vec *v) {
    return PyBytes_FromStringAndSize((const char *)v->data, v->n * (Py_ssize_t)sizeof(int64_t));
}

static PyObject *out_result(Out *out) {
    PyObject *a = vec_bytes(&out->offsets), *b = vec_bytes(&out->used);
    PyObject *c = vec_bytes(&out->after), *d = vec_bytes(&out->pieces);
    PyObject *result = NULL;
    if (a && b && c && d) result = PyTuple_Pack(4, a, b, c, d);
    Py_XDECREF(a);
    Py_XDECREF(b);
    Py_XDECREF(c);
    Py_XDECREF(d);
    return result;
}

static void free_bins(State *s) {
    for (Py_ssize_t i = 0; i < s->capbins; i++) free(s->bins[i].pieces);
    free(s->bins);
    s->bins = NULL;
    s->nbins = s->capbins = 0;
}

static void State_dealloc(State *s) {
    free_bins(s);
    vec_free(&s->win);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int State_init(State *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_length", "algorithm", "num_bins", "min_sequence_length",
                             "window", NULL};
    long long max_length, num_bins = 8, min_room = 1, window = 4096;
    const char *algorithm = "first_fit";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "L|$sLLL", kwlist, &max_length, &algorithm,
                                     &num_bins, &min_room, &window))
        return -1;
    int kind = -1;
    for (int i = 0; i < N_ALGORITHMS; i++)
        if (strcmp(algorithm, ALGORITHM_NAMES[i]) == 0) kind = i;
    if (kind < 0) {
        PyErr_Format(PyExc_ValueError,
                     "unknown algorithm '%s'; use one of 'first_fit', 'best_fit', 'wrap', "
                     "'best_fit_decreasing'", algorithm);
        return -1;
    }
    if (max_length < 1 || num_bins < 1 || window < 1 || min_room < 1 || min_room > max_length) {
        PyErr_Format(PyExc_ValueError,
                     "placement needs max_length >= 1, num_bins >= 1, window >= 1 and "
                     "1 <= min_sequence_length <= max_length; got max_length=%lld, "
                     "num_bins=%lld, window=%lld, min_sequence_length=%lld",
                     max_length, num_bins, window, min_room);
        return -1;
    }
    free_bins(s);
    vec_free(&s->win);
    s->algorithm = kind;
    s->max_length = max_length;
    s->num_bins = num_bins;
    s->min_room = min_room;
    s->window = window;
    s->admitted = 0;
    s->busy = s->broken = 0;
    return 0;
}

/* The end of place() and flush(): the state is free again, and the rows that went
   out become the result (a failed allocation breaks the state for good). */
static PyObject *finish(State *s, Out *out, int rc) {
    s->busy = 0;
    PyObject *result = NULL;
    if (rc < 0) {
        s->broken = 1;
        PyErr_NoMemory();
    } else {
        result = out_result(out);
    }
    out_free(out);
    return result;
}

static PyObject *State_place(State *s, PyObject *arg) {
    static const char *const wanted =
        "place() takes a 1-D C-contiguous array of native int64 lengths "
        "(numpy.ascontiguousarray(lengths, dtype=numpy.int64))";
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* not contiguous, or no buffer at all: say what is wanted */
        PyErr_SetString(PyExc_TypeError, wanted);
        return NULL;
    }
    if (view.ndim != 1 || view.itemsize != 8 || !view.format ||
        !(strcmp(view.format, "q") == 0 || strcmp(view.format, "l") == 0)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, wanted);
        return NULL;
    }
    const int64_t *lengths = (const int64_t *)view.buf;
    const Py_ssize_t n = view.shape ? view.shape[0] : view.len / 8;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (lengths[j] < 1) {
            PyErr_Format(PyExc_ValueError,
                         "lengths[%zd] is %lld: every placed document must hold at least one "
                         "token (turn empty documents into tombstones before placing)",
                         j, (long long)lengths[j]);
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    if (enter(s) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Out out;
    memset(&out, 0, sizeof out);
    int rc = vec_push(&out.offsets, 0);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n && rc == 0; j++) {
        int64_t doc = s->admitted++;
        switch (s->algorithm) {
        case WRAP:
            rc = place_wrap(s, &out, doc, lengths[j]);
            break;
        case BFD:
            rc = vec_push(&s->win, lengths[j]);
            if (rc == 0 && s->win.n >= s->window) rc = pack_window(s, &out, doc);
            break;
        default:
            rc = place_fit(s, &out, doc, lengths[j]);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return finish(s, &out, rc);
}

static PyObject *State_flush(State *s, PyObject *Py_UNUSED(ignored)) {
    if (enter(s) < 0) return NULL;
    Out out;
    memset(&out, 0, sizeof out);
    int rc = vec_push(&out.offsets, 0);
    Py_BEGIN_ALLOW_THREADS
    if (rc == 0 && s->algorithm == BFD) {
        if (s->win.n) rc = pack_window(s, &out, -1);
    } else {
        for (Py_ssize_t i = 0; i < s->nbins && rc == 0; i++) {
            Bin *b = &s->bins[i];
            rc = out_row(&out, b->pieces, b->n, b->used, -1);
        }
        clear_bins(s);
    }
    s->admitted = 0;
    Py_END_ALLOW_THREADS
    return finish(s, &out, rc);
}

static PyObject *State_reset(State *s, PyObject *Py_UNUSED(ignored)) {
    if (check_free(s) < 0) return NULL;
    clear_bins(s);
    s->win.n = 0;
    s->admitted = 0;
    s->broken = 0;
    Py_RETURN_NONE;
}

static PyObject *State_copy(State *s, PyObject *Py_UNUSED(ignored)) {
    if (enter(s) < 0) return NULL;
    s->busy = 0;
    State *c = (State *)Py_TYPE(s)->tp_alloc(Py_TYPE(s), 0);
    if (!c) return NULL;
    c->algorithm = s->algorithm;
    c->max_length = s->max_length;
    c->num_bins = s->num_bins;
    c->min_room = s->min_room;
    c->window = s->window;
    c->admitted = s->admitted;
    if (s->nbins) {
        c->bins = (Bin *)calloc((size_t)s->nbins, sizeof(Bin));
        if (!c->bins) goto oom;
        c->capbins = s->nbins;
        for (Py_ssize_t i = 0; i < s->nbins; i++) {
            const Bin *b = &s->bins[i];
            c->bins[i].pieces = (Piece *)malloc((size_t)(b->n ? b->n : 1) * sizeof(Piece));
            if (!c->bins[i].pieces) goto oom;
            memcpy(c->bins[i].pieces, b->pieces, (size_t)b->n * sizeof(Piece));
            c->bins[i].n = c->bins[i].cap = b->n;
            c->bins[i].used = b->used;
        }
        c->nbins = s->nbins;
    }
    if (s->win.n) {
        if (vec_reserve(&c->win, s->win.n) < 0) goto oom;
        memcpy(c->win.data, s->win.data, (size_t)s->win.n * sizeof(int64_t));
        c->win.n = s->win.n;
    }
    return (PyObject *)c;
oom:
    Py_DECREF(c);
    return PyErr_NoMemory();
}

static PyObject *State_snapshot(State *s, PyObject *Py_UNUSED(ignored)) {
    if (enter(s) < 0) return NULL;
    s->busy = 0;
    PyObject *bins = PyTuple_New(s->nbins);
    if (!bins) return NULL;
    for (Py_ssize_t i = 0; i < s->nbins; i++) {
        const Bin *b = &s->bins[i];
        PyObject *pieces = PyTuple_New(b->n);
        if (!pieces) goto fail;
        PyTuple_SET_ITEM(bins, i, pieces);
        for (Py_ssize_t j = 0; j < b->n; j++) {
            const Piece *p = &b->pieces[j];
            PyObject *t = Py_BuildValue("(LLLL)", (long long)p->doc, (long long)p->start,
                                        (long long)p->stop, (long long)p->child);
            if (!t) goto fail;
            PyTuple_SET_ITEM(pieces, j, t);
        }
    }
    PyObject *win = PyTuple_New(s->win.n);
    if (!win) goto fail;
    for (Py_ssize_t j = 0; j < s->win.n; j++) {
        PyObject *x = PyLong_FromLongLong(s->win.data[j]);
        if (!x) {
            Py_DECREF(win);
            goto fail;
        }
        PyTuple_SET_ITEM(win, j, x);
    }
    return Py_BuildValue("{s:L,s:N,s:N}", "admitted", (long long)s->admitted, "bins", bins,
                         "window", win);
fail:
    Py_DECREF(bins);
    return NULL;
}

static PyObject *State_get_pending(State *s, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(s->nbins > 0 || s->win.n > 0);
}

static PyObject *State_get_admitted(State *s, void *Py_UNUSED(closure)) {
    return PyLong_FromLongLong(s->admitted);
}

static PyObject *State_get_algorithm(State *s, void *Py_UNUSED(closure)) {
    return PyUnicode_FromString(ALGORITHM_NAMES[s->algorithm]);
}

static PyMethodDef State_methods[] = {
    {"place", (PyCFunction)State_place, METH_O,
     "place(lengths) -> (row_offsets, row_used, row_after, pieces) as int64 bytes"},
    {"flush", (PyCFunction)State_flush, METH_NOARGS,
     "Emit every open bin (and a partial window) and leave the state fresh."},
    {"reset", (PyCFunction)State_reset, METH_NOARGS, "Forget everything open."},
    {"copy", (PyCFunction)State_copy, METH_NOARGS, "An independent copy of the state."},
    {"snapshot", (PyCFunction)State_snapshot, METH_NOARGS,
     "The state as plain Python values (for comparisons)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef State_getset[] = {
    {"pending", (getter)State_get_pending, NULL, "Whether a flush would emit anything.", NULL},
    {"admitted", (getter)State_get_admitted, NULL, "Documents placed since the last reset.",
     NULL},
    {"algorithm", (getter)State_get_algorithm, NULL, "The placement algorithm.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject StateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zephon_torch._native.binpack.State",
    .tp_basicsize = sizeof(State),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One lane's open bins: State(max_length, *, algorithm, num_bins, "
              "min_sequence_length, window).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)State_init,
    .tp_dealloc = (destructor)State_dealloc,
    .tp_methods = State_methods,
    .tp_getset = State_getset,
};

/* ------------------------------------------------------------------ row assembly */

/* A 1-D C-contiguous buffer of `itemsize`-byte integers ("i" for 4, "q"/"l" for 8). */
static int int_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable,
                      const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D C-contiguous%s array of int%zd",
                     name, writable ? " writable" : "", itemsize * 8);
        return -1;
    }
    const char *f = view->format ? view->format : "";
    int ok = view->ndim == 1 && view->itemsize == itemsize &&
             (itemsize == 4 ? strcmp(f, "i") == 0
                            : (strcmp(f, "q") == 0 || strcmp(f, "l") == 0));
    if (!ok) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D C-contiguous%s array of int%zd",
                     name, writable ? " writable" : "", itemsize * 8);
        return -1;
    }
    return 0;
}

/* copy_runs(values, src, dest, lengths, out): out[dest[p]:dest[p] + lengths[p]] =
 * values[src[p]:src[p] + lengths[p]] for every run p; int32 values, int64 runs. */
static PyObject *copy_runs(PyObject *module, PyObject *args) {
    PyObject *objs[5];
    if (!PyArg_ParseTuple(args, "OOOOO:copy_runs", &objs[0], &objs[1], &objs[2], &objs[3],
                          &objs[4]))
        return NULL;
    static const char *const names[5] = {"values", "src", "dest", "lengths", "out"};
    static const Py_ssize_t sizes[5] = {4, 8, 8, 8, 4};
    Py_buffer views[5];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 5; got++)
        if (int_buffer(objs[got], &views[got], sizes[got], got == 4, names[got]) < 0) goto done;
    const int32_t *values = (const int32_t *)views[0].buf;
    const int64_t *src = (const int64_t *)views[1].buf, *dest = (const int64_t *)views[2].buf;
    const int64_t *lengths = (const int64_t *)views[3].buf;
    int32_t *out = (int32_t *)views[4].buf;
    const Py_ssize_t nvalues = views[0].len / 4, nout = views[4].len / 4;
    const Py_ssize_t n = views[1].len / 8;
    if (views[2].len / 8 != n || views[3].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "copy_runs(): src, dest and lengths differ in length");
        goto done;
    }
    for (Py_ssize_t p = 0; p < n; p++) {
        if (lengths[p] < 0 || src[p] < 0 || dest[p] < 0 || src[p] > nvalues - lengths[p] ||
            dest[p] > nout - lengths[p]) {
            PyErr_Format(PyExc_ValueError, "copy_runs(): run %zd (src %lld, dest %lld, length "
                         "%lld) falls outside values (%zd) or out (%zd)", p, (long long)src[p],
                         (long long)dest[p], (long long)lengths[p], nvalues, nout);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < n; p++)
        memcpy(out + dest[p], values + src[p], (size_t)lengths[p] * sizeof(int32_t));
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return result;
}

/* ramps(starts, lengths, out): out[starts[p] + k] = k for k < lengths[p], every run p;
 * int64 runs, int32 out (the packed rows' positions: each segment counts from 0). */
static PyObject *ramps(PyObject *module, PyObject *args) {
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO:ramps", &objs[0], &objs[1], &objs[2])) return NULL;
    static const char *const names[3] = {"starts", "lengths", "out"};
    static const Py_ssize_t sizes[3] = {8, 8, 4};
    Py_buffer views[3];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 3; got++)
        if (int_buffer(objs[got], &views[got], sizes[got], got == 2, names[got]) < 0) goto done;
    const int64_t *starts = (const int64_t *)views[0].buf;
    const int64_t *lengths = (const int64_t *)views[1].buf;
    int32_t *out = (int32_t *)views[2].buf;
    const Py_ssize_t nout = views[2].len / 4, n = views[0].len / 8;
    if (views[1].len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "ramps(): starts and lengths differ in length");
        goto done;
    }
    for (Py_ssize_t p = 0; p < n; p++) {
        if (lengths[p] < 0 || lengths[p] > INT32_MAX || starts[p] < 0 ||
            starts[p] > nout - lengths[p]) {
            PyErr_Format(PyExc_ValueError, "ramps(): run %zd (start %lld, length %lld) falls "
                         "outside out (%zd)", p, (long long)starts[p], (long long)lengths[p],
                         nout);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < n; p++) {
        int32_t *at = out + starts[p];
        const int32_t len = (int32_t)lengths[p];
        for (int32_t k = 0; k < len; k++) at[k] = k;
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    return result;
}

static PyMethodDef module_methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(values, src, dest, lengths, out): copy runs of int32 values into out."},
    {"ramps", ramps, METH_VARARGS,
     "ramps(starts, lengths, out): write 0, 1, ... lengths[p] - 1 at out[starts[p]:]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef binpack_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "zephon_torch._native.binpack",
    .m_doc = "The packers' placement kernel (see zephon_torch/ops/_binpack.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit_binpack(void) {
    if (PyType_Ready(&StateType) < 0) return NULL;
    PyObject *m = PyModule_Create(&binpack_module);
    if (!m) return NULL;
    Py_INCREF(&StateType);
    if (PyModule_AddObject(m, "State", (PyObject *)&StateType) < 0) {
        Py_DECREF(&StateType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
