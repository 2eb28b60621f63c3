"""Framework-agnostic core: tensor-ops backend, wire formats, collectives, state."""
