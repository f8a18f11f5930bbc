"""The node store of one Evergreen session: every ordering and shape rule of the spec.

Transport-independent (WebSocket and gRPC feed it the same ``NodeFragment`` messages) and
synchronous: it either accepts a fragment or raises :class:`GatewayError`, which aborts the
session. Actions wait on it through :meth:`NodeStore.wait_complete` (the spec's data dependency
barriers: a node may name children that have not arrived yet). The rules it keeps (fragment
order and retries, the last seq, leaf or non-leaf, metadata, cycles and depth, the limits on
nodes and bytes, server-claimed output ids) are docs/evergreen.md, "Node rules".
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from prismgate.core.errors import Code, exhausted, invalid, not_found, precondition, quote
from prismgate.schemas import evergreen_pb2 as pb


@dataclass(frozen=True, slots=True)
class Limits:
    max_nodes: int = 10_000
    max_bytes: int = 64 * 1024 * 1024
    max_depth: int = 32


@dataclass(slots=True)
class Node:
    id: str
    fragments: dict[int, pb.NodeFragment] = field(default_factory=dict)
    final_seq: int | None = None
    leaf: bool | None = None  # None until a fragment with a chunk or children arrives
    metadata: pb.ChunkMetadata | None = None
    metadata_seq: int | None = None
    produced: bool = False  # an action's output: the server writes it
    tokens: list[int] | None = None  # exact token ids, for text the model generated here

    @property
    def arrived(self) -> bool:
        return bool(self.fragments)

    @property
    def complete(self) -> bool:
        """Every fragment up to and including the final one is here."""
        return self.final_seq is not None and len(self.fragments) == self.final_seq + 1

    def ordered(self) -> list[pb.NodeFragment]:
        return [self.fragments[s] for s in sorted(self.fragments)]

    def children(self) -> list[str]:
        return [c for f in self.ordered() for c in f.child_ids]

    def chunks(self) -> list[pb.Chunk]:
        return [f.chunk_fragment for f in self.ordered() if f.HasField("chunk_fragment")]


def _size(fragment: pb.NodeFragment) -> int:
    chunk = fragment.chunk_fragment
    return len(fragment.id) + sum(len(c) for c in fragment.child_ids) + len(chunk.data) + len(chunk.ref) + 16


class NodeStore:
    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._nodes: dict[str, Node] = {}
        self._dropped: set[str] = set()
        self._parents: dict[str, set[str]] = {}
        self.bytes = 0
        self._changed = asyncio.Event() if _has_loop() else None
        self._closed = False

    # -- reading ---------------------------------------------------------------------

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, node_id: str) -> Node:
        node = self._nodes.get(node_id)
        if node is None:
            if node_id in self._dropped:
                raise precondition(f"node {quote(node_id)} was dropped")
            raise not_found(f"node {quote(node_id)} does not exist")
        return node

    def missing(self, root: str) -> str | None:
        """The id of the first node under ``root`` that is not complete yet (None: the tree is complete)."""
        seen: set[str] = set()
        stack = [root]
        while stack:
            node_id = stack.pop()
            if node_id in seen:
                continue
            seen.add(node_id)
            if node_id in self._dropped:
                raise precondition(f"node {quote(node_id)} was dropped while an action still needed it")
            node = self._nodes.get(node_id)
            if node is None or not node.complete:
                return node_id
            stack.extend(reversed(node.children()))
        return None

    def count_leaves(self, root: str) -> int:
        """How many leaves :meth:`leaves` would yield, counted in time linear in the nodes (not the leaves).

        A node may list the same child many times, nested, so ~500 bytes can expand to
        millions of leaves: count before flattening.
        """
        counts: dict[str, int] = {}
        stack: list[tuple[str, bool]] = [(root, False)]
        while stack:
            node_id, ready = stack.pop()
            if node_id in counts:
                continue
            node = self.get(node_id)
            if node.leaf:
                counts[node_id] = 1
            elif ready:
                counts[node_id] = sum(counts[c] for c in node.children())
            else:
                stack.append((node_id, True))
                stack.extend((c, False) for c in node.children() if c not in counts)
        return counts[root]

    def leaves(self, root: str) -> Iterator[Node]:
        """The leaves under a complete ``root``, in order (a shared node appears each time it is used)."""
        node = self.get(root)
        if node.leaf:
            yield node
            return
        for child in node.children():
            yield from self.leaves(child)

    async def wait_complete(self, root: str) -> None:
        """The data-dependency barrier: return once ``root`` and everything under it arrived."""
        while True:
            missing = self.missing(root)
            if missing is None:
                return
            if self._closed:
                raise precondition(
                    f"node {quote(missing)} (under {quote(root)}) never completed before the input ended"
                )
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            await self._changed.wait()

    def close_input(self) -> None:
        """The client will send nothing more: barriers that cannot complete now fail."""
        self._closed = True
        self._notify()

    # -- writing ---------------------------------------------------------------------

    def add(self, fragment: pb.NodeFragment, *, server: bool = False) -> bool:
        """Store one fragment; False when it was a duplicate (ignored). Raises on a broken rule."""
        node_id = fragment.id
        where = f"node {quote(node_id)} seq {fragment.seq}"
        if not node_id:
            raise invalid("a node fragment has no id")
        if fragment.seq < 0:
            raise invalid(f"{where}: seq must be >= 0")
        if node_id in self._dropped:
            raise precondition(f"{where}: node {quote(node_id)} was dropped; ids are not reused")
        node = self._nodes.get(node_id)
        if node is not None and node.produced and not server:
            raise invalid(f"{where}: node {quote(node_id)} is an action output; only the server writes it")
        if node is not None and fragment.seq in node.fragments:
            return False
        if node is not None and node.final_seq is not None and fragment.seq > node.final_seq:
            raise invalid(f"{where}: seq is past the node's final seq {node.final_seq}")
        if not fragment.continued and node is not None and node.fragments and max(node.fragments) > fragment.seq:
            raise invalid(f"{where}: marked final but seq {max(node.fragments)} already arrived")
        has_chunk = fragment.HasField("chunk_fragment")
        if has_chunk and fragment.child_ids:
            raise invalid(f"{where}: a fragment carries either a chunk or child ids, not both")
        kind = True if has_chunk else (False if fragment.child_ids else None)
        if node is not None and kind is not None and node.leaf is not None and kind != node.leaf:
            what = "a leaf (chunks)" if node.leaf else "a non-leaf (child ids)"
            raise invalid(
                f"{where}: node {quote(node_id)} is {what}; it cannot take {'a chunk' if kind else 'child ids'}"
            )
        if has_chunk and fragment.chunk_fragment.HasField("metadata"):
            self._check_metadata(node, fragment)
        size = _size(fragment)
        if self.bytes + size > self.limits.max_bytes:
            raise exhausted(f"{where}: the session would hold more than {self.limits.max_bytes} bytes of nodes")
        new_ids = [c for c in fragment.child_ids if c not in self._nodes]
        if node is None:
            new_ids.append(node_id)
        if len(self._nodes) + len(set(new_ids)) > self.limits.max_nodes:
            raise exhausted(f"{where}: the session would hold more than {self.limits.max_nodes} nodes")
        for child in fragment.child_ids:
            if child in self._dropped:
                raise precondition(f"{where}: child {quote(child)} was dropped")
        if fragment.child_ids:
            self._check_edges(node_id, list(fragment.child_ids))

        # every check passed: commit
        if node is None:
            node = self._nodes[node_id] = Node(node_id)
        node.fragments[fragment.seq] = fragment
        if kind is not None:
            node.leaf = kind
        if not fragment.continued:
            node.final_seq = fragment.seq
        if has_chunk and fragment.chunk_fragment.HasField("metadata") and (node.metadata is None or fragment.seq == 0):
            node.metadata, node.metadata_seq = fragment.chunk_fragment.metadata, fragment.seq
        for child in fragment.child_ids:
            self._nodes.setdefault(child, Node(child))
            self._parents.setdefault(child, set()).add(node_id)
        self.bytes += size
        if node.complete and node.leaf and node.metadata is None:
            raise invalid(f"node {quote(node_id)}: a leaf needs metadata (a mimetype) on seq 0")
        self._notify()
        return True

    def _check_metadata(self, node: Node | None, fragment: pb.NodeFragment) -> None:
        metadata = fragment.chunk_fragment.metadata
        if node is None or node.metadata is None:
            return
        if metadata != node.metadata:
            raise invalid(
                f"node {quote(fragment.id)} seq {fragment.seq}: metadata differs from seq {node.metadata_seq}'s "
                f"(mimetype {metadata.mimetype!r} role {metadata.role!r} vs "
                f"{node.metadata.mimetype!r} role {node.metadata.role!r})"
            )

    def _check_edges(self, parent: str, children: list[str]) -> None:
        """Reject an edge that closes a cycle or makes a path longer than the depth limit."""
        heights: dict[str, int] = {}
        for child in children:
            if child == parent or self._reaches(child, parent):
                raise invalid(
                    f"node {quote(parent)}: child {quote(child)} would make a cycle (a node cannot contain itself)"
                )
        below = max(self._height(c, heights) for c in children)
        above = self._depth_above(parent, {})
        if above + below > self.limits.max_depth:
            raise invalid(
                f"node {quote(parent)}: nesting would reach depth {above + below}, "
                f"over the limit {self.limits.max_depth}"
            )

    def _reaches(self, start: str, target: str) -> bool:
        seen: set[str] = set()
        stack = [start]
        while stack:
            node_id = stack.pop()
            if node_id == target:
                return True
            if node_id in seen:
                continue
            seen.add(node_id)
            node = self._nodes.get(node_id)
            if node is not None:
                stack.extend(node.children())
        return False

    def _height(self, node_id: str, memo: dict[str, int]) -> int:
        """Nodes on the longest path down from ``node_id`` (itself included)."""
        if node_id not in memo:
            node = self._nodes.get(node_id)
            kids = node.children() if node is not None else []
            memo[node_id] = 1 + max((self._height(c, memo) for c in kids), default=0)
        return memo[node_id]

    def _depth_above(self, node_id: str, memo: dict[str, int]) -> int:
        """Nodes on the longest path from a root down to ``node_id`` (itself included)."""
        if node_id not in memo:
            parents = self._parents.get(node_id, set())
            memo[node_id] = 1 + max((self._depth_above(p, memo) for p in parents), default=0)
        return memo[node_id]

    def claim_output(self, node_id: str, *, what: str) -> None:
        """Reserve ``node_id`` for an action's output: it must be new (never sent, never used)."""
        if not node_id:
            raise invalid(f"{what}: an output has no id")
        node = self._nodes.get(node_id)
        if node_id in self._dropped or (node is not None and (node.arrived or node.produced)):
            raise invalid(f"{what}: output id {quote(node_id)} is not new (output ids must not be reused)")
        if node is None:
            if len(self._nodes) + 1 > self.limits.max_nodes:
                raise exhausted(f"{what}: the session would hold more than {self.limits.max_nodes} nodes")
            node = self._nodes[node_id] = Node(node_id)
        node.produced = True

    def drop(self, node_ids: list[str], *, busy: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Forget ``node_ids`` and every descendant no surviving node still references.

        ``busy`` holds outputs still being written; dropping one is FAILED_PRECONDITION.
        """
        for node_id in node_ids:
            self.get(node_id)
            if node_id in busy:
                raise precondition(f"node {quote(node_id)} is still being produced; CANCEL its action first")
        doomed: set[str] = set()
        stack = list(node_ids)
        while stack:
            node_id = stack.pop()
            if node_id in doomed or node_id not in self._nodes:
                continue
            doomed.add(node_id)
            stack.extend(self._nodes[node_id].children())
        kept_roots = {c for n, node in self._nodes.items() if n not in doomed for c in node.children() if c in doomed}
        kept_roots -= set(node_ids)
        stack = list(kept_roots)
        while stack:  # shared with a surviving node: keep it and what hangs below
            node_id = stack.pop()
            if node_id in doomed and node_id not in node_ids:
                doomed.discard(node_id)
                stack.extend(self._nodes[node_id].children())
        doomed -= busy
        for node_id in doomed:
            node = self._nodes.pop(node_id)
            self.bytes -= sum(_size(f) for f in node.fragments.values())
            for child in node.children():
                parents = self._parents.get(child)
                if parents is not None:
                    parents.discard(node_id)
            self._parents.pop(node_id, None)
        self._dropped |= doomed
        self._notify()
        return sorted(doomed)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


__all__ = ["Code", "Limits", "Node", "NodeStore"]
