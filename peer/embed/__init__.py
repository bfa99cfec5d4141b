"""A training loop of the user's own as a peer (`peertrain.Optimizer`): `optimizer`, the
public face; `engine`, the daemon in a thread; `worker`, what the loop feeds; `rendezvous`,
where the engine's work on the model runs."""
