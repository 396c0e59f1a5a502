// tracecmp._crecord: sampled self-checks gathered on the per-op path.
//
// The reference is CaptureMode._sample_before and _sample_after with SelfChecker.signature,
// gather_sampled and finish_sampled (capture/selfcheck.py, "sampled checks gathered on the
// per-op path"): a call whose signature (op, other arguments, input dtypes and shapes) has a
// recipe (a pointwise op, a copy, a 2-D matmul, a sum or mean, a softmax, a layer or batch norm,
// a convolution, and some of their gradients) draws its sample from
// the checker's splitmix64 stream and reads the values behind it straight from each tensor's
// memory, into float64. The float64 recomputation stays in Python, once per recipe
// at the hand-over. Without this a check costs two calls into Python and a dozen torch calls,
// ~100 us in a training step (cold caches between big kernels); reading a few elements by
// pointer costs the tensors' metadata and a few cache lines.
#include <cmath>
#include <cstring>

#include "record.hpp"

namespace tracecmp::record {
namespace {

constexpr int kMaxDims = 16;  // more: the call is checked the usual way

// Where a tensor's elements lie: its data, dtype code (stats._NATIVE_CODES), shape and strides.
struct Layout {
  const char* data = nullptr;
  int code = -1;
  int dims = 0;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
};

double from_half(uint16_t h) {
  int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  double v = exponent == 0    ? std::ldexp(mantissa, -24)
             : exponent == 31 ? (mantissa ? NAN : INFINITY)
                              : std::ldexp(mantissa + 1024, exponent - 25);
  return (h & 0x8000) ? -v : v;
}

double element(const char* p, int code) {
  switch (code) {
    case 0: {
      float f;
      std::memcpy(&f, p, sizeof f);
      return f;
    }
    case 1: {
      double d;
      std::memcpy(&d, p, sizeof d);
      return d;
    }
    case 2: {
      uint16_t h;
      std::memcpy(&h, p, sizeof h);
      return from_half(h);
    }
    case 3: {  // bfloat16: the high half of a float32
      uint16_t h;
      std::memcpy(&h, p, sizeof h);
      uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    case 4:
      return static_cast<double>(*reinterpret_cast<const uint8_t*>(p));
    case 5:
      return static_cast<double>(*reinterpret_cast<const int8_t*>(p));
    case 6: {
      int16_t v;
      std::memcpy(&v, p, sizeof v);
      return static_cast<double>(v);
    }
    case 7: {
      int32_t v;
      std::memcpy(&v, p, sizeof v);
      return static_cast<double>(v);
    }
    case 8: {
      int64_t v;
      std::memcpy(&v, p, sizeof v);
      return static_cast<double>(v);
    }
    default:  // 9, bool: any non-zero byte is true
      return *reinterpret_cast<const uint8_t*>(p) != 0 ? 1.0 : 0.0;
  }
}

// Bytes per element, by dtype code (stats._NATIVE_CODES).
constexpr int kItemSize[10] = {4, 8, 2, 2, 1, 1, 2, 4, 8, 1};

// One element of a dtype read as a double: ``element`` with its dtype chosen once per tensor,
// not per element (a convolution's sample reads up to ~10^5 of them).
using Load = double (*)(const char*);
template <int Code>
double load(const char* p) {
  return element(p, Code);
}
constexpr Load kLoad[10] = {load<0>, load<1>, load<2>, load<3>, load<4>, load<5>, load<6>, load<7>, load<8>, load<9>};

// A tensor's elements read by offset (in elements): its data, item size and loader.
struct Reader {
  const char* data;
  int64_t item;
  Load read;
  explicit Reader(const Layout& t) : data(t.data), item(kItemSize[t.code]), read(kLoad[t.code]) {}
  double operator()(int64_t offset) const { return read(data + offset * item); }
};

// A tuple of ints into out[0..n), n <= most; false otherwise (no exception left).
bool ints_of(PyObject* tuple, int64_t* out, int* n, int most = kMaxDims) {
  if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) > most) return false;
  *n = static_cast<int>(PyTuple_GET_SIZE(tuple));
  for (int i = 0; i < *n; ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

// selfcheck._sampled_readable and the tensor's layout: a plain, dense CPU tensor, not a negated
// view, with memory behind its pointer. False (no exception left) for anything else.
bool readable(PyObject* t, PyObject* dtype, PyObject* shape, Layout& out) {
  if (!plain_type(t)) return false;
  Ref layout(PyObject_GetAttr(t, s.layout));
  Ref cpu(layout && layout.p == g.strided ? PyObject_GetAttr(t, s.is_cpu) : nullptr);
  Ref neg(cpu && cpu.p == Py_True ? call_method(t, s.is_neg, {}) : nullptr);
  Ref ptr(neg && neg.p == Py_False ? call_method(t, s.data_ptr, {}) : nullptr);
  Ref strides(ptr ? call_method(t, s.stride, {}) : nullptr);
  PyObject* code = strides ? PyDict_GetItemWithError(g.native_codes, dtype) : nullptr;
  int dims = 0;
  bool ok = code != nullptr && ints_of(shape, out.sizes, &out.dims) && ints_of(strides.p, out.strides, &dims) &&
            dims == out.dims;
  if (ok) {
    out.code = static_cast<int>(PyLong_AsLong(code));
    out.data = static_cast<const char*>(PyLong_AsVoidPtr(ptr.p));
    ok = out.code >= 0 && out.code <= 9 && out.data != nullptr;
  }
  PyErr_Clear();
  return ok;
}

// The values of ``t`` (broadcast to ``sizes``) at row-major positions ``flat`` of ``sizes``, appended.
void gather(const Layout& t, const int64_t* sizes, int dims, const std::vector<uint64_t>& flat,
            std::vector<double>& values) {
  int64_t strides[kMaxDims];
  int lead = dims - t.dims;  // broadcast dimensions in front: stride 0, as are dimensions of size 1
  for (int d = 0; d < dims; ++d)
    strides[d] = d < lead || t.sizes[d - lead] == 1 ? 0 : t.strides[d - lead];
  const int64_t item = kItemSize[t.code];
  for (uint64_t position : flat) {
    int64_t offset = 0;
    for (int d = dims - 1; d >= 0; --d) {
      const auto size = static_cast<uint64_t>(sizes[d]);
      offset += static_cast<int64_t>(position % size) * strides[d];
      position /= size;
    }
    values.push_back(element(t.data + offset * item, t.code));
  }
}

// selfcheck.draw: k positions below n from the splitmix64 stream at *state; every one in turn
// where n <= k, nothing drawn.
void draw(uint64_t* state, uint64_t n, int64_t k, std::vector<uint64_t>& flat) {
  if (n <= static_cast<uint64_t>(k)) {
    for (int64_t i = 0; i < k; ++i) flat.push_back(static_cast<uint64_t>(i) % n);
    return;
  }
  for (int64_t i = 0; i < k; ++i) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    flat.push_back(static_cast<uint64_t>((static_cast<unsigned __int128>(z) * n) >> 64));
  }
}

// The Recipe's fields read here, by position (selfcheck.Recipe).
enum RecipeField {
  kSizes, kNumel, kSample, kLimit, kOutCode, kValues, kTickets, kOutSizes, kGrid, kHow, kSampled, kOutIndex,
  kExtras, kMore, kRecipeFields
};
// selfcheck.GRID_MATMUL, GRID_ROWS, GRID_PLACED, GRID_CONV, GRID_CHANNELS, GRID_PICKED,
// GRID_ATTENTION: what a Recipe.grid's first field says it reads
enum GridKind { kGridMatmul, kGridRows, kGridPlaced, kGridConv, kGridChannels, kGridPicked, kGridAttention };
// selfcheck.NLL_LOSS, NLL_LOSS_BACKWARD: a GRID_PICKED's roles
enum PickedRole { kNllLoss, kNllLossBackward };
// selfcheck.CONV_OUTPUT, CONV_INPUT_GRADIENT, CONV_WEIGHT_GRADIENT: a GRID_CONV's roles
enum ConvRole { kConvOutput, kConvInputGradient, kConvWeightGradient };
// A grid's fields at most: a convolution's geometry, or a batch norm's positions (selfcheck.CHANNEL_POSITIONS)
constexpr int kGridFields = 128;

// selfcheck.Recipe.grid of GRID_MATMUL: a 2-D matmul's block of ``rows`` adjacent rows of A and
// ``cols`` adjacent columns of B (their starts drawn, columns first; a bmm's matrix drawn before
// them), every crossing a sampled
// output element; each tensor read in its role (A's rows whole, B's columns whole, the bias at
// the crossings). False where the recipe does not fit the tensors (no exception: the usual path).
bool gather_matmul(const int64_t* g, int n_fields, const Layout* layouts, Py_ssize_t count, const int64_t* sizes,
                   int dims, uint64_t* state, SampledPiece& call) {
  if (n_fields != 6 || (dims != 2 && dims != 3)) return false;
  const int64_t rows = g[1], cols = g[2], a = g[3], b = g[4], bias = g[5];
  const int lead = dims - 2;  // a bmm's batch of matrices: one drawn first
  const int64_t m = sizes[lead], n = sizes[lead + 1];
  if (a < 0 || a >= count || b < 0 || b >= count || bias >= count || (lead && bias >= 0) ||
      layouts[a].dims != dims || layouts[b].dims != dims)
    return false;
  const Layout &A = layouts[a], &B = layouts[b];
  const int64_t K = A.sizes[lead + 1];
  if (A.sizes[lead] != m || B.sizes[lead] != K || B.sizes[lead + 1] != n || rows > m || cols > n) return false;
  if (lead && (A.sizes[0] != sizes[0] || B.sizes[0] != sizes[0] || sizes[0] < 1)) return false;
  std::vector<uint64_t> start;
  if (lead) draw(state, static_cast<uint64_t>(sizes[0]), 1, start);
  draw(state, static_cast<uint64_t>(n - cols + 1), 1, start);
  draw(state, static_cast<uint64_t>(m - rows + 1), 1, start);
  const int64_t at = lead ? static_cast<int64_t>(start[0]) : 0;
  const int64_t j = static_cast<int64_t>(start[lead]), i = static_cast<int64_t>(start[lead + 1]);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) call.flat.push_back(static_cast<uint64_t>((at * m + i + r) * n + j + c));
  // A's rows and B's columns in row-major order, read by their strides (a deep layer's block reads
  // thousands of values: no division per value, the dtype's loader chosen once).
  for (Py_ssize_t t = 0; t < count; ++t) {
    const Layout& l = layouts[t];
    if (t != a && t != b) {
      gather(l, sizes, 2, call.flat, call.values);  // the bias, broadcast to the output
      continue;
    }
    const Reader read(l);
    const int64_t* strides = l.strides + lead;  // of the matrix's rows and columns
    const int64_t outer = t == a ? rows : K, inner = t == a ? K : cols;
    const int64_t from = (lead ? at * l.strides[0] : 0) + (t == a ? i * strides[0] : j * strides[1]);
    const size_t base = call.values.size();
    call.values.resize(base + static_cast<size_t>(outer * inner));
    double* out = call.values.data() + base;
    for (int64_t r = 0; r < outer; ++r)
      for (int64_t c = 0; c < inner; ++c) *out++ = read(from + r * strides[0] + c * strides[1]);
  }
  return true;
}

// The offsets (in elements) of the row-major positions of ``count`` dimensions ``order`` of a
// tensor of ``sizes`` and ``strides``, from ``first`` on, ``n`` of them: an odometer, last fastest.
void offsets(const int64_t* sizes, const int64_t* strides, const int64_t* order, int count, int64_t first, int64_t n,
             std::vector<int64_t>& out) {
  if (n <= 0) return;  // an empty dimension: nothing to read (and no size to divide by)
  int64_t at[kMaxDims];
  for (int d = count - 1; d >= 0; --d) {  // ``first`` unravelled
    at[d] = first % sizes[order[d]];
    first /= sizes[order[d]];
  }
  for (int64_t i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (int d = 0; d < count; ++d) offset += at[d] * strides[order[d]];
    out.push_back(offset);
    for (int d = count - 1; d >= 0 && ++at[d] == sizes[order[d]]; --d) at[d] = 0;
  }
}

// selfcheck.Recipe.grid of GRID_ROWS (block, kept, along, *order): ``block`` adjacent rows (their
// start drawn) of every tensor, each viewed with its dimensions in ``order``, the first ``kept``
// numbering the rows, each row as long as the tensor's own dimensions after them (a layer norm's
// saved mean: 1); a tensor of fewer dimensions than the first is read whole, in row-major order
// (its weight). The output is read at those rows (along 0: a reduction's) or along them (1: at
// the same positions of a tensor of the first's shape, in its own row-major order).
bool gather_rows(const int64_t* g, int n_fields, const Layout* layouts, Py_ssize_t count, uint64_t* state,
                 SampledPiece& call) {
  const Layout& x = layouts[0];
  const int dims = n_fields - 4;
  const int64_t block = g[1], kept = g[2], along = g[3];
  const int64_t* order = g + 4;
  if (dims != x.dims || kept < 0 || kept > dims || block < 1) return false;
  bool seen[kMaxDims] = {};
  for (int d = 0; d < dims; ++d) {
    if (order[d] < 0 || order[d] >= dims || seen[order[d]]) return false;
    seen[order[d]] = true;
  }
  for (Py_ssize_t t = 1; t < count; ++t) {  // the same rows, each as long as its own
    const Layout& l = layouts[t];
    for (int d = 0; l.dims == dims && d < dims; ++d) {
      const int64_t size = l.sizes[order[d]], own = x.sizes[order[d]];
      if (size != own && (d < kept || size != 1)) return false;
    }
  }
  int64_t rows = 1, length = 1;
  for (int d = 0; d < dims; ++d) (d < kept ? rows : length) *= x.sizes[order[d]];
  if (block > rows) return false;
  std::vector<uint64_t> start;
  draw(state, static_cast<uint64_t>(rows - block + 1), 1, start);
  const int64_t first = static_cast<int64_t>(start[0]);
  std::vector<int64_t> row_at, along_row;
  int64_t whole[kMaxDims];
  for (Py_ssize_t t = 0; t < count; ++t) {
    const Layout& l = layouts[t];
    row_at.clear();
    along_row.clear();
    if (l.dims < dims) {  // whole: one row of all its dimensions
      for (int d = 0; d < l.dims; ++d) whole[d] = d;
      int64_t numel = 1;
      for (int d = 0; d < l.dims; ++d) numel *= l.sizes[d];
      row_at.push_back(0);
      offsets(l.sizes, l.strides, whole, l.dims, 0, numel, along_row);
    } else {
      int64_t own = 1;
      for (int d = static_cast<int>(kept); d < dims; ++d) own *= l.sizes[order[d]];
      offsets(l.sizes, l.strides, order, static_cast<int>(kept), first, block, row_at);
      offsets(l.sizes, l.strides, order + kept, static_cast<int>(dims - kept), 0, own, along_row);
    }
    const int64_t item = kItemSize[l.code];
    for (int64_t r : row_at)
      for (int64_t q : along_row) call.values.push_back(element(l.data + (r + q) * item, l.code));
  }
  for (int64_t r = 0; r < block; ++r) call.rows.push_back(static_cast<uint64_t>(first + r));
  if (!along) {
    call.flat = call.rows;
    return true;
  }
  int64_t dense[kMaxDims];  // the output's row-major strides: it has the inputs' shape
  int64_t step = 1;
  for (int d = dims - 1; d >= 0; --d) {
    dense[d] = step;
    step *= x.sizes[d];
  }
  row_at.clear();
  along_row.clear();
  offsets(x.sizes, dense, order, static_cast<int>(kept), first, block, row_at);
  offsets(x.sizes, dense, order + kept, static_cast<int>(dims - kept), 0, length, along_row);
  for (int64_t r : row_at)
    for (int64_t q : along_row) call.flat.push_back(static_cast<uint64_t>(r + q));
  return true;
}

// selfcheck.Recipe.grid of GRID_CHANNELS (block, *positions): ``block`` adjacent channels
// (dimension 1, their start drawn) of every tensor of the first's shape, each channel whole in
// (batch, positions) order, and of every 1-D tensor as long as the channels, one value a channel;
// the output (of the first's shape) read in each of them at ``positions`` (row-major over the
// channel's batch and positions), its extras at them.
bool gather_channels(const int64_t* g, int n_fields, const Layout* layouts, Py_ssize_t count, uint64_t* state,
                     SampledPiece& call) {
  const Layout& x = layouts[0];
  if (n_fields < 3 || x.dims < 2) return false;
  const int64_t block = g[1], channels = x.sizes[1], *positions = g + 2, picked = n_fields - 2;
  if (block < 1 || block > channels) return false;
  for (Py_ssize_t t = 1; t < count; ++t) {
    const Layout& l = layouts[t];
    if (l.dims == 1 && l.sizes[0] == channels) continue;
    if (l.dims != x.dims) return false;
    for (int d = 0; d < x.dims; ++d)
      if (l.sizes[d] != x.sizes[d]) return false;
  }
  int64_t spatial = 1;
  for (int d = 2; d < x.dims; ++d) spatial *= x.sizes[d];
  const int64_t length = x.sizes[0] * spatial;
  for (int64_t i = 0; i < picked; ++i)
    if (positions[i] < 0 || positions[i] >= length) return false;
  std::vector<uint64_t> start;
  draw(state, static_cast<uint64_t>(channels - block + 1), 1, start);
  const int64_t first = static_cast<int64_t>(start[0]);
  int64_t order[kMaxDims];
  for (int d = 2; d < x.dims; ++d) order[d - 2] = d;
  std::vector<int64_t> at;  // a channel's positions within one image, as offsets
  for (Py_ssize_t t = 0; t < count; ++t) {
    const Layout& l = layouts[t];
    const Reader read(l);
    if (l.dims == 1 && l.dims != x.dims) {
      for (int64_t c = first; c < first + block; ++c) call.values.push_back(read(c * l.strides[0]));
      continue;
    }
    at.clear();
    offsets(l.sizes, l.strides, order, l.dims - 2, 0, spatial, at);
    const size_t base = call.values.size();
    call.values.resize(base + static_cast<size_t>(block * length));
    double* out = call.values.data() + base;
    for (int64_t c = first; c < first + block; ++c)
      for (int64_t n = 0; n < x.sizes[0]; ++n) {
        const int64_t from = c * l.strides[1] + n * l.strides[0];
        for (int64_t q : at) *out++ = read(from + q);
      }
  }
  // The output (of the first's shape, row-major) at the same positions of each channel
  for (int64_t c = first; c < first + block; ++c)
    for (int64_t i = 0; i < picked; ++i) {
      const int64_t n = positions[i] / spatial, q = positions[i] % spatial;
      call.flat.push_back(static_cast<uint64_t>((n * channels + c) * spatial + q));
    }
  for (int64_t r = 0; r < block; ++r) call.rows.push_back(static_cast<uint64_t>(first + r));
  return true;
}

// selfcheck.Recipe.grid of GRID_PLACED (dim, start, step, taken, dropped), selfcheck._placed: at
// ``k`` positions drawn below the output's ``numel`` (of ``sizes``), the gradient's element a
// select's or slice's backward places there (``taken`` positions of ``dim`` from ``start`` by
// ``step``; ``dropped``: the gradient lacks ``dim``), or 0.
bool gather_placed(const int64_t* g, int n_fields, const Layout* layouts, Py_ssize_t count, const int64_t* sizes,
                   int dims, uint64_t numel, int64_t k, uint64_t* state, SampledPiece& call) {
  if (n_fields != 6 || count != 1) return false;
  const int64_t dim = g[1], start = g[2], step = g[3], taken = g[4], dropped = g[5];
  const Layout& grad = layouts[0];
  if (dim < 0 || dim >= dims || step < 1 || grad.dims != dims - (dropped ? 1 : 0)) return false;
  for (int d = 0, s = 0; d < dims; ++d) {  // the gradient's own dimensions, in the output's order
    if (d == dim && dropped) continue;
    if (grad.sizes[s++] != (d == dim ? taken : sizes[d])) return false;
  }
  draw(state, numel, k, call.flat);
  const int64_t item = kItemSize[grad.code];
  for (uint64_t position : call.flat) {
    int64_t at[kMaxDims];
    for (int d = dims - 1; d >= 0; --d) {
      at[d] = static_cast<int64_t>(position % static_cast<uint64_t>(sizes[d]));
      position /= static_cast<uint64_t>(sizes[d]);
    }
    const int64_t from = at[dim] - start;
    if (from < 0 || from % step != 0 || from / step >= taken) {
      call.values.push_back(0.0);
      continue;
    }
    int64_t offset = 0;
    for (int d = 0, s = 0; d < dims; ++d) {
      if (d == dim && dropped) continue;
      offset += (d == dim ? from / step : at[d]) * grad.strides[s++];
    }
    call.values.push_back(element(grad.data + offset * item, grad.code));
  }
  return true;
}

// selfcheck.Recipe.grid of GRID_PICKED (role, ignore_index, per_row), SelfChecker._picked: an
// ``nll_loss_forward``'s every row (role kNllLoss: input, target[, weight]) or its backward's ``k``
// rows drawn below their count (kNllLossBackward: output gradient, input, target[, weight], total
// weight), each row's class read from its target (0 and a class weight of 0 where it is
// ``ignore_index``); false where a target lies outside the classes.
bool gather_picked(const int64_t* g, int n_fields, const Layout* layouts, Py_ssize_t count, int64_t k,
                   uint64_t* state, SampledPiece& call) {
  if (n_fields != 4 || (g[1] != kNllLoss && g[1] != kNllLossBackward)) return false;
  const bool backward = g[1] == kNllLossBackward;
  const int64_t ignore = g[2], per_row = g[3];
  const Py_ssize_t at = backward ? 1 : 0, plain = at + 2 + (backward ? 1 : 0);
  if (count != plain && count != plain + 1) return false;
  const Layout &x = layouts[at], &target = layouts[at + 1];
  const Layout* weight = count == plain + 1 ? &layouts[at + 2] : nullptr;
  if (x.dims < 1 || x.dims > 2 || target.dims != x.dims - 1 || target.code < 4 || target.code > 8) return false;
  const int64_t rows = x.dims == 2 ? x.sizes[0] : 1, classes = x.sizes[x.dims - 1];
  if (rows < 1 || classes < 1 || (x.dims == 2 && target.sizes[0] != rows)) return false;
  if (weight != nullptr && (weight->dims != 1 || weight->sizes[0] != classes)) return false;
  std::vector<uint64_t> picked;
  if (backward) {
    draw(state, static_cast<uint64_t>(rows), k, picked);
  } else {
    for (int64_t r = 0; r < rows; ++r) picked.push_back(static_cast<uint64_t>(r));
  }
  const Reader read_target(target), read_x(x), read_weight(weight != nullptr ? *weight : target);
  const int64_t by_target = target.dims ? target.strides[0] : 0, by_row = x.dims == 2 ? x.strides[0] : 0;
  std::vector<int64_t> classes_at;  // each picked row's class (0 where ignored)
  std::vector<double> weights, inputs;
  for (uint64_t r : picked) {
    const auto t = static_cast<int64_t>(read_target(static_cast<int64_t>(r) * by_target));
    const bool ignored = t == ignore;
    if (!ignored && (t < 0 || t >= classes)) return false;
    classes_at.push_back(ignored ? 0 : t);
    weights.push_back(ignored ? 0.0 : weight != nullptr ? read_weight(t * weight->strides[0]) : 1.0);
    if (!backward)
      inputs.push_back(ignored ? 0.0 : read_x(static_cast<int64_t>(r) * by_row + t * x.strides[x.dims - 1]));
  }
  if (backward) {
    const Layout &grad = layouts[0], &total = layouts[count - 1];
    if (total.dims != 0 || grad.dims > 1 || (grad.dims == 1 && grad.sizes[0] != rows)) return false;
    const Reader read_grad(grad);
    for (uint64_t r : picked)
      call.values.push_back(read_grad(grad.dims ? static_cast<int64_t>(r) * grad.strides[0] : 0));
    call.values.insert(call.values.end(), weights.begin(), weights.end());
    call.values.push_back(Reader(total)(0));
    for (size_t i = 0; i < picked.size(); ++i)
      call.flat.push_back(picked[i] * static_cast<uint64_t>(classes) + static_cast<uint64_t>(classes_at[i]));
    return true;
  }
  call.values.insert(call.values.end(), inputs.begin(), inputs.end());
  call.values.insert(call.values.end(), weights.begin(), weights.end());
  if (per_row) {
    call.flat = picked;
  } else {  // the loss, and its total weight (an extra) at row 0
    call.flat.push_back(0);
    call.rows.push_back(0);
  }
  return true;
}

// selfcheck.Recipe.grid of GRID_ATTENTION (block, causal, masked), SelfChecker._attended: fused
// attention's ``block`` adjacent query rows of one batch and head (the pair drawn, then the first
// row), with that head's keys and values whole, the mask's rows there (broadcast to (B, H, L, S))
// and the rows' positions; the output (B, H, L, Ev) at those rows.
bool gather_attention(const int64_t* g, int n_fields, const Layout* layouts, Py_ssize_t count, uint64_t* state,
                      SampledPiece& call) {
  if (n_fields != 4) return false;
  const int64_t block = g[1], masked = g[3];
  if (count != 3 + (masked ? 1 : 0)) return false;
  const Layout &q = layouts[0], &k = layouts[1], &v = layouts[2];
  if (q.dims != 4 || k.dims != 4 || v.dims != 4) return false;
  const int64_t batch = q.sizes[0], heads = q.sizes[1], length = q.sizes[2], width = q.sizes[3];
  const int64_t source = k.sizes[2], out_width = v.sizes[3];
  if (k.sizes[0] != batch || k.sizes[1] != heads || k.sizes[3] != width || v.sizes[0] != batch ||
      v.sizes[1] != heads || v.sizes[2] != source || block < 1 || block > length || batch < 1 || heads < 1)
    return false;
  const int64_t full[4] = {batch, heads, length, source};
  int64_t mask_strides[4] = {0, 0, 0, 0};
  if (masked) {  // broadcast to (B, H, L, S): leading and size-1 dimensions read with stride 0
    const Layout& m = layouts[3];
    const int lead = 4 - m.dims;
    if (lead < 0) return false;
    for (int d = 0; d < m.dims; ++d) {
      if (m.sizes[d] != 1 && m.sizes[d] != full[lead + d]) return false;
      mask_strides[lead + d] = m.sizes[d] == 1 ? 0 : m.strides[d];
    }
  }
  std::vector<uint64_t> drawn;
  draw(state, static_cast<uint64_t>(batch * heads), 1, drawn);
  draw(state, static_cast<uint64_t>(length - block + 1), 1, drawn);
  const int64_t pair = static_cast<int64_t>(drawn[0]), start = static_cast<int64_t>(drawn[1]);
  const int64_t b = pair / heads, h = pair % heads;
  // Rows ``first`` on (``n`` of them) of a (B, H, rows, columns) tensor's head (b, h), row-major
  auto rows_of = [&](const Layout& t, const int64_t* strides, int64_t first, int64_t n, int64_t columns) {
    const Reader read(t);
    const int64_t head = b * strides[0] + h * strides[1];
    const size_t base = call.values.size();
    call.values.resize(base + static_cast<size_t>(n * columns));
    double* out = call.values.data() + base;
    for (int64_t r = first; r < first + n; ++r)
      for (int64_t c = 0; c < columns; ++c) *out++ = read(head + r * strides[2] + c * strides[3]);
  };
  rows_of(q, q.strides, start, block, width);
  rows_of(k, k.strides, 0, source, width);
  rows_of(v, v.strides, 0, source, out_width);
  if (masked) rows_of(layouts[3], mask_strides, start, block, source);
  for (int64_t r = start; r < start + block; ++r) {
    call.values.push_back(static_cast<double>(r));
    for (int64_t c = 0; c < out_width; ++c)
      call.flat.push_back(static_cast<uint64_t>((pair * length + r) * out_width + c));
  }
  return true;
}

// A row-major counter ``at`` over ``sizes`` (``n`` of them) advanced: false once it wraps to 0.
bool advance(int64_t* at, const int64_t* sizes, int64_t n) {
  for (int64_t j = n - 1; j >= 0; --j) {
    if (++at[j] < sizes[j]) return true;
    at[j] = 0;
  }
  return false;
}

// selfcheck.Recipe.grid of GRID_CONV (role, dims, groups, *stride, *padding, *dilation),
// selfcheck._conv_terms: at ``k`` positions drawn below the checked output's ``numel``, the two
// factors of each term its element sums (both 0 where a tap reads nothing): a convolution's
// output from input taps and weights (and its bias), its input gradient from output gradients
// and weights, its weight gradient from output gradients and inputs; each in its tensor's slot.
// Per sampled element, the offsets of its taps (or output positions) are worked out once and
// read for every channel (or image).
bool gather_conv(const int64_t* g, int n_fields, const Layout* layouts, Py_ssize_t count, uint64_t numel, int64_t k,
                 uint64_t* state, SampledPiece& call) {
  if (n_fields < 4) return false;
  const int64_t role = g[1], d = g[2], groups = g[3];
  if (d < 1 || d > kMaxDims - 2 || n_fields != 4 + 3 * d || groups < 1) return false;
  const int64_t *stride = g + 4, *padding = g + 4 + d, *dilation = g + 4 + 2 * d;
  const Layout *x = nullptr, *w = nullptr, *grad = nullptr, *bias = nullptr;
  if (role == kConvOutput && (count == 2 || count == 3)) {
    x = &layouts[0], w = &layouts[1], bias = count == 3 ? &layouts[2] : nullptr;
  } else if ((role == kConvInputGradient || role == kConvWeightGradient) && count == 3) {
    grad = &layouts[0], x = &layouts[1], w = &layouts[2];
  } else {
    return false;
  }
  if (x->dims != d + 2 || w->dims != d + 2) return false;
  const int64_t batch = x->sizes[0], channels = x->sizes[1], out_channels = w->sizes[0], group_in = w->sizes[1];
  if (group_in * groups != channels || out_channels % groups) return false;
  const int64_t group_out = out_channels / groups;
  const int64_t *size = x->sizes + 2, *kernel = w->sizes + 2;
  int64_t out[kMaxDims], out_sizes[kMaxDims] = {batch, out_channels};
  for (int64_t j = 0; j < d; ++j) {
    const int64_t reach = size[j] + 2 * padding[j] - dilation[j] * (kernel[j] - 1) - 1;
    if (stride[j] < 1 || dilation[j] < 1 || kernel[j] < 1 || reach < 0) return false;
    out[j] = out_sizes[2 + j] = reach / stride[j] + 1;
  }
  if (grad != nullptr) {
    if (grad->dims != d + 2) return false;
    for (int64_t j = 0; j < d + 2; ++j)
      if (grad->sizes[j] != out_sizes[j]) return false;
  }
  if (bias != nullptr && (bias->dims != 1 || bias->sizes[0] != out_channels)) return false;
  // The checked output: its sizes, from which the sampled positions are unravelled
  const int64_t* checked = role == kConvOutput ? out_sizes : role == kConvInputGradient ? x->sizes : w->sizes;
  uint64_t total = 1;
  for (int64_t j = 0; j < d + 2; ++j) total *= static_cast<uint64_t>(checked[j]);
  if (total != numel) return false;
  draw(state, numel, k, call.flat);
  // Positions a sampled element reads, each its spatial offset into the two tensors, or -1 (none):
  // the kernel's taps (output and input gradient) or the output's positions (weight gradient).
  int64_t taps = 1, positions = 1;
  for (int64_t j = 0; j < d; ++j) taps *= kernel[j], positions *= out[j];
  const int64_t spots = role == kConvWeightGradient ? positions : taps;
  const int64_t width = spots * (role == kConvOutput ? group_in : role == kConvInputGradient ? group_out : batch);
  std::vector<int64_t> first_at(static_cast<size_t>(spots)), second_at(static_cast<size_t>(spots));
  const Layout& first = role == kConvOutput ? *x : *grad;  // the tensors of the two factors
  const Layout& second = role == kConvWeightGradient ? *x : *w;
  const Reader read_first(first), read_second(second);
  const size_t base = call.values.size(), n = call.flat.size() * static_cast<size_t>(width);
  call.values.resize(base + 2 * n);
  double* left = call.values.data() + base;
  double* right = left + n;
  std::vector<double> biases;
  int64_t at[kMaxDims], t[kMaxDims];
  for (uint64_t position : call.flat) {
    for (int64_t j = d + 1; j >= 0; --j) {
      at[j] = static_cast<int64_t>(position % static_cast<uint64_t>(checked[j]));
      position /= static_cast<uint64_t>(checked[j]);
    }
    std::fill(t, t + d, 0);
    for (int64_t spot = 0; spot < spots; ++spot, advance(t, role == kConvWeightGradient ? out : kernel, d)) {
      int64_t a = 0, b = 0;  // offsets into the first and second factor's tensors
      bool valid = true;
      for (int64_t j = 0; j < d && valid; ++j) {
        if (role == kConvOutput) {  // at: (n, co, *o); x at o * stride - padding + t * dilation
          const int64_t p = at[2 + j] * stride[j] - padding[j] + t[j] * dilation[j];
          valid = p >= 0 && p < size[j];
          a += p * first.strides[2 + j], b += t[j] * second.strides[2 + j];
        } else if (role == kConvInputGradient) {  // at: (n, ci, *p); grad at (p + padding - t * dilation) / stride
          const int64_t r = at[2 + j] + padding[j] - t[j] * dilation[j];
          valid = r >= 0 && r % stride[j] == 0 && r / stride[j] < out[j];
          a += r / stride[j] * first.strides[2 + j], b += t[j] * second.strides[2 + j];
        } else {  // at: (co, cl, *tap), t: an output position o; x at o * stride - padding + tap * dilation
          const int64_t p = t[j] * stride[j] - padding[j] + at[2 + j] * dilation[j];
          valid = p >= 0 && p < size[j];
          a += t[j] * first.strides[2 + j], b += p * second.strides[2 + j];
        }
      }
      first_at[static_cast<size_t>(spot)] = valid ? a : -1;
      second_at[static_cast<size_t>(spot)] = valid ? b : -1;
    }
    // Per channel (or image), the offsets of its slice of each tensor; the spots inside it
    for (int64_t c = 0, outer = width / spots; c < outer; ++c) {
      int64_t a, b;
      if (role == kConvOutput) {
        a = at[0] * first.strides[0] + (at[1] / group_out * group_in + c) * first.strides[1];
        b = at[1] * second.strides[0] + c * second.strides[1];
      } else if (role == kConvInputGradient) {
        const int64_t co = at[1] / group_in * group_out + c;
        a = at[0] * first.strides[0] + co * first.strides[1];
        b = co * second.strides[0] + at[1] % group_in * second.strides[1];
      } else {
        a = c * first.strides[0] + at[0] * first.strides[1];
        b = c * second.strides[0] + (at[0] / group_out * group_in + at[1]) * second.strides[1];
      }
      for (int64_t spot = 0; spot < spots; ++spot) {
        const int64_t at_a = first_at[static_cast<size_t>(spot)];
        *left++ = at_a < 0 ? 0.0 : read_first(a + at_a);
        *right++ = at_a < 0 ? 0.0 : read_second(b + second_at[static_cast<size_t>(spot)]);
      }
    }
    if (bias != nullptr) biases.push_back(Reader(*bias)(at[1] * bias->strides[0]));
  }
  call.values.insert(call.values.end(), biases.begin(), biases.end());
  return true;
}

// A Recipe.grid's blocks gathered: false where the recipe does not fit the tensors.
bool gather_grid(PyObject* grid, const Layout* layouts, Py_ssize_t count, const int64_t* sizes, int dims,
                 uint64_t numel, int64_t k, uint64_t* state, SampledPiece& call) {
  int64_t g[kGridFields];
  int n_fields = 0;
  if (!ints_of(grid, g, &n_fields, kGridFields) || n_fields < 1) return false;
  if (g[0] == kGridMatmul) return gather_matmul(g, n_fields, layouts, count, sizes, dims, state, call);
  if (g[0] == kGridPlaced) return gather_placed(g, n_fields, layouts, count, sizes, dims, numel, k, state, call);
  if (g[0] == kGridConv) return gather_conv(g, n_fields, layouts, count, numel, k, state, call);
  if (g[0] == kGridChannels) return gather_channels(g, n_fields, layouts, count, state, call);
  if (g[0] == kGridPicked) return gather_picked(g, n_fields, layouts, count, k, state, call);
  if (g[0] == kGridAttention) return gather_attention(g, n_fields, layouts, count, state, call);
  return g[0] == kGridRows && gather_rows(g, n_fields, layouts, count, state, call);
}

// One recipe of a call gathered (selfcheck.SelfChecker.gather_sampled): 1, 0 where it does not
// fit the tensors, -1 with an exception set.
int gather_piece(PyObject* recipe, const Layout* layouts, Py_ssize_t count, uint64_t* state, SampledPiece& call) {
  if (!PyTuple_Check(recipe) || PyTuple_GET_SIZE(recipe) < kRecipeFields) {
    PyErr_SetString(PyExc_TypeError, "a self-check recipe must be a selfcheck.Recipe");
    return -1;
  }
  int64_t sizes[kMaxDims];
  int dims = 0;
  if (!ints_of(PyTuple_GET_ITEM(recipe, kSizes), sizes, &dims)) return 0;
  for (Py_ssize_t i = 0; i < count; ++i)
    if (layouts[i].dims > dims) return 0;
  long long numel = PyLong_AsLongLong(PyTuple_GET_ITEM(recipe, kNumel));
  long long k = PyLong_AsLongLong(PyTuple_GET_ITEM(recipe, kSample));
  if (PyErr_Occurred()) return -1;
  call.flat.clear();
  call.values.clear();
  call.rows.clear();
  PyObject* grid = PyTuple_GET_ITEM(recipe, kGrid);
  if (grid == Py_None) {
    draw(state, static_cast<uint64_t>(numel), k, call.flat);
    call.values.reserve(static_cast<size_t>((count + 1) * k));
    for (Py_ssize_t i = 0; i < count; ++i) gather(layouts[i], sizes, dims, call.flat, call.values);
  } else if (!gather_grid(grid, layouts, count, sizes, dims, static_cast<uint64_t>(numel), k, state, call)) {
    return PyErr_Occurred() ? -1 : 0;
  }
  return 1;
}

}  // namespace

int sample_before(PyObject* md, PyObject* kind, PyObject* func, PyObject* key, PyObject* tensors, SampledCall& call) {
  if (!PyTuple_Check(g.recipe_kinds)) return 0;
  bool has_recipes = false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g.recipe_kinds); ++i) has_recipes |= PyTuple_GET_ITEM(g.recipe_kinds, i) == kind;
  if (!has_recipes) return 0;
  PyObject* checker = item(md, s._checker);
  Ref cd(checker != nullptr ? dict_of(checker) : nullptr);
  if (!cd) return -1;
  int full = truth(cd.p, s.full);
  if (full != 0) return full < 0 ? -1 : 0;
  // SelfChecker.signature: (func, key, dtype, shape, dtype, shape, ...), a pointwise op's
  // (RECIPE_KINDS[0]) floats left open in the key (trace.args.scan_value writes one (float, value))
  // and gathered with the call.
  std::vector<double> floats;
  Ref open_key(Py_NewRef(key));
  if (PyTuple_Check(key) && PyTuple_GET_SIZE(g.recipe_kinds) > 0 && PyTuple_GET_ITEM(g.recipe_kinds, 0) == kind) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(key); ++i) {
      PyObject* part = PyTuple_GET_ITEM(key, i);
      if (!PyTuple_CheckExact(part) || PyTuple_GET_SIZE(part) != 2 ||
          PyTuple_GET_ITEM(part, 0) != reinterpret_cast<PyObject*>(&PyFloat_Type))
        continue;
      if (floats.empty()) {  // a new tuple: the key is the argument memo's too (a slice may be the same object)
        open_key.reset(PyTuple_New(PyTuple_GET_SIZE(key)));
        if (!open_key) return -1;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(key); ++j)
          PyTuple_SET_ITEM(open_key.p, j, Py_NewRef(PyTuple_GET_ITEM(key, j)));
      }
      floats.push_back(PyFloat_AsDouble(PyTuple_GET_ITEM(part, 1)));
      if (PyErr_Occurred()) return -1;
      PyObject* old = PyTuple_GET_ITEM(open_key.p, i);
      PyTuple_SET_ITEM(open_key.p, i, Py_NewRef(reinterpret_cast<PyObject*>(&PyFloat_Type)));
      Py_DECREF(old);
    }
  }
  Py_ssize_t count = PyList_GET_SIZE(tensors);
  Ref signature(PyTuple_New(2 + 2 * count));
  if (!signature) return -1;
  PyTuple_SET_ITEM(signature.p, 0, Py_NewRef(func));
  PyTuple_SET_ITEM(signature.p, 1, open_key.release());
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* t = PyList_GET_ITEM(tensors, i);
    PyObject* dtype = PyObject_GetAttr(t, s.dtype);
    PyObject* shape = dtype != nullptr ? PyObject_GetAttr(t, s.shape) : nullptr;
    if (shape == nullptr) {
      Py_XDECREF(dtype);
      return -1;
    }
    PyTuple_SET_ITEM(signature.p, 2 + 2 * i, dtype);
    PyTuple_SET_ITEM(signature.p, 3 + 2 * i, shape);
  }
  PyObject* recipes = item(cd.p, s.recipes);
  if (recipes == nullptr) return -1;
  PyObject* recipe = PyDict_GetItemWithError(recipes, signature.p);
  if (recipe == nullptr) {
    if (PyErr_Occurred()) {  // symbolic sizes: unhashable, checked the usual way
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) return -1;
      PyErr_Clear();
      return 0;
    }
    call.signature.reset(signature.release());
    call.learn = true;
    return 0;
  }
  if (recipe == Py_None) return 0;
  if (!PyTuple_Check(recipe)) {  // selfcheck.SEEN_ONCE or SEEN_BEFORE: made at this call's end
    call.signature.reset(signature.release());
    call.learn = true;
    return 0;
  }
  if (!PyTuple_Check(recipe) || PyTuple_GET_SIZE(recipe) < kRecipeFields || !PyTuple_Check(PyTuple_GET_ITEM(recipe, kMore))) {
    PyErr_SetString(PyExc_TypeError, "a self-check recipe must be a selfcheck.Recipe");
    return -1;
  }
  Layout layouts[8];
  if (count > 8) return 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* t = PyList_GET_ITEM(tensors, i);
    PyObject* dtype = PyTuple_GET_ITEM(signature.p, 2 + 2 * i);
    PyObject* shape = PyTuple_GET_ITEM(signature.p, 3 + 2 * i);
    if (!readable(t, dtype, shape, layouts[i])) return 0;
  }
  // Drawn only once every tensor is readable, as the reference does; kept only once every
  // recipe of the call has gathered (SelfChecker.gather_call).
  PyObject* stream = item(cd.p, s._stream);
  if (stream == nullptr) return -1;
  uint64_t state = PyLong_AsUnsignedLongLong(stream);
  if (PyErr_Occurred()) return -1;
  PyObject* more = PyTuple_GET_ITEM(recipe, kMore);
  call.pieces.resize(static_cast<size_t>(1 + PyTuple_GET_SIZE(more)));
  for (size_t p = 0; p < call.pieces.size(); ++p) {
    int got = gather_piece(p ? PyTuple_GET_ITEM(more, p - 1) : recipe, layouts, count, &state, call.pieces[p]);
    if (got <= 0) return got;
  }
  Ref next(PyLong_FromUnsignedLongLong(state));
  if (!next || PyDict_SetItem(cd.p, s._stream, next.p) < 0) return -1;
  std::vector<double>& first = call.pieces[0].values;
  first.insert(first.end(), floats.begin(), floats.end());
  call.recipe.reset(Py_NewRef(recipe));
  return 1;
}

namespace {

// An output as a recipe expects it (its shape ``sizes``, its dtype ``code``): 1 with its layout,
// 0 where it is not (the call is left unchecked), -1 with an exception set.
int expected_output(PyObject* t, PyObject* sizes, PyObject* code, Layout& layout) {
  if (t == nullptr || !PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(g.tensor_type))) return 0;
  Ref dtype(PyObject_GetAttr(t, s.dtype));
  Ref shape(dtype ? PyObject_GetAttr(t, s.shape) : nullptr);
  if (!shape) return -1;
  if (!readable(t, dtype.p, shape.p, layout)) return 0;
  int same = PyObject_RichCompareBool(shape.p, sizes, Py_EQ);
  long wanted = PyLong_AsLong(code);
  if (same < 0 || (wanted == -1 && PyErr_Occurred())) return -1;
  return same && layout.code == wanted;  // the recipe's code: a floating one
}

}  // namespace

namespace {

// One recipe's gathered call queued with its calls (SelfChecker.finish_sampled) and its check
// rows recorded (CaptureMode._sample_after); false with an exception set.
bool queue_piece(PyObject* md, PyObject* recipe, SampledPiece& call, PyObject* op_id, PyObject* out) {
  // SelfChecker.finish_sampled: an output the recipe does not expect is left unchecked (every
  // output it reads, or none). It is read at the same row-major positions, in its own shape; its
  // extras (a layer norm's mean and 1/std) at the block's rows.
  Py_ssize_t out_index = PyLong_AsSsize_t(PyTuple_GET_ITEM(recipe, kOutIndex));
  if (out_index == -1 && PyErr_Occurred()) return false;
  PyObject* extras = PyTuple_GET_ITEM(recipe, kExtras);
  if (!PyTuple_Check(extras)) {
    PyErr_SetString(PyExc_TypeError, "a recipe's extras must be a tuple");
    return false;
  }
  const Py_ssize_t n_extras = PyTuple_GET_SIZE(extras);
  const bool several = PyTuple_Check(out) || PyList_Check(out);
  const Py_ssize_t n_outputs = several ? PySequence_Fast_GET_SIZE(out) : 0;
  PyObject* const* outputs = several ? PySequence_Fast_ITEMS(out) : nullptr;
  if (out_index >= 0) out = out_index < n_outputs ? outputs[out_index] : nullptr;  // one of the op's outputs
  // Its check rows name each output by its place among the op's tensors (None ones are not recorded)
  auto place = [&](Py_ssize_t index) {
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < index && i < n_outputs; ++i) at += outputs[i] != Py_None;
    return PyLong_FromSsize_t(at);
  };
  Layout layout;
  int ok = expected_output(out, PyTuple_GET_ITEM(recipe, kOutSizes), PyTuple_GET_ITEM(recipe, kOutCode), layout);
  if (ok <= 0) return ok == 0;
  std::vector<Layout> more(static_cast<size_t>(n_extras));
  for (Py_ssize_t e = 0; e < n_extras; ++e) {  // (index, sizes, code, limit, rows)
    PyObject* extra = PyTuple_GET_ITEM(extras, e);
    if (!PyTuple_Check(extra) || PyTuple_GET_SIZE(extra) != 5) {
      PyErr_SetString(PyExc_TypeError, "a recipe's extra must be (index, sizes, code, limit, rows)");
      return false;
    }
    Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(extra, 0));
    if (index == -1 && PyErr_Occurred()) return false;
    PyObject* t = index >= 0 && index < n_outputs ? outputs[index] : nullptr;
    ok = expected_output(t, PyTuple_GET_ITEM(extra, 1), PyTuple_GET_ITEM(extra, 2), more[e]);
    if (ok <= 0) return ok == 0;
  }
  gather(layout, layout.sizes, layout.dims, call.flat, call.values);
  if (n_extras) {  // at the block's rows
    long long k = PyLong_AsLongLong(PyTuple_GET_ITEM(recipe, kSample));
    long long rows_n = PyLong_AsLongLong(PyTuple_GET_ITEM(recipe, kSampled));
    if (PyErr_Occurred()) return false;
    if (rows_n <= 0 || k % rows_n != 0 || static_cast<size_t>(k) != call.flat.size()) {
      PyErr_SetString(PyExc_ValueError, "a recipe with extras reads whole rows");
      return false;
    }
    if (call.rows.size() != static_cast<size_t>(rows_n)) {
      PyErr_SetString(PyExc_ValueError, "a recipe with extras reads a block of rows");
      return false;
    }
    for (const Layout& l : more) gather(l, l.sizes, l.dims, call.rows, call.values);
  }
  PyObject* checker = item(md, s._checker);
  Ref cd(checker != nullptr ? dict_of(checker) : nullptr);
  if (!cd) return false;
  PyObject* residuals = item(cd.p, s._residuals);
  PyObject* coarse = item(cd.p, s._coarse);
  PyObject* tickets = PyTuple_GET_ITEM(recipe, kTickets);
  if (residuals == nullptr || coarse == nullptr || !PyList_Check(residuals) || !PyList_Check(coarse) ||
      !PyList_Check(tickets)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "the checker's queues must be lists");
    return false;
  }
  const Py_ssize_t first = PyList_GET_SIZE(residuals);
  Ref ticket(PyLong_FromSsize_t(first));
  Ref nan(PyFloat_FromDouble(NAN));
  if (!ticket || !nan ||
      !buffer_extend_doubles(PyTuple_GET_ITEM(recipe, kValues), call.values.data(),
                             static_cast<Py_ssize_t>(call.values.size())) ||
      PyList_Append(tickets, ticket.p) < 0)
    return false;
  for (Py_ssize_t e = 0; e <= n_extras; ++e)  // a ticket an output: the call's first, then its extras'
    if (PyList_Append(residuals, nan.p) < 0 || PyList_Append(coarse, nan.p) < 0) return false;
  Ref queued(bump(cd.p, s._queued));
  if (!queued) return false;
  // CaptureMode._sample_after: the check rows, filled in at take through their tickets.
  PyObject* deferred = item(md, s._deferred_rows);
  PyObject* rows = item(md, s.check_rows);
  if (deferred == nullptr || rows == nullptr || !PyList_Check(deferred)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "_deferred_rows must be a list");
    return false;
  }
  Ref none_yet(PyLong_FromLong(-1));
  if (!none_yet) return false;
  while (PyList_GET_SIZE(deferred) < first)
    if (PyList_Append(deferred, none_yet.p) < 0) return false;
  for (Py_ssize_t e = 0; e <= n_extras; ++e) {
    PyObject* extra = e ? PyTuple_GET_ITEM(extras, e - 1) : nullptr;
    Py_ssize_t index = extra ? PyLong_AsSsize_t(PyTuple_GET_ITEM(extra, 0)) : out_index;
    if (index == -1 && PyErr_Occurred()) return false;
    Ref place_id(place(index));
    if (!place_id) return false;
    PyObject* fields[7] = {op_id,
                           place_id.p,
                           nan.p,
                           extra ? PyTuple_GET_ITEM(extra, 3) : PyTuple_GET_ITEM(recipe, kLimit),
                           nan.p,
                           extra ? PyTuple_GET_ITEM(extra, 4) : PyTuple_GET_ITEM(recipe, kSampled),
                           PyTuple_GET_ITEM(recipe, kHow)};
    Py_ssize_t count = 0;
    if (!append_row(rows, fields, 7, &count)) return false;
    Ref row(PyLong_FromSsize_t(count - 1));
    if (!row || PyList_Append(deferred, row.p) < 0) return false;
  }
  return true;
}

}  // namespace

bool sample_after(PyObject* mode, PyObject* md, SampledCall& call, PyObject* op_id, PyObject* out) {
  PyObject* more = PyTuple_GET_ITEM(call.recipe.p, kMore);
  for (size_t p = 0; p < call.pieces.size(); ++p)
    if (!queue_piece(md, p ? PyTuple_GET_ITEM(more, p - 1) : call.recipe.p, call.pieces[p], op_id, out)) return false;
  PyObject* checker = item(md, s._checker);
  Ref cd(checker != nullptr ? dict_of(checker) : nullptr);
  PyObject* queued = cd ? item(cd.p, s._queued) : nullptr;
  PyObject* most = cd ? item(cd.p, s._queue_max) : nullptr;
  if (queued == nullptr || most == nullptr) return false;
  int full = PyObject_RichCompareBool(queued, most, Py_GE);
  if (full < 0) return false;
  if (full) {
    Ref r(call_method(mode, s._resolve_checks, {}));
    if (!r) return false;
  }
  return true;
}

}  // namespace tracecmp::record
