"""GPU memory, checked on every machine against stand-ins for CuPy that keep to its rules:
- `mm.profile().peak_bytes["gpu"]` is the high-water mark of the bytes CuPy's memory pool hands
  out (used, not cached), and `"gpu_cached"` the pool's total (hooks per thread, registered by
  name, called after each malloc and free with the rounded size; peaks worked out by hand);
- each rank's pool is capped at its share of its GPU (`backend.cap_gpu_pool`; limits per device)."""
import importlib
import sys
import threading
import types

import pytest

import mpimesh as mm

from mpimesh import backend

profile_mod = importlib.import_module("mpimesh.profile")  # `mm.profile` is the context manager


class FakeHookBase:
    """CuPy's `MemoryHook` contract: `with hook:` registers it under `hook.name`; a second hook of
    the same name raises KeyError, as CuPy's does."""
    registry: dict = {}

    def __enter__(self):
        if self.name in self.registry:
            raise KeyError(f"memory hook {self.name} already exists")
        self.registry[self.name] = self
        return self

    def __exit__(self, *_):
        del self.registry[self.name]


class FakePool:
    """A pool that rounds sizes up to 512 bytes and caches freed blocks."""

    def __init__(self):
        self.used, self.cached = 0, 0

    def malloc(self, size: int) -> int:
        size = -(-size // 512) * 512
        self.cached = max(self.cached - size, 0)
        self.used += size
        for hook in list(FakeHookBase.registry.values()):
            hook.malloc_postprocess(device_id=0, size=size, mem_size=size, mem_ptr=1, pmem_id=1)
        return size

    def free(self, size: int) -> None:
        self.used -= size
        self.cached += size
        for hook in list(FakeHookBase.registry.values()):
            hook.free_postprocess(device_id=0, mem_size=size, mem_ptr=1, pmem_id=1)

    def used_bytes(self) -> int:
        return self.used

    def total_bytes(self) -> int:
        return self.used + self.cached


@pytest.fixture
def pool(monkeypatch):
    pool = FakePool()
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(MemoryHook=FakeHookBase)
    cupy.get_default_memory_pool = lambda: pool
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(profile_mod._UsedPeak, "_hook_class", None)  # built on the stand-in, then forgotten
    monkeypatch.setattr(FakeHookBase, "registry", {})
    return pool


def test_gpu_peak_counts_used_bytes_not_the_cache(pool):
    params = pool.malloc(10_000)  # held before the profile: counted, as torch.cuda.max_memory_allocated does
    with mm.profile() as prof:
        a = pool.malloc(3000)     # 3072
        b = pool.malloc(1000)     # 1024: peak 10240 + 4096
        pool.free(a)
        pool.free(b)
        c = pool.malloc(600)      # 1024, from the cache
        pool.free(c)
    assert prof.peak_bytes["gpu"] == params + 3072 + 1024
    assert prof.peak_bytes["gpu_cached"] == params + 3072 + 1024  # the pool kept the freed blocks
    assert FakeHookBase.registry == {}  # the hook is gone after the block


def test_gpu_peaks_nest(pool):
    with mm.profile() as outer:
        big = pool.malloc(50 * 512)
        pool.free(big)
        with mm.profile() as inner:  # its own hook beside the outer one
            small = pool.malloc(512)
            pool.free(small)
        assert len(FakeHookBase.registry) == 1
    assert outer.peak_bytes["gpu"] == 50 * 512
    assert inner.peak_bytes["gpu"] == 512


def test_gpu_hooks_are_per_thread_by_name(pool):
    """Two threads profiling at once register two hooks: names differ, so neither raises."""
    errors = []

    def work():
        try:
            with mm.profile():
                pool.free(pool.malloc(512))
        except Exception as e:  # pragma: no cover - what the test is for
            errors.append(e)
    with mm.profile():
        t = threading.Thread(target=work)
        t.start()
        t.join()
    assert errors == []


class FakeDevicePools:
    """CuPy's default pool seen per current device, with `set_limit`/`get_limit` (0: none), and
    `cuda.Device(i)` as the context that makes device i current."""

    def __init__(self, totals):
        self.totals, self.limits, self.current = totals, {i: 0 for i in range(len(totals))}, 0

    def module(self):
        pools = self

        class Device:
            def __init__(self, i):
                self.i = i

            def __enter__(self):
                self.before, pools.current = pools.current, self.i

            def __exit__(self, *_):
                pools.current = self.before

        class Pool:
            def set_limit(self, size):
                pools.limits[pools.current] = size

            def get_limit(self):
                return pools.limits[pools.current]
        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(
            memGetInfo=lambda: (0, pools.totals[pools.current])))
        cupy.get_default_memory_pool = Pool
        return cupy


@pytest.fixture
def devices(monkeypatch):
    pools = FakeDevicePools([80 << 30, 40 << 30])
    monkeypatch.setitem(sys.modules, "cupy", pools.module())
    monkeypatch.setattr(backend, "_pool_caps", {})
    monkeypatch.delenv("MPIMESH_GPU_MEMORY_FRACTION", raising=False)
    return pools


def test_pool_cap_is_a_share_of_the_gpu(devices):
    assert backend.cap_gpu_pool(1, sharing=2) == int((40 << 30) * 0.9 / 2)  # two ranks on GPU 1
    assert devices.limits == {0: 0, 1: int((40 << 30) * 0.9 / 2)}
    assert backend.cap_gpu_pool(1, sharing=1) == int((40 << 30) * 0.9 / 2)  # the first cap stays
    assert backend.cap_gpu_pool(0, sharing=1) == int((80 << 30) * 0.9)


def test_pool_cap_keeps_the_users_and_can_be_off(devices, monkeypatch):
    devices.limits[0] = 5 << 30
    assert backend.cap_gpu_pool(0, sharing=4) == 5 << 30 and devices.limits[0] == 5 << 30
    monkeypatch.setenv("MPIMESH_GPU_MEMORY_FRACTION", "off")
    assert backend.cap_gpu_pool(1, sharing=1) is None and devices.limits[1] == 0
    monkeypatch.setenv("MPIMESH_GPU_MEMORY_FRACTION", "0.5")
    assert backend.cap_gpu_pool(1, sharing=1) == 20 << 30
    for bad in ("1.5", "-0.1", "half"):
        monkeypatch.setenv("MPIMESH_GPU_MEMORY_FRACTION", bad)
        with pytest.raises(mm.MpimeshError, match="MPIMESH_GPU_MEMORY_FRACTION"):
            backend.cap_gpu_pool(0, sharing=1)
