// tracecmp._crecord, the per-op path: CaptureMode.__torch_dispatch__ in C (see record.cpp).
#if PY_VERSION_HEX >= 0x030B0000
#include <frameobject.h>
#endif

#include <algorithm>
#include <unordered_map>

#include "record.hpp"

namespace tracecmp::record {
namespace {

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

// ---- trace.args.scan ----------------------------------------------------------------------------

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

// trace.args.scan_value; values it sends through pytree go to the Python function itself.
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

// trace.args.scan: the memo key of the non-tensor part; tensors appended in order.
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

}  // namespace

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

namespace {

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
int all_fresh_outputs(PyObject* mode, PyObject* md, PyObject* idd, const OpEntry& e, PyObject* out,
                      PyObject* tensors, PyObject* op_id, PyObject* outputs) {
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
        } else if (!fresh(mode, md, idd, items[i], op_id, outputs, !e.uninitialized)) {
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

}  // namespace

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
  if (!md) return nullptr;
  PyObject* ids = item(md.p, s.ids);  // the mode's TensorIds (capture/identity.py)
  Ref idd(ids != nullptr ? dict_of(ids) : nullptr);
  if (!idd || !settle(mode, idd.p)) return nullptr;
  const OpEntry* found = entry_for(func);
  if (found == nullptr && PyErr_Occurred()) return nullptr;
  int plain = truth(md.p, s._plain), stack = truth(md.p, s._stack);
  if (plain < 0 || stack < 0) return nullptr;
  if (found == nullptr || !found->record || found->collective || found->write_only || (!plain && found->rewritable) ||
      stack)
    return PyObject_Vectorcall(g.slow, argv, nargs, kwnames);
  // Self-checks (capture/selfcheck.py): the mode's checker's kinds, op -> its check or None. An op
  // not classified yet takes the reference, which classifies it; a checked one is checked around
  // the call below (mode._check_before and _check_after).
  PyObject* check_kinds = PyDict_GetItemWithError(md.p, s._check_kinds);
  if (check_kinds == nullptr && PyErr_Occurred()) return nullptr;
  bool checked = false;
  PyObject* kind = nullptr;  // borrowed: the checker's kind of this op
  if (check_kinds != nullptr && check_kinds != Py_None) {
    kind = PyDict_GetItemWithError(check_kinds, func);
    if (kind == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      return PyObject_Vectorcall(g.slow, argv, nargs, kwnames);
    }
    checked = kind != Py_None;
  }
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
    PyObject* collectives = item(md.p, s.collectives);  // the mode's CollectiveRecorder
    Ref cd(collectives != nullptr ? dict_of(collectives) : nullptr);
    PyObject* awaiting = cd ? item(cd.p, s.awaited_groups) : nullptr;
    PyObject* known = item(idd.p, s.known);
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
    long task = -1;
    if (!optimizer) {
      Ref id(call0(g.graph_task));
      if (!id) return nullptr;
      task = PyLong_AsLong(id.p);
      if (task == -1 && PyErr_Occurred()) return nullptr;
    }
    if (task != -1) {
      // Backward's final callbacks (DDP's bucket copy-out, FSDP2's post-backward): no node runs
      // them; they belong to the module whose gradient they move (mode._unnoded_context).
      phase.reset(Py_NewRef(s.backward));
      module.reset(call_method(scope, s.grad_module, {tensors.p}));
      if (!module) return nullptr;
    } else {
      phase.reset(Py_NewRef(optimizer ? s.optimizer : s.forward));
      PyObject* current = item(sd.p, s.current);
      if (current == nullptr) return nullptr;
      module.reset(Py_NewRef(current));
    }
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
  PyObject* known = item(idd.p, s.known);
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

  // Before the call: an in-place op overwrites the inputs its check recomputes from.
  Ref plan;
  SampledCall sampled;  // record_check.cpp: a call with a recipe is gathered here
  int gathered = 0;
  if (checked) {
    gathered = sample_before(md.p, kind, func, key.p, tensors.p, sampled);
    if (gathered < 0) return nullptr;
    if (!gathered) {
      plan.reset(call_method(mode, s._check_before, {func, args, kwargs}));
      if (!plan) return nullptr;
    }
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
    if (!fresh(mode, md.p, idd.p, out.p, op_id.p, outputs_list.p, !e.uninitialized)) return nullptr;
  } else if (e.all_fresh && (handled = all_fresh_outputs(mode, md.p, idd.p, e, out.p, tensors.p, op_id.p,
                                                         outputs_list.p)) >= 0) {
    if (handled == 0) return nullptr;
  } else if (e.shape == kView && out_is_tensor) {
    PyObject* base = arg_value(e, args, kwargs);
    if (base == nullptr && PyErr_Occurred()) return nullptr;
    if (!view(mode, md.p, idd.p, out.p, base, op_id.p, outputs_list.p)) return nullptr;
  } else if (e.shape == kWrite && out_is_tensor) {
    if (!written(mode, md.p, idd.p, out.p, op_id.p, outputs_list.p)) return nullptr;
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
  if (gathered) {
    if (!sample_after(mode, md.p, sampled, op_id.p, out.p)) return nullptr;
  } else if (plan && plan.p != Py_None) {
    Ref r(call_method(mode, s._check_after, {plan.p, op_id.p, out.p}));
    if (!r) return nullptr;
  }
  if (sampled.learn) {
    PyObject* learn_argv[6] = {mode, sampled.signature.p, func, args, kwargs, out.p};
    Ref r(PyObject_VectorcallMethod(s._learn, learn_argv, 6, nullptr));
    if (!r) return nullptr;
  }
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

void ready_ops() {
  if (g_ops == nullptr) g_ops = new std::unordered_map<PyObject*, OpEntry>();
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

}  // namespace tracecmp::record
