"""peertrain: DeDLOC-style collaborative training on volunteer machines."""

__version__ = "0.1.0"
