"""shared/gguf_reader.FastGGUFReader reads what gguf.GGUFReader reads, element for element."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from shared.gguf_reader import FastGGUFReader


def assert_same(path: Path | str) -> None:
    stock, fast = gguf.GGUFReader(path), FastGGUFReader(path)
    assert stock.byte_order == fast.byte_order
    assert list(stock.fields) == list(fast.fields)
    for name, want in stock.fields.items():
        got = fast.fields[name]
        assert (got.offset, got.types, got.data) == (want.offset, want.types, want.data), name
        assert [p.tobytes() for p in got.parts] == [p.tobytes() for p in want.parts], name
        assert [p.dtype for p in got.parts] == [p.dtype for p in want.parts], name
        assert got.contents() == want.contents(), name
    assert len(stock.tensors) == len(fast.tensors)
    for want_t, got_t in zip(stock.tensors, fast.tensors, strict=True):
        assert (got_t.name, got_t.tensor_type, got_t.data_offset) == (
            want_t.name,
            want_t.tensor_type,
            want_t.data_offset,
        )
        assert got_t.shape.tolist() == want_t.shape.tolist()
        assert got_t.data.dtype == want_t.data.dtype and got_t.data.shape == want_t.data.shape
        assert np.array_equal(got_t.data, want_t.data, equal_nan=True)


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_and_tensor_reads_the_same(
    tmp_path: Path, endian: gguf.GGUFEndian
) -> None:
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 1.5)
    writer.add_uint64("t.u64", 2**40)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float64("t.f64", -2.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_array("t.strings", ["", "a", "ünï", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.0])
    writer.add_array("t.empty", [])
    gen = np.random.default_rng(0)
    writer.add_tensor("a.weight", gen.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("b.weight", gen.standard_normal((4, 8)).astype(np.float16))
    writer.add_tensor(
        "c.weight",
        gen.integers(0, 256, (2, 34), dtype=np.uint8),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same(path)
    fast = FastGGUFReader(path)
    assert fast.fields["t.strings"].contents() == ["", "a", "ünï", "x" * 300]
    assert fast.fields["t.u64"].contents() == 2**40
    assert fast.fields["t.f64"].contents() == -2.25
