"""Reading drafter checkpoints of every kind (DeepSpec DSpark / DFlash,
EAGLE-3, vLLM speculators), checking them against their target, and loading a
pair."""
