"""Every node-store rule of evergreen-wire.md, on the store alone (no model, no transport)."""

from __future__ import annotations

import asyncio

import pytest

from prismgate.codecs.evergreen.nodes import Limits, NodeStore
from prismgate.core.errors import Code, GatewayError
from prismgate.schemas import evergreen_pb2 as pb


def leaf(
    node_id: str,
    data: bytes = b"x",
    *,
    seq: int = 0,
    continued: bool = False,
    mime: str | None = "text/plain",
    role: str = "",
) -> pb.NodeFragment:
    f = pb.NodeFragment(id=node_id, seq=seq, continued=continued)
    f.chunk_fragment.data = data
    if mime is not None:
        f.chunk_fragment.metadata.mimetype = mime
        if role:
            f.chunk_fragment.metadata.role = role
    return f


def branch(node_id: str, *children: str, seq: int = 0, continued: bool = False) -> pb.NodeFragment:
    return pb.NodeFragment(id=node_id, seq=seq, continued=continued, child_ids=list(children))


def empty(node_id: str, seq: int) -> pb.NodeFragment:
    return pb.NodeFragment(id=node_id, seq=seq, continued=False)


def rejects(store: NodeStore, fragment: pb.NodeFragment, code: Code, *words: str) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        store.add(fragment)
    assert info.value.code is code, info.value
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value


def test_fragments_in_any_order_complete_the_node() -> None:
    store = NodeStore()
    store.add(leaf("a", b"c", seq=2))
    assert store.missing("a") == "a"
    store.add(leaf("a", b"a", seq=0, continued=True))
    store.add(leaf("a", b"b", seq=1, continued=True, mime=None))
    assert store.missing("a") is None
    assert [c.data for c in store.get("a").chunks()] == [b"a", b"b", b"c"]


def test_duplicate_seq_keeps_the_first_and_is_not_an_error() -> None:
    store = NodeStore()
    assert store.add(leaf("a", b"first", continued=True))
    assert not store.add(leaf("a", b"second", continued=True))
    assert store.add(leaf("a", b"end", seq=1))
    assert not store.add(leaf("a", b"again", seq=1))
    assert [c.data for c in store.get("a").chunks()] == [b"first", b"end"]


def test_seq_past_the_final_one_aborts() -> None:
    store = NodeStore()
    store.add(leaf("a", seq=0, continued=True))
    store.add(empty("a", 1))
    rejects(store, leaf("a", seq=2, mime=None), Code.INVALID_ARGUMENT, "'a'", "past the node's final seq 1")


def test_final_below_an_arrived_seq_aborts() -> None:
    store = NodeStore()
    store.add(leaf("a", seq=3, continued=True))
    rejects(store, empty("a", 1), Code.INVALID_ARGUMENT, "'a'", "final")


def test_negative_seq_and_missing_id_abort() -> None:
    store = NodeStore()
    rejects(store, leaf("a", seq=-1), Code.INVALID_ARGUMENT, "seq must be >= 0")
    rejects(store, leaf(""), Code.INVALID_ARGUMENT, "no id")


def test_leaf_or_non_leaf_is_fixed_by_the_first_fragment() -> None:
    store = NodeStore()
    store.add(leaf("a", continued=True))
    rejects(store, branch("a", "x", seq=1), Code.INVALID_ARGUMENT, "'a' is a leaf")
    store.add(branch("b", "x", continued=True))
    rejects(store, leaf("b", seq=1), Code.INVALID_ARGUMENT, "'b' is a non-leaf")


def test_a_fragment_with_both_children_and_a_chunk_aborts() -> None:
    f = leaf("a")
    f.child_ids.append("x")
    rejects(NodeStore(), f, Code.INVALID_ARGUMENT, "not both")


def test_children_may_be_referenced_before_they_arrive() -> None:
    store = NodeStore()
    store.add(branch("root", "later", "sooner"))
    store.add(leaf("sooner", b"s"))
    assert store.missing("root") == "later"
    store.add(leaf("later", b"l"))
    assert store.missing("root") is None
    assert [n.id for n in store.leaves("root")] == ["later", "sooner"]


async def test_barrier_waits_until_the_whole_tree_is_complete() -> None:
    store = NodeStore()
    store.add(branch("root", "a", continued=True))
    waiter = asyncio.create_task(store.wait_complete("root"))
    await asyncio.sleep(0.01)
    store.add(leaf("a"))
    await asyncio.sleep(0.01)
    assert not waiter.done(), "the root is still continued"
    store.add(branch("root", "b", seq=1))
    await asyncio.sleep(0.01)
    assert not waiter.done(), "child b has not arrived"
    store.add(leaf("b"))
    await asyncio.wait_for(waiter, 1)


async def test_barrier_fails_when_the_input_ends_incomplete() -> None:
    store = NodeStore()
    store.add(branch("root", "never"))
    waiter = asyncio.create_task(store.wait_complete("root"))
    await asyncio.sleep(0.01)
    store.close_input()
    with pytest.raises(GatewayError) as info:
        await asyncio.wait_for(waiter, 1)
    assert info.value.code is Code.FAILED_PRECONDITION and "'never'" in info.value.message


def test_cycles_are_rejected() -> None:
    store = NodeStore()
    rejects(store, branch("a", "a"), Code.INVALID_ARGUMENT, "cycle")
    store.add(branch("x", "y"))
    store.add(branch("y", "z"))
    rejects(store, branch("z", "x"), Code.INVALID_ARGUMENT, "'z'", "cycle")


def test_shared_children_form_a_dag_not_a_cycle() -> None:
    store = NodeStore()
    store.add(branch("p1", "shared"))
    store.add(branch("p2", "p1", "shared"))
    store.add(leaf("shared"))
    assert [n.id for n in store.leaves("p2")] == ["shared", "shared"]


def test_depth_limit_counts_nodes_on_the_longest_path() -> None:
    store = NodeStore(Limits(max_depth=3))
    store.add(branch("a", "b"))
    store.add(branch("b", "c"))  # a > b > c: depth 3
    rejects(store, branch("c", "d"), Code.INVALID_ARGUMENT, "depth 4", "limit 3")
    rejects(store, branch("top", "a"), Code.INVALID_ARGUMENT, "depth 4")


def test_metadata_after_seq_0_is_accepted_when_it_matches() -> None:
    store = NodeStore()
    store.add(leaf("a", seq=0, continued=True, role="user"))
    store.add(leaf("a", seq=1, continued=True, role="user"))
    store.add(empty("a", 2))
    assert store.missing("a") is None


def test_metadata_that_differs_aborts_in_either_arrival_order() -> None:
    store = NodeStore()
    store.add(leaf("a", seq=0, continued=True))
    rejects(store, leaf("a", seq=1, mime="image/png"), Code.INVALID_ARGUMENT, "'a' seq 1", "metadata differs")
    store = NodeStore()
    store.add(leaf("b", seq=1, role="model"))
    rejects(store, leaf("b", seq=0, continued=True, role="user"), Code.INVALID_ARGUMENT, "metadata differs")


def test_a_leaf_needs_metadata() -> None:
    rejects(NodeStore(), leaf("a", mime=None), Code.INVALID_ARGUMENT, "needs metadata")


def test_empty_terminator_fragment_closes_a_node() -> None:
    store = NodeStore()
    store.add(branch("p", "q", continued=True))
    store.add(empty("p", 1))
    store.add(leaf("q"))
    assert store.missing("p") is None


def test_node_limit() -> None:
    store = NodeStore(Limits(max_nodes=3))
    store.add(branch("p", "a", "b"))
    rejects(store, leaf("c"), Code.RESOURCE_EXHAUSTED, "more than 3 nodes")


def test_byte_limit() -> None:
    store = NodeStore(Limits(max_bytes=1000))
    store.add(leaf("a", b"x" * 500))
    rejects(store, leaf("b", b"y" * 500), Code.RESOURCE_EXHAUSTED, "'b'", "1000 bytes")


def test_output_ids_must_be_new_and_are_written_by_the_server_only() -> None:
    store = NodeStore()
    store.add(leaf("sent"))
    with pytest.raises(GatewayError, match="not new"):
        store.claim_output("sent", what="action #1")
    store.claim_output("out", what="action #1")
    with pytest.raises(GatewayError, match="not new"):
        store.claim_output("out", what="action #2")
    rejects(store, leaf("out"), Code.INVALID_ARGUMENT, "'out'", "only the server")
    assert store.add(leaf("out"), server=True)


def test_a_referenced_but_unsent_id_may_become_an_output() -> None:
    store = NodeStore()
    store.add(branch("next_prompt", "future_answer"))
    store.claim_output("future_answer", what="action #1")
    store.add(leaf("future_answer"), server=True)
    assert store.missing("next_prompt") is None


def test_drop_forgets_a_subtree_but_keeps_shared_nodes() -> None:
    store = NodeStore()
    store.add(branch("p1", "q1", "shared"))
    store.add(branch("p2", "shared"))
    store.add(leaf("q1"))
    store.add(leaf("shared"))
    before = store.bytes
    assert store.drop(["p1"]) == ["p1", "q1"]
    assert "shared" in store and "p2" in store and "q1" not in store
    assert store.bytes < before
    rejects(store, leaf("q1"), Code.FAILED_PRECONDITION, "dropped")
    with pytest.raises(GatewayError, match="not new"):
        store.claim_output("p1", what="action #3")
    with pytest.raises(GatewayError) as info:
        store.drop(["nope"])
    assert info.value.code is Code.NOT_FOUND


def test_drop_refuses_outputs_still_being_written() -> None:
    store = NodeStore()
    store.claim_output("out", what="a")
    with pytest.raises(GatewayError) as info:
        store.drop(["out"], busy={"out"})
    assert info.value.code is Code.FAILED_PRECONDITION
