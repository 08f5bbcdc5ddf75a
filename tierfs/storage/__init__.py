"""Storage daemon: chunk engine, I/O backends, data-plane server, repair and scrub."""
