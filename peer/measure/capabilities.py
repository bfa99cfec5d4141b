"""What a node advertises about itself in its presence record: measured, never typed in.

The role solver reads these from every peer's record (`to_capacity`), and `peer status` shows
them. Every field is validated on decode (types and ranges, with upper bounds far above any real
machine), so a peer's record with impossible figures is dropped, not fed to the solver.

The figures are the peer's own: claims. What decides an averaging's shares and deadlines is
`attestations`, what backbones measured and signed (`peer.measure.attestation`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from peer.measure.attestation import MAX_ATTESTATIONS, Attestation
from peer.roles import PeerCapacity

# Upper bounds far above any real machine keep sums of many peers' figures finite.
Speed = Annotated[float, msgspec.Meta(ge=0, le=1e12)]
Rate = Annotated[float, msgspec.Meta(ge=0, le=1e13)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=3600)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 50)]


class Capabilities(msgspec.Struct, frozen=True):
    samples_per_s: Speed
    """Training throughput of the task on this node (0: it does not compute)."""
    upload_bps: Rate
    download_bps: Rate
    rtt_s: Seconds
    """Round trip to the nearest backbone probed (0: not measured)."""
    reachable: bool
    """Others can dial it (a backbone dialed it back): it may aggregate."""
    device: Annotated[str, msgspec.Meta(max_length=64)]
    free_memory_bytes: Count
    measured_at: float
    """Wall-clock time of the latest measurement."""
    task: Annotated[str, msgspec.Meta(max_length=256)]
    """The task it trains ("" for a backbone)."""
    gradient_bytes: Count
    """Bytes of one gradient of that task (P in the role solver)."""
    target_batch: Count
    """Samples per collaborative step it is configured for (B in the role solver)."""
    attestations: Annotated[tuple[Attestation, ...], msgspec.Meta(max_length=MAX_ATTESTATIONS)] = ()
    """Backbones' signed measurements of its link, the newest of each (checked by readers).
    The default keeps older records decodable; older readers ignore the field."""
    punchable: bool = False
    """Not reachable, but its NAT maps its listen port alike for every destination (what
    backbones saw of dials from that port, `peer.measure.reachability.punch_address`): peers
    that are reachable or punchable themselves reach it by hole punching
    (`peer.roles.aggregators`). A claim, like `reachable`."""


def to_capacity(peer_id: str, capabilities: Capabilities) -> PeerCapacity | None:
    """The solver's view of a peer, or None when its figures are not usable."""
    try:
        return PeerCapacity(
            peer_id=peer_id,
            samples_per_s=capabilities.samples_per_s,
            upload_bps=capabilities.upload_bps,
            download_bps=capabilities.download_bps,
            reachable=capabilities.reachable,
        )
    except ValueError:
        return None
