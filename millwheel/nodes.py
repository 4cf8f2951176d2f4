"""A node of the dataflow graph as the runtime names it, and the kind of node it is.

Every key range belongs to a node. A computation's node is its name; an injector and a
connector sink run as one-range nodes of their own, named with a prefix that no user
name can hold (names never contain ':', millwheel/limits.py), and a rescale stages its
copy under a third. The prefixes are the store's key layout and the wire's node names,
so they never change; code asks :func:`kind_of` rather than testing prefixes itself.
"""

from __future__ import annotations

import enum


class NodeKind(enum.Enum):
    """What runs a node's key ranges. The value is the node name's prefix."""

    COMPUTATION = ""
    INJECTOR = "injector:"
    SINK = "sink:"
    STAGING = "rescale:"  #: a rescale's staging copy (services/controller/rescale_journal.py)

    def node(self, name: str) -> str:
        """The node of this kind named ``name``."""
        return f"{self.value}{name}"


_PREFIXED = (NodeKind.INJECTOR, NodeKind.SINK, NodeKind.STAGING)


def kind_of(node: str) -> NodeKind:
    """The kind of ``node``, from its name."""
    for kind in _PREFIXED:
        if node.startswith(kind.value):
            return kind
    return NodeKind.COMPUTATION


def name_of(node: str) -> str:
    """``node`` without its kind's prefix: the injector's, sink's or computation's own name."""
    return node[len(kind_of(node).value):]


def injector_node(name: str) -> str:
    """The node (one key range) of injector ``name``."""
    return NodeKind.INJECTOR.node(name)


def sink_node(name: str) -> str:
    """The node (one key range) whose owner runs sink ``name``."""
    return NodeKind.SINK.node(name)


def is_injector(node: str) -> bool:
    return kind_of(node) is NodeKind.INJECTOR


def is_sink(node: str) -> bool:
    return kind_of(node) is NodeKind.SINK
