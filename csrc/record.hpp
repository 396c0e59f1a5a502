// tracecmp._crecord: what its files share (record.cpp, record_buffer.cpp, record_identity.cpp,
// record_dispatch.cpp). See record.cpp for what the module is.
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace tracecmp::record {

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
  PyObject* marker = nullptr;          // trace.args.TENSOR_MARK, a tensor in a memo key
  PyObject* scan_value = nullptr;      // trace.args.scan_value, for values the C walk does not know
  PyObject* plain_types = nullptr;     // (dtype, device, layout, memory_format): kept as is
  PyObject* rec_type = nullptr;        // identity.TensorRef
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
  PyObject* graph_task = nullptr;      // torch._C._current_graph_task_id: -1 outside a backward
  PyObject* recipe_kinds = nullptr;    // capture.selfcheck.RECIPE_KINDS: the kinds with recipes
  bool ready = false;
};
extern Config g;

// Interned attribute and key names.
struct Names {
#define TRACECMP_NAMES(X)                                                                        \
  X(ids) X(known) X(next_id) X(unsettled) X(held) X(writes) X(forget_cb) X(collectives)          \
  X(awaited_groups) X(_next_op) X(step) X(in_optimizer) X(rows)                                 \
  X(tensor_rows) X(_row_limit) X(saved_bytes) X(_max_bytes) X(_save_data) X(_plain) X(_stack)   \
  X(_args_memo) X(_args) X(_dtypes) X(scope) X(_locator) X(_on_limit) X(_enter)                 \
  X(_outputs) X(_value) X(_bare) X(_dtype) X(encode) X(current)                                 \
  X(depth) X(seq_info) X(claims) X(claim_floor) X(_code) X(_text) X(_classify) X(tid)           \
  X(version) X(group) X(key) X(_version) X(requires_grad) X(is_inference) X(is_cpu) X(dtype)    \
  X(shape) X(is_neg) X(numel) X(data_ptr) X(stride) X(_native_stats) X(_op) X(_sequence_nr)     \
  X(record) X(rewritable) X(returns) X(extra_writes) X(uninitialized) X(inplace) X(random)      \
  X(kind) X(name) X(forward) X(backward) X(optimizer) X(cpu) X(_written) X(variable) X(owner) X(grad_module) X(schema) X(parts) \
  X(kinds) X(append) X(_rollback) X(layout) X(collective) X(write_only) X(_unbumped) X(_base)   \
  X(_check_kinds) X(_check_before) X(_check_after) X(_checker) X(full) X(recipes) X(_stream)      \
  X(_residuals) X(_coarse) X(_queued) X(_queue_max) X(_deferred_rows) X(check_rows) X(_learn)   \
  X(_resolve_checks)
#define TRACECMP_DECLARE(n) PyObject* n = nullptr;
  TRACECMP_NAMES(TRACECMP_DECLARE)
#undef TRACECMP_DECLARE
  PyObject* empty = nullptr;  // ""
  PyObject* one = nullptr;    // 1
  PyObject* zero = nullptr;   // 0
};
extern Names s;

constexpr Py_ssize_t kTextLimit = Py_ssize_t{1} << 16;  // location.py's _TEXT_LIMIT
constexpr Py_ssize_t kWriteHistory = 16;                 // identity.py's WRITE_HISTORY
constexpr unsigned long long kSeqNone = 1ULL << 63;       // mode.py's _SEQ_NONE

inline PyObject* dict_of(PyObject* obj) { return PyObject_GenericGetDict(obj, nullptr); }

// A borrowed item of an instance dict, or nullptr with an AttributeError set.
inline PyObject* item(PyObject* dict, PyObject* name) {
  PyObject* v = PyDict_GetItemWithError(dict, name);
  if (v == nullptr && !PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, name);
  return v;
}

inline PyObject* call0(PyObject* f) { return PyObject_CallNoArgs(f); }

inline PyObject* call_method(PyObject* obj, PyObject* name, std::initializer_list<PyObject*> args) {
  PyObject* argv[8];
  argv[0] = obj;
  Py_ssize_t n = 1;
  for (PyObject* a : args) argv[n++] = a;
  return PyObject_VectorcallMethod(name, argv, n, nullptr);
}

inline int truth(PyObject* dict, PyObject* name) {
  PyObject* v = item(dict, name);
  return v == nullptr ? -1 : PyObject_IsTrue(v);
}

// dict[name] += 1 for an int item; the old value (new reference).
inline PyObject* bump(PyObject* dict, PyObject* name) {
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

// ---- record_buffer.cpp: the number columns of the row buffers, and appending a row -------------

extern PyTypeObject BufferType;
bool ready_buffer_type();  // once, at import
// Columns.append: one row of n fields; *rows (when given) gets the row count after it.
bool append_row(PyObject* columns, PyObject* const* fields, int n, Py_ssize_t* rows = nullptr);
// n float64 values at the end of a Buffer of typecode 'd'.
bool buffer_extend_doubles(PyObject* column, const double* values, Py_ssize_t n);

// ---- record_identity.cpp: which value each tensor holds ---------------------------------------
// ``md`` is the mode's instance dict, ``idd`` its identity's (mode.ids, a capture.identity.TensorIds).

PyObject* record_of(PyObject* known, PyObject* t, PyObject* id);
PyObject* version_of(PyObject* t);
PyObject* remember(PyObject* idd, PyObject* t, PyObject* tid, PyObject* version, PyObject* group);
bool settle(PyObject* mode, PyObject* idd);
bool written(PyObject* mode, PyObject* md, PyObject* idd, PyObject* t, PyObject* op_id, PyObject* outputs);
bool view(PyObject* mode, PyObject* md, PyObject* idd, PyObject* t, PyObject* base, PyObject* op_id,
          PyObject* outputs);
bool fresh(PyObject* mode, PyObject* md, PyObject* idd, PyObject* t, PyObject* op_id, PyObject* outputs,
           bool stats);
PyObject* forget(PyObject*, PyObject* const* argv, Py_ssize_t nargs);

// ---- record_check.cpp: sampled self-checks (capture/selfcheck.py's recipes) ---------------------

// What one recipe of a call gathers.
struct SampledPiece {
  std::vector<uint64_t> flat;  // the sampled positions of its output
  std::vector<double> values;  // the inputs' values there, then the output's
  std::vector<uint64_t> rows;  // a block's rows, where its extras are read
};
// One call's sampled check, from before the op to after it.
struct SampledCall {
  Ref signature;  // the calls a recipe serves (SelfChecker.signature); null: not a kind with recipes
  Ref recipe;     // its Recipe, while the call is sampled
  bool learn = false;  // a signature seen for the first time: mode._learn after the op
  std::vector<SampledPiece> pieces;  // the recipe's, then each of its ``more``'s
};
// Before the op: 1 with the call's inputs gathered, 0 where it is checked the usual way
// (call.learn set for a new signature), -1 with an exception set.
int sample_before(PyObject* md, PyObject* kind, PyObject* func, PyObject* key, PyObject* tensors, SampledCall& call);
// After the op: the call queued with its recipe's and its check row recorded.
bool sample_after(PyObject* mode, PyObject* md, SampledCall& call, PyObject* op_id, PyObject* out);

// ---- record_dispatch.cpp: the per-op path ------------------------------------------------------

PyObject* dims_of(PyObject* shape);
PyObject* dtype_name(PyObject* mode, PyObject* md, PyObject* dtype);
bool plain_type(PyObject* t);
bool value(PyObject* mode, PyObject* md, PyObject* t, PyObject* tid, PyObject* op_id, PyObject* index,
           PyObject* view_of);
void ready_ops();  // once, at configure()
PyObject* dispatch(PyObject*, PyObject* const* argv, Py_ssize_t nargs, PyObject* kwnames);
PyObject* passthrough(PyObject*, PyObject* const* argv, Py_ssize_t nargs, PyObject* kwnames);

}  // namespace tracecmp::record
