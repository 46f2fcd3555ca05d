#!/usr/bin/env python3
"""What growable plan blocks save: the CUDA driver's costs, measured with ctypes (no Rust, no
torch), on device 0, median of 7 of each.

* a fresh block from the stream-ordered pool at release threshold 0 (cuMemAllocAsync after the
  pool was trimmed: what gpucache's other blocks come from), and its free (cuMemFreeAsync, then
  a stream synchronisation, where the pool gives the memory back);
* the same block through virtual memory management, as `gpucache/src/backend/cuda/vmm.rs` makes
  it (an address range as large as the device's memory reserved, physical memory created,
  mapped and made accessible), and its release (synchronisation, unmap, release, address free);
* growing a mapped range in place by 24 MiB (what a step that outgrows its plan by that much
  now costs).

    python3 gpucache/benches/vmm_probe.py
"""
import ctypes
import statistics
import time

cu = ctypes.CDLL("libcuda.so.1")


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what}: CUresult {r}")


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Flags(ctypes.Structure):
    _fields_ = [("compression", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", Loc),
                ("win32", ctypes.c_void_p), ("flags", Flags)]


class Access(ctypes.Structure):
    _fields_ = [("location", Loc), ("flags", ctypes.c_int)]


ck(cu.cuInit(0), "init")
dev = ctypes.c_int()
ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "device")
ctx = ctypes.c_void_p()
ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "context")
ck(cu.cuCtxSetCurrent(ctx), "current")
prop = Prop(type=1, location=Loc(1, 0))  # pinned, on device 0
access = Access(Loc(1, 0), 3)  # read and write
gran = ctypes.c_size_t()
ck(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 0), "granularity")
total = ctypes.c_size_t()
ck(cu.cuDeviceTotalMem_v2(ctypes.byref(total), dev), "total")
reserve = -(-total.value // gran.value) * gran.value
pool = ctypes.c_void_p()
ck(cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev), "pool")
stream = ctypes.c_void_p()
ck(cu.cuStreamCreate(ctypes.byref(stream), 1), "stream")
MB = 1 << 20


def timed(f):
    t = time.perf_counter()
    out = f()
    return time.perf_counter() - t, out


def pool_block(size):
    ck(cu.cuStreamSynchronize(stream), "sync")
    ck(cu.cuMemPoolTrimTo(pool, ctypes.c_size_t(0)), "trim")
    p = ctypes.c_uint64()
    a, _ = timed(lambda: ck(cu.cuMemAllocAsync(ctypes.byref(p), ctypes.c_size_t(size), stream), "alloc"))
    f, _ = timed(lambda: (ck(cu.cuMemFreeAsync(p, stream), "free"), ck(cu.cuStreamSynchronize(stream), "sync")))
    return a, f


def map_more(va, at, size):
    h = ctypes.c_uint64()
    ck(cu.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)), "create")
    ck(cu.cuMemMap(ctypes.c_uint64(va + at), ctypes.c_size_t(size), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "map")
    ck(cu.cuMemSetAccess(ctypes.c_uint64(va + at), ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)), "access")
    return h


def vmm_block(size, grow=0):
    va = ctypes.c_uint64()

    def make():
        ck(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(reserve), ctypes.c_size_t(0),
                                  ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "reserve")
        return [(map_more(va.value, 0, size), size)]

    a, handles = timed(make)
    g = 0.0
    if grow:
        g, h = timed(lambda: map_more(va.value, size, grow))
        handles.append((h, grow))

    def release():
        ck(cu.cuStreamSynchronize(stream), "sync")
        ck(cu.cuMemUnmap(va, ctypes.c_size_t(sum(s for _, s in handles))), "unmap")
        for h, _ in handles:
            ck(cu.cuMemRelease(h), "release")
        ck(cu.cuMemAddressFree(va, ctypes.c_size_t(reserve)), "address free")

    f, _ = timed(release)
    return a, f, g


def med(xs):
    return f"{statistics.median(xs) * 1e6:7.0f} us"


print(f"granularity {gran.value >> 20} MiB, reservation {reserve >> 30} GiB per block")
for mb in [24, 64, 86, 142, 300, 600, 1200]:
    size = -(-mb * MB // gran.value) * gran.value
    p = [pool_block(size) for _ in range(7)]
    v = [vmm_block(size, grow=24 * MB) for _ in range(7)]
    print(f"{mb:5d} MiB: pool alloc {med([a for a, _ in p])}, free+sync {med([f for _, f in p])}"
          f" | mapped {med([a for a, _, _ in v])}, released {med([f for _, f, _ in v])},"
          f" grown by 24 MiB {med([g for _, _, g in v])}")
