"""Evidence of a smarthost's own records about relayed messages (design.md, reconciliation)."""
