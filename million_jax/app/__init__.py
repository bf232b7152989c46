"""The application layer: what the command line drives (may import ``models``)."""
