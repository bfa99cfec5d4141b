"""State download: a late or lagging peer fetches the training state from up-to-date peers.

Control over libp2p, bulk bytes over TLS 1.3 on TCP. A py-libp2p Noise + yamux stream tops out
near 0.3 GB/s and keeps a core busy (docs/benchmarks.md), a tenth of loopback TCP, so:

    /peertrain/state/2 (RPC)  manifest{min_step} -> Manifest{step, total_bytes, ends,
                                                   hashes, data_host, data_port, data_cert,
                                                   ticket}
                                                | Err{unavailable}   nothing new enough / busy
                              release{ticket}   -> Released{}        the download is over
    data port (TCP)           admission (the network key, if any: `peer.net.admission`), then
                              TLS 1.3: the client pins the manifest's `data_cert`, which names
                              the donor's peer id (`peer.net.tls`); inside TLS:
                              client: MAGIC | ticket, then chunk indices (4 bytes each, pipelined)
                              donor:  per index, in order: kind | index | length, then `length`
                                      bytes (the chunk, or a UTF-8 error that ends the connection)

Where the donor's data address is not one we may dial, or connects nowhere within
`direct_timeout`, the same data protocol runs over a libp2p stream `/peertrain/state-data/1`
(`peer.net.streamio`) instead of TCP + TLS: Noise authenticates the donor, and the donor takes
only a ticket it gave the stream's own peer (a stream from a peer holding none is reset unread).

The manifest travels over the Noise-authenticated RPC, so the donor's certificate is the one
its libp2p identity vouches for, and every chunk is also checked against its hash (BLAKE3) before it
is accepted. The ticket (32 random bytes) is the admission token that bounds how many downloads
a donor serves at once (`max_downloads`); it travels inside TLS, so no eavesdropper can replay
it or read the state.

A donor pins, per ticket, the exact `Snapshot` its manifest describes, so a step that ends
mid-download does not change the bytes under the downloader. Chunks follow the state's
layout (`chunks.chunk_ends`), so a large tensor's chunks are the pieces its step's digest
hashed: a trainer's snapshot brings those hashes (`Snapshot.hashes`), and the donor hashes only
the rest, once per snapshot, in worker threads (BLAKE3 releases the GIL: ~0.18 s/GB per thread
here). The downloader receives straight into its result buffer and hashes each chunk in a
worker thread while the next one arrives; the finished `Snapshot` carries those checked hashes,
which the joiner's digest takes instead of hashing the state again. A trainer downloads into
its own tensors instead (`StateDownload.run_into`, `inplace`): the header and the small
chunks first, then, once the sink has checked the state, the rest straight where it goes. Protocol decisions (which
manifest, who serves which chunk, requeueing) are pure code in `peer.training.chunks`. Nothing
received is unpickled.

Modules: `wire` (the `Snapshot` and the data-plane framing both sides share), `donor`
(`StateDonor`), `download` (`StateDownload`, `download_state`, `StateDownloadFailed`),
`inplace` (a download into the downloader's own tensors: the pure part, and the `Sink`).
"""

from peer.training.statesync.donor import DonorStatistics, SnapshotSource, StateDonor, held
from peer.training.statesync.download import (
    DownloadStatistics,
    StateDownload,
    StateDownloadFailed,
    download_state,
)
from peer.training.statesync.wire import REPLY, Snapshot

__all__ = [
    "REPLY",
    "DonorStatistics",
    "DownloadStatistics",
    "Snapshot",
    "SnapshotSource",
    "StateDonor",
    "StateDownload",
    "StateDownloadFailed",
    "download_state",
    "held",
]
