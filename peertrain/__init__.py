"""peertrain's Python API: train collaboratively from a training loop of one's own.

    import peertrain
    opt = peertrain.Optimizer(model, torch.optim.AdamW(model.parameters()), backbones=[...])

See `peer.embed.optimizer` for the whole example. The daemons (`peer join`, `backbone
start`) are the same engine behind the command line.
"""

from peer import __version__
from peer.embed.optimizer import Optimizer
from peer.errors import ConfigError, PeertrainError, RemoteError, UserError

__all__ = ["ConfigError", "Optimizer", "PeertrainError", "RemoteError", "UserError", "__version__"]
