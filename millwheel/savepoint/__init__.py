"""Savepoints: a consistent cut of a whole deployment as one portable file
(format.py), read from a store (capture.py) and written into one (restore.py)."""
