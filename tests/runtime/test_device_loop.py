"""The device loop's staging buffers (runtime/device_loop.py ``Mirrors``): one block, one upload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_trt.runtime import device
from dflash_trt.runtime.device_loop import Mirrors

PARTS = {"ints": ((4, 5), torch.int64), "floats": ((2, 5), torch.float32), "seeds": ((5, 3), torch.int64), "odd": ((3,), torch.int16)}


def fill(block: Mirrors) -> dict[str, np.ndarray]:
    """Distinct values in every part, written through the numpy twins; returns what each should hold."""
    expected = {}
    for i, (name, part) in enumerate(block.parts.items()):
        values = (np.arange(part.array.size).reshape(part.array.shape) + 100 * (i + 1)).astype(part.array.dtype)
        part.array[...] = values
        expected[name] = values
    return expected


def test_mirror_parts_are_disjoint_aligned_views_of_one_block():
    """Guards against parts of one staging block overlapping (a write to one row's sampling corrupting
    another's anchors) or starting misaligned (a view of the wrong bytes): every part has its shape and
    dtype, starts 16-byte aligned inside the one block, and holds exactly what was written to it, on the
    device side too (on CPU the same memory)."""
    block = Mirrors(torch.device("cpu"), **PARTS)
    expected = fill(block)
    base = block.block.data_ptr()
    for name, (shape, dtype) in PARTS.items():
        part = block.parts[name]
        assert part.device.shape == shape and part.device.dtype == dtype
        offset = part.device.data_ptr() - base
        assert offset % Mirrors.ALIGN == 0 and offset + part.device.numel() * dtype.itemsize <= block.block.numel()
        np.testing.assert_array_equal(part.device.numpy(), expected[name])


@pytest.mark.gpu
def test_mirror_block_uploads_in_one_copy(monkeypatch):
    """Guards against a round's staging costing one CUDA copy per tensor (each a host call of tens of
    microseconds in a busy serving process): a block's upload is one copy, and after it every device
    part holds its host twin's values."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    block = Mirrors(torch.device("cuda"), **PARTS)
    expected = fill(block)
    copies = []
    copy_async = device.copy_async
    monkeypatch.setattr(device, "copy_async", lambda *args: (copies.append(args), copy_async(*args))[1])
    stream = device.Stream()
    block.upload(stream)
    stream.synchronize()
    assert len(copies) == 1
    for name, part in block.parts.items():
        np.testing.assert_array_equal(part.device.cpu().numpy(), expected[name])
    block.close()
    stream.close()


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [1, 2])
def test_uploads_queued_back_to_back_each_deliver_their_own_inputs(depth):
    """Guards against launches queued without a host sync between them (an execute's batched prefills)
    reading the last launch's inputs: an async copy reads pinned memory when the stream reaches it, so
    rewriting the host twin for launch 3 while launches 1 and 2 still wait would hand them launch 3's
    tokens. Held behind a long kernel, each of three uploads is seen by the clone queued after it, also
    when the ring is shallower than the queue (its oldest copy is waited for)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dflash_trt.runtime.prefill import Staging

    block = Mirrors(torch.device("cuda"), values=((1024,), torch.int64))
    staging, stream, seen = Staging(block, depth), device.Stream(), []
    with torch.cuda.stream(stream.torch_stream()):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: every upload below is queued before any runs
        for launch in range(3):
            block.parts["values"].array[:] = launch
            staging.upload(stream)
            seen.append(block.parts["values"].device.clone())
    stream.synchronize()
    assert [int(v.unique().item()) if v.unique().numel() == 1 else None for v in seen] == [0, 1, 2]
    staging.close()
    block.close()
    stream.close()


@pytest.mark.parametrize("count", [1, 2, 4, 5, 9])
@pytest.mark.parametrize("as_slice", [False, True])
def test_sampling_columns_are_the_sample_graphs_feeds_for_few_rows_and_many(count, as_slice):
    """Guards against the few-owner shortcut of ``put_sampling`` (single values, for a request joining a
    running execute) staging columns other than the sample graph's feeds (``sampling_rows``: a float32
    rounding, a seed's parts, an int's width): at any count, by rows or by a slice, every column holds
    exactly ``sampling_rows``' values and no other column changes."""
    from dflash_trt.export.sampling import Sampling
    from dflash_trt.runtime.cycles import sampling_rows
    from dflash_trt.runtime.device_loop import TEMPERATURE, TOP_K, TOP_P, put_sampling

    generator = np.random.default_rng(count)
    samplings = [
        Sampling(float(generator.uniform(0.01, 3.0)) if i % 3 else 0.0, int(generator.integers(0, 50)), float(generator.uniform(0.05, 1.0)),
                 int(generator.integers(0, 2**63)) * 2 + i % 2)
        for i in range(count)
    ]
    R = 12
    ints, seeds, floats = np.full((4, R), -7, np.int64), np.full((R, 3), -7, np.int64), np.full((2, R), -7.0, np.float32)
    rows = slice(0, count) if as_slice else [R - 1 - 2 * i for i in range(count)] if count <= 6 else list(range(count))[::-1]
    put_sampling(ints, seeds, floats, rows, samplings)
    feeds = sampling_rows(samplings, [0] * count)
    at = list(range(count)) if as_slice else rows
    assert ints[TOP_K, at].tolist() == feeds["top_k"].tolist()
    assert seeds[at].tolist() == feeds["seed"].tolist()
    assert floats[TEMPERATURE, at].tobytes() == feeds["temperature"].tobytes() and floats[TOP_P, at].tobytes() == feeds["top_p"].tobytes()
    untouched = [r for r in range(R) if r not in set(at)]
    assert (ints[:, untouched] == -7).all() and (ints[:TOP_K, :] == -7).all() and (seeds[untouched] == -7).all() and (floats[:, untouched] == -7).all()
