"""The cache of checked problems (api/common.py) and the launches' parameter
records: what a repeated call may skip, and what it may not. Runs anywhere (the CPU fallback
without a GPU, the kernels with one)."""

import ctypes
import gc
import types
import weakref

import numpy
import pytest

import cupyflash
from cupyflash import BlockMask, reference
from cupyflash.api import common
from cupyflash.catalog.params import BWD_PARAMS_DTYPE, FWD_PARAMS_DTYPE
from cupyflash.runtime import launch, params, tma, workspace
from shapes import random_qkv


class CountingDict(dict):
    """A cache that counts its insertions: one per call that missed it and was checked."""

    def __init__(self):
        super().__init__()
        self.inserted = 0

    def __setitem__(self, key, value):
        self.inserted += 1
        super().__setitem__(key, value)


@pytest.fixture
def cache(monkeypatch):
    """An empty cache of checked problems (calls without a block mask) that counts its misses."""
    empty = CountingDict()
    monkeypatch.setattr(common, "CHECKED", empty)
    return empty


def test_option_keys_tell_types_apart():
    key = common.option_key
    assert key(True) != key(1) and key(1) != key(1.0) and key(True) != key(numpy.True_)
    assert key((1, None)) != key((True, None)) and key((1, None)) == key((1, None))
    assert key((0.5, (2, None))) != key((0.5, (2.0, None)))
    with pytest.raises(TypeError):
        key([1, None])


def test_prepared_signatures_tell_option_types_apart():
    """api/prepared.py's flags: causal=1 (refused) is not causal=True; scale=True not 1.0; a window
    of ints not one of floats; an unhashable window fails to hash (the full path then names it)."""
    from cupyflash.api import prepared

    key = prepared.flags_key
    assert key(True, None, None, None, False) != key(1, None, None, None, False)
    assert key(False, True, None, None, False) != key(False, 1.0, None, None, False)
    assert key(False, None, (3, 0), None, False) != key(False, None, (3.0, 0), None, False)
    assert key(True, 0.5, (3, None), 2.0, True) == key(True, 0.5, (3, None), 2.0, True)
    with pytest.raises(TypeError):
        hash(key(False, None, [3, 0], None, False))
    assert prepared.plain(None, None, 0.0, None, 0)
    assert not any(prepared.plain(*args) for args in [
        (numpy.ones(2), None, 0.0, None, 0), (None, 3, 0.0, None, 0), (None, None, 0, None, 0),
        (None, None, 0.1, 5, 0), (None, None, 0.0, 5, 0), (None, None, 0.0, None, 1), (None, None, 0.0, None, True)])


def test_a_repeated_call_is_checked_once_and_reads_its_own_arrays(rng, cache):
    shape = (2, 37, 53, 3, 24)
    for _ in range(3):
        q, k, v = random_qkv(rng, "float64", *shape)
        out = cupyflash.attention(q, k, v, causal=True, scale=0.4)
        numpy.testing.assert_allclose(out, reference.attention(q, k, v, causal=True, scale=0.4), rtol=1e-10, atol=1e-12)
    assert cache.inserted == 1
    cupyflash.attention(q, k, v, causal=False, scale=0.4)  # another option: another key
    cupyflash.attention(q[:, :30], k, v, causal=True, scale=0.4)  # another shape, and strides
    assert cache.inserted == 3


@pytest.mark.parametrize("good,bad,error", [
    ({"causal": True}, {"causal": 1}, "causal must be True or False"),
    ({"scale": 1.0}, {"scale": True}, "scale must be a real number"),
    ({"window": (1, None)}, {"window": (True, None)}, "window's left side must be an int"),
    ({"return_lse": False}, {"return_lse": 0}, "return_lse must be True or False"),
])
def test_a_cached_key_lets_no_bad_option_through(rng, cache, good, bad, error):
    """Values that compare equal to a checked one (1 == True == 1.0) are keyed apart and refused."""
    q, k, v = random_qkv(rng, "float32", 1, 9, 9, 2, 16)
    cupyflash.attention(q, k, v, **good)
    with pytest.raises(TypeError, match=error):
        cupyflash.attention(q, k, v, **bad)


def test_unhashable_options_are_checked_every_time(rng, cache):
    q, k, v = random_qkv(rng, "float32", 1, 9, 9, 2, 16)
    for _ in range(2):
        cupyflash.attention(q, k, v, window=[3, 0])
    assert cache.inserted == 0


def test_a_masks_problems_stay_with_the_mask_and_go_with_it(rng, cache):
    """Kept by the mask, not globally, and holding no reference to it: the mask is freed as soon
    as the caller drops it (no cycle waiting for the garbage collector)."""
    q, k, v = random_qkv(rng, "float32", 1, 200, 300, 2, 16)
    mask = BlockMask(numpy.array([[[True, False, True], [False, True, True]]] * 2))
    for _ in range(2):
        out = cupyflash.block_sparse_attention(q, k, v, mask)
    exact = reference.attention(*(x.astype(numpy.float64) for x in (q, k, v)), block_mask=mask)
    numpy.testing.assert_allclose(out, exact, atol=2e-5)
    assert cache.inserted == 0 and len(mask.checked_problems) == 1
    assert all(p.block_mask is None for p in mask.checked_problems.values())
    other = BlockMask(mask.to_dense())  # equal, but another object: checked for itself
    cupyflash.block_sparse_attention(q, k, v, other)
    assert len(other.checked_problems) == 1
    dropped = weakref.ref(mask)
    gc.disable()
    try:
        del mask
        assert dropped() is None
    finally:
        gc.enable()


def test_a_wrong_mask_is_refused_after_a_good_one(rng, cache):
    q, k, v = random_qkv(rng, "float32", 1, 200, 300, 2, 16)
    cupyflash.block_sparse_attention(q, k, v, BlockMask(numpy.ones((2, 2, 3), bool)))
    with pytest.raises(ValueError, match="block_mask has 2 x 2 blocks"):
        cupyflash.block_sparse_attention(q, k, v, BlockMask(numpy.ones((2, 2, 2), bool)))
    with pytest.raises(TypeError, match="block_mask must be a cupyflash.BlockMask"):
        cupyflash.block_sparse_attention(q, k, v, numpy.ones((2, 2, 3), bool))


def test_the_cache_keeps_a_bounded_number_of_problems(rng, cache, monkeypatch):
    monkeypatch.setattr(common, "CHECKED_KEPT", 3)
    for seqlen in range(1, 6):
        q, k, v = random_qkv(rng, "float32", 1, seqlen, 4, 1, 8)
        cupyflash.attention(q, k, v)
    assert len(common.CHECKED) == 3


@pytest.mark.parametrize("dtype,pointers,words", [
    (FWD_PARAMS_DTYPE, ("q", "k", "v", "o", "lse"), ()),
    (FWD_PARAMS_DTYPE, ("q", "k", "v", "o", "lse", "dropout_seed", "dropout_state"), ("dropout_offset",)),
    (BWD_PARAMS_DTYPE, ("lse", "lse_log2", "d", "dq_accum", "q", "k", "v", "o", "dout", "dq", "dk", "dv"), ()),
    (BWD_PARAMS_DTYPE, ("q", "dq", "dropout_seed", "dropout_state"), ("dropout_offset",)),
])
def test_a_launch_record_writes_each_calls_pointers(rng, dtype, pointers, words):
    """The struct a record gives for new pointers (and 4-byte values: dropout's offset, which shares
    its word with the threshold) holds, field by field, the struct built from scratch (the padding
    between fields is left as it comes)."""
    fields = {name: int(x) for name, x in zip(dtype.names, rng.integers(0, 2**31, len(dtype.names)))}
    record = params.LaunchRecord(dtype, fields, pointers, words)
    for _ in range(2):
        new = {name: int(x) for name, x in zip(pointers, rng.integers(0, 2**63, len(pointers), dtype=numpy.uint64))}
        new.update((name, int(x)) for name, x in zip(words, rng.integers(0, 2**32, len(words), dtype=numpy.uint64)))
        made = record.params(new)
        assert made.dtype == dtype and made.shape == (1,)
        assert made[0].tolist() == params.image(dtype, {**fields, **new})[0].tolist()
    assert record.params(fields)[0].tolist() == params.image(dtype, fields)[0].tolist()


def test_argument_addresses_are_the_bytes_the_driver_reads(monkeypatch):
    """launch._address gives each argument's first byte: a struct through the uint64 image it views,
    a pinned array from the kept entry (also once evicted, from the array itself), a new array
    whose id an evicted one had from itself."""
    monkeypatch.setattr(launch, "_PINNED", {})
    monkeypatch.setattr(launch, "_PINNED_KEPT", 2)
    record = params.LaunchRecord(FWD_PARAMS_DTYPE, dict.fromkeys(FWD_PARAMS_DTYPE.names, 0), ("q",))
    struct = record.params({"q": 5})
    assert launch._address(struct) == struct.ctypes.data
    arrays = [launch.pinned(numpy.array(n, numpy.int32)) for n in range(3)]  # the first is dropped
    assert len(launch._PINNED) == 2
    for x in arrays:
        assert launch._address(x) == x.ctypes.data
    del arrays
    assert all(launch._address(y) == y.ctypes.data for y in [numpy.array(n, numpy.int32) for n in range(8)])


def test_a_launch_record_keeps_the_newest_tensor_maps(monkeypatch):
    """A record keeps the maps of _MAPS_KEPT pointer sets, dropping the oldest first (keep_bounded,
    as the problems' cache); a kept set's maps are not made again."""
    monkeypatch.setattr(params.LaunchRecord, "MAPS_KEPT", 3)
    dtype = FWD_PARAMS_DTYPE
    record = params.LaunchRecord(dtype, dict.fromkeys(dtype.names, 0), ())
    made = []

    def maps_for(key):
        return record.tensor_maps(key, lambda fields: made.append(key) or ("maps", key), {})

    for key in range(5):
        assert maps_for(key) == ("maps", key)
    assert list(record.maps) == [2, 3, 4]
    assert maps_for(3) == ("maps", 3) and maps_for(0) == ("maps", 0)
    assert made == [0, 1, 2, 3, 4, 0] and list(record.maps) == [3, 4, 0]


def test_calls_from_many_threads(rng):
    """Threads calling with a few shapes at once share the cache (and the launch records on a GPU):
    every result is its own call's."""
    import threading

    shapes = [(1, 20, 30, 2, 16), (2, 7, 9, 1, 8), (1, 33, 33, 3, 24)]
    inputs = [[random_qkv(rng, "float64", *shape) for _ in range(4)] for shape in shapes]
    failures = []

    def work(index):
        for round_ in range(12):
            q, k, v = inputs[(index + round_) % 3][(index * round_) % 4]
            out = cupyflash.attention(q, k, v, causal=index % 2 == 0)
            exact = reference.attention(q, k, v, causal=index % 2 == 0)
            if not numpy.allclose(out, exact, rtol=1e-10, atol=1e-12):
                failures.append((index, round_))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_bounded_inserts_from_many_threads():
    """keep_bounded (the problems' cache and decode's steps) dropping its oldest entries from eight
    threads at once: no thread raises, and the bound holds. Unlocked, two threads took the same
    oldest key (KeyError) or iterated a dict another was growing (RuntimeError)."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        cache, errors = {}, []

        def work(index):
            try:
                for n in range(3000):
                    workspace.keep_bounded(cache, (index, n), n, 4)
            except Exception as error:  # noqa: BLE001 - the test reports whatever a thread raised
                errors.append(repr(error))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == [] and len(cache) == 4


def test_launch_arguments_go_by_their_arrays_addresses():
    """launch passes each argument's bytes by address: the struct (a record view of a copy), the
    maps, a 0-d scalar, and the arrays ctypes cannot view (read-only, empty, strided) alike."""
    record = numpy.zeros(1, FWD_PARAMS_DTYPE)
    frozen = numpy.arange(4, dtype=numpy.uint64)
    frozen.flags.writeable = False
    for x in (record, record.view(numpy.uint64).copy().view(record.dtype), tma.NO_MAPS,
              numpy.array(7, numpy.int32), frozen, numpy.zeros(0, numpy.uint8), numpy.zeros((4, 4), numpy.uint32)[:, ::2]):
        assert launch._address(x) == x.ctypes.data


def test_a_launch_records_struct_is_its_threads_own():
    """Each thread writes its pointers into its own struct (two copies, for a plan that takes two),
    the same array call after call within a thread: one thread's call cannot change another's."""
    import threading

    record = params.LaunchRecord(FWD_PARAMS_DTYPE, dict.fromkeys(FWD_PARAMS_DTYPE.names, 0), ("q",))
    first = record.params({"q": 1})
    assert record.params({"q": 2}) is first and field(first, "q") == 2
    second = record.params({"q": 3}, copy=1)
    assert second is not first and (field(first, "q"), field(second, "q")) == (2, 3)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(record.params({"q": 4})))
    thread.start()
    thread.join()
    assert theirs[0] is not first and field(theirs[0], "q") == 4 and field(first, "q") == 2


def field(struct, name: str) -> int:
    return int(struct[name][0])


def test_a_launch_is_made_ready_once_for_its_arrays(monkeypatch):
    """launch.run passes the driver each launch's function, grid, block and shared memory and the
    address of an array holding its arguments' addresses; the same kernel, grid and argument arrays
    again reuse that array (a struct written since is read at its address), other arrays or
    another grid get their own."""
    from cupyflash.dispatch.plan import Launch, Plan

    monkeypatch.setattr(launch, "_READY", {})
    calls = []
    driver = types.SimpleNamespace(launchKernel=lambda *args: calls.append(args))
    monkeypatch.setattr(launch, "_driver", lambda: driver)
    monkeypatch.setattr(launch, "_function_pointer", lambda kernel, device_id: 1000 + device_id)
    kernel = types.SimpleNamespace(num_threads=128, smem_bytes=4096)
    record = params.LaunchRecord(FWD_PARAMS_DTYPE, dict.fromkeys(FWD_PARAMS_DTYPE.names, 0), ("q",))
    maps = launch.pinned(numpy.arange(16, dtype=numpy.uint8))

    def arguments_of(call):
        """The addresses the call's argument array holds."""
        return list(numpy.ctypeslib.as_array(ctypes.cast(call[9], ctypes.POINTER(ctypes.c_uint64)), (2,)))

    for q in (5, 6):
        launch.run(Plan(None, 3, [Launch(kernel, (4, 2), (record.params({"q": q}), maps))], ()), stream=77)
    struct = record.params({"q": 6})
    assert calls[0][:9] == (1003, 4, 2, 1, 128, 1, 1, 4096, 77) and calls[0][10] == 0
    assert calls[1] == calls[0] and len(launch._READY) == 1
    assert arguments_of(calls[0]) == [struct.ctypes.data, maps.ctypes.data]
    other = launch.pinned(numpy.arange(16, dtype=numpy.uint8))
    launch.run(Plan(None, 3, [Launch(kernel, (4, 2), (struct, other)), Launch(kernel, (8, 1), (struct, maps))], ()),
               stream=77)
    assert len(launch._READY) == 3 and calls[3][1:3] == (8, 1)
    assert arguments_of(calls[2]) == [struct.ctypes.data, other.ctypes.data]
