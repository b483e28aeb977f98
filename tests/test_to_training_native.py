"""The native ``to_training`` kernel and its numpy twin give the same outputs and errors.

A pipeline's batch (a :class:`~zephon_torch.block_views.BlockBatch` whose token,
position and loss-mask columns are ``[B, S]`` arrays) goes through
``to_training`` twice, once on the compiled kernel
(``zephon_torch/_native/training.c``) and once on the numpy twin, and the two
must agree: the same keys in the same order, the same types, dtypes, shapes
and values, or the same exception with the same message. The batches and
options are random: rows, widths, token and position dtypes, segments,
padding (also outside its row), loss masks of every dtype, texts, and the
options (labels, dtype, flatten, position_mode, EOS masking, ignore_index,
counts, masks, boundaries, rename/exclude). Cases the kernel does not cover
are in the mix too: there it hands the batch to the twin.

With ``ZEPHON_NATIVE=0`` (``scripts/test`` runs this file so once more) the
kernel is off and the kernel-only tests skip.
"""

from __future__ import annotations

import os
import warnings
from itertools import pairwise
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon_torch import _training_native
from zephon_torch.block import Block
from zephon_torch.block_views import BlockBatch
from zephon_torch.ops._binpack import NativeKernelWarning

DISABLED = os.environ.get("ZEPHON_NATIVE", "").strip().lower() in ("0", "false", "no", "off")
NATIVE = _training_native.kernel_available() and not DISABLED
WHY_NOT = ("the compiled to_training kernel is disabled by ZEPHON_NATIVE" if DISABLED else
           "the compiled to_training kernel is not built")
needs_kernel = pytest.mark.skipif(not NATIVE, reason=WHY_NOT)

IGNORES = [-100, -100, -1, 0, 3, 2**40, -(2**33)]


# --------------------------------------------------------------------------- batches


def _segments(rng: np.random.Generator, width: int, dtype: Any) -> np.ndarray:
    """Positions restarting at 0 at random cuts (a pack_flat row)."""
    cuts = sorted(set(rng.integers(1, width, size=int(rng.integers(0, 4))).tolist())
                  ) if width > 1 else []
    bounds = [0, *cuts, width]
    return np.concatenate([np.arange(b - a) for a, b in pairwise(bounds)]
                          ).astype(dtype) if width else np.zeros(0, dtype=dtype)


def _rare(draw: st.DrawFn, common: Any, *rare: Any) -> Any:
    """``common`` 19 times in 20, else one of ``rare``."""
    # Not 0: hypothesis draws the ends of a range more often than the rest.
    return common if draw(st.integers(0, 19)) != 13 else draw(st.sampled_from(rare))


@st.composite
def packed_batches(draw: st.DrawFn) -> BlockBatch:
    rows = draw(st.integers(1, 4))
    width = draw(st.integers(0, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    token_dtype = _rare(draw, draw(st.sampled_from([np.int32, np.int64])), np.int16, np.uint32)
    tokens = rng.integers(-4, 12, size=(rows, width))
    if token_dtype is np.int64 and draw(st.booleans()):
        tokens[rng.random((rows, width)) < 0.2] = 2**40 + 3  # refused by int32 outputs
    if draw(st.booleans()):
        tokens[rng.random((rows, width)) < 0.2] = draw(st.sampled_from(IGNORES[:4]))
    name = _rare(draw, "input_ids", "tokens", "ids")
    fields: dict[str, Any] = {name: tokens.astype(token_dtype)}
    positions = _rare(draw, "segments", "none", "none", "random", "float")
    pos_dtype = _rare(draw, draw(st.sampled_from([np.int32, np.int64])), np.int16)
    if positions == "segments":
        fields["positions"] = np.stack([_segments(rng, width, pos_dtype) for _ in range(rows)])
    elif positions == "random":  # rows that may not start at zero
        fields["positions"] = rng.integers(0, 3, size=(rows, width)).astype(pos_dtype)
    elif positions == "float":
        fields["positions"] = np.zeros((rows, width), dtype=np.float32)
    mask = draw(st.sampled_from([None, None, np.bool_, np.uint8, np.int8, np.int32,
                                 np.float32, np.float64]))
    if mask is not None:
        values = rng.integers(0, 2, size=(rows, width)).astype(mask)
        if mask is np.float64 and width:
            values[0, -1] = np.nan
        if mask is np.int8 and width:
            values[-1, 0] = -1
        fields["loss_mask"] = values
    texts = _rare(draw, draw(st.sampled_from(["none", "strings", "with_none"])), "bytes")
    if texts != "none":
        items: list[Any] = [f"row {i}" for i in range(rows)]
        if texts == "with_none":
            items[0] = None
        elif texts == "bytes":
            items[-1] = b"row"
        fields["text"] = items
    pads: list[Any] = [draw(st.integers(0, width)) for _ in range(rows)]
    odd = _rare(draw, "", "beyond", "negative", "float", "missing")
    if odd == "beyond":
        pads[0] = width + 1
    elif odd == "negative":
        pads[-1] = -1
    elif odd == "float":
        pads[0] = float(pads[0])
    packing = [None if odd == "missing" and i == 0 else {"padding_length": p}
               for i, p in enumerate(pads)]
    ids = np.zeros((rows, 5), dtype=np.int64)
    ids[:, 2] = np.arange(rows)
    return BlockBatch(Block(0, ids, fields=fields, component=np.zeros(rows, dtype=np.int64),
                            packing=packing))


@st.composite
def options(draw: st.DrawFn) -> dict[str, Any]:
    labels = draw(st.booleans())
    kwargs: dict[str, Any] = {
        "return_labels": labels,
        "dtype": _rare(draw, draw(st.sampled_from(["auto", torch.int64, torch.int32, np.int64,
                                                   np.int32, "int64"])),
                       torch.int16, torch.float32, np.uint8, None),
        "flatten": draw(st.booleans()),
        "position_mode": draw(st.sampled_from(["preserve", "sequence"])),
        "return_cu_seqlens": draw(st.booleans()),
        "return_padding_mask": draw(st.booleans()),
        "ignore_index": draw(st.sampled_from(IGNORES)),
    }
    if labels or draw(st.integers(0, 19)) == 13:  # an error, now and then
        kwargs["return_num_valid_tokens"] = draw(st.booleans())
        kwargs["return_loss_mask"] = draw(st.booleans())
    if labels and draw(st.booleans()):
        kwargs.update(eos_mask_loss=True, eos_token_id=_rare(
            draw, draw(st.sampled_from([0, 3, 11])), 2**40, 2**70))
    kwargs["tokens_field"] = _rare(draw, "auto", "input_ids", "tokens")
    renames: list[Any] = [None, None, {"input_ids": "input"}, {"positions": "position_ids"}]
    if labels:
        renames.append({"labels": "input_ids", "input_ids": "labels"})  # a swap
    if kwargs["return_cu_seqlens"]:
        renames.append({"cu_seqlens": "cu", "max_seqlen": "max"})
    kwargs["rename_fields"] = _rare(draw, draw(st.sampled_from(renames)), {"labels": "y"})
    kwargs["exclude_fields"] = draw(st.sampled_from(
        [(), (), ("texts",), ("ids", "positions"), ["max_seqlen", "loss_mask"]]))
    return kwargs


# --------------------------------------------------------------------------- comparing


def _run(batch: BlockBatch, kwargs: dict[str, Any], *, native: bool,
         monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(_training_native, "_enabled", native)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return batch.to_training(**kwargs)
    except (TypeError, ValueError) as exc:
        return exc


def assert_same_output(mine: Any, theirs: Any) -> None:
    """The same exception, or the same keys (in order), types, dtypes, shapes and values
    (bit for bit: a NaN in a payload loss mask equals itself)."""
    if isinstance(theirs, Exception) or isinstance(mine, Exception):
        assert type(mine) is type(theirs) and str(mine) == str(theirs), (mine, theirs)
        return
    assert list(mine) == list(theirs)
    for key in theirs:
        a, b = mine[key], theirs[key]
        assert type(a) is type(b), key
        if isinstance(b, torch.Tensor):
            assert (a.dtype, a.shape, a.is_contiguous()) == (b.dtype, b.shape, True), key
            a, b = a.numpy(), b.numpy()
        if isinstance(b, np.ndarray):
            assert (a.dtype, a.shape, a.flags.c_contiguous) == (b.dtype, b.shape, True), key
            assert a.tobytes() == b.tobytes(), key
        else:
            assert _plain(a) == _plain(b), key


def _plain(value: Any) -> Any:
    """Lists and scalars as comparable values, with their types (True is not 1)."""
    if isinstance(value, (list, tuple)):
        return (type(value), [_plain(v) for v in value])
    if isinstance(value, float) and value != value:
        return (float, "nan")
    return (type(value), value)


@needs_kernel
@settings(max_examples=500, deadline=None)
@given(packed_batches(), options())
def test_the_kernel_and_the_numpy_twin_give_identical_outputs_and_errors(
        batch: BlockBatch, kwargs: dict[str, Any]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        native = _run(batch, kwargs, native=True, monkeypatch=patch)
        twin = _run(batch, kwargs, native=False, monkeypatch=patch)
    assert_same_output(native, twin)


def _bench_batch(pads: tuple[int, ...] = (0, 2, 5)) -> BlockBatch:
    tokens = np.arange(30, dtype=np.int32).reshape(3, 10)
    positions = np.array([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]] * 3, dtype=np.int32)
    block = Block(0, np.zeros((3, 5), dtype=np.int64),
                  fields={"input_ids": tokens, "positions": positions},
                  component=np.zeros(3, dtype=np.int64),
                  packing=[{"padding_length": p} for p in pads])
    return BlockBatch(block)


@needs_kernel
def test_a_pipelines_batch_of_packed_rows_takes_the_kernel(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    calls = []
    real = _training_native._kernel

    class Spy:
        def __getattr__(self, name: str) -> Any:
            if name == "fill":
                def fill(*args: Any) -> Any:
                    calls.append(args)
                    return real.fill(*args)
                return fill
            return getattr(real, name)

    monkeypatch.setattr(_training_native, "_kernel", Spy())
    monkeypatch.setattr(_training_native, "_enabled", True)
    out = _bench_batch().to_training(return_labels=True, return_cu_seqlens=True,
                                     return_loss_mask=True)
    assert len(calls) == 1
    assert out["labels"].tolist()[1] == [11, 12, 13, 14, 15, 16, 17, -100, -100]
    assert out["loss_mask"][2].tolist() == [1.0] * 4 + [0.0] * 5
    assert out["cu_seqlens"].tolist() == [[0, 3, 5, 9]] * 3
    assert out["max_seqlen"].tolist() == [4] * 3
    assert out["positions"].dtype == torch.int64 and out["input_ids"].dtype == torch.int64


@needs_kernel
def test_rows_the_twin_refuses_are_left_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_training_native, "_enabled", True)
    with pytest.raises(ValueError, match="padding_length 11 falls outside its token row"):
        _bench_batch(pads=(0, 11, 0)).to_training(return_labels=True)
    batch = _bench_batch()
    batch.block.fields["positions"][1, 0] = 1
    with pytest.raises(ValueError, match=r"record \(0, 0, 0\) has input positions starting"):
        batch.to_training(return_cu_seqlens=True)


def test_zephon_native_0_or_a_missing_kernel_selects_the_twin(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    monkeypatch.setattr(_training_native, "_enabled", None)
    monkeypatch.setenv("ZEPHON_NATIVE", "0")
    assert _training_native.kernel_enabled() is False
    monkeypatch.setattr(_training_native, "_enabled", None)
    monkeypatch.setattr(_training_native, "_kernel", None)
    monkeypatch.setattr(_training_native, "_KERNEL_ERROR", "No module named 'training'")
    monkeypatch.delenv("ZEPHON_NATIVE")
    with pytest.warns(NativeKernelWarning, match="to_training kernel is not available.*numpy "
                                                 "twin.*C compiler.*ZEPHON_NATIVE=0"):
        assert _training_native.kernel_enabled() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _training_native.kernel_enabled() is False  # decided once per process
        out = _bench_batch().to_training(return_labels=True)
    assert out["labels"][0].tolist() == list(range(1, 10))


@pytest.mark.skipif(not _training_native.kernel_available(), reason=WHY_NOT)
def test_an_unknown_zephon_native_value_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_training_native, "_enabled", None)
    monkeypatch.setenv("ZEPHON_NATIVE", "maybe")
    with pytest.raises(ValueError, match=r"ZEPHON_NATIVE='maybe' is not understood"):
        _bench_batch().to_training()


@needs_kernel
def test_the_kernel_refuses_buffers_of_the_wrong_kind() -> None:
    kernel = _training_native._kernel
    tokens = np.zeros((2, 4), dtype=np.int32)
    out = np.empty((2, 4), dtype=np.int64)
    none = (None,) * 5
    with pytest.raises(TypeError, match="tokens must be a 2-D array"):
        kernel.fill(tokens.ravel(), None, None, None, 0, 0, 0, out, *none)
    with pytest.raises(TypeError, match="inputs must hold at least 8 signed integers of 4 or 8"):
        kernel.fill(tokens, None, None, None, 0, 0, 0, out[:1], *none)
    with pytest.raises(TypeError, match="inputs must be a writable"):
        readonly = out.copy()
        readonly.flags.writeable = False
        kernel.fill(tokens, None, None, None, 0, 0, 0, readonly, *none)
    with pytest.raises(TypeError, match="tokens must be a C-contiguous"):
        kernel.fill(np.zeros((4, 2), dtype=np.int32).T, None, None, None, 0, 0, 0, out, *none)
    with pytest.raises(TypeError, match="fill\\(\\) takes 13 arguments"):
        kernel.fill(tokens)


@needs_kernel
def test_pinned_outputs_are_the_tensors_the_pinned_allocator_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``pin_memory=True`` the kernel fills pinned tensors through their numpy views
    and returns those very tensors (the pinned allocator tracks copies only on its own)."""
    from zephon_torch._training_format import _output_format

    made: list[torch.Tensor] = []
    real_empty = torch.empty

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        assert pin_memory  # a stand-in for pinned memory on a machine without a GPU
        made.append(real_empty(*args, **kwargs))
        return made[-1]

    plan = _training_native.native_plan(
        _output_format("auto", None, True), return_labels=True, ignore_index=-100,
        return_num_valid_tokens=True, return_loss_mask=True, return_cu_seqlens=True,
        return_padding_mask=True, eos_token_id=None, position_mode="preserve", flatten=False)
    assert plan is not None
    batch = _bench_batch()
    monkeypatch.setattr(torch, "empty", empty)
    out = _training_native.columns_to_training(batch.block.fields, batch._training_rows(),
                                               "auto", plan)
    monkeypatch.undo()
    assert out is not None
    pinned = [out[k] for k in ("input_ids", "labels", "positions", "loss_mask", "max_seqlen",
                               "padding_mask")]
    assert sorted(map(id, made)) == sorted(map(id, pinned))
    monkeypatch.setattr(_training_native, "_enabled", False)
    assert_same_output(out, batch.to_training(
        return_labels=True, return_num_valid_tokens=True, return_loss_mask=True,
        return_cu_seqlens=True, return_padding_mask=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_pin_memory_without_a_gpu_fails_as_on_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    errors = []
    for native in (True, False):
        monkeypatch.setattr(_training_native, "_enabled", native and NATIVE)
        with pytest.raises(RuntimeError) as caught:
            _bench_batch().to_training(return_labels=True, pin_memory=True)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]
