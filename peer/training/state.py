"""The training state of a peer as named CPU tensors plus JSON: what checkpoints hold and donors send.

Nothing here is ever unpickled (no `torch.load`, no `pickle`): a state travels as a safetensors
blob, whose parser only reads a JSON header and raw little-endian arrays, so a malicious donor can
at worst send wrong numbers, which `restore` checks against the local model before using them.

Layout of a `TrainingState`:

    tensors   "model.<name>"          model.state_dict() entries; a tensor tied to an earlier
                                      name (GPT's head = token embedding) is stored once
              "<opt>.<index>.<key>"   tensor entries of optimizers[opt].state_dict()["state"]
    metadata  {"model_aliases": {tied name: stored name},
               "optimizers": {opt: {"param_groups": [...], "scalars": {index: {key: value}}}},
               "scheduler": dict | None, "extra": dict | None}

The bytes (`to_bytes`) are `safetensors.torch.save(tensors)` with one header entry,
"peertrain" = JSON {"format": 1, "step": ..., "metadata": ...}. The tensors are laid out in a
fixed order (safetensors sorts by dtype then name) and the JSON has sorted keys, so equal states
give equal bytes.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import re
import warnings
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate, chain
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from peer.errors import ProtocolError, RemoteError
from peer.files import Sink
from peer.training.chunks import PIECE_BYTES, chunk_hash

FORMAT = 1
HEADER_KEY = "peertrain"
_METADATA_KEYS = frozenset({"model_aliases", "optimizers", "scheduler", "extra"})
_OPTIMIZER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


class StateMismatch(ProtocolError):
    """A state does not fit the local model and optimizers, or its bytes are malformed.

    A `ProtocolError`: the donor that sent it is treated as faulty."""


@dataclass(eq=False)  # eq on tensors is elementwise, not a bool
class TrainingState:
    step: int
    tensors: dict[str, torch.Tensor]
    """CPU, contiguous; named as in the module docstring."""
    metadata: dict[str, Any]
    """JSON-able: optimizer param_groups and scalar state, scheduler state, extra."""

    @property
    def scheduler_state(self) -> dict[str, Any] | None:
        return self.metadata.get("scheduler")

    @property
    def extra(self) -> dict[str, Any] | None:
        return self.metadata.get("extra")


# ---------------------------------------------------------------------------------- capture


def capture(
    step: int,
    model: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    scheduler_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    copy: bool = True,
    parameters: Mapping[str, torch.Tensor] | None = None,
) -> TrainingState:
    """A copy of the model's and optimizers' state at `step` (later training does not change it).

    Copies every tensor to the CPU: a GPU-CPU sync point, and as much host memory as the state.
    `copy=False` (CPU tensors only): the parameters and optimizer tensors are the live ones, not
    copies, so the state is valid only until the next optimizer step or load (the caller's
    guarantee: DeDLOC changes neither between steps); buffers, which every forward pass may
    move, are still copied. Saves a copy of the whole state. `parameters`: tensors to take
    for these parameters (by name) instead of the model's own, alike in shape and dtype
    (DiLoCo's anchor: the parameters as of the outer step, which inner steps leave alone)."""
    assert isinstance(step, int) and step >= 0, step
    stored, aliases = _untie(model.state_dict())
    named = dict(model.named_parameters(remove_duplicate=False))
    instead = parameters or {}
    tensors = {}
    for name, tensor in stored.items():
        if name in instead:
            assert _same_kind(instead[name], tensor), name
            tensor = instead[name]
        live = not copy and name in named
        tensors[f"model.{name}"] = _live(tensor) if live else _copy(tensor)
    metadata = {
        "model_aliases": aliases,
        "optimizers": _capture_optimizers(optimizers, tensors, copy=copy),
        "scheduler": _jsonable(scheduler_state, "scheduler_state"),
        "extra": _jsonable(extra, "extra"),
    }
    return TrainingState(step, tensors, metadata)


def with_optimizers(
    state: TrainingState, optimizers: Mapping[str, torch.optim.Optimizer], *, copy: bool = True
) -> TrainingState:
    """`state` and `optimizers`' states as they are now, copied unless `copy=False` (a DiLoCo
    checkpoint: the held state lacks the inner optimizer, whose moments each inner step moves)."""
    tensors = dict(state.tensors)
    added = _capture_optimizers(optimizers, tensors, copy=copy)
    held = state.metadata["optimizers"]
    assert not set(added) & set(held), sorted(added)
    metadata = {**state.metadata, "optimizers": {**held, **added}}
    return TrainingState(state.step, tensors, metadata)


def _capture_optimizers(
    optimizers: Mapping[str, torch.optim.Optimizer], tensors: dict[str, torch.Tensor], *, copy: bool
) -> dict[str, Any]:
    """Each optimizer's metadata; its tensors go into `tensors` (copies, or the live ones)."""
    optimizer_meta = {}
    for opt_name, optimizer in optimizers.items():
        if opt_name == "model" or not _OPTIMIZER_NAME.fullmatch(opt_name):
            raise ValueError(f"optimizer name {opt_name!r}: expected an identifier, not 'model'")
        saved = optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for index, entries in saved["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{opt_name}.{index}.{key}"] = _copy(value) if copy else _live(value)
                else:  # e.g. SGD's momentum_buffer = None, an int step in old torch versions
                    scalars.setdefault(str(index), {})[key] = _jsonable(
                        value, f"{opt_name}.{index}"
                    )
        optimizer_meta[opt_name] = {
            "param_groups": _jsonable(saved["param_groups"], f"{opt_name}.param_groups"),
            "scalars": scalars,
        }
    return optimizer_meta


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)


def _live(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.device.type == "cpu", "a live state holds CPU tensors only"
    return tensor.detach() if tensor.is_contiguous() else _copy(tensor)


def _untie(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Entries to store, and {later name: earlier name} for tensors that are the same memory.

    safetensors refuses shared memory, and storing a tied matrix twice would let a donor send two
    different values for one parameter."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state_dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
        key = (
            tensor.device,
            tensor.dtype,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
        )
        if tensor.numel() and key in seen:  # empty tensors may all report data_ptr 0
            aliases[name] = seen[key]
        else:
            seen[key] = name
            stored[name] = tensor
    return stored, aliases


def _jsonable(value: Any, where: str) -> Any:
    """`value` as plain JSON types (tuples become lists); TypeError for anything else (our bug)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(item, where) for item in value]
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"{where}: dict keys must be strings, got {list(value)!r}")
        return {key: _jsonable(item, f"{where}.{key}") for key, item in value.items()}
    raise TypeError(f"{where}: cannot store a {type(value).__name__} as JSON: {value!r}")


# ---------------------------------------------------------------------------------- bytes


def _header_text(state: TrainingState) -> str:
    return json.dumps(
        {"format": FORMAT, "step": state.step, "metadata": state.metadata},
        sort_keys=True,
        separators=(",", ":"),
    )


def to_bytes(state: TrainingState) -> bytes:
    """The safetensors blob of `state`; the same state always gives the same bytes."""
    tensors = {name: state.tensors[name].contiguous() for name in sorted(state.tensors)}
    return safetensors.torch.save(tensors, metadata={HEADER_KEY: _header_text(state)})


#: safetensors' names of the dtypes a state may hold.
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
#: Bytes written (and summed) at a time: one piece's checksum runs while the next is written.
WRITE_PIECE_BYTES = 16 << 20


def _layout(state: TrainingState) -> tuple[list[str], list[memoryview]]:
    """The pieces of a state's safetensors layout: the length-prefixed header, then each
    tensor's bytes (their own memory, not copies), and the tensors' names in that order. Widest
    dtype first, then by name, so each tensor starts aligned to its element size (as
    safetensors orders them)."""
    order = sorted(state.tensors, key=lambda n: (-state.tensors[n].element_size(), n))
    entries: dict[str, Any] = {"__metadata__": {HEADER_KEY: _header_text(state)}}
    offset = 0
    for name in order:
        tensor = state.tensors[name]
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"state tensor {name!r} has dtype {tensor.dtype}, which we do not save")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    prefix = memoryview(len(header).to_bytes(8, "little") + header)
    return order, [prefix, *(raw_bytes(state.tensors[name]) for name in order)]


@dataclass(frozen=True)
class BlobLayout:
    """Where a state's blob keeps what: each tensor's [start, end), and where the parts of the
    layout end (the header, then each tensor, in blob order)."""

    spans: Mapping[str, tuple[int, int]]
    parts: tuple[int, ...]

    def piece_hashes(self, pieces: Mapping[str, Sequence[bytes]]) -> dict[tuple[int, int], bytes]:
        """The hashes (`chunk_hash`) of blob ranges, from `pieces` (a tensor's digest pieces:
        `Certified`)."""
        return {
            _piece(self.spans[name], index): digest
            for name, hashes in pieces.items()
            for index, digest in enumerate(hashes)
        }

    def known(self, hashes: Mapping[tuple[int, int], bytes]) -> Callable[[str, int], bytes | None]:
        """`state_digest`'s `known` from the hashes of blob ranges (`Snapshot.hashes`)."""

        def piece(name: str, index: int) -> bytes | None:
            span = self.spans.get(name)
            return None if span is None else hashes.get(_piece(span, index))

        return piece

    @staticmethod
    def piece_range(span: tuple[int, int], at: int) -> tuple[int, int]:
        """The blob range of the digest's piece that holds byte `at` of the tensor at `span`."""
        return _piece(span, (at - span[0]) // PIECE_BYTES)


def _piece(span: tuple[int, int], index: int) -> tuple[int, int]:
    """The blob range of piece `index` of the tensor at `span` (the last may be short)."""
    first = span[0] + index * PIECE_BYTES
    return first, min(first + PIECE_BYTES, span[1])


class WriteCancelled(Exception):
    """`write_file` stopped at its `cancelled()` (the file is incomplete)."""


def write_file(
    state: TrainingState,
    file: Sink,
    *,
    cancelled: Callable[[], bool] = lambda: False,
    written: Callable[[str], None] = lambda name: None,
    piece_bytes: int = WRITE_PIECE_BYTES,
) -> int:
    """Write `state` to `file` in the safetensors format, straight from its tensors' memory
    (no whole-state blob: that doubled a checkpoint's memory and time), and return the CRC-32
    of what was written. The checksum runs in a second thread beside the writes (both release
    the GIL). `from_file` (the safetensors library) reads it back. `cancelled()` is asked
    between pieces: WriteCancelled if true. `written(name)` once a tensor's bytes are written
    and summed: nothing reads them after that, so they may change. `piece_bytes`: written
    (and summed) at a time."""
    crc = _Crc32()
    names, parts = _layout(state)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="peertrain-crc") as checksum:
        pending = checksum.submit(lambda: None)
        for name, data in zip([None, *names], parts, strict=True):
            for start in range(0, len(data), piece_bytes):
                if cancelled():
                    raise WriteCancelled(f"cut short after {file.tell()} bytes")
                piece = data[start : start + piece_bytes]
                pending.result()  # one piece summed while the next is written
                pending = checksum.submit(crc.update, piece)
                file.write(piece)
            if name is not None:
                pending.result()
                written(name)
        pending.result()
    return crc.value


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)


class StaleState(RemoteError):
    """A `StateBytes` read after its state moved on (the trainer stepped): ask again."""


class StateBytes:
    """A state's bytes in `write_file`'s layout, read from its tensors' memory on demand, so a
    donor hashes and serves chunks of it without a whole-state blob (`to_bytes` built two:
    safetensors copies every tensor to bytes, then joins them). `valid()` says whether the
    tensors still hold the state (a trainer's live state lasts until its next step); a read
    after that raises `StaleState`. A read racing a step can still see torn bytes: the
    downloader checks every chunk's hash and drops such a donor."""

    def __init__(self, state: TrainingState, valid: Callable[[], bool] = lambda: True) -> None:
        names, self._parts = _layout(state)
        self._starts = list(accumulate((len(p) for p in self._parts), initial=0))
        self._valid = valid
        ends = self._starts[1:]
        self.layout = BlobLayout(
            {name: (ends[i], ends[i + 1]) for i, name in enumerate(names)}, tuple(ends)
        )

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, key: slice) -> memoryview | bytes:
        """`blob[start:end]`: a view where it lies in one piece, else the pieces joined."""
        start, stop, step = key.indices(len(self))
        assert step == 1, key
        if not self._valid():
            raise StaleState("the state moved on to a newer step; ask for a manifest again")
        first = bisect.bisect_right(self._starts, start) - 1
        out = []
        while start < stop:
            part, offset = self._parts[first], start - self._starts[first]
            piece = part[offset : offset + stop - start]
            out.append(piece)
            start += len(piece)
            first += 1
        return out[0] if len(out) == 1 else b"".join(out)

    def __bytes__(self) -> bytes:
        return b"".join(self._parts)


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, without a copy (little-endian machines: x86, ARM)."""
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def from_file(path: Path) -> TrainingState:
    """Read a file from `write_file` or `to_bytes` (mapped, not read into a blob first);
    StateMismatch if it is anything else."""
    try:
        tensors = safetensors.torch.load_file(path)
        with safetensors.safe_open(path, framework="pt") as opened:
            metadata = opened.metadata() or {}
    except OSError:
        raise
    except Exception as error:  # as in from_bytes: whatever the parser raises, garbage
        raise StateMismatch(f"not a safetensors state: {_first_line(error)}") from error
    return _state(tensors, _payload(metadata.get(HEADER_KEY)))


def from_bytes(data: bytes | StateBytes) -> TrainingState:
    """Parse a blob from `to_bytes` (or `write_file`'s bytes); StateMismatch (a ProtocolError)
    if it is anything else. The tensors are views of `data`, not copies (`_views`)."""
    return parse_blob(data if isinstance(data, bytes) else bytes(data))[0]


def parse_blob(data: bytes) -> tuple[TrainingState, BlobLayout]:
    """`from_bytes`, and where the blob keeps each tensor."""
    tensors, layout, metadata = _views(data)
    return _state(tensors, _metadata_payload(metadata)), layout


_FROM_NAME = {name: dtype for dtype, name in _DTYPES.items()}
#: The largest header a state may have (one of 100 M parameters: ~20 KB; safetensors' own
#: limit is 100 MB), fetched and parsed before a catch-up in place checks anything.
MAX_HEADER_BYTES = 16 << 20
#: The most dimensions a state's tensor may have (torch's own limit is 64).
MAX_DIMS = 16
#: What torch raises for a shape it cannot make a tensor of (an empty one whose strides
#: overflow: [0, 2**62, 2**62]), from a donor's header.
TORCH_SHAPE_ERRORS = (RuntimeError, ValueError, OverflowError, TypeError)


def _views(data: bytes) -> tuple[dict[str, torch.Tensor], BlobLayout, object]:
    """The tensors of a safetensors blob as read-only views of it, where they lie, and its
    header's "__metadata__".

    `safetensors.torch.load` copies every tensor out of the blob: a joiner held the download
    and a copy of it (twice the state) before loading either. So the framing is checked here
    (`_entries`), as strictly as the safetensors parser does."""
    entries, layout, metadata = _entries(data, len(data))
    tensors = {}
    for name, (dtype, shape) in entries.items():
        start, _ = layout.spans[name]
        try:  # an empty tensor of a shape torch cannot stride, say
            tensors[name] = _view(data, dtype, shape, start, math.prod(shape))
        except TORCH_SHAPE_ERRORS as error:
            raise StateMismatch(
                f"not a safetensors state: entry {name[:80]!r}: {_first_line(error)}"
            ) from error
    return tensors, layout, metadata


def header_bytes(head: bytes | memoryview) -> int:
    """How many of a blob's first bytes hold its header (the length prefix and the JSON), from
    at least its first 8; StateMismatch if over MAX_HEADER_BYTES."""
    if len(head) < 8:
        raise StateMismatch(f"not a safetensors state: {len(head)} bytes")
    size = int.from_bytes(head[:8], "little")
    if size > MAX_HEADER_BYTES:
        raise StateMismatch(f"not a safetensors state: a header of {size} bytes")
    return 8 + size


def parse_header(head: bytes, total_bytes: int) -> tuple[TrainingState, BlobLayout]:
    """The state a blob of `total_bytes` holds, from its first bytes (`header_bytes` of them at
    least), checked as `from_bytes` checks it: its tensors are meta tensors (a shape and a
    dtype, no data), for checks that need no values (`restore`'s, of shapes and dtypes)."""
    entries, layout, metadata = _entries(head, total_bytes)
    tensors = {}
    for name, (dtype, shape) in entries.items():
        try:  # an empty tensor of a shape torch cannot stride, say
            tensors[name] = torch.empty(shape, dtype=dtype, device="meta")
        except TORCH_SHAPE_ERRORS as error:
            raise StateMismatch(
                f"not a safetensors state: entry {name[:80]!r}: {_first_line(error)}"
            ) from error
    return _state(tensors, _metadata_payload(metadata)), layout


def _entries(
    data: bytes | memoryview, total_bytes: int
) -> tuple[dict[str, tuple[torch.dtype, list[int]]], BlobLayout, object]:
    """Each tensor's dtype and shape in a blob of `total_bytes` whose first bytes are `data`,
    where they lie, and the header's "__metadata__" (parsed once): a header length within the
    blob, a JSON object of entries with a known dtype, a shape of non-negative integers, and
    data offsets whose length is the shape's; the entries tile the data region exactly (no
    gap, no overlap)."""
    size = header_bytes(data) - 8
    if size > total_bytes - 8 or size > len(data) - 8:
        raise StateMismatch(f"not a safetensors state: a {size}-byte header in {total_bytes} bytes")
    try:
        header = json.loads(data[8 : 8 + size])
    except (ValueError, RecursionError) as error:
        raise StateMismatch(f"not a safetensors state: {_first_line(error)}") from error
    if not isinstance(header, dict):
        raise StateMismatch("not a safetensors state: the header is no JSON object")
    start, length = 8 + size, total_bytes - 8 - size
    spans: dict[str, tuple[int, int]] = {}
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not (
            isinstance(entry, dict)
            and set(entry) == {"dtype", "shape", "data_offsets"}
            and entry["dtype"] in _FROM_NAME
            and isinstance(entry["shape"], list)
            and len(entry["shape"]) <= MAX_DIMS
            and all(type(n) is int and 0 <= n < 1 << 62 for n in entry["shape"])
            and isinstance(entry["data_offsets"], list)
            and len(entry["data_offsets"]) == 2
            and all(type(n) is int for n in entry["data_offsets"])
        ):
            raise StateMismatch(f"not a safetensors state: entry {name[:80]!r} is malformed")
        dtype, shape = _FROM_NAME[entry["dtype"]], entry["shape"]
        begin, end = entry["data_offsets"]
        if not (0 <= begin <= end <= length and end - begin == math.prod(shape) * dtype.itemsize):
            raise StateMismatch(f"not a safetensors state: entry {name[:80]!r} has bad offsets")
        spans[name] = (start + begin, start + end)
        entries[name] = (dtype, shape)
    covered = start
    for begin, end in sorted(spans.values()):
        if begin != covered:
            raise StateMismatch("not a safetensors state: its tensors overlap or leave gaps")
        covered = end
    if covered != total_bytes:
        raise StateMismatch("not a safetensors state: bytes past its last tensor")
    parts = (start, *sorted(end for _, end in spans.values()))
    return entries, BlobLayout(spans, parts), header.get("__metadata__", {})


def _view(
    data: bytes, dtype: torch.dtype, shape: list[int], offset: int, count: int
) -> torch.Tensor:
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    # Read-only, unless the blob is ours alone (`restore`'s `release`): optimizers then keep
    # their tensors in it and write into them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
    return flat.view(shape)


def _state(tensors: dict[str, torch.Tensor], payload: dict[str, Any]) -> TrainingState:
    if set(payload) != {"format", "step", "metadata"}:
        raise StateMismatch(
            f"state header has keys {sorted(payload)}, expected format, step, metadata"
        )
    if payload["format"] != FORMAT:
        raise StateMismatch(f"state format {payload['format']!r}, expected {FORMAT}")
    step = payload["step"]
    if type(step) is not int or step < 0:
        raise StateMismatch(f"state step {step!r}, expected an integer >= 0")
    state = TrainingState(step, tensors, payload["metadata"])
    check_structure(state)
    return state


def _metadata_payload(metadata: object) -> dict[str, Any]:
    """The decoded HEADER_KEY entry of a header's "__metadata__"."""
    if not isinstance(metadata, dict):
        raise StateMismatch("state header is not valid JSON: its __metadata__ is no object")
    return _payload(metadata.get(HEADER_KEY))


def _payload(text: object) -> dict[str, Any]:
    """The decoded HEADER_KEY metadata entry."""
    if not isinstance(text, str):
        raise StateMismatch(f"safetensors header lacks the {HEADER_KEY!r} metadata entry")
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise StateMismatch(f"state header is not valid JSON: {_first_line(error)}") from error
    if not isinstance(payload, dict):
        raise StateMismatch(f"state header is a {type(payload).__name__}, expected an object")
    return payload


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def check_structure(state: TrainingState) -> None:
    """StateMismatch unless `state` is laid out as the module docstring says (any model)."""
    metadata = state.metadata
    if not isinstance(metadata, dict) or set(metadata) != _METADATA_KEYS:
        keys = sorted(metadata) if isinstance(metadata, dict) else type(metadata).__name__
        raise StateMismatch(f"state metadata has keys {keys}, expected {sorted(_METADATA_KEYS)}")
    aliases = metadata["model_aliases"]
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise StateMismatch(f"model_aliases = {aliases!r}, expected {{name: name}}")
    optimizers = metadata["optimizers"]
    if not isinstance(optimizers, dict):
        raise StateMismatch(f"optimizers is a {type(optimizers).__name__}, expected an object")
    for opt_name, entry in optimizers.items():
        if opt_name == "model" or not _OPTIMIZER_NAME.fullmatch(opt_name):
            raise StateMismatch(f"optimizer name {opt_name!r} is not an identifier")
        if not isinstance(entry, dict) or set(entry) != {"param_groups", "scalars"}:
            raise StateMismatch(f"optimizer {opt_name!r}: expected param_groups and scalars")
        groups, scalars = entry["param_groups"], entry["scalars"]
        if not isinstance(groups, list) or not all(
            isinstance(g, dict)
            and isinstance(g.get("params"), list)
            and all(type(i) is int for i in g["params"])
            for g in groups
        ):
            raise StateMismatch(f"optimizer {opt_name!r}: param_groups must list integer params")
        if not isinstance(scalars, dict) or not all(
            _is_index(i) and isinstance(s, dict) for i, s in scalars.items()
        ):
            raise StateMismatch(f"optimizer {opt_name!r}: scalars must map indices to objects")
    for scheduler_or_extra in ("scheduler", "extra"):
        if not isinstance(metadata[scheduler_or_extra], dict | None):
            raise StateMismatch(f"{scheduler_or_extra} must be an object or null")
    for name, tensor in state.tensors.items():
        prefix, _, rest = name.partition(".")
        if prefix == "model" and rest:
            continue
        index, _, key = rest.partition(".")
        if prefix not in optimizers or not _is_index(index) or not key:
            raise StateMismatch(f"unexpected tensor {name!r} in state")
        assert isinstance(tensor, torch.Tensor), name


def _is_index(text: str) -> bool:
    # Canonical decimal only: "01" and "1" must not name the same parameter.
    return text.isascii() and text.isdigit() and str(int(text)) == text


# ---------------------------------------------------------------------------------- restore


def restore(
    state: TrainingState,
    model: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    from_donor: bool = False,
    release: Callable[[int, int], None] | None = None,
) -> None:
    """Load `state` into `model` and `optimizers`, or raise StateMismatch and change nothing.

    Everything is checked before anything is written, so a bad donor cannot leave a half-loaded
    model behind. Optimizer tensors are copied into the optimizer's own (or cloned): the state
    stays valid for serving to others (unless `release` says it is ours alone, below).

    `from_donor`: the state came from another peer. Then every tensor loaded must be finite,
    the optimizers' hyperparameters (learning rate, betas, weight decay, ...) stay ours (the
    task's: a donor once set AdamW's lr to 1e-9 in every peer), and `optimizers` may name only
    some of the state's (diloco's inner optimizer is each peer's own).

    `release`: given for a buffer the state's tensors are views of, ours alone and read by
    no one else after this (a download, `Snapshot.disposable`). The optimizers then keep their
    tensors in it where they fit as they are (`_into_own`'s `adopt`), and `release` is told
    the (address, size) of every other tensor, to give its pages back (`heap.releaser`): each
    one copied as soon as it is, then whatever the optimizers did not keep (the tensors of
    optimizers not loaded: a donor's DiLoCo inner one, or anything a hostile donor added).
    Then the peak is the download beside the model, not also beside the optimizer state
    cloned from it (a fresh 100 M joiner: 0.8 GB less), the moments are not copied at all,
    and nothing else of the download stays resident while the kept ones keep it alive.
    Unchecked: a caller that passes a buffer still in use reads zeros from it, and sees the
    optimizers write into it."""
    model_state, optimizer_states = _fitted(state, model, optimizers, from_donor=from_donor)
    if from_donor:
        loaded = [*model_state.values()]
        loaded += [
            v for o in optimizer_states.values() for s in o["state"].values() for v in s.values()
        ]
        check_finite(loaded)
    # Checked; from here on nothing raises on account of the state.
    model.load_state_dict(model_state, strict=True)  # copies into the existing parameters

    def loaded_from(tensor: torch.Tensor) -> None:
        if release is not None and tensor.device.type == "cpu":
            release(tensor.data_ptr(), tensor.nbytes)

    for tensor in model_state.values():
        loaded_from(tensor)
    adopt = release is not None
    for name, optimizer in optimizers.items():
        optimizer.load_state_dict(
            _into_own(optimizer, optimizer_states[name], loaded_from, adopt=adopt)
        )
    if release is not None:
        kept = {
            value.data_ptr()
            for optimizer in optimizers.values()
            for values in optimizer.state.values()
            for value in values.values()
            if isinstance(value, torch.Tensor)
        }
        # The state's tensors tile the buffer (`_views`) and release rounds inward to whole
        # pages: no page of a kept tensor goes (one given back twice is no harm).
        for tensor in state.tensors.values():
            if tensor.data_ptr() not in kept:
                loaded_from(tensor)


def _fitted(
    state: TrainingState,
    model: nn.Module,
    optimizers: Mapping[str, torch.optim.Optimizer],
    *,
    from_donor: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """What `restore` loads into the model and each optimizer, checked against them (shapes,
    dtypes, groups: no values), or StateMismatch."""
    check_structure(state)
    model_state = _model_state(state, model)
    held = set(state.metadata["optimizers"])
    if not (set(optimizers) <= held if from_donor else set(optimizers) == held):
        raise StateMismatch(f"state has optimizers {sorted(held)}, expected {sorted(optimizers)}")
    optimizer_states = {
        name: _optimizer_state(state, name, opt, keep_settings=from_donor)
        for name, opt in optimizers.items()
    }
    return model_state, optimizer_states


def receivers(
    state: TrainingState, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer]
) -> dict[str, torch.Tensor]:
    """Where each tensor of a donor's `state` that `restore(from_donor=True)` loads may be
    written before it is loaded (`parse_header`'s state: shapes and dtypes, no data), or
    StateMismatch: the model's or the optimizer's own tensor, where it is a contiguous CPU
    tensor alike in shape and dtype (then written in place: no second copy of the state), else
    a new CPU tensor (one that `restore` adopts or copies)."""
    model_state, optimizer_states = _fitted(state, model, optimizers, from_donor=True)
    stored, _ = _untie(model.state_dict())
    out = {f"model.{name}": _own_or_new(own, model_state[name]) for name, own in stored.items()}
    for opt_name, optimizer in optimizers.items():
        ids = chain.from_iterable(g["params"] for g in optimizer_states[opt_name]["param_groups"])
        params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
        by_id = dict(zip(ids, params, strict=True))
        for index, values in optimizer_states[opt_name]["state"].items():
            own = optimizer.state.get(by_id[index], {})
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    out[f"{opt_name}.{index}.{key}"] = _own_or_new(own.get(key), value)
    return out


def fill(
    tensors: Mapping[str, torch.Tensor],
    spans: Mapping[str, tuple[int, int]],
    pieces: Mapping[int, tuple[int, memoryview]],
) -> None:
    """Copy into each of `tensors` (contiguous, on the CPU; the blob keeps it at `spans[name]`)
    whatever bytes of it `pieces` hold (each: where in the blob it starts, its bytes)."""
    order = sorted((spans[name], name) for name in tensors if spans[name][1] > spans[name][0])
    ends = [span[1] for span, _ in order]
    for start, data in pieces.values():
        end = start + len(data)
        at = bisect.bisect_right(ends, start)  # the first tensor that ends past `start`
        while at < len(order) and order[at][0][0] < end:
            (first, last), name = order[at]
            low, high = max(first, start), min(last, end)
            raw_bytes(tensors[name])[low - first : high - first] = data[low - start : high - start]
            at += 1


def _own_or_new(own: Any, like: torch.Tensor) -> torch.Tensor:
    if (
        isinstance(own, torch.Tensor)
        and own.device.type == "cpu"
        and own.is_contiguous()
        and own.shape == like.shape
        and own.dtype == like.dtype
    ):
        return own.detach()
    return torch.empty(like.shape, dtype=like.dtype)


def _into_own(
    optimizer: torch.optim.Optimizer,
    optimizer_state: dict[str, Any],
    loaded_from: Callable[[torch.Tensor], None] = lambda tensor: None,
    *,
    adopt: bool = False,
) -> dict[str, Any]:
    """`optimizer_state` with its tensors copied into the optimizer's own where it has them
    alike (same shape and dtype), else cloned (unless `adopt`, below): load_state_dict keeps
    same-dtype tensors as they are, and training must not write into a state we may still
    serve to other peers or read again (a checkpoint's, a keeper's). Copying in place makes
    no new moments. Freeing the old ones before cloning did not keep the peak down: a trained
    100 M DeDLOC worker's RSS rose 0.76 GB during a restore (the restore's thread did not
    reuse the memory the torch thread had freed), and a peer that caught up peaked at 3.05x
    its state. `loaded_from` is told of each tensor once it is copied or cloned.

    `adopt`: the state's tensors are views of a buffer ours alone (a download): those on the
    device and of the dtype of their parameter, and aligned to their element size (a donor
    chooses the layout), are kept as they are, the optimizer's from now on, which writes into
    them (no copy, and no new memory to fault in: beside three training peers, cloning a fresh
    100 M joiner's AdamW moments took 1.4-2.5 s, against 0.15 s on an idle machine)."""
    ids = chain.from_iterable(group["params"] for group in optimizer_state["param_groups"])
    params = chain.from_iterable(group["params"] for group in optimizer.param_groups)
    by_id = dict(zip(ids, params, strict=True))  # as load_state_dict pairs them

    def into(own: Any, value: Any, parameter: torch.Tensor) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if (
            adopt
            and value.device == parameter.device
            and value.dtype == parameter.dtype
            and value.data_ptr() % value.element_size() == 0
        ):
            return value  # load_state_dict keeps it as it is; never given back
        if isinstance(own, torch.Tensor) and own.shape == value.shape and own.dtype == value.dtype:
            copied = own.copy_(value)
        else:
            copied = value.clone()
        loaded_from(value)
        return copied

    state = {}
    for index, values in optimizer_state["state"].items():
        parameter = by_id[index]
        own = optimizer.state.get(parameter, {})
        state[index] = {key: into(own.get(key), value, parameter) for key, value in values.items()}
    return {"state": state, "param_groups": optimizer_state["param_groups"]}


def _model_state(state: TrainingState, model: nn.Module) -> dict[str, torch.Tensor]:
    stored, aliases = _untie(model.state_dict())
    if state.metadata["model_aliases"] != aliases:
        raise StateMismatch(
            f"state ties model tensors {state.metadata['model_aliases']!r}, the model ties {aliases!r}"
        )
    given = {
        n.removeprefix("model."): t for n, t in state.tensors.items() if n.startswith("model.")
    }
    if missing := [name for name in stored if name not in given]:
        raise StateMismatch(f"state lacks model tensor {missing[0]!r}")
    if unexpected := sorted(set(given) - set(stored)):
        raise StateMismatch(f"state has unexpected model tensor {unexpected[0]!r}")
    for name, tensor in stored.items():
        _expect_like(f"model tensor {name!r}", given[name], tensor)
    full = {name: given[name] for name in stored}
    full.update((alias, given[target]) for alias, target in aliases.items())
    return full


def check_finite(values: list[Any]) -> None:
    """StateMismatch unless every floating-point tensor and number in `values` is finite."""
    for value in values:
        if isinstance(value, torch.Tensor):
            ok = not value.is_floating_point() or _finite(value)
        else:
            ok = not isinstance(value, float) or math.isfinite(value)
        if not ok:
            raise StateMismatch("the state holds NaN or Inf values")


def _finite(tensor: torch.Tensor) -> bool:
    """Every value finite. A NaN or Inf makes the sum NaN or Inf, so a finite sum settles it
    in one pass without a temporary (`isfinite` makes a bool per value: 1 s for a state of
    1.2 GB, the sum 0.15 s); an overflowing sum of finite values takes the exact way."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _optimizer_state(
    state: TrainingState,
    opt_name: str,
    optimizer: torch.optim.Optimizer,
    *,
    keep_settings: bool = False,
) -> dict[str, Any]:
    """The state_dict to load into `optimizer`, checked against its parameters and groups
    (with `keep_settings`, the groups' settings are the optimizer's own, not the state's)."""
    entry = state.metadata["optimizers"][opt_name]
    saved_groups, current_groups = entry["param_groups"], optimizer.state_dict()["param_groups"]
    where = f"optimizer {opt_name!r}"
    if len(saved_groups) != len(current_groups):
        raise StateMismatch(
            f"{where} has {len(saved_groups)} param groups in the state, expected {len(current_groups)}"
        )
    groups = []
    for number, (saved, current) in enumerate(zip(saved_groups, current_groups, strict=True)):
        if len(saved["params"]) != len(current["params"]):
            raise StateMismatch(
                f"{where} group {number} has {len(saved['params'])} params, expected {len(current['params'])}"
            )
        if saved["params"] != current["params"]:
            # They pair the state's moments with our parameters, and no digest covers them: a
            # donor that reordered them swapped the moments of parameters of the same shape.
            raise StateMismatch(
                f"{where} group {number} numbers its params otherwise than the optimizer does"
            )
        if set(saved) != set(current):
            raise StateMismatch(
                f"{where} group {number} has settings {sorted(saved)}, expected {sorted(current)}"
            )
        group = {
            key: value
            if keep_settings
            else _like(value, saved[key], f"{where} group {number} {key}")
            for key, value in current.items()
            if key != "params"
        }
        groups.append({**group, "params": saved["params"]})
    saved_ids = list(chain.from_iterable(group["params"] for group in groups))
    parameters = list(chain.from_iterable(group["params"] for group in optimizer.param_groups))
    if len(set(saved_ids)) != len(saved_ids):
        raise StateMismatch(f"{where} lists a parameter index twice: {saved_ids!r}")
    by_id = dict(zip(saved_ids, parameters, strict=True))

    result: dict[int, dict[str, Any]] = {}

    def slot(index: str) -> tuple[dict[str, Any], torch.Tensor]:
        if int(index) not in by_id:
            raise StateMismatch(f"{where} has state for parameter {index}, which it does not list")
        return result.setdefault(int(index), {}), by_id[int(index)]

    prefix = f"{opt_name}."
    for name in sorted(n for n in state.tensors if n.startswith(prefix)):
        index, _, key = name.removeprefix(prefix).partition(".")
        values, parameter = slot(index)
        value = state.tensors[name]
        current = optimizer.state.get(parameter, {}).get(key)
        if isinstance(current, torch.Tensor):
            _expect_like(f"{where} state {name!r}", value, current)
        elif value.dim() != 0 and value.shape != parameter.shape:  # moments, or a scalar step
            raise StateMismatch(
                f"{where} state {name!r} has shape {tuple(value.shape)}, expected {tuple(parameter.shape)} or ()"
            )
        values[key] = value  # copied once loading can no longer fail (`_into_own`)
    for index, entries in entry["scalars"].items():
        values, _ = slot(index)
        for key, value in entries.items():
            if key in values:
                raise StateMismatch(f"{where} state {index}.{key} is both a tensor and a scalar")
            if not (value is None or isinstance(value, bool | int | float)):
                raise StateMismatch(f"{where} state {index}.{key} = {value!r}, expected a number")
            values[key] = value
    return {"state": result, "param_groups": groups}


def _expect_like(what: str, given: torch.Tensor, local: torch.Tensor) -> None:
    if given.shape != local.shape or given.dtype != local.dtype:
        raise StateMismatch(
            f"{what} is {tuple(given.shape)} {given.dtype} in the state, expected {tuple(local.shape)} {local.dtype}"
        )


def _like(template: Any, value: Any, where: str) -> Any:
    """Decoded JSON `value` with the type of the local setting `template`, or StateMismatch."""
    if isinstance(template, list | tuple):
        if not isinstance(value, list) or len(value) != len(template):
            raise StateMismatch(f"{where} = {value!r}, expected {len(template)} values")
        # JSON has no tuples: AdamW's betas come back as a tuple, as the optimizer made them.
        return type(template)(
            _like(t, v, f"{where}[{i}]")
            for i, (t, v) in enumerate(zip(template, value, strict=True))
        )
    if template is None:
        ok = value is None or isinstance(value, bool | int | float | str)
    elif isinstance(template, bool):
        ok = isinstance(value, bool)
    elif isinstance(template, int | float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif isinstance(template, str):
        ok = isinstance(value, str)
    else:  # a tensor-valued lr, say: capture could not have stored it either
        raise StateMismatch(f"{where}: cannot restore a setting of type {type(template).__name__}")
    if not ok:
        raise StateMismatch(f"{where} = {value!r}, expected a {type(template).__name__}")
    return value


# ---------------------------------------------------------------------------------- digest


def parameters_digest(model: nn.Module) -> str:
    """Short hex digest of the parameters (names, dtypes, shapes, bits) in name order: equal
    digests mean bit-identical parameters. Reads every parameter: a GPU-CPU sync point."""
    digest = hashlib.blake2b(digest_size=16)
    for name, parameter in sorted(
        model.named_parameters(), key=lambda item: item[0]
    ):  # tied parameters appear once
        data = parameter.detach().to("cpu").contiguous()
        label = f"{name}\0{data.dtype}\0{tuple(data.shape)}".encode()
        digest.update(len(label).to_bytes(8, "little") + label)
        digest.update(data.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class DigestCancelled(Exception):
    """`state_digest` was told to stop (the peer is stopping)."""


@dataclass(frozen=True)
class Certified:
    """What a step certifies of a state (`state_digest`)."""

    digest: str
    pieces: Mapping[str, Sequence[bytes]]
    """Each certified tensor's `chunk_hash` per PIECE_BYTES of its bytes, by tensor name (a donor's
    chunks of it: `BlobLayout.piece_hashes`)."""


def certified_tensors(
    state: TrainingState, parameters: Sequence[str], shared: Collection[str]
) -> list[str]:
    """The tensors of `state` a step certifies (`state_digest`), in the digest's order: the
    named model parameters (a tied one under the name it is stored by), then the tensors of
    the `shared` optimizers."""
    aliases = state.metadata.get("model_aliases", {})
    names = [f"model.{aliases.get(name, name)}" for name in sorted(set(parameters))]
    for opt_name in sorted(shared):
        names += sorted(n for n in state.tensors if n.startswith(f"{opt_name}."))
    return names


def state_digest(
    state: TrainingState,
    parameters: Sequence[str],
    shared: Collection[str],
    *,
    cancelled: Callable[[], bool] = lambda: False,
    known: Callable[[str, int], bytes | None] = lambda name, index: None,
) -> Certified:
    """What a step certifies (`peer.training.certificate`): the named model parameters and the
    tensors and scalars of the `shared` optimizers (those every member of an averaging holds
    bit-identical: dedloc's optimizer, diloco's outer one), in name order. Each tensor counts
    as its name, dtype and shape and the `chunk_hash` (BLAKE3) of each PIECE_BYTES of its
    bytes: a donor's chunks of a large tensor are those pieces (`chunks.chunk_ends`), so it
    serves them without hashing again, and `known(name, index)` gives a piece's hash where one was
    checked already (a download's chunks), so a joiner hashes its state once. Equal digests
    mean bit-identical certified state. Buffers and per-peer optimizers (diloco's inner one)
    are left out: peers may hold them apart. StateMismatch if a tensor is missing;
    DigestCancelled once `cancelled()` (asked every piece: a stop waits for no more)."""
    digest = hashlib.blake2b(digest_size=16)
    optimizers = state.metadata.get("optimizers", {})
    for opt_name in sorted(shared):
        if opt_name not in optimizers:
            raise StateMismatch(f"state lacks optimizer {opt_name!r}")
        scalars = json.dumps(optimizers[opt_name]["scalars"], sort_keys=True).encode()
        digest.update(len(scalars).to_bytes(8, "little") + scalars)
    names = certified_tensors(state, parameters, shared)
    pieces: dict[str, list[bytes]] = {}
    for name in names:
        if name not in state.tensors:
            raise StateMismatch(f"state lacks tensor {name!r}")
        tensor = state.tensors[name]
        label = f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}".encode()
        digest.update(len(label).to_bytes(8, "little") + label)
        raw = None  # read only for a piece not known: a tensor yet to arrive has no data
        hashes = pieces[name] = []
        for index, start in enumerate(
            range(0, tensor.numel() * tensor.element_size(), PIECE_BYTES)
        ):
            if cancelled():
                raise DigestCancelled(f"the digest of step {state.step} was cancelled")
            piece = known(name, index)
            if piece is None:
                if raw is None:
                    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                piece = chunk_hash(raw[start : start + PIECE_BYTES])
            hashes.append(piece)
            digest.update(piece)
    return Certified(digest.hexdigest(), pieces)
