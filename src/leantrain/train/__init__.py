"""Training: the loop (trainer), optimizer, LR schedule, precision policy and the `train` command."""
