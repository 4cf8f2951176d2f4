"""State stores behind one protocol; :func:`open_store` picks the backend by URL."""

from millwheel.state.protocol import Checkpoint, Production, StateStore
from millwheel.state.url import open_store

__all__ = ["Checkpoint", "Production", "StateStore", "open_store"]
