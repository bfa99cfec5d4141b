"""A participant running modified software, for the hostile tests:

    python -m tests.hostile.malicious_peer MODE join --backbone ... --identity ...

It is the real `peer join` daemon with one behaviour changed (a volunteer may run anything):

- `forge-certificate`: as a group's leader, it lists itself with another member's data
  certificate, to read that member's contribution and forge its averages (issue 16, class 3).
- `bad-shares`: as a leader, it sends all-zero shares, a NaN weight and itself twice: values
  that cut no vector (class 2; they raised ValueError/KeyError in every member).
- `junk-certificate`: its data certificate is 600 bytes of garbage, in its joins and in its
  specs (class 1: unusable key material from a member crashed every honest member).
- `crawl`: it advertises 1 B/s both ways and, in a round, never dials a reducer (class 4:
  deadlines were taken from the slowest claim, so its group waited for it ~10^7 s).
- `hijack`: its progress record claims step + 1000 (signed by itself) and its donor serves a
  state of that step with every parameter at 0.25 and AdamW's lr at 1e-9 (issue 17: the global
  step was the highest any record claimed, so every peer and the keeper downloaded it).
"""

from __future__ import annotations

import dataclasses
import sys

import msgspec
import trio

from peer.averaging import allreduce, matchmaking
from peer.measure.service import Measurements
from peer.net import tls
from peer.training import state as states
from peer.training import trainer as trainers
from peer.training.certificate import sign_step

HIJACK_AHEAD = 1000
POISON = 0.25


def forge_certificate(spec, leader: str):
    victim = next(m for m in spec.members if m.peer_id != leader)
    return dataclasses.replace(
        spec,
        members=tuple(
            dataclasses.replace(m, cert=victim.cert) if m.peer_id == leader else m
            for m in spec.members
        ),
    )


def bad_shares(spec, leader: str):
    members = [dataclasses.replace(m, share=0.0) for m in spec.members]
    members[0] = dataclasses.replace(members[0], weight=float("nan"))
    ours = next(m for m in members if m.peer_id == leader)
    return dataclasses.replace(spec, members=(*members, ours))


def as_leader(tamper) -> None:
    original = matchmaking.build_spec

    def build_spec(members, **kwargs):
        spec = original(members, **kwargs)
        return tamper(spec, kwargs["leader"])

    matchmaking.build_spec = build_spec


def junk_certificate() -> None:
    original = tls.DataIdentity.__init__

    def init(self, identity_key, peer_id: str) -> None:
        original(self, identity_key, peer_id)
        self.certificate = b"\x30\x82\x02\x54" + bytes(596)

    tls.DataIdentity.__init__ = init


def crawl() -> None:
    measured = Measurements.capabilities

    def capabilities(self):
        figures = measured(self)
        if figures is None:
            return None
        return msgspec.structs.replace(figures, upload_bps=1.0, download_bps=1.0)

    async def never_dial(self, j: int, reducer) -> None:
        await trio.sleep_forever()

    Measurements.capabilities = capabilities
    allreduce._Round._send_to = never_dial


def hijack() -> None:
    """A higher step than anyone's, and a poisoned state for it."""
    Trainer = trainers.Trainer
    honest_record = Trainer.record

    def record(self):
        claimed, digest = self.step + HIJACK_AHEAD, "0" * 32  # sorts below any real digest
        key = self.dht.node.identity.key_pair.private_key
        own = sign_step(key, self.me, self.config.collaboration.name, claimed, digest)
        return msgspec.structs.replace(
            honest_record(self), step=claimed, digest=digest, signatures=[own]
        )

    def snapshot(self):
        from peer.training.statesync import Snapshot

        state = states.capture(self.step, self.model, self.strategy.optimizers())
        state.step += HIJACK_AHEAD
        for name, tensor in state.tensors.items():
            if name.startswith("model."):
                tensor.fill_(POISON)
        for group in state.metadata["optimizers"]["optimizer"]["param_groups"]:
            group["lr"] = 1e-9
        return Snapshot(state.step, states.to_bytes(state))

    Trainer.record = record
    Trainer.snapshot = snapshot


MODES = {
    "hijack": hijack,
    "forge-certificate": lambda: as_leader(forge_certificate),
    "bad-shares": lambda: as_leader(bad_shares),
    "junk-certificate": junk_certificate,
    "crawl": crawl,
}


if __name__ == "__main__":
    mode = sys.argv.pop(1)
    MODES[mode]()
    from cli.peer_cli import app

    app()
