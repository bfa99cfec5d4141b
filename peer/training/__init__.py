"""Training: tasks (model + data + loss); the collaborative optimizers come with the training issue."""
