"""engine/model_runner.py's choice of path, said at start: a GGUF whose layers mix in a block type the
native CPU step does not read (here one tensor written as F32 with gguf-py) takes the torch path, and
the log names the type and the path in one line; one of the types it reads besides Q4_0/Q4_1 (Q8_0, Q5_0,
Q5_1, requantised with gguf-py) runs natively with the float reference's greedy tokens."""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest

from engine import EngineConfig, EngineRequest, LLMEngine, SamplingParams
from engine.loader import default_model_path

pytestmark = pytest.mark.model


@functools.cache
def _reader(path):
    """gguf-py's reader of a file, once per test process: it parses the tokenizer's 49k-entry fields into
    numpy views, ~6 s each time, and four tests here read the packaged file."""
    import gguf

    return gguf.GGUFReader(str(path))


def requantised(src, dst, names: dict[str, str], scale: dict[str, float] | None = None) -> None:
    """A copy of the GGUF `src` with the tensors in `names` requantised (name -> gguf-py type name), those
    in `scale` multiplied by its factor first."""
    import gguf

    reader = _reader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # rows first, as the writer takes them
        if t.name in names:
            qtype = gguf.GGMLQuantizationType[names[t.name]]
            dense = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            dense *= (scale or {}).get(t.name, 1.0)
            writer.add_tensor(t.name, gguf.quants.quantize(dense, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_block_type_the_native_step_does_not_read_is_named_with_the_path_taken(tmp_path, caplog):
    path = tmp_path / "SmolLM2-135M-Instruct-mixed.gguf"
    requantised(default_model_path(), path, {"blk.0.attn_v.weight": "F32"})
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = LLMEngine(EngineConfig(model=str(path), kv_cache_tokens=1024, max_running_requests=2))
    said = [r.getMessage() for r in caplog.records if "native CPU forward step not used" in r.getMessage()]
    if not engine.runner.kernels.native:
        pytest.skip("no native CPU step on this machine (no C compiler)")
    assert engine.runner.model.native is None
    assert len(said) == 1, said
    assert "F32 (1)" in said[0] and "of this file's 210 are" in said[0] and "torch path" in said[0], said[0]
    out = engine.generate([EngineRequest("r", engine.tokenizer.encode("Hello"),
                                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])
    assert sum(len(o.token_ids) for o in out["r"]) == 4


def _greedy(engine: LLMEngine, prompt: str, n: int = 32) -> list[int]:
    out = engine.generate([EngineRequest("g", engine.tokenizer.encode(prompt),
                                         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))])["g"]
    return [t for o in out for t in o.token_ids]


Q8Q5 = {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q5_0",
        "ffn_up": "Q5_0", "ffn_down": "Q5_1"}
F16 = dict.fromkeys(Q8Q5, "F16")
BF16 = dict.fromkeys(Q8Q5, "BF16")
# the BF16 file's attn_v rows times 2^-12 and attn_output's times 2^12: the same model (powers of two, within
# bf16's range), but values V's below fp16's normal range, which fp16 tiles would round (the old BF16 rule
# sent such a file to the torch path); bf16 tiles keep them as they are
BF16_SCALE = {"attn_v": 2.0 ** -12, "attn_output": 2.0 ** 12}


@pytest.mark.parametrize("kinds,formats", [(Q8Q5, {"int8 group": 60, "5-bit": 60}), (F16, {"fp16": 120}),
                                            (BF16, {"bf16": 120})], ids=["q8_0-q5_0-q5_1", "f16", "bf16"])
def test_a_file_of_other_types_runs_natively_with_the_float_references_greedy_tokens(tmp_path, caplog, kinds,
                                                                                    formats):
    """SmolLM2 requantised by gguf-py (the types it writes), one type per kind of matrix, or all F16 or BF16:
    the native step reads every layer (int8 group tiles for Q8_0's, 5-bit for Q5_0's and Q5_1's, fp16 or bf16
    tiles; no torch copy) and its greedy tokens equal those of the torch path over the same file's weights
    dequantised to float32, for 32 tokens."""
    tiles = next(iter(formats))
    src = default_model_path()
    names = {t.name: kinds[t.name.split(".")[2]] for t in _reader(src).tensors
             if t.name.startswith("blk.") and t.name.split(".")[2] in kinds}
    path = tmp_path / f"SmolLM2-135M-Instruct-{tiles.replace(' ', '-')}.gguf"
    scale = {n: BF16_SCALE[n.split(".")[2]] for n in names if n.split(".")[2] in BF16_SCALE} \
        if tiles == "bf16" else None
    requantised(src, path, names, scale)
    with caplog.at_level(logging.INFO, logger="engine"):
        # int16 matmuls for every step (prefill too): the int8 wide matmul is the reference test's, by KL
        native = LLMEngine(EngineConfig(model=str(path), kv_cache_tokens=2048, max_running_requests=2,
                                        wide_min_rows=0))
    if not native.runner.kernels.native:
        pytest.skip("no native CPU step on this machine (no C compiler)")
    assert native.runner.model.native is not None and not native.runner.model.layers
    assert native.runner.model.native.tile_formats() == formats
    assert not [r for r in caplog.records if "not used" in r.getMessage()]
    ref = LLMEngine(EngineConfig(model=str(path), kv_cache_tokens=2048, max_running_requests=2, dtype="float32",
                                 weight_dtype="float32"))
    assert ref.runner.model.native is None
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        assert _greedy(native, prompt) == _greedy(ref, prompt), prompt


def test_a_4bit_output_layer_keeps_the_float_references_greedy_tokens(caplog):
    """The output layer's candidate pass on a 4-bit copy (`output_layer_bits = 4`; by default only from 2^26
    weights on, a 128k vocabulary's): each row's 16 best recomputed from the file's rows hold the argmax, so
    the packaged SmolLM2's greedy tokens are the float32 torch path's for 32 tokens; said at start."""
    import kernels.cpu as cpu_kernels

    with caplog.at_level(logging.INFO, logger="engine"):
        native = LLMEngine(EngineConfig(model=str(default_model_path()), kv_cache_tokens=2048, max_running_requests=2,
                                        wide_min_rows=0, output_layer_bits=4))
    if not native.runner.kernels.native:
        pytest.skip("no native CPU step on this machine (no C compiler)")
    assert isinstance(native.runner.model.head_tiles, cpu_kernels.LayerTiles)
    assert any("4-bit output layer" in r.getMessage() for r in caplog.records)
    ref = LLMEngine(EngineConfig(model=str(default_model_path()), kv_cache_tokens=2048, max_running_requests=2,
                                 dtype="float32", weight_dtype="float32"))
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        assert _greedy(native, prompt) == _greedy(ref, prompt), prompt
    # and the int8 copy's tokens where the native step's own rounding parts from the float path (a near-tie
    # at the 8th token of this one, whatever the output layer's copy)
    int8 = LLMEngine(EngineConfig(model=str(default_model_path()), kv_cache_tokens=2048, max_running_requests=2,
                                  wide_min_rows=0, output_layer_bits=8))
    assert isinstance(int8.runner.model.head_tiles, cpu_kernels.Q8Tiles)
    assert _greedy(native, "List three fruits.", 64) == _greedy(int8, "List three fruits.", 64)


def test_the_int8_and_amx_row_thresholds_are_configured_or_measured_at_every_chunk_size(monkeypatch, tmp_path):
    """wide_min_rows = 0 keeps every step on int16 (no AMX either, unless amx_min_rows says so); configured
    thresholds are taken as they are (AMX only where the CPU has it); measured ones time int16, int8 and
    (with AMX) bf16 tiles at every step size up to max_num_batched_tokens, not only up to
    max_running_requests: a prefill chunk has that many rows whatever the batch."""
    import engine.model_runner as model_runner

    monkeypatch.setenv("SLUICE_TUNING_CACHE", str(tmp_path))
    seen: list[tuple[list[str], list[int]]] = []
    real = model_runner.wide_thresholds
    monkeypatch.setattr(model_runner, "wide_thresholds",
                        lambda time_step, modes, rows: seen.append((list(modes), list(rows))) or
                        real(time_step, modes, rows))
    from engine.model import LlamaModel

    layers_timed: dict[int, set[int]] = {}  # step rows -> the layer counts timed
    hidden = LlamaModel.hidden

    def spy(self, token_ids, *args, num_layers=None, **kw):
        if num_layers is not None:
            layers_timed.setdefault(token_ids.shape[0], set()).add(num_layers)
        return hidden(self, token_ids, *args, num_layers=num_layers, **kw)

    monkeypatch.setattr(LlamaModel, "hidden", spy)

    def kernels(**cfg):
        e = LLMEngine(EngineConfig(kv_cache_tokens=2048, max_running_requests=2, **cfg))
        return e.runner.model.native, (e.runner.kernels.wide_min_rows, e.runner.kernels.amx_min_rows)

    native, rows = kernels(wide_min_rows=0)
    if native is None:
        pytest.skip("no native CPU step on this machine (no C compiler)")
    assert rows == (0, 0) and not seen
    amx = 7 if native.amx else 0
    assert kernels(wide_min_rows=3, amx_min_rows=7)[1] == (3 if native.wide else 0, amx)
    assert kernels(wide_min_rows=0, amx_min_rows=7)[1] == (0, amx) and not seen
    if not native.wide:
        return
    _, (int8, amx_rows) = kernels(max_num_batched_tokens=64, chunked_prefill_size=64)
    modes, timed = seen[-1]
    assert modes == ["int16", "int8"] + (["amx"] if native.amx else [])
    assert max(timed) > 2 and set(timed) <= {1, 2, 4, 8, 16, 32, 64}  # beyond max_running_requests
    # a few rows stream every layer's weights from memory: timed over all 30 layers; more rows over 3 (the
    # sizes timed: from 1 row until the last mode has won twice in a row)
    assert 1 in layers_timed and set(layers_timed) <= set(timed)
    assert layers_timed == {r: {30} if r <= 4 else {3} for r in layers_timed}
    assert amx_rows == 0 or native.amx
    _, (int8, amx_rows) = kernels(amx_min_rows=0)  # AMX off: only int16 and int8 timed
    assert seen[-1][0] == ["int16", "int8"] and amx_rows == 0
