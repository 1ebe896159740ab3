"""I/O shells: they move bytes and never decide what to send."""
