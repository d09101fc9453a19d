"""What keeps a run from wasting itself, each off unless asked for except the health warnings:
the collapse guard (rollbacks), adaptive group size, dynamic sampling, the health warnings."""
