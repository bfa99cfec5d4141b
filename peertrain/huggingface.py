"""HuggingFace `Trainer` integration (needs `transformers`): see `peer.embed.huggingface`."""

from peer.embed.huggingface import PeertrainCallback, TrainerOptimizer, trainer_kwargs

__all__ = ["PeertrainCallback", "TrainerOptimizer", "trainer_kwargs"]
