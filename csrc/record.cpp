// tracecmp._crecord: the capture mode's per-op path in C, over the CPython API only.
//
// tracecmp.capture.mode.CaptureMode.__torch_dispatch__ is the reference: this file does the
// same steps in the same order on the same Python objects (the mode's instance dict, its scope,
// locator and weak records), so a trace is identical row for row whichever runs, and the tests
// require that. What it saves is the interpreter: recording an op takes ~3 us of C instead of
// ~8 us of bytecode (benchmarks/overhead_ablation.py). It runs the common cases itself (an op of
// a known schema returning one new tensor, one view, one written input or only new tensors; CPU
// statistics by the fused kernel) and calls the reference's own methods for everything rarer (a
// new source tensor, an alias update, other output patterns, accelerator or saved tensors), or
// hands the whole op to the reference before anything is recorded (an op seen for the first
// time, argument rewrites, full stacks). Like _cstats it includes no torch headers: one build
// serves every torch.
//
// Python API:
//   configure(**objects)   once, from tracecmp.capture.mode (the reference's helpers and types)
//   dispatch(mode, func, types, args=(), kwargs=None)   bound to a mode as its __torch_dispatch__
//   passthrough(mode, func, types, args, kwargs=None)   the same binding recording nothing (benchmarks)
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX >= 0x030B0000
#include <frameobject.h>
#endif

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <unordered_map>

namespace {

// Owned references, released at scope exit.
struct Ref {
  PyObject* p = nullptr;
  Ref() = default;
  explicit Ref(PyObject* o) : p(o) {}
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(p); }
  void reset(PyObject* o) {
    Py_XDECREF(p);
    p = o;
  }
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
  explicit operator bool() const { return p != nullptr; }
};

// What configure() hands over (strong references, kept for the process's life).
struct Config {
  PyObject* slow = nullptr;            // CaptureMode.__torch_dispatch__, the reference
  PyObject* tensor_type = nullptr;     // torch.Tensor
  PyObject* op_overload = nullptr;     // torch._ops.OpOverload (called through its _op)
  PyObject* op_infos = nullptr;        // aten.schema.OP_INFOS: id(func) -> OpInfo
  PyObject* one_fresh = nullptr;       // aten.schema.ONE_FRESH
  PyObject* marker = nullptr;          // aten.args.TENSOR_MARK, a tensor in a memo key
  PyObject* scan_value = nullptr;      // aten.args.scan_value, for values the C walk does not know
  PyObject* plain_types = nullptr;     // (dtype, device, layout, memory_format): kept as is
  PyObject* rec_type = nullptr;        // mode._Rec
  PyObject* current_node = nullptr;    // torch._C._current_autograd_node
  PyObject* sequence_nr = nullptr;     // torch._C._autograd._get_sequence_nr
  PyObject* grad_enabled = nullptr;    // torch.is_grad_enabled
  PyObject* inference_enabled = nullptr;  // torch.is_inference_mode_enabled
  PyObject* num_threads = nullptr;     // torch.get_num_threads
  PyObject* stats_module = nullptr;    // tracecmp.capture.stats (its _native_stats may change)
  PyObject* native_codes = nullptr;    // stats._NATIVE_CODES
  PyObject* parallel_min = nullptr;    // stats._PARALLEL_MIN
  PyObject* view_kind = nullptr;       // aten.schema.VIEW
  PyObject* write_kind = nullptr;      // aten.schema.WRITE
  PyObject* fresh_kind = nullptr;      // aten.schema.FRESH
  PyObject* parameter_type = nullptr;  // torch.nn.Parameter
  PyObject* strided = nullptr;         // torch.strided
  PyObject* stack_len = nullptr;       // torch._C._len_torch_dispatch_stack: other modes below this one
  bool ready = false;
};
Config g;

// Interned attribute and key names.
struct Names {
#define TRACECMP_NAMES(X)                                                                        \
  X(_unsettled) X(_known) X(_next_op) X(_next_tensor) X(step) X(in_optimizer) X(rows)           \
  X(tensor_rows) X(_row_limit) X(saved_bytes) X(_max_bytes) X(_save_data) X(_plain) X(_stack)   \
  X(_args_memo) X(_args) X(_dtypes) X(_forget_cb) X(scope) X(_locator) X(_on_limit) X(_enter)   \
  X(_outputs) X(_value) X(_bare) X(_dtype) X(_backward_context) X(_writes) X(encode) X(current) \
  X(depth) X(seq_info) X(claims) X(claim_floor) X(_code) X(_text) X(_classify) X(tid)           \
  X(version) X(group) X(key) X(_version) X(requires_grad) X(is_inference) X(is_cpu) X(dtype)    \
  X(shape) X(is_neg) X(numel) X(data_ptr) X(stride) X(_native_stats) X(_op) X(_sequence_nr)     \
  X(record) X(rewritable) X(returns) X(extra_writes) X(uninitialized) X(inplace) X(random)      \
  X(kind) X(name) X(forward) X(backward) X(optimizer) X(cpu) X(_written) X(variable) X(owner) X(schema) X(parts) \
  X(kinds) X(append) X(_rollback) X(layout) X(collective) X(_awaited_groups) X(write_only) X(_unbumped) X(_held) X(_base)
#define TRACECMP_DECLARE(n) PyObject* n = nullptr;
  TRACECMP_NAMES(TRACECMP_DECLARE)
#undef TRACECMP_DECLARE
  PyObject* empty = nullptr;  // ""
  PyObject* one = nullptr;    // 1
  PyObject* zero = nullptr;   // 0
};
Names s;

constexpr Py_ssize_t kTextLimit = Py_ssize_t{1} << 16;  // location.py's _TEXT_LIMIT
constexpr Py_ssize_t kWriteHistory = 16;                 // mode.py's _WRITE_HISTORY
constexpr unsigned long long kSeqNone = 1ULL << 63;       // mode.py's _SEQ_NONE

// The op's return pattern, as far as this path handles it itself.
enum Shape : int { kOther = 0, kFresh = 1, kView = 2, kWrite = 3 };

// Per-operator facts read once from its OpInfo (operators are long-lived; the entry pins it).
struct OpEntry {
  PyObject* func;      // pinned
  PyObject* info;      // the OpInfo
  PyObject* call;      // func._op for an OpOverload (skips its Python __call__), else func
  PyObject* name;
  PyObject* kind;
  PyObject* inplace;   // Py_True / Py_False
  PyObject* random;
  bool record, rewritable, uninitialized;
  bool collective;       // c10d / _c10d_functional: the reference records it (capture/collectives.py)
  bool write_only;       // has out= arguments: the reference records their first use without statistics
  bool all_fresh;        // a schema whose every return is new, and no other writes
  Py_ssize_t n_returns;
  Shape shape;
  Py_ssize_t ref_position;  // kView / kWrite: where the aliased argument arrives
  PyObject* ref_name;
};
std::unordered_map<PyObject*, OpEntry>* g_ops = nullptr;

PyObject* dict_of(PyObject* obj) { return PyObject_GenericGetDict(obj, nullptr); }

// A borrowed item of an instance dict, or nullptr with an AttributeError set.
PyObject* item(PyObject* dict, PyObject* name) {
  PyObject* v = PyDict_GetItemWithError(dict, name);
  if (v == nullptr && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
  return v;
}

PyObject* call0(PyObject* f) { return PyObject_CallNoArgs(f); }

PyObject* call_method(PyObject* obj, PyObject* name, std::initializer_list<PyObject*> args) {
  PyObject* argv[8];
  argv[0] = obj;
  Py_ssize_t n = 1;
  for (PyObject* a : args) argv[n++] = a;
  return PyObject_VectorcallMethod(name, argv, n, nullptr);
}

int truth(PyObject* dict, PyObject* name) {
  PyObject* v = item(dict, name);
  return v == nullptr ? -1 : PyObject_IsTrue(v);
}

// dict[name] += 1 for an int item; the old value (new reference).
PyObject* bump(PyObject* dict, PyObject* name) {
  PyObject* v = item(dict, name);
  if (v == nullptr) return nullptr;
  Py_INCREF(v);
  Ref next(PyNumber_Add(v, s.one));
  if (!next || PyDict_SetItem(dict, name, next.p) < 0) {
    Py_DECREF(v);
    return nullptr;
  }
  return v;
}

const OpEntry* entry_for(PyObject* func) {
  auto hit = g_ops->find(func);
  if (hit != g_ops->end()) return &hit->second;
  Ref id(PyLong_FromVoidPtr(func));
  if (!id) return nullptr;
  PyObject* info = PyDict_GetItemWithError(g.op_infos, id.p);
  if (info == nullptr) return nullptr;  // not built yet: the reference builds it
  OpEntry e{};
  Ref record(PyObject_GetAttr(info, s.record)), rewritable(PyObject_GetAttr(info, s.rewritable)),
      returns(PyObject_GetAttr(info, s.returns)), extra(PyObject_GetAttr(info, s.extra_writes)),
      uninit(PyObject_GetAttr(info, s.uninitialized)), inplace(PyObject_GetAttr(info, s.inplace)),
      random(PyObject_GetAttr(info, s.random)), name(PyObject_GetAttr(info, s.name)),
      kind(PyObject_GetAttr(info, s.kind)), collective(PyObject_GetAttr(info, s.collective)),
      write_only(PyObject_GetAttr(info, s.write_only));
  if (!record || !rewritable || !returns || !extra || !uninit || !inplace || !random || !name ||
      !kind || !collective || !write_only || !PyTuple_Check(returns.p) || !PyTuple_Check(extra.p) ||
      !PyTuple_Check(write_only.p))
    return nullptr;
  e.collective = collective.p == Py_True;
  e.write_only = PyTuple_GET_SIZE(write_only.p) > 0;
  e.record = record.p == Py_True;
  e.rewritable = rewritable.p == Py_True;
  e.uninitialized = uninit.p == Py_True;
  e.shape = kOther;
  e.ref_position = -1;
  e.ref_name = nullptr;
  Ref schema(PyObject_GetAttr(info, s.schema));
  if (!schema) return nullptr;
  e.n_returns = PyTuple_GET_SIZE(returns.p);
  e.all_fresh = schema.p == Py_True && PyTuple_GET_SIZE(extra.p) == 0;
  for (Py_ssize_t i = 0; e.all_fresh && i < e.n_returns; ++i) {
    PyObject* ret = PyTuple_GET_ITEM(returns.p, i);  // (FRESH, None)
    int fresh = PyTuple_Check(ret) && PyTuple_GET_SIZE(ret) == 2 && PyTuple_GET_ITEM(ret, 1) == Py_None
                    ? PyObject_RichCompareBool(PyTuple_GET_ITEM(ret, 0), g.fresh_kind, Py_EQ)
                    : 0;
    if (fresh < 0) return nullptr;
    e.all_fresh = fresh;
  }
  if (returns.p == g.one_fresh) {
    e.shape = kFresh;
  } else if (PyTuple_GET_SIZE(returns.p) == 1 && PyTuple_GET_SIZE(extra.p) == 0) {
    PyObject* ret = PyTuple_GET_ITEM(returns.p, 0);  // (kind, (position, name))
    if (PyTuple_Check(ret) && PyTuple_GET_SIZE(ret) == 2 && PyTuple_Check(PyTuple_GET_ITEM(ret, 1))) {
      PyObject* kind_code = PyTuple_GET_ITEM(ret, 0);
      PyObject* ref = PyTuple_GET_ITEM(ret, 1);
      int is_view = PyObject_RichCompareBool(kind_code, g.view_kind, Py_EQ);
      int is_write = PyObject_RichCompareBool(kind_code, g.write_kind, Py_EQ);
      if (is_view < 0 || is_write < 0) return nullptr;
      if ((is_view || is_write) && PyTuple_GET_SIZE(ref) == 2) {
        e.shape = is_view ? kView : kWrite;
        e.ref_position = PyLong_AsSsize_t(PyTuple_GET_ITEM(ref, 0));
        if (e.ref_position == -1 && PyErr_Occurred()) return nullptr;
        e.ref_name = PyTuple_GET_ITEM(ref, 1);
        Py_INCREF(e.ref_name);
      }
    }
  }
  int exact = Py_IS_TYPE(func, reinterpret_cast<PyTypeObject*>(g.op_overload));
  e.call = exact ? PyObject_GetAttr(func, s._op) : nullptr;
  if (e.call == nullptr) {
    PyErr_Clear();
    e.call = func;
    Py_INCREF(func);
  }
  Py_INCREF(func);
  Py_INCREF(info);
  e.func = func;
  e.info = info;
  e.name = name.release();
  e.kind = kind.release();
  e.inplace = inplace.release();
  e.random = random.release();
  return &g_ops->emplace(func, e).first->second;
}

// ---- Buffer: a column of numbers --------------------------------------------------------------

// A growable array of int64 ('q'), int32 ('i'), float64 ('d') or int8 ('b') values, the
// interface of array.array that tracecmp/trace/columns.py uses (its fallback where this module
// is not built): append, extend, len and the buffer protocol, with the typecode as the buffer's
// format. Values are stored as they come, so Arrow takes the column as one copy of its bytes
// instead of reading one Python object per row, cold, once a second. It never moves its storage
// while a view of it is alive (an append that would raises BufferError, as array.array does).
struct Buffer {
  PyObject_HEAD
  char* data;
  Py_ssize_t size;      // items
  Py_ssize_t capacity;  // items
  Py_ssize_t exports;
  char code[2];         // the typecode, a format string
  Py_ssize_t itemsize;  // also the buffer's one stride
};

extern PyTypeObject BufferType;

bool is_buffer(PyObject* o) { return Py_IS_TYPE(o, &BufferType); }

// The next free item, growing the storage; nullptr with an exception set.
char* buffer_slot(Buffer* b) {
  if (b->size == b->capacity) {
    if (b->exports > 0) {
      PyErr_SetString(PyExc_BufferError, "cannot append to a Buffer while a view of it exists");
      return nullptr;
    }
    Py_ssize_t capacity = b->capacity < 64 ? 64 : b->capacity * 2;
    char* grown = static_cast<char*>(PyMem_Realloc(b->data, static_cast<size_t>(capacity) * b->itemsize));
    if (grown == nullptr) {
      PyErr_NoMemory();
      return nullptr;
    }
    b->data = grown;
    b->capacity = capacity;
  }
  return b->data + b->size * b->itemsize;
}

bool buffer_append(Buffer* b, PyObject* v) {
  char* slot = buffer_slot(b);
  if (slot == nullptr) return false;
  switch (b->code[0]) {
    case 'd': {
      double x = PyFloat_AsDouble(v);
      if (x == -1.0 && PyErr_Occurred()) return false;
      std::memcpy(slot, &x, sizeof x);
      break;
    }
    case 'q': {
      long long x = PyLong_AsLongLong(v);
      if (x == -1 && PyErr_Occurred()) return false;
      int64_t y = x;
      std::memcpy(slot, &y, sizeof y);
      break;
    }
    default: {  // 'i', 'b'
      long x = PyLong_AsLong(v);
      if (x == -1 && PyErr_Occurred()) return false;
      long low = b->code[0] == 'i' ? INT32_MIN : INT8_MIN, high = b->code[0] == 'i' ? INT32_MAX : INT8_MAX;
      if (x < low || x > high) {
        PyErr_Format(PyExc_OverflowError, "%ld does not fit a Buffer of typecode '%s'", x, b->code);
        return false;
      }
      if (b->code[0] == 'i') {
        int32_t y = static_cast<int32_t>(x);
        std::memcpy(slot, &y, sizeof y);
      } else {
        *slot = static_cast<char>(x);
      }
    }
  }
  ++b->size;
  return true;
}

// append to a column, a Buffer directly and anything else (a list, an array.array) by its method.
bool column_append(PyObject* column, PyObject* v) {
  if (is_buffer(column)) return buffer_append(reinterpret_cast<Buffer*>(column), v);
  if (PyList_CheckExact(column)) return PyList_Append(column, v) == 0;
  Ref r(PyObject_CallMethodOneArg(column, s.append, v));
  return static_cast<bool>(r);
}

// A zero (the value under a None) at the end of a column.
bool column_append_zero(PyObject* column) {
  if (!is_buffer(column)) return column_append(column, s.zero);
  auto* b = reinterpret_cast<Buffer*>(column);
  char* slot = buffer_slot(b);
  if (slot == nullptr) return false;
  std::memset(slot, 0, static_cast<size_t>(b->itemsize));
  ++b->size;
  return true;
}

PyObject* Buffer_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  const char* code = nullptr;
  static const char* keywords[] = {"typecode", nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s:Buffer", const_cast<char**>(keywords), &code)) return nullptr;
  Py_ssize_t itemsize = 0;
  if (code[0] != '\0' && code[1] == '\0')
    itemsize = code[0] == 'q' || code[0] == 'd' ? 8 : code[0] == 'i' ? 4 : code[0] == 'b' ? 1 : 0;
  if (itemsize == 0) {
    PyErr_Format(PyExc_ValueError, "Buffer typecode must be 'q', 'i', 'd' or 'b', not '%s'", code);
    return nullptr;
  }
  auto* b = reinterpret_cast<Buffer*>(type->tp_alloc(type, 0));
  if (b == nullptr) return nullptr;
  b->data = nullptr;
  b->size = b->capacity = b->exports = 0;
  b->code[0] = code[0];
  b->code[1] = '\0';
  b->itemsize = itemsize;
  return reinterpret_cast<PyObject*>(b);
}

void Buffer_dealloc(PyObject* self) {
  PyMem_Free(reinterpret_cast<Buffer*>(self)->data);
  Py_TYPE(self)->tp_free(self);
}

PyObject* Buffer_append(PyObject* self, PyObject* v) {
  if (!buffer_append(reinterpret_cast<Buffer*>(self), v)) return nullptr;
  Py_RETURN_NONE;
}

PyObject* Buffer_extend(PyObject* self, PyObject* values) {
  Ref items(PySequence_Fast(values, "Buffer.extend takes an iterable"));
  if (!items) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items.p); ++i)
    if (!buffer_append(reinterpret_cast<Buffer*>(self), PySequence_Fast_GET_ITEM(items.p, i))) return nullptr;
  Py_RETURN_NONE;
}

PyObject* Buffer_truncate(PyObject* self, PyObject* arg) {
  Py_ssize_t size = PyLong_AsSsize_t(arg);
  if (size == -1 && PyErr_Occurred()) return nullptr;
  auto* b = reinterpret_cast<Buffer*>(self);
  if (size < 0 || size > b->size) {
    PyErr_Format(PyExc_ValueError, "cannot truncate a Buffer of %zd items to %zd", b->size, size);
    return nullptr;
  }
  b->size = size;  // the storage stays, so a view alive now still points at valid memory
  Py_RETURN_NONE;
}

PyObject* Buffer_typecode(PyObject* self, void*) { return PyUnicode_FromString(reinterpret_cast<Buffer*>(self)->code); }

Py_ssize_t Buffer_length(PyObject* self) { return reinterpret_cast<Buffer*>(self)->size; }

int Buffer_getbuffer(PyObject* self, Py_buffer* view, int flags) {
  auto* b = reinterpret_cast<Buffer*>(self);
  static char empty_storage = 0;  // a valid pointer for an empty buffer
  view->obj = Py_NewRef(self);
  view->buf = b->data != nullptr ? b->data : &empty_storage;
  view->len = b->size * b->itemsize;
  view->readonly = 0;
  view->itemsize = b->itemsize;
  view->format = (flags & PyBUF_FORMAT) ? b->code : nullptr;
  view->ndim = 1;
  view->shape = (flags & PyBUF_ND) ? &b->size : nullptr;
  view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? &b->itemsize : nullptr;
  view->suboffsets = nullptr;
  view->internal = nullptr;
  ++b->exports;
  return 0;
}

void Buffer_releasebuffer(PyObject* self, Py_buffer*) { --reinterpret_cast<Buffer*>(self)->exports; }

PyMethodDef buffer_methods[] = {
    {"append", Buffer_append, METH_O, "append(value): one value at the end."},
    {"extend", Buffer_extend, METH_O, "extend(values): the values at the end, in order."},
    {"truncate", Buffer_truncate, METH_O, "truncate(size): keep the first size values."},
    {nullptr, nullptr, 0, nullptr}};
PyGetSetDef buffer_getset[] = {{"typecode", Buffer_typecode, nullptr, "the array.array typecode", nullptr},
                               {nullptr, nullptr, nullptr, nullptr, nullptr}};
PySequenceMethods buffer_sequence = {Buffer_length};
PyBufferProcs buffer_procs = {Buffer_getbuffer, Buffer_releasebuffer};
PyTypeObject BufferType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// Columns.append: one row into a Columns buffer (tracecmp/trace/columns.py), field by field as
// Columns.kinds says: 's' a list of objects, 'n' a Buffer, 'N' a Buffer and its validity (0 for
// None), 'l' a list column: its items to one Buffer and its length to the next.
bool append_row(PyObject* columns, PyObject* const* fields, int n, Py_ssize_t* rows = nullptr) {
  Ref parts(PyObject_GetAttr(columns, s.parts));
  Ref kinds(parts ? PyObject_GetAttr(columns, s.kinds) : nullptr);
  if (!kinds) return false;
  if (!PyTuple_Check(parts.p) || !PyBytes_Check(kinds.p) || PyBytes_GET_SIZE(kinds.p) != n) {
    PyErr_SetString(PyExc_TypeError, "row does not fit the Columns layout");
    return false;
  }
  const char* kind = PyBytes_AS_STRING(kinds.p);
  Py_ssize_t j = 0, count = PyTuple_GET_SIZE(parts.p);
  Py_ssize_t before = count > 0 ? PyObject_Length(PyTuple_GET_ITEM(parts.p, 0)) : -1;
  if (before < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "row does not fit the Columns layout");
    return false;
  }
  // A value that cannot be stored leaves the buffers as they were: the columns stay aligned.
  auto rollback = [&]() {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    Ref size(PyLong_FromSsize_t(before));
    Ref r(size ? PyObject_CallMethodOneArg(columns, s._rollback, size.p) : nullptr);
    if (!r) PyErr_WriteUnraisable(columns);
    PyErr_Restore(type, value, traceback);
    return false;
  };
  for (int i = 0; i < n; ++i) {
    PyObject* v = fields[i];
    bool pair = kind[i] == 'N' || kind[i] == 'l';
    if (j + (pair ? 1 : 0) >= count) {
      PyErr_SetString(PyExc_ValueError, "row does not fit the Columns layout");
      return rollback();
    }
    PyObject* part = PyTuple_GET_ITEM(parts.p, j);
    bool ok = true;
    switch (kind[i]) {
      case 'N': {
        PyObject* valid = PyTuple_GET_ITEM(parts.p, j + 1);
        ok = v == Py_None ? column_append_zero(part) && column_append(valid, s.zero)
                          : column_append(part, v) && column_append(valid, s.one);
        break;
      }
      case 'l': {
        if (!PyTuple_Check(v)) {
          PyErr_SetString(PyExc_TypeError, "a list column's value must be a tuple");
          return rollback();
        }
        for (Py_ssize_t k = 0; ok && k < PyTuple_GET_SIZE(v); ++k) ok = column_append(part, PyTuple_GET_ITEM(v, k));
        Ref length(ok ? PyLong_FromSsize_t(PyTuple_GET_SIZE(v)) : nullptr);
        ok = length && column_append(PyTuple_GET_ITEM(parts.p, j + 1), length.p);
        break;
      }
      default:  // 's', 'n'
        ok = column_append(part, v);
    }
    if (!ok) return rollback();
    j += pair ? 2 : 1;
  }
  if (rows != nullptr) *rows = PyObject_Length(PyTuple_GET_ITEM(parts.p, 0));
  return rows == nullptr || *rows >= 0;
}

// ---- aten.args.scan ----------------------------------------------------------------------------

PyObject* scan_value(PyObject* value, PyObject* tensors);

// A tuple of scan_value over a list or tuple's items.
PyObject* scan_sequence(PyObject* seq, PyObject* tensors) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  Ref out(PyTuple_New(n));
  if (!out) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = scan_value(items[i], tensors);
    if (v == nullptr) return nullptr;
    PyTuple_SET_ITEM(out.p, i, v);
  }
  return out.release();
}

// aten.args.scan_value; values it sends through pytree go to the Python function itself.
PyObject* scan_value(PyObject* value, PyObject* tensors) {
  if (PyObject_TypeCheck(value, reinterpret_cast<PyTypeObject*>(g.tensor_type))) {
    if (PyList_Append(tensors, value) < 0) return nullptr;
    Py_INCREF(g.marker);
    return g.marker;
  }
  PyTypeObject* kind = Py_TYPE(value);
  if (kind == &PyFloat_Type || kind == &PyBool_Type) return PyTuple_Pack(2, reinterpret_cast<PyObject*>(kind), value);
  if (kind == &PyList_Type || kind == &PyTuple_Type) return scan_sequence(value, tensors);
  if (kind == &PyLong_Type || kind == &PyUnicode_Type || value == Py_None) {
    Py_INCREF(value);
    return value;
  }
  int plain = PyObject_IsInstance(value, g.plain_types);
  if (plain < 0) return nullptr;
  if (plain) {
    Py_INCREF(value);
    return value;
  }
  return PyObject_CallFunctionObjArgs(g.scan_value, value, tensors, nullptr);
}

// aten.args.scan: the memo key of the non-tensor part; tensors appended in order.
PyObject* scan(PyObject* args, PyObject* kwargs, PyObject* tensors) {
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  Py_ssize_t nk = kwargs != nullptr ? PyDict_GET_SIZE(kwargs) : 0;
  Ref key(PyTuple_New(n + 2 * nk));
  if (!key) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* value = PyTuple_GET_ITEM(args, i);
    PyObject* v;
    if (PyObject_TypeCheck(value, reinterpret_cast<PyTypeObject*>(g.tensor_type))) {
      if (PyList_Append(tensors, value) < 0) return nullptr;
      v = g.marker;
      Py_INCREF(v);
    } else if (Py_IS_TYPE(value, &PyLong_Type) || value == Py_None) {
      v = value;
      Py_INCREF(v);
    } else {
      v = scan_value(value, tensors);
      if (v == nullptr) return nullptr;
    }
    PyTuple_SET_ITEM(key.p, i, v);
  }
  if (nk) {
    Py_ssize_t pos = 0, i = n;
    PyObject *name, *value;
    while (PyDict_Next(kwargs, &pos, &name, &value)) {
      Py_INCREF(name);
      PyTuple_SET_ITEM(key.p, i++, name);
      PyObject* v = scan_value(value, tensors);
      if (v == nullptr) return nullptr;
      PyTuple_SET_ITEM(key.p, i++, v);
    }
  }
  return key.release();
}

// ---- location.Locator.location ----------------------------------------------------------------

// "file.py:LINE" of the first user frame above the running op, or "" (new reference).
PyObject* locate(PyObject* mode_dict) {
  PyObject* locator = item(mode_dict, s._locator);
  if (locator == nullptr) return nullptr;
  Ref ld(dict_of(locator));
  if (!ld) return nullptr;
  PyObject* verdicts = item(ld.p, s._code);
  PyObject* texts = item(ld.p, s._text);
  if (verdicts == nullptr || texts == nullptr) return nullptr;
  PyFrameObject* current = PyEval_GetFrame();
  Ref frame(reinterpret_cast<PyObject*>(current));
  Py_XINCREF(frame.p);
  while (frame) {
    auto* f = reinterpret_cast<PyFrameObject*>(frame.p);
    Ref code(reinterpret_cast<PyObject*>(PyFrame_GetCode(f)));
    Ref id(PyLong_FromVoidPtr(code.p));
    if (!id) return nullptr;
    PyObject* verdict = PyDict_GetItemWithError(verdicts, id.p);
    Ref classified;
    if (verdict == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      classified.reset(call_method(locator, s._classify, {code.p}));
      if (!classified) return nullptr;
      verdict = classified.p;
    }
    if (verdict == Py_True) {
      frame.reset(reinterpret_cast<PyObject*>(PyFrame_GetBack(f)));
      continue;
    }
#if PY_VERSION_HEX >= 0x030B0000
    Ref lasti(PyLong_FromLong(PyFrame_GetLasti(f)));
#else
    Ref lasti(PyObject_GetAttrString(frame.p, "f_lasti"));
#endif
    if (!lasti) return nullptr;
    Ref key(PyTuple_Pack(2, id.p, lasti.p));
    if (!key) return nullptr;
    PyObject* text = PyDict_GetItemWithError(texts, key.p);
    if (text != nullptr) {
      Py_INCREF(text);
      return text;
    }
    if (PyErr_Occurred()) return nullptr;
    if (PyDict_GET_SIZE(texts) >= kTextLimit) PyDict_Clear(texts);
    Ref made(PyUnicode_FromFormat("%S:%d", verdict, PyFrame_GetLineNumber(f)));
    if (!made || PyDict_SetItem(texts, key.p, made.p) < 0) return nullptr;
    return made.release();
  }
  Py_INCREF(s.empty);
  return s.empty;
}

// ---- the mode's helpers ---------------------------------------------------------------------

// mode._backward_context(node): (module, location, seq) as three new references.
bool backward_context(PyObject* mode, PyObject* md, PyObject* sd, PyObject* node, Ref& module,
                      Ref& location, Ref& seq) {
  seq.reset(call_method(node, s._sequence_nr, {}));
  if (!seq) return false;
  unsigned long long number = PyLong_AsUnsignedLongLong(seq.p);
  if (number == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return false;
  if (number >= kSeqNone) {
    // Gradient accumulation into a parameter: it belongs to the parameter's module.
    Ref variable(PyObject_GetAttr(node, s.variable));
    if (!variable) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return false;
      PyErr_Clear();
    }
    if (variable && variable.p != Py_None) {
      PyObject* scope = item(md, s.scope);
      module.reset(scope != nullptr ? call_method(scope, s.owner, {variable.p}) : nullptr);
    } else {
      module.reset(Py_NewRef(s.empty));
    }
    location.reset(module ? locate(md) : nullptr);
    seq.reset(PyLong_FromLong(-1));
    return location && seq;
  }
  int depth = truth(sd, s.depth);
  if (depth < 0) return false;
  if (depth) {
    PyObject* current = item(sd, s.current);
    if (current == nullptr) return false;
    module.reset(Py_NewRef(current));
    location.reset(locate(md));
    return static_cast<bool>(location);
  }
  PyObject* seq_info = item(sd, s.seq_info);
  if (seq_info == nullptr) return false;
  PyObject* hit = PyDict_GetItemWithError(seq_info, seq.p);
  if (hit == nullptr) {
    if (PyErr_Occurred()) return false;
    module.reset(Py_NewRef(s.empty));
    location.reset(locate(md));
    return static_cast<bool>(location);
  }
  if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 2) {
    PyErr_SetString(PyExc_TypeError, "scope.seq_info values must be (module, location)");
    return false;
  }
  module.reset(Py_NewRef(PyTuple_GET_ITEM(hit, 0)));
  PyObject* loc = PyTuple_GET_ITEM(hit, 1);
  int has = PyObject_IsTrue(loc);
  if (has < 0) return false;
  location.reset(has ? Py_NewRef(loc) : locate(md));
  return static_cast<bool>(location);
}

// The _Rec in the map for tensor t if it is alive and is t (borrowed), else nullptr.
PyObject* record_of(PyObject* known, PyObject* t, PyObject* id) {
  PyObject* rec = PyDict_GetItemWithError(known, id);
  if (rec == nullptr) return nullptr;
  return PyWeakref_GetObject(rec) == t ? rec : nullptr;
}

// None when inference mode is on and t is an inference tensor, else t._version (new reference).
PyObject* version_of(PyObject* t) {
  Ref on(call0(g.inference_enabled));
  if (!on) return nullptr;
  if (on.p == Py_True) {
    Ref inf(call_method(t, s.is_inference, {}));
    if (!inf) return nullptr;
    if (inf.p == Py_True) Py_RETURN_NONE;
  }
  return PyObject_GetAttr(t, s._version);
}

// mode._remember: a new _Rec for t in the map (new reference).
PyObject* remember(PyObject* md, PyObject* t, PyObject* tid, PyObject* version, PyObject* group) {
  PyObject* cb = item(md, s._forget_cb);
  PyObject* known = item(md, s._known);
  if (cb == nullptr || known == nullptr) return nullptr;
  Ref rec(PyObject_CallFunctionObjArgs(g.rec_type, t, cb, nullptr));
  Ref key(PyLong_FromVoidPtr(t));
  if (!rec || !key || PyObject_SetAttr(rec.p, s.tid, tid) < 0 ||
      PyObject_SetAttr(rec.p, s.version, version) < 0 || PyObject_SetAttr(rec.p, s.group, group) < 0 ||
      PyObject_SetAttr(rec.p, s.key, key.p) < 0 || PyDict_SetItem(known, key.p, rec.p) < 0)
    return nullptr;
  return rec.release();
}

// A tensor's shape as the row's list value: torch.Size is a tuple already (new reference).
PyObject* dims_of(PyObject* shape) {
  return PyTuple_Check(shape) ? Py_NewRef(shape) : PySequence_Tuple(shape);
}

// mode._dtypes.get(dtype) or mode._dtype(dtype), as a new reference.
PyObject* dtype_name(PyObject* mode, PyObject* md, PyObject* dtype) {
  PyObject* dtypes = item(md, s._dtypes);
  if (dtypes == nullptr) return nullptr;
  PyObject* name = PyDict_GetItemWithError(dtypes, dtype);
  if (name != nullptr && PyUnicode_Check(name) && PyUnicode_GET_LENGTH(name) > 0) return Py_NewRef(name);
  if (PyErr_Occurred()) return nullptr;
  return call_method(mode, s._dtype, {dtype});
}

// A tensor of exactly torch.Tensor or nn.Parameter: no subclass, whose data_ptr() may be a wrapper's 0.
bool plain_type(PyObject* t) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(t));
  return type == g.tensor_type || type == g.parameter_type;
}

// mode._value on the CPU with the fused kernel; anything else goes to the reference method. The
// kernel reads memory, so it sees only a plain dense strided tensor with storage behind its
// pointer (capture/tensorkinds.py): a functional tensor's pointer is 0, a sparse one's raises,
// a nested one has no strides.
bool value(PyObject* mode, PyObject* md, PyObject* t, PyObject* tid, PyObject* op_id, PyObject* index,
           PyObject* view_of) {
  auto reference = [&]() {
    PyErr_Clear();
    Ref r(call_method(mode, s._value, {t, tid, op_id, index, view_of}));
    return static_cast<bool>(r);
  };
  int save = truth(md, s._save_data);
  if (save != 0) return save > 0 ? reference() : false;
  if (!plain_type(t)) return reference();
  Ref layout(PyObject_GetAttr(t, s.layout));
  if (!layout || layout.p != g.strided) return reference();
  Ref is_cpu(PyObject_GetAttr(t, s.is_cpu));
  if (!is_cpu || is_cpu.p != Py_True) return reference();
  Ref native(PyObject_GetAttr(g.stats_module, s._native_stats));
  if (!native || native.p == Py_None) return reference();
  Ref dtype(PyObject_GetAttr(t, s.dtype));
  if (!dtype) return reference();
  PyObject* code = PyDict_GetItemWithError(g.native_codes, dtype.p);
  if (code == nullptr) return reference();
  Ref neg(call_method(t, s.is_neg, {}));
  if (!neg || neg.p != Py_False) return reference();
  Ref numel(call_method(t, s.numel, {}));
  Ref shape(PyObject_GetAttr(t, s.shape));
  if (!numel || !shape) return reference();
  int big = PyObject_RichCompareBool(numel.p, g.parallel_min, Py_GE);
  if (big < 0) return reference();
  Ref threads(big ? call0(g.num_threads) : PyLong_FromLong(1));
  Ref ptr(call_method(t, s.data_ptr, {}));
  Ref strides(ptr ? call_method(t, s.stride, {}) : nullptr);
  if (!threads || !ptr || !strides) return reference();  // no storage or strides: the reference decides
  void* address = PyLong_AsVoidPtr(ptr.p);
  if (address == nullptr) {
    if (PyErr_Occurred()) return reference();
    int empty = PyObject_RichCompareBool(numel.p, s.zero, Py_EQ);
    if (empty != 1) return reference();  // nothing behind the pointer
  }
  PyObject* argv[6] = {ptr.p, shape.p, strides.p, code, numel.p, threads.p};
  Ref stats(PyObject_Vectorcall(native.p, argv, 6, nullptr));
  if (!stats || !PyTuple_Check(stats.p) || PyTuple_GET_SIZE(stats.p) != 7) return reference();
  Ref name(dtype_name(mode, md, dtype.p));
  Ref dims(dims_of(shape.p));
  if (!name || !dims) return false;
  PyObject* row[16] = {tid, op_id, index, dims.p, name.p, s.cpu, view_of, Py_True};
  for (int i = 0; i < 7; ++i) row[8 + i] = PyTuple_GET_ITEM(stats.p, i);
  row[15] = s.empty;
  PyObject* rows = item(md, s.tensor_rows);
  return rows != nullptr && append_row(rows, row, 16);
}

// mode.settle: read the versions of the tensors the previous op wrote.
bool settle(PyObject* mode, PyObject* md) {
  PyObject* pending = item(md, s._unsettled);
  if (pending == nullptr) return false;
  if (!PyList_Check(pending) || PyList_GET_SIZE(pending) == 0) return true;
  Ref unsettled(Py_NewRef(pending));
  Ref fresh(PyList_New(0));
  if (!fresh || PyDict_SetItem(md, s._unsettled, fresh.p) < 0) return false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(unsettled.p); ++i) {
    PyObject* pair = PyList_GET_ITEM(unsettled.p, i);  // (rec, [version, tid])
    PyObject* rec = PyTuple_GET_ITEM(pair, 0);
    PyObject* entry = PyTuple_GET_ITEM(pair, 1);
    PyObject* t = PyWeakref_GetObject(rec);
    if (t == Py_None) continue;
    Ref version(PyObject_GetAttr(t, s._version));
    if (!version) return false;
    int same = PyObject_RichCompareBool(version.p, PyList_GET_ITEM(entry, 0), Py_EQ);
    if (same < 0) return false;
    if (same) {  // written without moving its version counter: mode._unbumped records the base's new value
      Ref r(call_method(mode, s._unbumped, {t, PyList_GET_ITEM(entry, 1)}));
      if (!r) return false;
    }
    if (PyObject_SetAttr(rec, s.version, version.p) < 0) return false;
    if (PyList_SetItem(entry, 0, version.release()) < 0) return false;
  }
  PyObject* held = item(md, s._held);  // views kept alive for this look (mode._written)
  if (held == nullptr) return false;
  if (PyList_Check(held) && PyList_GET_SIZE(held) > 0) {
    Ref none(PyList_New(0));
    if (!none || PyDict_SetItem(md, s._held, none.p) < 0) return false;
  }
  return true;
}

// mode._written for a written input that is in the map (anything else: the reference).
bool written(PyObject* mode, PyObject* md, PyObject* t, PyObject* op_id, PyObject* outputs) {
  PyObject* known = item(md, s._known);
  if (known == nullptr) return false;
  Ref id(PyLong_FromVoidPtr(t));
  if (!id) return false;
  PyObject* rec = record_of(known, t, id.p);
  if (rec == nullptr) {
    if (PyErr_Occurred()) return false;
    // Not an input: the reference remembers it (rare; its own id is taken there).
    Ref list(PyList_New(0));
    Ref r(list ? call_method(mode, s._written, {t, op_id, list.p}) : nullptr);
    if (!r) return false;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list.p); ++i)
      if (PyList_Append(outputs, PyList_GET_ITEM(list.p, i)) < 0) return false;
    return true;
  }
  Ref tid(bump(md, s._next_tensor));
  if (!tid || PyObject_SetAttr(rec, s.tid, tid.p) < 0) return false;
  Ref version(PyObject_GetAttr(rec, s.version));
  if (!version) return false;
  if (version.p != Py_None) {
    Ref entry(PyList_New(2));
    if (!entry) return false;
    PyList_SET_ITEM(entry.p, 0, Py_NewRef(version.p));
    PyList_SET_ITEM(entry.p, 1, Py_NewRef(tid.p));
    Ref pair(PyTuple_Pack(2, rec, entry.p));
    PyObject* unsettled = item(md, s._unsettled);
    if (!pair || unsettled == nullptr || PyList_Append(unsettled, pair.p) < 0) return false;
    // A written view the caller drops at once (``x[i] = v``, FSDP2's out= views) is kept alive
    // until settle has read its version: else its view family's write history stays unsettled.
    Ref base(PyObject_GetAttr(t, s._base));
    if (!base) return false;
    if (base.p != Py_None) {
      PyObject* held = item(md, s._held);
      if (held == nullptr || PyList_Append(held, t) < 0) return false;
    }
    Ref group(PyObject_GetAttr(rec, s.group));
    PyObject* writes = item(md, s._writes);
    if (!group || writes == nullptr) return false;
    PyObject* history = PyDict_GetItemWithError(writes, group.p);
    if (history == nullptr) {
      if (PyErr_Occurred()) return false;
      Ref fresh(PyList_New(1));
      if (!fresh) return false;
      PyList_SET_ITEM(fresh.p, 0, Py_NewRef(entry.p));
      if (PyDict_SetItem(writes, group.p, fresh.p) < 0) return false;
    } else {
      if (PyList_Append(history, entry.p) < 0) return false;
      if (PyList_GET_SIZE(history) > kWriteHistory && PySequence_DelItem(history, 0) < 0) return false;
    }
  }
  Ref index(PyLong_FromSsize_t(PyList_GET_SIZE(outputs)));
  Ref none_view(PyLong_FromLong(-1));
  if (!index || !none_view || !value(mode, md, t, tid.p, op_id, index.p, none_view.p)) return false;
  return PyList_Append(outputs, tid.p) == 0;
}

// mode._view + mode._bare for a CPU view (anything else: the reference's _bare).
bool view(PyObject* mode, PyObject* md, PyObject* t, PyObject* base, PyObject* op_id, PyObject* outputs) {
  Ref tid(bump(md, s._next_tensor));
  PyObject* known = item(md, s._known);
  if (!tid || known == nullptr) return false;
  PyObject* rec = nullptr;
  if (base != nullptr && PyObject_TypeCheck(base, reinterpret_cast<PyTypeObject*>(g.tensor_type))) {
    Ref id(PyLong_FromVoidPtr(base));
    if (!id) return false;
    rec = record_of(known, base, id.p);
    if (rec == nullptr && PyErr_Occurred()) return false;
  }
  Ref view_of, group, version;
  if (rec != nullptr) {
    view_of.reset(PyObject_GetAttr(rec, s.tid));
    group.reset(PyObject_GetAttr(rec, s.group));
    version.reset(PyObject_GetAttr(rec, s.version));
  } else {
    view_of.reset(PyLong_FromLong(-1));
    group.reset(Py_NewRef(tid.p));
    Ref inf(call_method(t, s.is_inference, {}));
    if (!inf) return false;
    version.reset(inf.p == Py_True ? Py_NewRef(Py_None) : PyObject_GetAttr(t, s._version));
  }
  if (!view_of || !group || !version) return false;
  Ref made(remember(md, t, tid.p, version.p, group.p));
  if (!made) return false;
  Ref index(PyLong_FromSsize_t(PyList_GET_SIZE(outputs)));
  if (!index) return false;
  Ref is_cpu(PyObject_GetAttr(t, s.is_cpu));
  if (!is_cpu) return false;
  if (is_cpu.p != Py_True || !plain_type(t)) {  // the reference reads the shape of any tensor
    Ref r(call_method(mode, s._bare, {t, tid.p, op_id, index.p, view_of.p}));
    return r && PyList_Append(outputs, tid.p) == 0;
  }
  Ref dtype(PyObject_GetAttr(t, s.dtype));
  Ref shape(PyObject_GetAttr(t, s.shape));
  if (!dtype || !shape) {  // a nested tensor has no shape: the reference records it
    PyErr_Clear();
    Ref r(call_method(mode, s._bare, {t, tid.p, op_id, index.p, view_of.p}));
    return r && PyList_Append(outputs, tid.p) == 0;
  }
  Ref name(dtype_name(mode, md, dtype.p));
  Ref dims(dims_of(shape.p));
  if (!name || !dims) return false;
  PyObject* row[16] = {tid.p, op_id, index.p, dims.p, name.p, s.cpu, view_of.p, Py_False};
  for (int i = 8; i < 15; ++i) row[i] = Py_None;
  row[15] = s.empty;
  PyObject* rows = item(md, s.tensor_rows);
  return rows != nullptr && append_row(rows, row, 16) && PyList_Append(outputs, tid.p) == 0;
}

// mode._fresh: a new tensor among the op's outputs (statistics unless uninitialized).
bool fresh(PyObject* mode, PyObject* md, PyObject* t, PyObject* op_id, PyObject* outputs, bool stats) {
  Ref tid(bump(md, s._next_tensor));
  Ref version(tid ? version_of(t) : nullptr);
  Ref rec(version ? remember(md, t, tid.p, version.p, tid.p) : nullptr);
  Ref index(PyLong_FromSsize_t(PyList_GET_SIZE(outputs)));
  Ref none_view(PyLong_FromLong(-1));
  if (!rec || !index || !none_view) return false;
  if (stats) {
    if (!value(mode, md, t, tid.p, op_id, index.p, none_view.p)) return false;
  } else {
    Ref r(call_method(mode, s._bare, {t, tid.p, op_id, index.p, none_view.p}));
    if (!r) return false;
  }
  return PyList_Append(outputs, tid.p) == 0;
}

bool among(PyObject* t, PyObject* tensors);

bool is_tensor(PyObject* o) { return PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(g.tensor_type)); }

// The items mode._outputs walks in one return value: the tensor, a list's items, or none.
Py_ssize_t items_of(PyObject* value, PyObject** &items, PyObject* &single) {
  if (is_tensor(value)) {
    single = value;
    items = &single;
    return 1;
  }
  if (PyList_Check(value) || PyTuple_Check(value)) {
    items = PySequence_Fast_ITEMS(value);
    return PySequence_Fast_GET_SIZE(value);
  }
  return 0;
}

// mode._outputs for a schema whose returns are all new tensors. -1: an output is one of the
// inputs (an undeclared write) or the value has another shape, so the reference records them;
// nothing has been recorded then.
int all_fresh_outputs(PyObject* mode, PyObject* md, const OpEntry& e, PyObject* out, PyObject* tensors,
                      PyObject* op_id, PyObject* outputs) {
  PyObject* one[1] = {out};
  PyObject** values = one;
  Py_ssize_t n = 1;
  if (e.n_returns != 1) {
    if (!PyTuple_Check(out) && !PyList_Check(out)) return -1;
    values = PySequence_Fast_ITEMS(out);
    n = std::min(PySequence_Fast_GET_SIZE(out), e.n_returns);
  }
  for (int pass = 0; pass < 2; ++pass) {
    for (Py_ssize_t v = 0; v < n; ++v) {
      PyObject* single = nullptr;
      PyObject** items = nullptr;
      Py_ssize_t count = items_of(values[v], items, single);
      for (Py_ssize_t i = 0; i < count; ++i) {
        if (!is_tensor(items[i])) continue;
        if (pass == 0) {
          if (among(items[i], tensors)) return -1;
        } else if (!fresh(mode, md, items[i], op_id, outputs, !e.uninitialized)) {
          return 0;
        }
      }
    }
  }
  return 1;
}

// aten.schema.arg_value: the argument at (position, name), borrowed; nullptr when defaulted away.
PyObject* arg_value(const OpEntry& e, PyObject* args, PyObject* kwargs) {
  if (0 <= e.ref_position && e.ref_position < PyTuple_GET_SIZE(args)) return PyTuple_GET_ITEM(args, e.ref_position);
  return kwargs != nullptr ? PyDict_GetItemWithError(kwargs, e.ref_name) : nullptr;
}

bool among(PyObject* t, PyObject* tensors) {
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors); ++i)
    if (PyList_GET_ITEM(tensors, i) == t) return true;
  return false;
}

// ---- the per-op path --------------------------------------------------------------------------

PyObject* dispatch(PyObject*, PyObject* const* argv, Py_ssize_t nargs, PyObject* kwnames) {
  if (!g.ready || kwnames != nullptr || nargs < 4 || nargs > 5) {
    if (!g.ready) {
      PyErr_SetString(PyExc_RuntimeError, "tracecmp._crecord.configure() was not called");
      return nullptr;
    }
    return PyObject_Vectorcall(g.slow, argv, nargs, kwnames);
  }
  PyObject* mode = argv[0];
  PyObject* func = argv[1];
  PyObject* args = argv[3];
  // Tensor subclasses (DTensor, FakeTensor ...) and ops under another mode (a FakeTensorMode during
  // sharding propagation): the reference decides what to record (capture/tensorkinds.py).
  if (!PyTuple_Check(argv[2])) return PyObject_Vectorcall(g.slow, argv, nargs, kwnames);
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(argv[2]); ++i) {  // torch may list Tensor itself
    PyObject* type = PyTuple_GET_ITEM(argv[2], i);
    if (type != g.tensor_type && type != g.parameter_type) return PyObject_Vectorcall(g.slow, argv, nargs, kwnames);
  }
  Ref modes(call0(g.stack_len));
  if (!modes) return nullptr;
  int others = PyObject_IsTrue(modes.p);
  if (others < 0) return nullptr;
  if (others) return PyObject_Vectorcall(g.slow, argv, nargs, kwnames);
  PyObject* kwargs = nargs == 5 && argv[4] != Py_None ? argv[4] : nullptr;
  if (!PyTuple_Check(args) || (kwargs != nullptr && !PyDict_Check(kwargs)))
    return PyObject_Vectorcall(g.slow, argv, nargs, kwnames);
  Ref md(dict_of(mode));
  if (!md || !settle(mode, md.p)) return nullptr;
  const OpEntry* found = entry_for(func);
  if (found == nullptr && PyErr_Occurred()) return nullptr;
  int plain = truth(md.p, s._plain), stack = truth(md.p, s._stack);
  if (plain < 0 || stack < 0) return nullptr;
  if (found == nullptr || !found->record || found->collective || found->write_only || (!plain && found->rewritable) ||
      stack)
    return PyObject_Vectorcall(g.slow, argv, nargs, kwnames);
  const OpEntry& e = *found;
  Ref owned_kwargs;
  if (kwargs == nullptr) {
    owned_kwargs.reset(PyDict_New());
    if (!owned_kwargs) return nullptr;
    kwargs = owned_kwargs.p;
  }

  Ref tensors(PyList_New(0));
  if (!tensors) return nullptr;
  Ref key(scan(args, kwargs, tensors.p));
  if (!key) return nullptr;
  {
    // An op using a collective's output still awaited: the reference takes its statistics once
    // the collective completed (capture/collectives.py). Nothing is recorded yet.
    PyObject* awaiting = item(md.p, s._awaited_groups);
    PyObject* known = item(md.p, s._known);
    if (awaiting == nullptr || known == nullptr) return nullptr;
    if (PyDict_Check(awaiting) && PyDict_GET_SIZE(awaiting) > 0) {
      for (Py_ssize_t i = 0; i < PyList_GET_SIZE(tensors.p); ++i) {
        PyObject* t = PyList_GET_ITEM(tensors.p, i);
        Ref id(PyLong_FromVoidPtr(t));
        if (!id) return nullptr;
        PyObject* rec = record_of(known, t, id.p);
        if (rec == nullptr) {
          if (PyErr_Occurred()) return nullptr;
          continue;
        }
        Ref group(PyObject_GetAttr(rec, s.group));
        if (!group) return nullptr;
        int waiting = PyDict_Contains(awaiting, group.p);
        if (waiting < 0) return nullptr;
        if (waiting) return PyObject_Vectorcall(g.slow, argv, nargs, kwnames);
      }
    }
  }
  PyObject* scope = item(md.p, s.scope);
  if (scope == nullptr) return nullptr;
  Ref sd(dict_of(scope));
  Ref node(call0(g.current_node));
  if (!sd || !node) return nullptr;
  Ref phase, module, location, seq;
  if (node.p == Py_None) {
    int optimizer = truth(md.p, s.in_optimizer);
    if (optimizer < 0) return nullptr;
    phase.reset(Py_NewRef(optimizer ? s.optimizer : s.forward));
    PyObject* current = item(sd.p, s.current);
    if (current == nullptr) return nullptr;
    module.reset(Py_NewRef(current));
    location.reset(locate(md.p));
    seq.reset(PyLong_FromLong(-1));
    if (!location || !seq) return nullptr;
  } else {
    phase.reset(Py_NewRef(s.backward));
    if (!backward_context(mode, md.p, sd.p, node.p, module, location, seq)) return nullptr;
  }
  int forward = node.p == Py_None;
  if (!forward) {
    forward = truth(sd.p, s.depth);
    if (forward < 0) return nullptr;
  }
  Py_ssize_t count = PyList_GET_SIZE(tensors.p);
  if (forward && count) {
    Ref enabled(call0(g.grad_enabled));
    if (!enabled) return nullptr;
    if (enabled.p == Py_True) {
      Ref number(call0(g.sequence_nr));
      if (!number) return nullptr;
      Ref newest(PyNumber_Subtract(number.p, s.one));
      PyObject* floor = item(sd.p, s.claim_floor);
      if (!newest || floor == nullptr) return nullptr;
      int fresh_node = PyObject_RichCompareBool(newest.p, floor, Py_GE);
      if (fresh_node < 0) return nullptr;
      for (Py_ssize_t i = 0; fresh_node && i < count; ++i) {
        Ref grad(PyObject_GetAttr(PyList_GET_ITEM(tensors.p, i), s.requires_grad));
        if (!grad) return nullptr;
        if (grad.p != Py_True) continue;
        // A node was made since the previous op returned: this op's (modules.py).
        PyObject* seq_info = item(sd.p, s.seq_info);
        Ref claim(PyTuple_Pack(2, module.p, location.p));
        Ref claims(bump(sd.p, s.claims));
        if (seq_info == nullptr || !claim || !claims || PyDict_SetItem(seq_info, newest.p, claim.p) < 0)
          return nullptr;
        if (node.p == Py_None) seq.reset(Py_NewRef(newest.p));
        break;
      }
    }
  }
  PyObject* known = item(md.p, s._known);
  if (known == nullptr) return nullptr;
  Ref inputs(PyTuple_New(count));
  if (!inputs) return nullptr;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* t = PyList_GET_ITEM(tensors.p, i);
    Ref id(PyLong_FromVoidPtr(t));
    if (!id) return nullptr;
    // Held, as the reference's local holds it: a collection run by any allocation below may
    // call back and drop a dead tensor's record from the map.
    Ref held(Py_XNewRef(PyDict_GetItemWithError(known, id.p)));
    PyObject* rec = held.p;
    if (rec == nullptr && PyErr_Occurred()) return nullptr;
    PyObject* tid = nullptr;
    if (rec != nullptr && PyWeakref_GetObject(rec) == t) {
      Ref version(PyObject_GetAttr(rec, s.version));
      if (!version) return nullptr;
      int current = version.p == Py_None;
      if (!current) {
        Ref now(PyObject_GetAttr(t, s._version));
        if (!now) return nullptr;
        current = PyObject_RichCompareBool(version.p, now.p, Py_EQ);
        if (current < 0) return nullptr;
      }
      if (current) tid = PyObject_GetAttr(rec, s.tid);
    }
    if (tid == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      tid = call_method(mode, s._enter, {t, rec != nullptr ? rec : Py_None, phase.p, module.p, location.p, s.empty});
      if (tid == nullptr) return nullptr;
    }
    PyTuple_SET_ITEM(inputs.p, i, tid);
  }

  Ref out(PyObject_Call(e.call, args, kwargs));
  if (!out) return nullptr;
  if (forward) {
    Ref number(call0(g.sequence_nr));
    if (!number || PyDict_SetItem(sd.p, s.claim_floor, number.p) < 0) return nullptr;
  }
  Ref op_id(bump(md.p, s._next_op));
  if (!op_id) return nullptr;
  int out_is_tensor = is_tensor(out.p);
  Ref outputs_list(PyList_New(0));
  if (!outputs_list) return nullptr;
  PyObject* inplace = e.inplace;
  Ref returned_inplace;
  int handled = 0;
  if (e.shape == kFresh && out_is_tensor && !among(out.p, tensors.p)) {
    if (!fresh(mode, md.p, out.p, op_id.p, outputs_list.p, !e.uninitialized)) return nullptr;
  } else if (e.all_fresh && (handled = all_fresh_outputs(mode, md.p, e, out.p, tensors.p, op_id.p,
                                                         outputs_list.p)) >= 0) {
    if (handled == 0) return nullptr;
  } else if (e.shape == kView && out_is_tensor) {
    PyObject* base = arg_value(e, args, kwargs);
    if (base == nullptr && PyErr_Occurred()) return nullptr;
    if (!view(mode, md.p, out.p, base, op_id.p, outputs_list.p)) return nullptr;
  } else if (e.shape == kWrite && out_is_tensor) {
    if (!written(mode, md.p, out.p, op_id.p, outputs_list.p)) return nullptr;
  } else {
    Ref r(call_method(mode, s._outputs, {e.info, op_id.p, args, kwargs, out.p, tensors.p}));
    if (!r) return nullptr;
    if (!PyTuple_Check(r.p) || PyTuple_GET_SIZE(r.p) != 2) {
      PyErr_SetString(PyExc_TypeError, "_outputs must return (outputs, inplace)");
      return nullptr;
    }
    outputs_list.reset(PySequence_List(PyTuple_GET_ITEM(r.p, 0)));
    returned_inplace.reset(Py_NewRef(PyTuple_GET_ITEM(r.p, 1)));
    if (!outputs_list) return nullptr;
    inplace = returned_inplace.p;
  }
  Ref outputs(PyList_AsTuple(outputs_list.p));
  if (!outputs) return nullptr;

  PyObject* memo = item(md.p, s._args_memo);
  if (memo == nullptr) return nullptr;
  Ref memo_key(PyTuple_Pack(2, e.name, key.p));
  if (!memo_key) return nullptr;
  PyObject* text = PyDict_GetItemWithError(memo, memo_key.p);  // TypeError: unhashable (symbolic sizes)
  Ref encoded;
  if (text == nullptr) {
    PyErr_Clear();
    PyObject* encoder = item(md.p, s._args);
    if (encoder == nullptr) return nullptr;
    encoded.reset(call_method(encoder, s.encode, {e.info, key.p, args, kwargs}));
    if (!encoded) return nullptr;
    text = encoded.p;
  }
  PyObject* step = item(md.p, s.step);
  PyObject* rows = item(md.p, s.rows);
  if (step == nullptr || rows == nullptr) return nullptr;
  PyObject* fields[15] = {op_id.p,  step,    phase.p,  e.kind, e.name,        s.empty,  module.p, location.p,
                          text,     inputs.p, outputs.p, inplace, e.random, seq.p, s.empty};
  Py_ssize_t count_rows = 0;
  if (!append_row(rows, fields, 15, &count_rows)) return nullptr;
  PyObject* limit = item(md.p, s._row_limit);
  PyObject* saved = item(md.p, s.saved_bytes);
  PyObject* max_bytes = item(md.p, s._max_bytes);
  if (limit == nullptr || saved == nullptr || max_bytes == nullptr) return nullptr;
  Ref length(PyLong_FromSsize_t(count_rows));
  if (!length) return nullptr;
  int full = PyObject_RichCompareBool(length.p, limit, Py_GE);
  if (full == 0) full = PyObject_RichCompareBool(saved, max_bytes, Py_GE);
  if (full < 0) return nullptr;
  if (full) {
    PyObject* on_limit = item(md.p, s._on_limit);
    Ref r(on_limit ? call0(on_limit) : nullptr);
    if (!r) return nullptr;
  }
  return out.release();
}

// mode._forget as a weak record's callback: drop the record from the map unless replaced.
PyObject* forget(PyObject*, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 2 || !PyDict_Check(argv[0])) {
    PyErr_SetString(PyExc_TypeError, "forget(known, rec)");
    return nullptr;
  }
  Ref key(PyObject_GetAttr(argv[1], s.key));
  if (!key) return nullptr;
  PyObject* current = PyDict_GetItemWithError(argv[0], key.p);
  if (current == nullptr && PyErr_Occurred()) return nullptr;
  if (current == argv[1] && PyDict_DelItem(argv[0], key.p) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* configure(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"slow", "tensor_type", "op_overload", "op_infos", "one_fresh", "marker",
                                   "scan_value", "plain_types", "rec_type", "current_node", "sequence_nr",
                                   "grad_enabled", "inference_enabled", "num_threads", "stats_module",
                                   "native_codes", "parallel_min", "view_kind", "write_kind", "fresh_kind",
                                   "parameter_type", "strided", "stack_len", nullptr};
  Config c;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OOOO!OOOO!OOOOOOOO!OOOOOOO", const_cast<char**>(keywords), &c.slow,
                                   &c.tensor_type, &c.op_overload, &PyDict_Type, &c.op_infos, &c.one_fresh,
                                   &c.marker, &c.scan_value, &PyTuple_Type, &c.plain_types, &c.rec_type,
                                   &c.current_node, &c.sequence_nr, &c.grad_enabled, &c.inference_enabled,
                                   &c.num_threads, &c.stats_module, &PyDict_Type, &c.native_codes,
                                   &c.parallel_min, &c.view_kind, &c.write_kind, &c.fresh_kind, &c.parameter_type,
                                   &c.strided, &c.stack_len))
    return nullptr;
  if (!PyType_Check(c.tensor_type) || !PyType_Check(c.op_overload) || !PyType_Check(c.rec_type) ||
      !PyType_Check(c.parameter_type)) {
    PyErr_SetString(PyExc_TypeError, "tensor_type, op_overload, rec_type and parameter_type must be types");
    return nullptr;
  }
  PyObject** fields[] = {&c.slow, &c.tensor_type, &c.op_overload, &c.op_infos, &c.one_fresh, &c.marker,
                         &c.scan_value, &c.plain_types, &c.rec_type, &c.current_node, &c.sequence_nr,
                         &c.grad_enabled, &c.inference_enabled, &c.num_threads, &c.stats_module,
                         &c.native_codes, &c.parallel_min, &c.view_kind, &c.write_kind, &c.fresh_kind,
                         &c.parameter_type, &c.strided, &c.stack_len};
  for (PyObject** f : fields) Py_INCREF(*f);
  c.ready = true;
  g = c;  // once per process; a second call (a reload) leaks the first set, by design tiny
  if (g_ops == nullptr) g_ops = new std::unordered_map<PyObject*, OpEntry>();
  Py_RETURN_NONE;
}

// The same binding with nothing recorded: the op re-dispatched the way dispatch() does it. What a
// capture built on a dispatch mode pays before recording anything (benchmarks/overhead_ablation.py).
PyObject* passthrough(PyObject*, PyObject* const* argv, Py_ssize_t nargs, PyObject* kwnames) {
  if (kwnames != nullptr || nargs < 4 || nargs > 5 || !PyTuple_Check(argv[3])) {
    PyErr_SetString(PyExc_TypeError, "passthrough(mode, func, types, args, kwargs=None)");
    return nullptr;
  }
  PyObject* func = argv[1];
  PyObject* kwargs = nargs == 5 && argv[4] != Py_None ? argv[4] : nullptr;
  Ref call(Py_IS_TYPE(func, reinterpret_cast<PyTypeObject*>(g.op_overload)) ? PyObject_GetAttr(func, s._op)
                                                                             : Py_NewRef(func));
  return call ? PyObject_Call(call.p, argv[3], kwargs) : nullptr;
}

PyMethodDef methods[] = {
    {"dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(dispatch)),
     METH_FASTCALL | METH_KEYWORDS,
     "dispatch(mode, func, types, args=(), kwargs=None)\n\nCaptureMode.__torch_dispatch__ in C; "
     "bind it to a mode with types.MethodType."},
    {"passthrough", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(passthrough)),
     METH_FASTCALL | METH_KEYWORDS,
     "passthrough(mode, func, types, args, kwargs=None)\n\nRe-dispatch the op as dispatch() does, "
     "recording nothing: the floor of a capture built on a dispatch mode."},
    {"forget", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(forget)), METH_FASTCALL,
     "forget(known, rec)\n\nCaptureMode._forget over the map ``known``, for weak-record callbacks."},
    {"configure", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(configure)),
     METH_VARARGS | METH_KEYWORDS, "configure(**objects): the reference's helpers and types, once."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "tracecmp._crecord",
                          "The capture mode's per-op path in C (no torch headers).", -1, methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__crecord() {
#define TRACECMP_INTERN(n)                          \
  s.n = PyUnicode_InternFromString(#n);             \
  if (s.n == nullptr) return nullptr;
  TRACECMP_NAMES(TRACECMP_INTERN)
#undef TRACECMP_INTERN
  s.empty = PyUnicode_FromString("");
  s.one = PyLong_FromLong(1);
  s.zero = PyLong_FromLong(0);
  if (s.empty == nullptr || s.one == nullptr || s.zero == nullptr) return nullptr;
  BufferType.tp_name = "tracecmp._crecord.Buffer";
  BufferType.tp_basicsize = sizeof(Buffer);
  BufferType.tp_flags = Py_TPFLAGS_DEFAULT;
  BufferType.tp_doc = "Buffer(typecode): a growable column of numbers ('q', 'i', 'd' or 'b'), as array.array.";
  BufferType.tp_new = Buffer_new;
  BufferType.tp_dealloc = Buffer_dealloc;
  BufferType.tp_methods = buffer_methods;
  BufferType.tp_getset = buffer_getset;
  BufferType.tp_as_sequence = &buffer_sequence;
  BufferType.tp_as_buffer = &buffer_procs;
  if (PyType_Ready(&BufferType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr || PyModule_AddObjectRef(module, "Buffer", reinterpret_cast<PyObject*>(&BufferType)) < 0) {
    Py_XDECREF(module);
    return nullptr;
  }
  return module;
}
