# The C contract of tracecmp._cstats (csrc/cstats.cpp): the fused statistics pass over CPU memory.
# Imported by tracecmp.capture.native only; tracecmp.capture.stats is its reference and its caller.
BLOCK: int  # elements per summation block
PARALLEL_MIN: int  # from this many elements up a pass is split over num_threads threads
ISA: str  # the copy of the kernel in use: "baseline", "avx2" or "avx512" (TRACECMP_CSTATS_ISA caps it)
POOL: str  # where a parallel pass gets its threads: "openmp" (torch's team) or "threads" (its own)

def stats(
    data_ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype_code: int, numel: int, num_threads: int, /
) -> tuple[float, float, float, float, int, int, int]:
    """(min, max, mean, norm, nan_count, inf_count, checksum) of the tensor at ``data_ptr``.

    ``shape`` and ``strides`` are tuples of equal length (``torch.Size`` is one), strides in
    elements, the storage offset already in ``data_ptr``; ``dtype_code`` is the dtype's code in
    csrc/stats_kernel.hpp's ``enum DType`` (float32 0 ... bool 9, as tracecmp.capture.stats lists
    them). ``num_threads`` is used from ``PARALLEL_MIN`` elements up, with the GIL released; the
    result is the same bits at any count. TypeError for another number of arguments, ValueError
    for a shape, strides, code or ``numel`` that do not fit (or a null pointer under elements),
    before any memory is read.
    """
