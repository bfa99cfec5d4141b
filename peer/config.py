"""Peer configuration: frozen keyword-only dataclasses, loaded from TOML, env and flags.

Layers, lowest first: field defaults < the TOML file (`configs/*.toml`, or the file named by
`PEERTRAIN_CONFIG`) < `PEERTRAIN_<SECTION>_<KEY>` environment variables < CLI overrides. Each
dotted key remembers which layer set it (`LoadedConfig.sources`) so that every `ConfigError` can
say where a bad value came from, in one line.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from peer.errors import ConfigError

MAX_STEP_SIGNERS = 16
"""The most step signatures a progress record carries (`peer.training.certificate`): no
`averaging.min_group_size` above it could ever be met."""

__all__ = [
    "MAX_STEP_SIGNERS",
    "AveragingConfig",
    "CollaborationConfig",
    "DashboardConfig",
    "DhtConfig",
    "IdentityConfig",
    "LoadedConfig",
    "LogConfig",
    "MeasureConfig",
    "MetricsConfig",
    "NetConfig",
    "PeerConfig",
    "PresenceConfig",
    "ProbeConfig",
    "RelayConfig",
    "StateConfig",
    "TaskConfig",
    "TrainingConfig",
    "config_to_dict",
    "load_config",
]

ENV_PREFIX = "PEERTRAIN_"
#: Variables under ENV_PREFIX that are not config keys.
ENV_ALLOWED = frozenset({"PEERTRAIN_CONFIG"})


class _Section:
    """Validates a section built directly in code, as the loader does for user input."""

    def __post_init__(self) -> None:
        section = _SECTION_NAMES[type(self).__name__]
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = _coerce(f"{section}.{f.name}", getattr(self, f.name), "code")
            object.__setattr__(self, f.name, value)  # canonical form: 5 -> 5.0, tuple -> list
        for dotted, other, holds, expected in _CROSS_RULES:
            if dotted.startswith(f"{section}.") and other.startswith(f"{section}."):
                value = getattr(self, dotted.partition(".")[2])
                bound = getattr(self, other.partition(".")[2])
                if not holds(value, bound):
                    raise ConfigError(f"{dotted} = {value!r}: {expected} ({bound!r})")


@dataclass(frozen=True, kw_only=True)
class IdentityConfig(_Section):
    path: str = "~/.peertrain/peer.key"
    """Ed25519 key file; created (mode 0600) on first run."""


@dataclass(frozen=True, kw_only=True)
class NetConfig(_Section):
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    """Multiaddrs to listen on."""
    announce: list[str] = field(default_factory=list)
    """Addresses advertised to others; empty = derived from listen."""
    connect_timeout: float = 5.0
    """Seconds to open a connection to a peer."""
    rpc_timeout: float = 5.0
    """Default deadline of one RPC, in seconds."""
    max_message_bytes: int = 4194304
    """Largest frame accepted from a peer."""
    inbound_max_pending: int = 64
    """Inbound libp2p connections still in their handshake, at most (peer.net.inbound)."""
    inbound_max_pending_per_source: int = 16
    """Of those, from one IPv4 /24 or IPv6 /64; a newcomer past it takes its prefix's oldest."""
    inbound_handshake_seconds: float = 5.0
    """Seconds an inbound connection has to finish its handshake."""
    inbound_max_established: int = 160
    """Authenticated inbound connections kept; past it a newcomer prunes the least useful."""
    inbound_accept_rate: float = 20.0
    """TCP connections a second one IPv4 /24 or IPv6 /64 may open; more are closed at accept."""
    inbound_accept_burst: int = 64
    """TCP connections one IPv4 /24 or IPv6 /64 may open at once before that rate applies."""


@dataclass(frozen=True, kw_only=True)
class DhtConfig(_Section):
    bucket_size: int = 20
    """Kademlia k: contacts per routing-table bucket."""
    replicas: int = 8
    """Nodes a record is stored on."""
    alpha: int = 3
    """Parallel queries per lookup step."""
    max_value_bytes: int = 65536
    """Largest value of one subkey."""
    max_subkeys: int = 4096
    """Subkeys stored per key."""
    max_keys: int = 100000
    """Keys stored per node."""
    max_store_bytes: int = 268435456
    """Bytes of records one node holds, at most (256 MiB)."""
    caller_store_bytes: int = 16777216
    """Bytes of records one peer may store on this node per store_window (16 MiB)."""
    store_window: float = 60.0
    """Seconds for a peer's spent store budget to refill."""
    max_ttl: float = 3600.0
    """Longest record lifetime accepted, in seconds."""
    max_clock_skew: float = 10.0
    """Seconds a record's timestamp may lie in the future."""
    purge_interval: float = 10.0
    """Seconds between sweeps of expired records."""
    refresh_interval: float = 60.0
    """Seconds between routing-table refreshes."""


@dataclass(frozen=True, kw_only=True)
class PresenceConfig(_Section):
    ttl: float = 30.0
    """Seconds a presence record lives without refresh."""
    refresh: float = 10.0
    """Seconds between presence refreshes; must be < ttl."""


@dataclass(frozen=True, kw_only=True)
class CollaborationConfig(_Section):
    EMPTY_OK: ClassVar[frozenset[str]] = frozenset({"network_key"})
    name: str = "default"
    """Namespace of every DHT key."""
    backbones: list[str] = field(default_factory=list)
    """Multiaddrs of backbone peers."""
    network_key: str = ""
    """Key file of a private collaboration (`backbone network-key FILE` makes one): only
    machines holding it can connect at all. Empty: open to anyone."""


@dataclass(frozen=True, kw_only=True)
class TaskConfig(_Section):
    name: str = "gpt"
    """Built-in task name, or package.module:factory."""
    micro_batch: int = 32
    """Samples per forward/backward pass on this peer."""
    target_batch: int = 4096
    """Samples the collaboration accumulates per optimizer step."""
    device: str = "auto"
    """auto (CUDA if present, else CPU), cpu, cuda or cuda:N."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of a package.module:factory task: `[task.args]` in the file (strings,
    numbers, booleans, lists of them), a JSON object in PEERTRAIN_TASK_ARGS."""


@dataclass(frozen=True, kw_only=True)
class MeasureConfig(_Section):
    compute_seconds: float = 1.0
    """Length of the timed compute run at start, after warm-up."""
    probe_seconds: float = 2.0
    """Target length of each bandwidth probe."""
    interval: float = 600.0
    """Seconds between re-measurements of bandwidth and reachability."""
    max_backbones: int = 3
    """Backbones to probe; the best figures count (a probe measures the slower end)."""


@dataclass(frozen=True, kw_only=True)
class ProbeConfig(_Section):
    max_bytes: int = 33554432
    """Largest probe a backbone grants (32 MiB)."""
    max_seconds: float = 5.0
    """A probe's transfer stops after this long."""
    budget_bytes: int = 100663296
    """Bytes one caller may probe per budget window (96 MiB)."""
    budget_window: float = 60.0
    """Seconds for an empty budget to refill."""
    max_concurrent: int = 4
    """Probes served at once, over all callers."""


@dataclass(frozen=True, kw_only=True)
class AveragingConfig(_Section):
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "codec": ("none", "fp16", "int8"),
        "aggregation": ("mean", "centered_clip"),
    }
    MINIMUM: ClassVar[dict[str, int]] = {"data_port": 0}
    group_size: int = 4
    """Moshpit group size m: any N peers reach the exact average in ceil(log_m N) rounds."""
    min_group_size: int = 2
    """The fewest peers a step needs. With a single group (N <= group_size): fewer joiners
    refuse the averaging, each keeping its contribution (planned rounds, N > group_size,
    ignore it). Also the distinct signers a (step, digest) needs before any peer downloads it
    (`peer.training.certificate`): 1 lets a lone peer step alone, and trusts any one peer."""
    partial_from: int = 32
    """From this many peers in a Moshpit plan of several rounds, an averaging that some of them
    missed still gives the others the exact mean over whom it reached (their basis) and the
    majority's is the step; below it, such an averaging is refused by all and called again.
    (At 300 simulated peers an averaging never reached everyone; at 16 on one machine a
    ticket stored late made peers plan from two views and a quarter of them download. At 64,
    plans of 49 of 100 simulated peers that lost 4 members failed, and 9 of 10 rounds
    yielded a step; at 32, 9 of 9.)"""
    codec: str = "none"
    """Wire compression: none, fp16 or int8 (blockwise)."""
    chunk_elements: int = 262144
    """Elements per streamed chunk (1 MiB of float32)."""
    timeout_floor: float = 5.0
    """Seconds added to every predicted transfer time to make a deadline."""
    timeout_multiplier: float = 3.0
    """Deadlines allow this many times the predicted transfer time."""
    join_timeout: float = 5.0
    """Seconds a group's leader waits for its members to join (a later round's leader: this
    plus up to a round's length, asking missing members every join_timeout if they are alive)."""
    data_port: int = 0
    """TCP port of the all-reduce data plane (0: any free port)."""
    aggregation: str = "mean"
    """How this peer reduces its part: mean (weighted by samples) or centered_clip (robust to
    poisoned contributions while fewer than half of a group's senders are malicious). With more
    peers than group_size all must use the same, or the averaging is refused."""
    norm_factor: float = 2.0
    """centered_clip: contributions are scaled to at most this times their median norm."""
    min_bandwidth: float = 1_000_000.0
    """Bytes/s: a peer's measured (or claimed) bandwidth below this counts as this in every
    deadline, so one ticket claiming a crawl cannot stretch the group's waits; slower peers
    time out of averaging. Also the figure, for shares and deadlines, of a peer that no
    trusted backbone measured (attestation_max_age)."""
    max_averaging_seconds: float = 1800.0
    """Every averaging call ends within this many seconds after its gathering, whatever the
    peers' figures (within twice the bound computed from them, if that is shorter)."""
    attestation_max_age: float = 3600.0
    """Seconds a backbone's signed measurement of a peer's link counts for averaging shares
    and deadlines (peer.measure.attestation); must exceed measure.interval, how often peers
    re-measure. Older or missing: the peer counts at min_bandwidth, whatever it claims."""
    backbone_aggregates: bool = False
    """A backbone joins every step's averaging as an aggregator-only member (it reduces the
    share the solver gives it and contributes nothing), as DeDLOC's backbones do; only in a
    single group (N <= group_size), and never in a retry (peer.training.aggregator)."""


@dataclass(frozen=True, kw_only=True)
class TrainingConfig(_Section):
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "mode": ("dedloc", "diloco"),
        "outer_weighting": ("samples", "uniform"),
        "precision": ("fp32", "bf16", "fp16"),
    }
    MINIMUM: ClassVar[dict[str, int]] = {"max_steps": 0, "validation_interval": 0, "seed": 0}
    ZERO_OK: ClassVar[frozenset[str]] = frozenset(
        {"target_validation_loss", "outer_momentum", "clip_grad_norm"}
    )
    mode: str = "dedloc"
    """dedloc (synchronous large batches of task.target_batch samples) or diloco (local steps)."""
    delayed_updates: bool = False
    """dedloc: average step t's gradients while computing our part of step t+1. Not the exact
    large-batch algorithm: part of each step's micro-batches see the previous parameters
    (slower to a target per step, docs/benchmarks.md), in exchange for less idle time."""
    inner_steps: int = 50
    """diloco: local AdamW steps H every peer takes before each outer step (exactly H: a peer
    that is done waits for the others at its step, as in the DiLoCo paper)."""
    outer_weighting: str = "samples"
    """diloco: weight of each peer's pseudo-gradient in the average: samples (its inner steps
    times its micro-batch) or uniform (1 per peer, the DiLoCo paper's)."""
    outer_lr: float = 0.7
    """diloco: outer Nesterov SGD learning rate."""
    outer_momentum: float = 0.9
    """diloco: outer Nesterov SGD momentum (0: plain SGD; with outer_lr 1, parameter averaging)."""
    gather_window: float = 2.0
    """Seconds between a step being called and its averaging, at least (peers short of their
    part of the step keep computing meanwhile); widened where DHT stores are slow or
    micro-batches long (`peer.training.timing.Timing.window`)."""
    progress_interval: float = 1.0
    """Seconds between progress publications and reads of the collaboration's progress."""
    solo_after: float = 60.0
    """Seconds without another trainer at our step or beyond before we step with our samples
    alone (until then a cut-off or lagging peer keeps accumulating instead of running away)."""
    validation_interval: int = 10
    """Steps between validation-loss evaluations (0: never)."""
    validation_batches: int = 4
    """Held-out micro-batches per evaluation."""
    target_validation_loss: float = 0.0
    """Stop once a validation loss at or below this is reached (0: train on)."""
    max_steps: int = 0
    """Stop after this global step (0: no limit)."""
    precision: str = "fp32"
    """Local forward and backward: fp32, bf16 (autocast) or fp16 (autocast with a GradScaler;
    gradients are unscaled before they are averaged, so the scale is each peer's own)."""
    clip_grad_norm: float = 0.0
    """Clip the averaged gradient (diloco: pseudo-gradient) to this L2 norm before the step,
    identically on every peer (0: no clipping)."""
    average_buffers: bool = True
    """Average the model's floating and integer buffers (BatchNorm statistics) with every step
    and certify them with the parameters; off: each peer keeps its own."""
    checkpoint_dir: str = "~/.peertrain/checkpoints"
    """Where periodic checkpoints go (a folder per collaboration and task)."""
    checkpoint_interval: float = 300.0
    """Seconds between local checkpoints (one more is written on a clean stop)."""
    seed: int = 0
    """Seed of this peer's data sampling, mixed with its peer id: every peer draws its own
    micro-batches for any seed, and the same ones again with the same seed and identity."""


@dataclass(frozen=True, kw_only=True)
class StateConfig(_Section):
    parallel_donors: int = 3
    """Peers a late joiner downloads state from at once."""
    max_uploads: int = 4
    """Downloads this peer serves at once (more are refused; the joiner asks others)."""
    chunk_bytes: int = 4194304
    """Bytes per verified chunk of a state download (4 MiB)."""
    download_timeout: float = 120.0
    """Seconds a whole state download may take before it is retried."""
    caller_states: float = 20.0
    """State downloads (manifests) one peer may start from this one per caller_window."""
    caller_window: float = 300.0
    """Seconds over which a peer's state-download budget refills."""
    keep: bool = False
    """Backbones: keep the newest state (in training.checkpoint_dir) and serve it to joiners."""


@dataclass(frozen=True, kw_only=True)
class RelayConfig(_Section):
    """Circuit relay v2 and hole punching (peer.net.relay, peer.net.holepunch)."""

    serve: bool = True
    """Backbones: relay control traffic for peers behind NAT."""
    reserve: bool = True
    """Peers: while not reachable inbound, hold a slot on each backbone and announce it."""
    holepunch: bool = True
    """Try to turn a relayed connection into a direct one (both ends must allow it)."""
    max_reservations: int = 128
    """Backbones: reservations held at once."""
    max_reservations_per_source: int = 8
    """Of those, from one IPv4 /24 or IPv6 /64."""
    reservation_seconds: int = 900
    """Lifetime of a reservation; peers renew at half of it."""
    max_circuits: int = 64
    """Backbones: circuits relayed at once."""
    max_circuits_per_peer: int = 8
    """Of those, to one reserved peer."""
    max_circuits_per_source: int = 8
    """Of those, opened from one IPv4 /24 or IPv6 /64."""
    circuit_bytes: int = 4194304
    """Data budget of one circuit (both directions together) before the relay cuts it."""
    circuit_seconds: int = 600
    """Seconds one circuit lives before the relay cuts it."""
    retry_seconds: float = 10.0
    """Peers: pause before asking a relay again after a failure."""


@dataclass(frozen=True, kw_only=True)
class MetricsConfig(_Section):
    MINIMUM: ClassVar[dict[str, int]] = {"port": 0}
    MAXIMUM: ClassVar[dict[str, int]] = {"port": 65535}
    port: int = 0
    """TCP port of the Prometheus endpoint (GET /metrics); 0: no endpoint."""
    host: str = "127.0.0.1"
    """Address the endpoint listens on; 0.0.0.0 lets a Prometheus on another machine scrape."""


@dataclass(frozen=True, kw_only=True)
class DashboardConfig(_Section):
    MINIMUM: ClassVar[dict[str, int]] = {"port": 0}
    MAXIMUM: ClassVar[dict[str, int]] = {"port": 65535}
    port: int = 0
    """TCP port of the web dashboard (`backbone start --dashboard-port`); 0: none."""
    host: str = "127.0.0.1"
    """Address it listens on; 0.0.0.0 shows it to other machines (it is read-only and shows
    only the collaboration's public records)."""
    interval: float = 2.0
    """Seconds between its reads of the collaboration's records."""


@dataclass(frozen=True, kw_only=True)
class LogConfig(_Section):
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "level": ("debug", "info", "warning", "error"),
        "format": ("rich", "json"),
    }
    ZERO_OK: ClassVar[frozenset[str]] = frozenset({"collaboration_interval"})
    EMPTY_OK: ClassVar[frozenset[str]] = frozenset({"tensorboard_dir"})
    level: str = "info"
    """One of debug, info, warning, error."""
    format: str = "rich"
    """rich (for people) or json (one object per line, for machines)."""
    collaboration_interval: float = 30.0
    """A backbone's reads of the collaboration's progress, in seconds: a log line each time
    the global step moved (step, trainers, loss, samples/s, time per step). 0: none."""
    tensorboard_dir: str = ""
    """A peer's TensorBoard scalars (loss, samples/s, each step's peers, batch and times,
    validation loss, `peertrain.Optimizer.log`'s metrics) under DIR/peer-<id end>; empty:
    none. Needs `pip install tensorboard`."""


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    identity: IdentityConfig = field(default_factory=IdentityConfig)
    net: NetConfig = field(default_factory=NetConfig)
    dht: DhtConfig = field(default_factory=DhtConfig)
    presence: PresenceConfig = field(default_factory=PresenceConfig)
    collaboration: CollaborationConfig = field(default_factory=CollaborationConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    state: StateConfig = field(default_factory=StateConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    log: LogConfig = field(default_factory=LogConfig)


@dataclass(frozen=True, kw_only=True)
class LoadedConfig:
    config: PeerConfig
    """The validated configuration."""
    sources: dict[str, str]
    """Dotted key -> "default", "file <path>", "env <VAR>" or "flag"."""


_SECTION_TYPES = typing.get_type_hints(PeerConfig)
SECTIONS: dict[str, type[_Section]] = {
    f.name: _SECTION_TYPES[f.name] for f in dataclasses.fields(PeerConfig)
}
#: section -> field -> annotated type (str, int, float, bool, list[str] or dict[str, Any]).
FIELDS: dict[str, dict[str, Any]] = {
    section: {f.name: typing.get_type_hints(cls)[f.name] for f in dataclasses.fields(cls)}
    for section, cls in SECTIONS.items()
}

_SECTION_NAMES = {cls.__name__: name for name, cls in SECTIONS.items()}

_EXPECTED: dict[Any, str] = {
    bool: "expected true or false",
    int: "expected an integer",
    float: "expected a number",
    str: "expected a string",
    list[str]: "expected a list of strings (comma-separated in the environment)",
    dict[str, Any]: (
        "expected a table of name = value (strings, numbers, booleans or lists of them; a JSON "
        "object in the environment)"
    ),
}

#: What a `dict[str, Any]` field's values may be (TOML's and JSON's plain values).
_PLAIN = (str, int, float, bool)


def _plain(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, _PLAIN) or (
        isinstance(value, list) and all(isinstance(v, _PLAIN) and _plain(v) for v in value)
    )


# Cross-field rules: (key, other key, holds(value, other), expectation). Checked after every
# layer is merged, so a file may set ttl and a flag refresh.
_CROSS_RULES: list[tuple[str, str, Callable[[Any, Any], bool], str]] = [
    ("presence.refresh", "presence.ttl", lambda a, b: a < b, "expected less than presence.ttl"),
    ("dht.replicas", "dht.bucket_size", lambda a, b: a <= b, "expected at most dht.bucket_size"),
    (
        "task.micro_batch",
        "task.target_batch",
        lambda a, b: a <= b,
        "expected at most task.target_batch",
    ),
    (
        "probe.max_bytes",
        "probe.budget_bytes",
        lambda a, b: a <= b,
        "expected at most probe.budget_bytes",
    ),
    (
        "measure.interval",
        "averaging.attestation_max_age",
        lambda a, b: a < b,
        "expected less than averaging.attestation_max_age (peers' attestations would expire "
        "between measurements)",
    ),
    (
        "relay.max_reservations_per_source",
        "relay.max_reservations",
        lambda a, b: a <= b,
        "expected at most relay.max_reservations",
    ),
    (
        "relay.max_circuits_per_peer",
        "relay.max_circuits",
        lambda a, b: a <= b,
        "expected at most relay.max_circuits",
    ),
    (
        "relay.max_circuits_per_source",
        "relay.max_circuits",
        lambda a, b: a <= b,
        "expected at most relay.max_circuits",
    ),
    (
        "averaging.min_group_size",
        "averaging.group_size",
        lambda a, b: 1 <= a <= min(b, MAX_STEP_SIGNERS),
        f"expected at least 1, at most averaging.group_size and at most {MAX_STEP_SIGNERS} (the "
        "step signatures a progress record carries)",
    ),
]


def load_config(
    *,
    file: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LoadedConfig:
    """Merge defaults < file < env < overrides, validate, and record each key's source.

    `env=None` means no environment at all (callers pass `os.environ` explicitly, tests a dict).
    Without `file`, `env["PEERTRAIN_CONFIG"]` names the file if set. `None` overrides are
    flags that were not given and are skipped.
    """
    env = env or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for key, value in config_to_dict(cls()).items():
            values[f"{section}.{key}"] = value
            sources[f"{section}.{key}"] = "default"

    if file is None and env.get("PEERTRAIN_CONFIG"):
        file = Path(env["PEERTRAIN_CONFIG"])
    if file is not None:
        origin = f"file {file}"
        for dotted, raw in _read_toml(file).items():
            values[dotted] = _coerce(dotted, raw, origin)
            sources[dotted] = origin

    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in ENV_ALLOWED:
            continue
        dotted = _env_key(var)
        origin = f"env {var}"
        values[dotted] = _coerce(dotted, _parse_env(dotted, env[var], origin), origin)
        sources[dotted] = origin

    for dotted, raw in (overrides or {}).items():
        if raw is None:
            continue
        _check_known(dotted, "flag")
        values[dotted] = _coerce(dotted, raw, "flag")
        sources[dotted] = "flag"

    for dotted, other, holds, expected in _CROSS_RULES:
        if not holds(values[dotted], values[other]):
            raise ConfigError(
                f"{dotted} = {values[dotted]!r} (from {sources[dotted]}): {expected} "
                f"({values[other]!r} from {sources[other]})"
            )
    config = PeerConfig(
        **{
            name: cls(**{key: values[f"{name}.{key}"] for key in FIELDS[name]})
            for name, cls in SECTIONS.items()
        }
    )
    return LoadedConfig(config=config, sources=sources)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass as nested plain dicts and lists (for `peer config show`)."""
    return dataclasses.asdict(cfg)


def _read_toml(path: Path) -> dict[str, Any]:
    """Flatten a TOML file into {"section.key": value}, rejecting unknown sections and keys."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        message = " ".join(str(error).split())
        raise ConfigError(f"config file {path} is not valid TOML: {message}") from error
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from error
    origin = f"file {path}"
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown section [{section}] in {origin}: known sections are {', '.join(SECTIONS)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(
                f"{section} = {table!r} (from {origin}): expected a [{section}] table"
            )
        for key, value in table.items():
            _check_known(f"{section}.{key}", origin)
            flat[f"{section}.{key}"] = value
    return flat


def _check_known(dotted: str, origin: str) -> None:
    section, _, key = dotted.partition(".")
    if section not in FIELDS:
        raise ConfigError(
            f"unknown key {dotted!r} in {origin}: known sections are {', '.join(FIELDS)}"
        )
    if key not in FIELDS[section]:
        known = sorted(FIELDS[section])
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {section}.{close[0]}?)" if close else ""
        raise ConfigError(
            f"unknown key {dotted!r} in {origin}: known keys in [{section}] are "
            f"{', '.join(known)}{hint}"
        )


def _env_key(var: str) -> str:
    """PEERTRAIN_DHT_MAX_TTL -> "dht.max_ttl" (section names hold no underscore)."""
    section, _, key = var.removeprefix(ENV_PREFIX).lower().partition("_")
    dotted = f"{section}.{key}"
    if section not in FIELDS:
        raise ConfigError(
            f"unknown environment variable {var}: expected {ENV_PREFIX}<SECTION>_<KEY> with a "
            f"section among {', '.join(FIELDS)}, or one of {', '.join(sorted(ENV_ALLOWED))}"
        )
    _check_known(dotted, f"env {var}")
    return dotted


def _parse_env(dotted: str, text: str, origin: str) -> Any:
    """Turn an environment string into the field's Python type (checked again by _coerce)."""
    section, key = dotted.split(".")
    kind = FIELDS[section][key]
    try:
        if kind is bool:
            return {"true": True, "1": True, "false": False, "0": False}[text.strip().lower()]
        if kind is int:
            return int(text.strip())
        if kind is float:
            return float(text.strip())
    except (KeyError, ValueError):
        raise ConfigError(f"{dotted} = {text!r} (from {origin}): {_EXPECTED[kind]}") from None
    if kind == list[str]:
        return [item.strip() for item in text.split(",") if item.strip()]
    if kind == dict[str, Any]:
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            raise ConfigError(f"{dotted} = {text!r} (from {origin}): {_EXPECTED[kind]}") from None
    return text


def _coerce(dotted: str, value: Any, origin: str) -> Any:
    """Check `value` against the field's type and range; return it in canonical form."""
    section, key = dotted.split(".")
    kind = FIELDS[section][key]
    problem = None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        minimum = getattr(SECTIONS[section], "MINIMUM", {}).get(key, 1)
        maximum = getattr(SECTIONS[section], "MAXIMUM", {}).get(key, math.inf)
        if ok and not minimum <= value <= maximum:
            problem = f"expected an integer >= {minimum}" + (
                f" and <= {maximum}" if maximum != math.inf else ""
            )
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            value = float(value)
            zero_ok = key in getattr(SECTIONS[section], "ZERO_OK", frozenset())
            low, expected = (0.0, ">= 0") if zero_ok else (None, "> 0")
            in_range = value >= 0 if low is not None else value > 0
            problem = None if math.isfinite(value) and in_range else f"expected a number {expected}"
    elif kind == dict[str, Any]:
        ok = isinstance(value, dict)
        if ok:
            bad = [
                k
                for k, v in value.items()
                if not (isinstance(k, str) and k.isidentifier() and _plain(v))
            ]
            value = dict(value)
            problem = f"{bad[0]!r}: {_EXPECTED[kind]}" if bad else None
    elif kind == list[str]:
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
        if ok:
            value = list(value)
            bad = [v for v in value if not v.startswith("/")]
            problem = f"expected multiaddrs starting with '/', got {bad[0]!r}" if bad else None
    else:
        ok = isinstance(value, str)
        choices = getattr(SECTIONS[section], "CHOICES", {}).get(key)
        if ok and choices:
            value = value.lower()
            problem = None if value in choices else f"expected one of {', '.join(choices)}"
        elif ok and not value.strip() and key not in getattr(SECTIONS[section], "EMPTY_OK", ()):
            problem = "expected a non-empty string"
    if not ok:
        problem = _EXPECTED[kind]
    if problem:
        raise ConfigError(f"{dotted} = {value!r} (from {origin}): {problem}")
    return value
