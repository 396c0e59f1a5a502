// tracecmp._cstats: the fused per-tensor statistics pass, as one CPython function.
//
// Build choice: this is a plain CPython extension that does NOT include torch headers. Python
// hands over the tensor's data pointer (storage offset included), shape, strides, a dtype code
// and numel; the C++ side only reads memory. A torch C++ extension would be tied to the exact
// torch ABI it was compiled against and break on a torch upgrade or a vendor build (torch_npu);
// this module depends on nothing but the CPython ABI, so one build keeps working across torch
// versions. The kernel itself lives in stats_kernel.hpp.
//
// Python API:  stats(data_ptr, shape, strides, dtype_code, numel, num_threads)
//              -> (min, max, mean, norm, nan_count, inf_count, checksum)
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <type_traits>
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#include <pthread.h>
#endif

#include "stats_kernel.hpp"
#if defined(__x86_64__) && defined(__GNUC__)
#include "stats_x86.hpp"
#endif

namespace tracecmp {
namespace {

// Tensors from this many elements up are split over torch's intra-op threads (~12 us of work on
// one thread; the pool's threads are already running, so handing them work costs ~1-2 us).
constexpr int64_t kParallelMin = int64_t{1} << 16;
// Each thread should get at least this much work.
constexpr int64_t kPerThreadMin = int64_t{1} << 15;
// Blocks a thread takes at a time, at most (64K elements, ~10 us of work); smaller tensors are
// cut finer so that every thread gets several grabs and a late one just does fewer.
constexpr int64_t kGrabMax = 32;
// A bound on helper threads; memory bandwidth saturates long before.
constexpr int64_t kMaxThreads = 64;
// Releasing the GIL costs more than it gives for small tensors.
constexpr int64_t kReleaseGilMin = int64_t{1} << 15;

// Copies of the kernel per instruction set. x86-64 builds carry AVX2+FMA and AVX-512 copies
// besides the SSE2 baseline, compiled with function target attributes and picked at import, so
// one portable binary runs at full speed. All copies do the same arithmetic lane for lane, so
// their results are identical (the tests compare them bit for bit). Only bfloat16 has an
// AVX-512 loop: for the other dtypes it measured no faster than AVX2 on Zen 4 (whose 512-bit
// operations take two 256-bit pipe slots), so the AVX-512 level runs their AVX2 copy.
enum Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"baseline", "avx2", "avx512"};
int g_isa = kBaseline;  // set once at import, before any call

template <class T>
void run_portable(const void* data, const Cursor* cur, int64_t numel, int64_t b0, int64_t b1,
                  Partial<T>& part, Pairwise& pw, double* sums) {
  run_blocks<T, GenericLoop<16>, 16>(data, cur, numel, b0, b1, part, pw, sums);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <class T>
__attribute__((target("avx2,fma"))) void run_avx2(const void* data, const Cursor* cur,
                                                  int64_t numel, int64_t b0, int64_t b1,
                                                  Partial<T>& part, Pairwise& pw, double* sums) {
  using Loop = std::conditional_t<std::is_same_v<T, BF16>, Avx2Loop, GenericLoop<32>>;
  run_blocks<T, Loop, 32>(data, cur, numel, b0, b1, part, pw, sums);
}

__attribute__((target("avx512f,avx512vl,avx2,fma"))) void run_avx512(
    const void* data, const Cursor* cur, int64_t numel, int64_t b0, int64_t b1,
    Partial<BF16>& part, Pairwise& pw, double* sums) {
  run_blocks<BF16, Avx512Loop, 32>(data, cur, numel, b0, b1, part, pw, sums);
}

// The best level this CPU (and OS) supports.
int cpu_isa() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return kBaseline;
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512vl")) return kAvx2;
  return kAvx512;
}

template <class T>
void run_range(const void* data, const Cursor* cur, int64_t numel, int64_t b0, int64_t b1,
               Partial<T>& part, Pairwise& pw, double* sums) {
  if constexpr (std::is_same_v<T, BF16>) {
    if (g_isa >= kAvx512) return run_avx512(data, cur, numel, b0, b1, part, pw, sums);
  }
  if (g_isa >= kAvx2) return run_avx2<T>(data, cur, numel, b0, b1, part, pw, sums);
  run_portable<T>(data, cur, numel, b0, b1, part, pw, sums);
}
#else
int cpu_isa() { return kBaseline; }

template <class T>
void run_range(const void* data, const Cursor* cur, int64_t numel, int64_t b0, int64_t b1,
               Partial<T>& part, Pairwise& pw, double* sums) {
  run_portable<T>(data, cur, numel, b0, b1, part, pw, sums);
}
#endif

// The best level the CPU has, capped by TRACECMP_CSTATS_ISA (a level name; the tests force each
// one). -1 for a name that is not a level.
int choose_isa() {
  const int best = cpu_isa();
  const char* cap = std::getenv("TRACECMP_CSTATS_ISA");
  if (cap == nullptr || *cap == '\0') return best;
  for (int level = kBaseline; level <= kAvx512; ++level)
    if (std::strcmp(cap, kIsaNames[level]) == 0) return std::min(level, best);
  return -1;
}

struct Result {
  double lo, hi, mean, norm;
  int64_t nan, inf;
  uint64_t checksum;
};

// ---- threads -----------------------------------------------------------------------------------
//
// A parallel pass splits the tensor's blocks, not its arithmetic: every block is summed alone in
// its fixed lane order, its two sums are stored in the block's own slot and the slots are added
// in block order by the same pairwise sum the one-thread pass uses; min, max, the counts and the
// checksum are exact and combined per grab (a run of blocks) in grab order. So which thread took
// which grab, how big the grabs were and how many threads ran change no bit of the result: a
// trace does not depend on the cores that recorded it (test_stats.py holds 1, 2, 3 and 8 threads
// equal, through both kinds of threads below).
//
// Where the threads come from. First choice: torch's own intra-op threads. Torch's CPU builds
// run their parallel ops on an OpenMP team, and the OpenMP runtimes they ship (GNU libgomp, LLVM
// libomp, Intel libiomp5) all have GNU's entry point GOMP_parallel. This module links none: at
// import it looks that function up among the libraries already loaded (torch's), so it adds no
// dependency and never starts a second runtime. A pass then is one more parallel region on
// torch's team, on threads that are awake: between ops they spin waiting for the next region
// (libgomp spins for milliseconds by default), so any thread of ours would have to take a core
// from them. Otherwise (no OpenMP runtime loaded, or TRACECMP_CSTATS_POOL=threads): a pool of
// persistent threads of our own, which sleep between passes and never spin.

// Work any number of threads can join: run() takes grabs until none is left.
class Work {
 public:
  virtual ~Work() = default;
  virtual void run() = 0;
};

// GOMP_parallel(fn, data, num_threads, flags): fn(data) on a team of num_threads (the caller
// included), returning when all have returned.
using TeamFn = void (*)(void (*)(void*), void*, unsigned, unsigned);
TeamFn g_team = nullptr;  // set at import when the process has an OpenMP runtime

enum PoolKind : int { kThreads = 0, kOpenMP = 1 };
const char* const kPoolNames[] = {"threads", "openmp"};

TeamFn find_team() {
#if defined(__unix__) || defined(__APPLE__)
  return reinterpret_cast<TeamFn>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
#else
  return nullptr;
#endif
}

// Our own persistent threads. A pass offers its Work to idle helpers and does grabs itself; it
// never waits for a helper that has not started a grab (on a busy machine one may not get a core
// for milliseconds), only for grabs in flight (ParallelCall::finish). Helpers hold the Work
// through a shared_ptr, so one that wakes after the pass has returned finds nothing left.
class Pool {
 public:
  void offer(const std::shared_ptr<Work>& work, int helpers) {
    int wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (started_ < helpers) {
        try {
          std::thread([this] { serve(); }).detach();
        } catch (const std::system_error&) {  // out of threads: fewer helpers
          break;
        }
        ++started_;
      }
      work_ = work;  // kept until the next offer: a few KB
      wanted_ = wake = std::min(helpers, started_);
    }
    for (int i = 0; i < wake; ++i) cv_.notify_one();
  }

 private:
  void serve() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return wanted_ > 0; });
      --wanted_;
      std::shared_ptr<Work> work = work_;
      lock.unlock();
      work->run();
      work.reset();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::shared_ptr<Work> work_;
  int wanted_ = 0, started_ = 0;
};

// Made on first use and never freed: detached helpers use it until the process ends. A forked
// child has none of the parent's threads (and maybe a locked mutex), so it starts a new one.
std::atomic<Pool*> g_pool{nullptr};

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  Pool* made = new Pool;
  if (g_pool.compare_exchange_strong(p, made, std::memory_order_acq_rel)) return *made;
  delete made;  // another thread made one first
  return *p;
}

// The state of one parallel pass, shared with the threads that join it. Blocks are handed out in
// grabs from a counter, so a thread that starts late or is descheduled just does fewer; results
// are stored per grab and per block and combined in order (see above).
template <class T>
struct ParallelCall final : Work {
  ParallelCall(const void* data, const Cursor* cur, int64_t numel, int threads)
      : data(data), strided(cur != nullptr), numel(numel), nblocks((numel + kBlock - 1) / kBlock),
        grab(std::max<int64_t>(1, std::min<int64_t>(kGrabMax, nblocks / (4 * threads)))),
        ngrabs((nblocks + grab - 1) / grab), sums(new double[2 * nblocks]),
        grabs(new Partial<T>[ngrabs]) {
    if (cur) cursor = *cur;
  }

  void run() override {
    while (step()) {
    }
  }

  // Does one grab; false when none is left or the pass is closing.
  bool step() {
    active.fetch_add(1);  // seq_cst with closed: see finish()
    const int64_t g = closed.load() ? ngrabs : next.fetch_add(1);
    if (g < ngrabs) {
      Pairwise unused;
      run_range<T>(data, strided ? &cursor : nullptr, numel, g * grab,
                   std::min((g + 1) * grab, nblocks), grabs[g], unused, sums.get());
    }
    active.fetch_sub(1);
    return g < ngrabs;
  }

  // After the caller's own grabs ran out: no grab starts once closed is set, and the ones in
  // flight end when active drops to 0 (the fetch_sub publishes their results).
  void finish(Partial<T>& part, Pairwise& pw) {
    closed.store(true);
    while (active.load() != 0) std::this_thread::yield();
    for (int64_t g = 0; g < ngrabs; ++g) part.merge(grabs[g]);
    for (int64_t b = 0; b < nblocks; ++b) pw.push(sums[2 * b], sums[2 * b + 1]);
  }

  const void* data;
  Cursor cursor;
  const bool strided;
  const int64_t numel, nblocks, grab, ngrabs;
  std::unique_ptr<double[]> sums;       // per block: sum, sum of squares
  std::unique_ptr<Partial<T>[]> grabs;  // per grab: the exact statistics
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
  std::atomic<bool> closed{false};
};

template <class T>
Result compute(const void* data, const Cursor* cur, int64_t numel, int threads) {
  Partial<T> part;
  Pairwise pw;
  if (threads <= 1) {
    run_range<T>(data, cur, numel, 0, (numel + kBlock - 1) / kBlock, part, pw, nullptr);
  } else {
    auto call = std::make_shared<ParallelCall<T>>(data, cur, numel, threads);
    if (g_team != nullptr) {
      // num_threads 0: the team as torch starts it (its thread count), whatever share of it this
      // tensor needs; the rest find no grab. A smaller team would make libgomp end the threads
      // it leaves out and torch's next op start them again (why torch never passes a count
      // either, pytorch#32008).
      g_team([](void* work) { static_cast<Work*>(work)->run(); }, call.get(), 0, 0);
    } else {
      pool().offer(call, threads - 1);
      call->run();
    }
    call->finish(part, pw);
  }
  double sum, sumsq;
  pw.total(&sum, &sumsq);
  Result r;
  r.lo = static_cast<double>(part.lo);
  r.hi = static_cast<double>(part.hi);
  if (T::kFloat && part.nan == numel) r.lo = r.hi = std::nan("");
  const int64_t finite = numel - part.nan - part.inf;
  r.mean = finite > 0 ? sum / static_cast<double>(finite) : std::nan("");
  r.norm = std::sqrt(sumsq);
  r.nan = part.nan;
  r.inf = part.inf;
  r.checksum = part.checksum;
  return r;
}

Result dispatch(int code, const void* data, const Cursor* cur, int64_t numel, int threads) {
  switch (code) {
    case kF32: return compute<F32>(data, cur, numel, threads);
    case kF64: return compute<F64>(data, cur, numel, threads);
    case kF16: return compute<F16>(data, cur, numel, threads);
    case kBF16: return compute<BF16>(data, cur, numel, threads);
    case kU8: return compute<U8>(data, cur, numel, threads);
    case kI8: return compute<I8>(data, cur, numel, threads);
    case kI16: return compute<I16>(data, cur, numel, threads);
    case kI32: return compute<I32>(data, cur, numel, threads);
    case kI64: return compute<I64>(data, cur, numel, threads);
    default: return compute<Bool>(data, cur, numel, threads);
  }
}

// The caller passes torch's intra-op thread count; the pass uses it, less where a thread would
// get too little work.
int choose_threads(int64_t numel, long requested) {
  if (numel < kParallelMin || requested <= 1) return 1;
  return static_cast<int>(
      std::min<int64_t>({static_cast<int64_t>(requested), numel / kPerThreadMin, kMaxThreads}));
}

// Torch's OpenMP team when the process has one, unless TRACECMP_CSTATS_POOL=threads (a kind's
// name; the tests run both). -1 for a name that is not a kind.
int choose_pool() {
  const char* want = std::getenv("TRACECMP_CSTATS_POOL");
  int kind = kOpenMP;
  if (want != nullptr && *want != '\0') {
    kind = -1;
    for (int k = kThreads; k <= kOpenMP; ++k)
      if (std::strcmp(want, kPoolNames[k]) == 0) kind = k;
    if (kind < 0) return -1;
  }
  g_team = kind == kOpenMP ? find_team() : nullptr;
#if defined(__unix__) || defined(__APPLE__)
  pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); });  // the parent's is leaked
#endif
  return g_team != nullptr ? kOpenMP : kThreads;
}

PyObject* stats(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "stats(data_ptr, shape, strides, dtype_code, numel, num_threads)");
    return nullptr;
  }
  void* data = PyLong_AsVoidPtr(args[0]);
  PyObject* shape = args[1];
  PyObject* strides = args[2];
  const long code = PyLong_AsLong(args[3]);
  const long long numel = PyLong_AsLongLong(args[4]);
  const long requested = PyLong_AsLong(args[5]);
  if (PyErr_Occurred()) return nullptr;
  if (!PyTuple_Check(shape) || !PyTuple_Check(strides) ||
      PyTuple_GET_SIZE(shape) != PyTuple_GET_SIZE(strides) ||
      PyTuple_GET_SIZE(shape) > kMaxDims || code < 0 || code >= kNumDTypes) {
    PyErr_SetString(PyExc_ValueError, "bad shape/strides (tuples of equal length <= 64) or dtype");
    return nullptr;
  }
  // Coalesce: drop size-1 dims, merge a dim into its outer neighbour when they walk memory
  // as one, so contiguous tensors take the direct path and strided ones walk fewer dims.
  Cursor cur;
  long long count = 1;
  for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape); ++d) {
    const long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
    const long long stride = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, d));
    if (PyErr_Occurred()) return nullptr;
    count *= size;
    if (size == 1) continue;
    if (cur.nd > 0 && cur.stride[cur.nd - 1] == size * stride) {
      cur.size[cur.nd - 1] *= size;
      cur.stride[cur.nd - 1] = stride;
    } else {
      cur.size[cur.nd] = size;
      cur.stride[cur.nd] = stride;
      ++cur.nd;
    }
  }
  if (count != numel || numel < 0) {
    PyErr_SetString(PyExc_ValueError, "numel does not match shape");
    return nullptr;
  }
  Result r{std::nan(""), std::nan(""), std::nan(""), 0.0, 0, 0, 0};
  if (numel > 0) {
    if (data == nullptr) {
      PyErr_SetString(PyExc_ValueError, "null data pointer");
      return nullptr;
    }
    const bool contiguous = cur.nd == 0 || (cur.nd == 1 && cur.stride[0] == 1);
    const Cursor* walk = contiguous ? nullptr : &cur;
    const int threads = choose_threads(numel, requested);
    if (numel >= kReleaseGilMin) {
      Py_BEGIN_ALLOW_THREADS
      r = dispatch(static_cast<int>(code), data, walk, numel, threads);
      Py_END_ALLOW_THREADS
    } else {
      r = dispatch(static_cast<int>(code), data, walk, numel, threads);
    }
  }
  PyObject* out = PyTuple_New(7);
  if (!out) return nullptr;
  PyTuple_SET_ITEM(out, 0, PyFloat_FromDouble(r.lo));
  PyTuple_SET_ITEM(out, 1, PyFloat_FromDouble(r.hi));
  PyTuple_SET_ITEM(out, 2, PyFloat_FromDouble(r.mean));
  PyTuple_SET_ITEM(out, 3, PyFloat_FromDouble(r.norm));
  PyTuple_SET_ITEM(out, 4, PyLong_FromLongLong(r.nan));
  PyTuple_SET_ITEM(out, 5, PyLong_FromLongLong(r.inf));
  // Stored signed, as the definition says: the same 64 bits, two's complement.
  PyTuple_SET_ITEM(out, 6, PyLong_FromLongLong(static_cast<long long>(r.checksum)));
  return out;
}

PyMethodDef methods[] = {
    {"stats", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(stats)), METH_FASTCALL,
     "stats(data_ptr, shape, strides, dtype_code, numel, num_threads) -> (min, max, mean, norm, "
     "nan_count, inf_count, checksum)\n\nOne fused pass over CPU memory; see "
     "tracecmp.capture.stats for the definitions."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "tracecmp._cstats",
                      "Fused C++ statistics pass over CPU tensor memory (no torch headers).", -1,
                      methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace
}  // namespace tracecmp

PyMODINIT_FUNC PyInit__cstats() {
  tracecmp::g_isa = tracecmp::choose_isa();
  if (tracecmp::g_isa < 0) {
    PyErr_SetString(PyExc_ImportError,
                    "TRACECMP_CSTATS_ISA must be one of baseline, avx2, avx512 (or unset)");
    return nullptr;
  }
  const int pool = tracecmp::choose_pool();
  if (pool < 0) {
    PyErr_SetString(PyExc_ImportError, "TRACECMP_CSTATS_POOL must be openmp or threads (or unset)");
    return nullptr;
  }
  PyObject* m = PyModule_Create(&tracecmp::module);
  // BLOCK: elements per summation block (tests cross it); PARALLEL_MIN: below this numel the
  // thread count is ignored, so callers need not look it up; ISA: the copy of the kernel in use;
  // POOL: where a parallel pass gets its threads ("openmp": torch's team, "threads": our own).
  if (m && (PyModule_AddIntConstant(m, "BLOCK", tracecmp::kBlock) < 0 ||
            PyModule_AddIntConstant(m, "PARALLEL_MIN", tracecmp::kParallelMin) < 0 ||
            PyModule_AddStringConstant(m, "ISA", tracecmp::kIsaNames[tracecmp::g_isa]) < 0 ||
            PyModule_AddStringConstant(m, "POOL", tracecmp::kPoolNames[pool]) < 0)) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
