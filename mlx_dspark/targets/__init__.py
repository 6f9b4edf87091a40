"""The target model: the adapter that alone knows mlx-lm's internals (hidden-state
taps, tree masks and per-node positions, cache rollback), and which model types
it supports."""
