// tracecmp._crecord, tensor identity: what tracecmp.capture.identity.TensorIds does, on its
// instance dict: the map from a tensor to the weak record of the value it holds (TensorRef), new
// values' ids, the versions written tensors reach and the write history of each view family.
#include "record.hpp"

namespace tracecmp::record {

// The TensorRef in the map for tensor t if it is alive and is t (borrowed), else nullptr.
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

// TensorIds.remember: a new TensorRef for t in the map (new reference).
PyObject* remember(PyObject* idd, PyObject* t, PyObject* tid, PyObject* version, PyObject* group) {
  PyObject* cb = item(idd, s.forget_cb);
  PyObject* known = item(idd, s.known);
  if (cb == nullptr || known == nullptr) return nullptr;
  Ref rec(PyObject_CallFunctionObjArgs(g.rec_type, t, cb, nullptr));
  Ref key(PyLong_FromVoidPtr(t));
  if (!rec || !key || PyObject_SetAttr(rec.p, s.tid, tid) < 0 ||
      PyObject_SetAttr(rec.p, s.version, version) < 0 || PyObject_SetAttr(rec.p, s.group, group) < 0 ||
      PyObject_SetAttr(rec.p, s.key, key.p) < 0 || PyDict_SetItem(known, key.p, rec.p) < 0)
    return nullptr;
  return rec.release();
}

// TensorIds.settle(mode._unbumped): read the versions of the tensors the previous op wrote.
bool settle(PyObject* mode, PyObject* idd) {
  PyObject* pending = item(idd, s.unsettled);
  if (pending == nullptr) return false;
  if (!PyList_Check(pending) || PyList_GET_SIZE(pending) == 0) return true;
  Ref unsettled(Py_NewRef(pending));
  Ref fresh(PyList_New(0));
  if (!fresh || PyDict_SetItem(idd, s.unsettled, fresh.p) < 0) return false;
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
  PyObject* held = item(idd, s.held);  // views kept alive for this look (TensorIds.wrote)
  if (held == nullptr) return false;
  if (PyList_Check(held) && PyList_GET_SIZE(held) > 0) {
    Ref none(PyList_New(0));
    if (!none || PyDict_SetItem(idd, s.held, none.p) < 0) return false;
  }
  return true;
}

// mode._written (TensorIds.wrote) for a written input that is in the map (anything else: the reference).
bool written(PyObject* mode, PyObject* md, PyObject* idd, PyObject* t, PyObject* op_id, PyObject* outputs) {
  PyObject* known = item(idd, s.known);
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
  Ref tid(bump(idd, s.next_id));
  if (!tid || PyObject_SetAttr(rec, s.tid, tid.p) < 0) return false;
  Ref version(PyObject_GetAttr(rec, s.version));
  if (!version) return false;
  if (version.p != Py_None) {
    Ref entry(PyList_New(2));
    if (!entry) return false;
    PyList_SET_ITEM(entry.p, 0, Py_NewRef(version.p));
    PyList_SET_ITEM(entry.p, 1, Py_NewRef(tid.p));
    Ref pair(PyTuple_Pack(2, rec, entry.p));
    PyObject* unsettled = item(idd, s.unsettled);
    if (!pair || unsettled == nullptr || PyList_Append(unsettled, pair.p) < 0) return false;
    // A written view the caller drops at once (``x[i] = v``, FSDP2's out= views) is kept alive
    // until settle has read its version: else its view family's write history stays unsettled.
    Ref base(PyObject_GetAttr(t, s._base));
    if (!base) return false;
    if (base.p != Py_None) {
      PyObject* held = item(idd, s.held);
      if (held == nullptr || PyList_Append(held, t) < 0) return false;
    }
    Ref group(PyObject_GetAttr(rec, s.group));
    PyObject* writes = item(idd, s.writes);
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

// mode._view (TensorIds.view) + mode._bare for a CPU view (anything else: the reference's _bare).
bool view(PyObject* mode, PyObject* md, PyObject* idd, PyObject* t, PyObject* base, PyObject* op_id,
          PyObject* outputs) {
  Ref tid(bump(idd, s.next_id));
  PyObject* known = item(idd, s.known);
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
  Ref made(remember(idd, t, tid.p, version.p, group.p));
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

// mode._fresh (TensorIds.fresh): a new tensor among the op's outputs (statistics unless uninitialized).
bool fresh(PyObject* mode, PyObject* md, PyObject* idd, PyObject* t, PyObject* op_id, PyObject* outputs,
           bool stats) {
  Ref tid(bump(idd, s.next_id));
  Ref version(tid ? version_of(t) : nullptr);
  Ref rec(version ? remember(idd, t, tid.p, version.p, tid.p) : nullptr);
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

// TensorIds.forget as a weak record's callback: drop the record from the map unless replaced.
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

}  // namespace tracecmp::record
