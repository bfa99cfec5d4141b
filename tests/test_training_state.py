"""Training state as named tensors: exact round trips, determinism, and refusal of bad input."""

from __future__ import annotations

import ctypes
import functools
import io
import json
import math
import sys
import zlib
from typing import Any

import pytest
import safetensors.torch
import torch
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from peer import heap
from peer.errors import ProtocolError
from peer.training.chunks import PIECE_BYTES, chunk_ends, chunk_span
from peer.training.state import (
    StaleState,
    StateBytes,
    StateMismatch,
    TrainingState,
    capture,
    check_finite,
    from_bytes,
    from_file,
    header_bytes,
    parameters_digest,
    parse_blob,
    parse_header,
    restore,
    state_digest,
    to_bytes,
    write_file,
)
from peer.training.task import ByteGPTTask, TinyTask

Optimizers = dict[str, torch.optim.Optimizer]


def tiny_setup() -> tuple[TinyTask, nn.Module, Optimizers]:
    """The tiny task with the DiLoCo pair of optimizers: AdamW inner, Nesterov SGD outer."""
    task = TinyTask()
    model = task.build_model()
    optimizers: Optimizers = {
        "inner": torch.optim.AdamW(model.parameters(), lr=1e-2),
        "outer": torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, nesterov=True),
    }
    return task, model, optimizers


def train(task: TinyTask, model: nn.Module, optimizers: Optimizers, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for optimizer in optimizers.values():  # both step, so both have state
            optimizer.zero_grad()
            task.loss(model, task.sample_batch(8, generator)).backward()
            optimizer.step()


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal structure, types and bits (tensors: same dtype, shape and every bit)."""
    kinds = [dict if isinstance(x, dict) else type(x) for x in (a, b)]  # OrderedDict is a dict
    assert kinds[0] is kinds[1], f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        bits = [t.reshape(-1).view(torch.uint8) for t in (a, b)]  # -0.0 != 0.0, NaN == NaN
        assert torch.equal(*bits), where
    elif isinstance(a, dict):
        assert sorted(a, key=str) == sorted(b, key=str), f"{where}: {list(a)} vs {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def snapshot(model: nn.Module, optimizers: Optimizers) -> dict[str, Any]:
    """A deep copy of everything restore may write."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        **{
            name: {
                "state": {
                    i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                    for i, s in opt.state_dict()["state"].items()
                },
                "param_groups": opt.state_dict()["param_groups"],
            }
            for name, opt in optimizers.items()
        },
    }


def current(model: nn.Module, optimizers: Optimizers) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        **{name: opt.state_dict() for name, opt in optimizers.items()},
    }


def test_round_trip_is_bit_identical_and_training_continues_identically():
    task, model, optimizers = tiny_setup()
    train(task, model, optimizers, steps=3, seed=1)
    state = capture(7, model, optimizers, scheduler_state={"last_epoch": 7}, extra={"samples": 9})
    blob = to_bytes(state)

    _, fresh, fresh_optimizers = tiny_setup()
    assert parameters_digest(fresh) != parameters_digest(model)
    loaded = from_bytes(blob)
    restore(loaded, fresh, fresh_optimizers)

    assert loaded.step == 7
    assert loaded.scheduler_state == {"last_epoch": 7} and loaded.extra == {"samples": 9}
    assert_same(current(fresh, fresh_optimizers), current(model, optimizers))
    assert fresh_optimizers["inner"].param_groups[0]["betas"] == (0.9, 0.999)  # a tuple again
    assert parameters_digest(fresh) == parameters_digest(model)

    train(task, model, optimizers, steps=3, seed=2)
    train(task, fresh, fresh_optimizers, steps=3, seed=2)
    assert_same(current(fresh, fresh_optimizers), current(model, optimizers))
    assert parameters_digest(fresh) == parameters_digest(model)
    # Neither the capture nor the restore aliased the live tensors: the state did not move.
    assert to_bytes(state) == blob == to_bytes(loaded)


def _state_addresses(optimizers: Optimizers) -> dict[tuple[str, int, str], int]:
    """Where each optimizer state tensor lives, by (optimizer, parameter, key)."""
    return {
        (name, id(p), key): value.data_ptr()
        for name, opt in optimizers.items()
        for p, values in opt.state.items()
        for key, value in values.items()
        if isinstance(value, torch.Tensor)
    }


def test_a_restore_into_a_trained_optimizer_writes_into_its_own_moments():
    """A peer catching up already holds moments of the same shapes: the downloaded ones are
    copied into them, so no second set is allocated (at 100 M, 0.8 GB more at the peak of
    a catch-up), and training goes on exactly as from a fresh restore, the state untouched."""
    task, model, optimizers = tiny_setup()
    train(task, model, optimizers, steps=3, seed=1)
    blob = to_bytes(capture(3, model, optimizers))

    _, behind, behind_optimizers = tiny_setup()
    train(task, behind, behind_optimizers, steps=1, seed=5)  # its own, older moments
    own = _state_addresses(behind_optimizers)
    loaded = from_bytes(blob)
    restore(loaded, behind, behind_optimizers)
    assert _state_addresses(behind_optimizers) == own  # the same memory, every tensor
    assert_same(current(behind, behind_optimizers), current(model, optimizers))

    train(task, model, optimizers, steps=2, seed=2)
    train(task, behind, behind_optimizers, steps=2, seed=2)
    assert_same(current(behind, behind_optimizers), current(model, optimizers))
    assert to_bytes(loaded) == blob  # the download was not written into


def _shifted(blob: bytes, by: int) -> bytes:
    """The same state with every tensor `by` bytes further on (a longer header): a donor
    chooses the layout, and no digest covers it."""
    size = int.from_bytes(blob[:8], "little")
    header = blob[8 : 8 + size] + b" " * by
    return len(header).to_bytes(8, "little") + header + blob[8 + size :]


@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "trained"])
@pytest.mark.parametrize("loaded", [("inner", "outer"), ("outer",)], ids=["both", "outer"])
@pytest.mark.parametrize("shift", [0, 1], ids=["aligned", "misaligned"])
def test_a_download_s_optimizer_tensors_are_kept_where_they_lie_and_the_rest_given_back(
    trained, loaded, shift
):
    """A download is ours alone (`release` given): the optimizers keep their tensors in it as
    they are (no copy: beside three training 100 M peers, cloning AdamW's moments took
    1.4-2.5 s of a joiner's load), unless misaligned; every other tensor is given back (the
    model's, copied into the parameters, and those of an optimizer not loaded: a donor's
    DiLoCo inner one), and training goes on exactly as the donor's does."""
    task, model, optimizers = tiny_setup()
    train(task, model, optimizers, steps=3, seed=1)
    blob = bytes(bytearray(_shifted(to_bytes(capture(3, model, optimizers)), shift)))
    state = from_bytes(blob)
    names = {t.data_ptr(): n for n, t in state.tensors.items()}

    _, joiner, joiner_optimizers = tiny_setup()
    if trained:  # moments of its own, which a copy would have gone into
        train(task, joiner, joiner_optimizers, steps=1, seed=5)
    released: list[tuple[int, int]] = []
    restore(
        state,
        joiner,
        {name: joiner_optimizers[name] for name in loaded},
        from_donor=True,
        release=lambda address, size: released.append((address, size)),
    )
    kept = {
        names.get(address, "elsewhere")
        for name in loaded
        for address in _state_addresses({name: joiner_optimizers[name]}).values()
    }
    given_back = {names.get(address, "elsewhere") for address, _ in released}
    if shift:
        assert kept == {"elsewhere"}  # copies, aligned
    else:
        assert kept == {n for n in state.tensors if n.startswith(loaded)}
    assert given_back == set(state.tensors) - kept

    train(task, model, optimizers, steps=2, seed=2)
    train(task, joiner, joiner_optimizers, steps=2, seed=2)
    if loaded == ("inner", "outer"):
        assert_same(current(joiner, joiner_optimizers), current(model, optimizers))


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_DONTNEED) is Linux's")
@pytest.mark.parametrize("page", [4096, 65536])
def test_a_released_download_loads_exactly_whatever_the_kernel_s_page(page):
    """`release` gives a download's pages back as its tensors are loaded, and must never take
    one still to be loaded: madvise rounds its range to the kernel's page (64 KiB on some
    arm64 kernels, where 4 KiB rounding zeroed the start of the next tensor). The kernel is
    emulated here: a misaligned address refused, a length rounded up to `page`."""
    real = heap._madvise()  # read, not replaced: the emulated kernel calls it
    assert real is not None
    calls = []

    def kernel(address: int, length: int, advice: int) -> int:
        calls.append(address)
        if address % page:
            return -1  # EINVAL
        return real(address, -(-length // page) * page, advice)

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))  # 256 KiB weights
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    blob = to_bytes(capture(1, model, {"optimizer": optimizer}))
    expected = {n: t.clone() for n, t in from_bytes(blob).tensors.items()}
    torch.manual_seed(1)
    fresh = nn.Sequential(*(nn.Linear(256, 256) for _ in range(6)))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    restore(
        from_bytes(blob),
        fresh,
        {"optimizer": fresh_optimizer},
        from_donor=True,
        release=functools.partial(
            heap.drop_pages, within=heap.span_of(blob), page=page, madvise=kernel
        ),
    )
    assert calls  # pages went back
    loaded = capture(1, fresh, {"optimizer": fresh_optimizer}).tensors
    assert all(torch.equal(loaded[n], expected[n]) for n in expected if n in loaded)
    assert sum(n in loaded for n in expected) >= 24  # weights, biases and their moments
    assert blob.count(0) > 6 * 256 * 256  # most of the weights' bytes were given back


def test_to_bytes_is_deterministic():
    task, model, optimizers = tiny_setup()
    train(task, model, optimizers, steps=2, seed=1)
    blob = to_bytes(capture(2, model, optimizers))
    reordered = {"outer": optimizers["outer"], "inner": optimizers["inner"]}
    assert to_bytes(capture(2, model, reordered)) == blob
    assert to_bytes(from_bytes(blob)) == blob


def test_a_streamed_file_is_a_safetensors_state_and_its_crc_is_the_file_s(tmp_path, monkeypatch):
    """`write_file` streams the tensors (no `to_bytes` blob); the file loads with the
    safetensors library and back into the same state; equal states give equal files."""
    task, model, optimizers = tiny_setup()
    train(task, model, optimizers, steps=2, seed=1)
    state = capture(4, model, optimizers, extra={"samples": 3})
    state.tensors["model.flag"] = torch.tensor([True, False])  # 1-byte and 8-byte tensors
    state.tensors["model.count"] = torch.tensor(2**62 + 1, dtype=torch.int64)
    state.tensors["model.half"] = torch.tensor([1.0009765625, -0.0], dtype=torch.bfloat16)
    monkeypatch.setattr(
        "peer.training.state.to_bytes", lambda state: pytest.fail("a whole-state blob")
    )
    path = tmp_path / "state.safetensors"
    with path.open("wb") as file:
        crc32 = write_file(state, file, piece_bytes=1000)  # many pieces per tensor
    data = path.read_bytes()
    assert crc32 == zlib.crc32(data)
    assert len(data) > 20 * 1000
    loaded = from_file(path)
    assert loaded.step == 4 and loaded.extra == {"samples": 3}
    assert_same(dict(sorted(loaded.tensors.items())), dict(sorted(state.tensors.items())))
    assert set(safetensors.torch.load(data)) == set(state.tensors)
    again = tmp_path / "again.safetensors"
    with again.open("wb") as file:
        write_file(from_file(path), file)
    assert again.read_bytes() == data


def test_from_file_refuses_what_is_no_state(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"\x10" + bytes(40))
    with pytest.raises(StateMismatch, match="not a safetensors state"):
        from_file(path)
    safetensors.torch.save_file({"model.w": torch.zeros(2)}, path)
    with pytest.raises(StateMismatch, match="lacks the 'peertrain' metadata"):
        from_file(path)


def test_restoring_a_never_stepped_optimizer_clears_state():
    task, model, optimizers = tiny_setup()
    blank = capture(0, model, optimizers)
    train(task, model, optimizers, steps=2, seed=1)
    restore(from_bytes(to_bytes(blank)), model, optimizers)
    assert all(not opt.state for opt in optimizers.values())
    _, initial, _ = tiny_setup()
    assert parameters_digest(model) == parameters_digest(initial)


def test_scalar_and_none_optimizer_state_round_trip():
    _, model, optimizers = tiny_setup()
    first = next(model.parameters())
    # Older torch keeps SGD's momentum_buffer = None before the first step, and an int step.
    optimizers["outer"].state[first]["momentum_buffer"] = None
    optimizers["inner"].state[first]["step"] = 3
    state = from_bytes(to_bytes(capture(1, model, optimizers)))
    _, fresh, fresh_optimizers = tiny_setup()
    restore(state, fresh, fresh_optimizers)
    restored = next(fresh.parameters())
    assert fresh_optimizers["outer"].state[restored] == {"momentum_buffer": None}
    assert fresh_optimizers["inner"].state[restored] == {"step": 3}


def test_bool_int_and_scalar_tensors_round_trip_exactly():
    tensors = {
        "model.flag": torch.tensor([True, False, True]),
        "model.count": torch.tensor(2**62 + 1, dtype=torch.int64),
        "model.half": torch.tensor([1.0009765625, -0.0], dtype=torch.bfloat16),
        "model.empty": torch.zeros(0, 3),
    }
    state = TrainingState(
        5, tensors, {"model_aliases": {}, "optimizers": {}, "scheduler": None, "extra": None}
    )
    loaded = from_bytes(to_bytes(state))
    assert_same(dict(sorted(loaded.tensors.items())), dict(sorted(tensors.items())))


def test_gpt_round_trip_keeps_the_tied_head_tied():
    task = ByteGPTTask()
    model = task.build_model()
    assert model.head.weight is model.tokens.weight
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    state = capture(1, model, {"optimizer": task.make_optimizer(model.parameters())})
    assert "model.head.weight" not in state.tensors  # stored once, as tokens.weight
    assert state.metadata["model_aliases"] == {"head.weight": "tokens.weight"}

    fresh = task.build_model()
    restore(
        from_bytes(to_bytes(state)), fresh, {"optimizer": task.make_optimizer(fresh.parameters())}
    )
    assert fresh.head.weight is fresh.tokens.weight
    assert parameters_digest(fresh) == parameters_digest(model)

    untied = task.build_model()
    untied.head.weight = nn.Parameter(untied.tokens.weight.detach().clone())
    with pytest.raises(StateMismatch, match="ties"):
        restore(state, untied, {"optimizer": task.make_optimizer(untied.parameters())})


def _other_widths() -> tuple[nn.Module, Optimizers]:
    model = nn.Sequential(nn.Linear(64, 100), nn.GELU(), nn.Linear(100, 16))
    return model, {
        "inner": torch.optim.AdamW(model.parameters()),
        "outer": torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, nesterov=True),
    }


def _renamed(state: TrainingState) -> None:
    state.tensors["model.0.weights"] = state.tensors.pop("model.0.weight")


def _extra_tensor(state: TrainingState) -> None:
    state.tensors["model.3.weight"] = torch.zeros(1)


def _double(state: TrainingState) -> None:
    state.tensors["model.2.bias"] = state.tensors["model.2.bias"].double()


def _bad_moment(state: TrainingState) -> None:  # the model is fine, the optimizer is not
    state.tensors["inner.1.exp_avg"] = torch.zeros(3)


def _unknown_parameter(state: TrainingState) -> None:
    state.tensors["outer.9.momentum_buffer"] = torch.zeros(16)


def _two_groups(state: TrainingState) -> None:
    groups = state.metadata["optimizers"]["outer"]["param_groups"]
    groups.append(dict(groups[0], params=[]))


def _missing_optimizer(state: TrainingState) -> None:
    del state.metadata["optimizers"]["outer"]
    for name in [n for n in state.tensors if n.startswith("outer.")]:
        del state.tensors[name]


def _bad_setting(state: TrainingState) -> None:
    state.metadata["optimizers"]["inner"]["param_groups"][0]["betas"] = [0.9]


def _reordered(state: TrainingState) -> None:  # no digest covers it: moments trade places
    state.metadata["optimizers"]["inner"]["param_groups"][0]["params"].reverse()


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (_renamed, "lacks model tensor '0.weight'"),
        (_extra_tensor, "unexpected model tensor '3.weight'"),
        (_double, r"model tensor '2.bias' is \(16,\) torch.float64"),
        (_bad_moment, "'inner.1.exp_avg'"),
        (_unknown_parameter, "parameter 9"),
        (_two_groups, "2 param groups"),
        (_missing_optimizer, "optimizers"),
        (_bad_setting, "betas"),
        (_reordered, "numbers its params otherwise"),
        (None, r"model tensor '0.weight' is \(128, 64\).*expected \(100, 64\)"),
    ],
)
def test_restore_refuses_a_mismatch_and_changes_nothing(spoil, message):
    task, donor, donor_optimizers = tiny_setup()
    train(task, donor, donor_optimizers, steps=2, seed=1)
    state = from_bytes(to_bytes(capture(2, donor, donor_optimizers)))
    if spoil is None:
        model, optimizers = _other_widths()
    else:
        spoil(state)
        _, model, optimizers = tiny_setup()
    train(task, model, optimizers, steps=1, seed=3)  # so there is optimizer state to keep
    before = snapshot(model, optimizers)
    with pytest.raises(StateMismatch, match=message) as raised:
        restore(state, model, optimizers)
    assert isinstance(raised.value, ProtocolError)
    assert "\n" not in str(raised.value)
    assert_same(current(model, optimizers), before)


def test_a_never_stepped_optimizer_still_checks_shapes_against_its_parameters():
    task, donor, donor_optimizers = tiny_setup()
    train(task, donor, donor_optimizers, steps=1, seed=1)
    state = capture(1, donor, donor_optimizers)
    state.tensors["inner.1.exp_avg"] = torch.zeros(3)  # parameter 1 is a (128,) bias
    _, model, optimizers = tiny_setup()
    with pytest.raises(StateMismatch, match=r"'inner\.1\.exp_avg' has shape \(3,\)"):
        restore(state, model, optimizers)
    assert all(not opt.state for opt in optimizers.values())


def _payload_blob(payload: Any) -> bytes:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return safetensors.torch.save({"model.w": torch.zeros(2)}, metadata={"peertrain": text})


GOOD = {
    "format": 1,
    "step": 3,
    "metadata": {"model_aliases": {}, "optimizers": {}, "scheduler": None, "extra": None},
}


def test_a_well_formed_handmade_blob_parses():
    assert from_bytes(_payload_blob(GOOD)).step == 3  # so the refusals below are about one thing


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({**GOOD, "step": -1}, "step -1"),
        ({**GOOD, "step": "3"}, "step '3'"),
        ({**GOOD, "step": True}, "step True"),
        ({**GOOD, "format": 2}, "format 2"),
        ({"format": 1, "step": 3}, "keys"),
        ({**GOOD, "metadata": []}, "metadata"),
        ({**GOOD, "metadata": {**GOOD["metadata"], "optimizers": {"a.b": {}}}}, "identifier"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "list"),
        ("[" * 100_000, "not valid JSON"),
    ],
)
def test_from_bytes_refuses_a_bad_header(payload, message):
    with pytest.raises(StateMismatch, match=message):
        from_bytes(_payload_blob(payload))


def test_from_bytes_refuses_stray_tensors_and_a_missing_header():
    blob = safetensors.torch.save(
        {"model.w": torch.zeros(2), "evil.0.x": torch.zeros(1)},
        metadata={"peertrain": json.dumps(GOOD)},
    )
    with pytest.raises(StateMismatch, match=r"evil\.0\.x"):
        from_bytes(blob)
    with pytest.raises(StateMismatch, match="lacks"):
        from_bytes(safetensors.torch.save({"model.w": torch.zeros(2)}))


def test_from_bytes_refuses_every_truncation():
    task, model, optimizers = tiny_setup()
    train(task, model, optimizers, steps=1, seed=1)
    blob = to_bytes(capture(1, model, optimizers))
    for length in [*range(0, 300), *range(300, len(blob), 997), len(blob) - 1]:
        with pytest.raises(ProtocolError):
            from_bytes(blob[:length])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_from_bytes_refuses_random_bytes(data):
    with pytest.raises(ProtocolError):
        from_bytes(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(min_value=0))
def test_from_bytes_refuses_random_corruption_of_the_header(garbage, offset):
    """Overwrite bytes inside the header of a real blob: a clean refusal or a clean parse."""
    blob = bytearray(_payload_blob(GOOD))
    header_end = 8 + int.from_bytes(blob[:8], "little")
    start = offset % header_end
    blob[start : start + len(garbage)] = garbage[: header_end - start]
    try:
        state = from_bytes(bytes(blob))
    except ProtocolError:
        return
    assert isinstance(state.step, int) and state.step >= 0


def test_from_bytes_never_unpickles(monkeypatch):
    buffer = io.BytesIO()
    torch.save({"model.w": torch.zeros(2)}, buffer)
    pickled = buffer.getvalue()

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("from_bytes unpickled something")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr("pickle.loads", refuse)
    monkeypatch.setattr("pickle.load", refuse)
    with pytest.raises(ProtocolError):
        from_bytes(pickled)
    assert from_bytes(_payload_blob(GOOD)).step == 3


def test_parameters_digest_sees_one_bit():
    _, model, _ = tiny_setup()
    digest = parameters_digest(model)
    assert len(digest) == 32 and digest == parameters_digest(tiny_setup()[1])
    with torch.no_grad():
        weight = next(model.parameters())
        weight.view(torch.int32)[0, 0] ^= 1  # the lowest mantissa bit of one weight
    assert parameters_digest(model) != digest


def _framed(entries: dict, data: bytes) -> bytes:
    """A safetensors-framed blob with these header entries (and GOOD's metadata)."""
    header = json.dumps({"__metadata__": {"peertrain": json.dumps(GOOD)}, **entries}).encode()
    return len(header).to_bytes(8, "little") + header + data


def test_parsed_tensors_are_views_of_the_downloaded_bytes():
    """No copy of the state beside the download (a joiner held both: twice the state)."""
    blob = _framed(
        {
            "model.w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "model.h": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
            "model.e": {"dtype": "F32", "shape": [0, 4], "data_offsets": [22, 22]},
        },
        torch.arange(4.0).numpy().tobytes()
        + torch.ones(3, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes(),
    )
    state = from_bytes(blob)
    assert state.tensors["model.w"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    assert state.tensors["model.h"].tolist() == [1.0, 1.0, 1.0]
    assert state.tensors["model.e"].shape == (0, 4)
    start = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value
    assert start <= state.tensors["model.w"].data_ptr() < start + len(blob)
    assert safetensors.torch.load(blob)["model.w"].tolist() == [[0.0, 1.0], [2.0, 3.0]]


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("entries", "data", "message"),
    [
        ({"model.w": {**F32x2, "dtype": "X9"}}, bytes(8), "malformed"),
        ({"model.w": {**F32x2, "shape": [-2]}}, bytes(8), "malformed"),
        ({"model.w": {**F32x2, "shape": [2.0]}}, bytes(8), "malformed"),
        ({"model.w": {**F32x2, "data_offsets": [0]}}, bytes(8), "malformed"),
        ({"model.w": {**F32x2, "extra": 1}}, bytes(8), "malformed"),
        ({"model.w": [1, 2]}, bytes(8), "malformed"),
        ({"model.w": {**F32x2, "data_offsets": [0, 12]}}, bytes(12), "bad offsets"),
        ({"model.w": {**F32x2, "data_offsets": [8, 16]}}, bytes(8), "bad offsets"),
        ({"model.w": {**F32x2, "data_offsets": [-8, 0]}}, bytes(8), "bad offsets"),
        ({"model.w": F32x2, "model.v": F32x2}, bytes(8), "overlap or leave gaps"),
        ({"model.w": {**F32x2, "data_offsets": [4, 12]}}, bytes(12), "overlap or leave gaps"),
        ({"model.w": F32x2}, bytes(9), "past its last tensor"),
        # Empty, but of a shape torch cannot stride (it raised RuntimeError past the parser).
        (
            {"model.e": {"dtype": "F32", "shape": [0, 2**61, 2**61], "data_offsets": [0, 0]}},
            b"",
            "entry 'model.e': .*overflow",
        ),
        # ...or cannot take at all (TypeError), and more dimensions than a state has.
        ({"model.e": {**F32x2, "shape": [0, 2**63], "data_offsets": [0, 0]}}, b"", "malformed"),
        ({"model.e": {**F32x2, "shape": [1] * 17, "data_offsets": [0, 4]}}, bytes(4), "malformed"),
    ],
)
@pytest.mark.parametrize("whole", [True, False])
def test_from_bytes_refuses_bad_framing_without_a_copy(entries, data, message, whole):
    """Whole (`from_bytes`), or the header alone (`parse_header`: a catch-up in place)."""
    blob = _framed(entries, data)
    with pytest.raises(StateMismatch, match=message):
        if whole:
            from_bytes(blob)
        else:
            parse_header(blob[: header_bytes(blob)], len(blob))


def test_from_bytes_refuses_a_header_longer_than_the_blob():
    blob = _framed({"model.w": F32x2}, bytes(8))
    with pytest.raises(StateMismatch, match="header in"):
        from_bytes((len(blob) - 7).to_bytes(8, "little") + blob[8:])
    with pytest.raises(StateMismatch, match="no JSON object"):
        from_bytes((2).to_bytes(8, "little") + b"[]")


def test_state_bytes_are_the_file_s_bytes_read_in_slices_from_the_tensors(tmp_path):
    task, model, optimizers = tiny_setup()
    train(task, model, optimizers, steps=1, seed=3)
    state = capture(2, model, optimizers, copy=True)
    path = tmp_path / "s.safetensors"
    with path.open("wb") as file:
        write_file(state, file)
    expected = path.read_bytes()
    moved = [False]
    sliced = StateBytes(state, valid=lambda: not moved[0])
    assert len(sliced) == len(expected) and bytes(sliced) == expected
    for start, stop in [(0, 8), (5, 300), (100, len(expected)), (len(expected) - 3, 10**9)]:
        assert bytes(sliced[start:stop]) == expected[start:stop]
    inside = sliced[len(expected) - 64 : len(expected) - 32]
    assert isinstance(inside, memoryview)  # within one tensor: no copy
    assert from_bytes(sliced).step == 2
    moved[0] = True  # the trainer stepped: what the tensors hold is no longer this state
    with pytest.raises(StaleState):
        sliced[0:8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_check_finite_finds_one_bad_value_and_passes_sums_that_overflow(dtype, bad):
    """The check sums each tensor (one pass, no per-value temporary): a sum that overflows
    from finite values must not refuse them, and one NaN or Inf anywhere must be refused."""
    huge = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)
    assert not torch.isfinite(huge.sum())
    check_finite([huge, torch.zeros(0, dtype=dtype), 1.5, 3])
    for where in (0, 517, 999):
        spoiled = huge.clone() if where % 2 else torch.ones(1000, dtype=dtype)
        spoiled[where] = bad
        with pytest.raises(StateMismatch, match="NaN or Inf"):
            check_finite([torch.ones(3, dtype=dtype), spoiled])
    with pytest.raises(StateMismatch, match="NaN or Inf"):
        check_finite([bad])


def large_state() -> TrainingState:
    """A header, a tensor of 2.5 pieces (the digest's PIECE_BYTES), small ones around it."""
    generator = torch.Generator().manual_seed(3)
    large = torch.randn(PIECE_BYTES * 5 // 8, generator=generator)  # float32: 2.5 pieces
    return TrainingState(
        4,
        {
            "model.a_bias": torch.randn(5, generator=generator),
            "model.weight": large,
            "model.z_bias": torch.randn(7, generator=generator),
        },
        {"model_aliases": {}, "optimizers": {}, "scheduler": None, "extra": None},
    )


def test_a_donor_s_chunks_of_a_large_tensor_are_its_digest_s_pieces():
    """A donor serves a trainer's held state without hashing it again: the chunks it cuts
    along the layout are the pieces its step's digest hashed."""
    state = large_state()
    names = ["a_bias", "weight", "z_bias"]
    certified = state_digest(state, names, ())
    assert [len(certified.pieces[f"model.{n}"]) for n in names] == [1, 3, 1]
    blob = StateBytes(state)
    known = blob.layout.piece_hashes(certified.pieces)
    ends = chunk_ends(len(blob), blob.layout.parts, PIECE_BYTES)
    spans = [chunk_span(ends, i) for i in range(len(ends))]
    start, end = blob.layout.spans["model.weight"]
    covered = [span for span in spans if start <= span[0] < end]
    assert len(covered) == 3 and all(span in known for span in covered)
    for span, digest in known.items():
        assert digest == blake3(blob[span[0] : span[1]]).digest()


def test_a_joiner_takes_the_pieces_its_chunk_checks_hashed():
    """The digest of a download takes each piece's hash from the chunk checks (they hashed
    the bytes received), so a joiner hashes its state once. Only checked hashes may be
    given: a wrong one makes another digest."""
    state = large_state()
    names = ["a_bias", "weight", "z_bias"]
    expected = state_digest(state, names, ()).digest
    data = bytes(StateBytes(state))
    ends = chunk_ends(len(data), StateBytes(state).layout.parts, PIECE_BYTES)
    checked = {
        span: blake3(data[span[0] : span[1]]).digest()
        for span in (chunk_span(ends, i) for i in range(len(ends)))
    }
    parsed, layout = parse_blob(data)
    taken: list[tuple[str, int]] = []
    known = layout.known(checked)

    def counted(name: str, index: int) -> bytes | None:
        digest = known(name, index)
        if digest is not None:
            taken.append((name, index))
        return digest

    assert state_digest(parsed, names, (), known=counted).digest == expected
    assert [(n, i) for n, i in taken if n == "model.weight"] == [
        ("model.weight", i) for i in range(3)
    ]
    first = layout.spans["model.weight"][0]
    wrong = {**checked, (first, first + PIECE_BYTES): bytes(32)}
    assert state_digest(parsed, names, (), known=layout.known(wrong)).digest != expected
