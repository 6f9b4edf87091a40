"""Pairs: the built-in pairs (SmolLM2-135M in :mod:`.default`, Gemma-3-270M in
:mod:`.gemma3`), and the structured and synthetic pairs tests and benchmarks
build."""
