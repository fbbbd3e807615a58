"""The chaos soak: real workers, brokers and faults, then a ledger (docs/reliability.md)."""
