"""RadixCache / ChunkCache: property tests against a reference model, plus unit tests.

The reference model for the tree is a dict {prefix tuple: slot of its last token};
because stored prefixes are prefix-closed, it answers match / insert / evict
questions without any tree logic. All tests use the real KV pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from workbench.core.mem_cache.base_prefix_cache import MatchResult
from workbench.core.mem_cache.chunk_cache import ChunkCache
from workbench.core.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from workbench.core.mem_cache.radix_cache import RadixCache, _common_len
from workbench.core.trace.events import CacheEvict, CacheInsert, CacheTree, decode_json, encode_json

SM_SETTINGS = settings(
    max_examples=200, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def make_cache(pool_size=64, rows=8, ctx=64, cls=RadixCache, **kw):
    req_pool = ReqToTokenPool(rows, ctx)
    alloc = TokenToKVPoolAllocator(pool_size)
    return cls(req_pool, alloc, **kw), req_pool, alloc


def tree_contents(cache: RadixCache) -> dict[tuple, int]:
    """{full prefix: slot of its last token} read off the tree."""
    out: dict[tuple, int] = {}
    stack = [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for first, child in node.children.items():
            assert child.key and child.key[0] == first, "children must be keyed by first token"
            assert len(child.key) == len(child.value)
            assert child.parent is node
            p = path
            for tok, slot in zip(child.key, child.value.tolist()):
                p = p + (tok,)
                out[p] = slot
            stack.append((child, p))
    return out


def node_path(node) -> tuple:
    """Token ids from the root to the end of `node`'s edge."""
    parts = []
    while node is not None and node.parent is not None:
        parts.append(tuple(node.key))
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def path_values(node) -> list[int]:
    vals = []
    while node is not None and node.parent is not None:
        vals = node.value.tolist() + vals
        node = node.parent
    return vals


def all_nodes(cache: RadixCache):
    return list(cache._iter_nodes())


def assert_slots_partition(alloc: TokenToKVPoolAllocator, *held: list[int]) -> None:
    """Every slot 1..size is exactly once either free or held by one of `held`."""
    every = alloc.free_slots.tolist()
    for h in held:
        every += h
    assert sorted(every) == list(range(1, alloc.size + 1))


# ---- property tests: tree operations ------------------------------------------

tokens = st.lists(st.integers(0, 2), min_size=0, max_size=8)


class TreeMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / evict against the dict reference."""

    POOL = 48

    def __init__(self):
        super().__init__()
        self.events: list = []
        self.cache, _, self.alloc = make_cache(
            self.POOL, on_event=self.events.append, decode_text=lambda ids: ",".join(map(str, ids))
        )
        self.ref: dict[tuple, int] = {}
        self.locks: list[tuple[Any, tuple]] = []

    def _longest(self, seq) -> int:
        n = 0
        while n < len(seq) and tuple(seq[: n + 1]) in self.ref:
            n += 1
        return n

    def _protected(self) -> set[tuple]:
        return {p[:i] for _, p in self.locks for i in range(1, len(p) + 1)}

    @rule(seq=tokens)
    def insert(self, seq):
        slots = self.alloc.alloc(len(seq))
        if slots is None:
            self.cache.evict(len(seq) - self.alloc.available_size())
            self.ref = tree_contents(self.cache)
            slots = self.alloc.alloc(len(seq))
            if slots is None:
                return
        expected = self._longest(seq)
        got = self.cache.insert(seq, slots)
        assert got == expected
        self.alloc.free(slots[:got])
        for i in range(got, len(seq)):
            self.ref[tuple(seq[: i + 1])] = int(slots[i])

    @rule(seq=tokens)
    def match(self, seq):
        n = self._longest(seq)
        r = self.cache.match_prefix(seq)
        assert isinstance(r, MatchResult)
        assert r.device_indices.dtype == torch.int64
        assert r.device_indices.tolist() == [self.ref[tuple(seq[: i + 1])] for i in range(n)]
        # The split guarantees the match ends exactly at a node boundary.
        assert node_path(r.last_node) == tuple(seq[:n])

    @rule(seq=tokens)
    def lock(self, seq):
        before = self._protected()
        r = self.cache.match_prefix(seq)
        delta = self.cache.inc_lock_ref(r.last_node)
        self.locks.append((r.last_node, node_path(r.last_node)))
        assert delta == -(len(self._protected()) - len(before))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        before = self._protected()
        node, _ = self.locks.pop(i)
        delta = self.cache.dec_lock_ref(node)
        assert delta == len(before) - len(self._protected())

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        before = dict(self.ref)
        evictable = self.cache.evictable_size()
        n_events = len(self.events)
        got = self.cache.evict(n)
        now = tree_contents(self.cache)
        assert all(before.get(p) == s for p, s in now.items()), "evict must only remove"
        assert got == len(before) - len(now)
        if n > 0:
            assert got >= n if evictable >= n else got == evictable
        assert self._protected() <= set(now), "a locked prefix was evicted"
        evs = [e for e in self.events[n_events:] if isinstance(e, CacheEvict)]
        assert sum(e.tokens for e in evs) == got
        self.ref = now

    @invariant()
    def consistent(self):
        assert tree_contents(self.cache) == self.ref
        total = self.cache.total_size()
        assert total == len(self.ref)
        assert self.cache.evictable_size() + self.cache.protected_size() == total
        assert self.cache.protected_size() == len(self._protected())
        assert_slots_partition(self.alloc, list(self.ref.values()))
        for node in all_nodes(self.cache):
            p = node_path(node)
            want = sum(1 for _, lp in self.locks if lp[: len(p)] == p)
            assert node.lock_ref == want


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = SM_SETTINGS


# ---- property tests: request lifecycle (what the scheduler does) ---------------


@dataclass
class FakeReq:
    """The attributes of the scheduler's Req that the caches use, plus test bookkeeping."""

    rid: int
    req_pool_idx: int
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any | None = None
    written: int = 0  # row entries holding valid slots
    chunk: int = 4
    max_new: int = 1


class ReqLifecycle(RuleBasedStateMachine):
    """Admit (match + lock), chunked prefill, decode, finish, abort — with eviction under pressure."""

    # A small pool so allocation fails often and eviction runs under locks.
    POOL, ROWS, CTX = 24, 4, 32
    CACHE_CLS: type = RadixCache
    CACHE_KW: dict = {}

    def __init__(self):
        super().__init__()
        self.cache, self.req_pool, self.alloc = make_cache(
            self.POOL, self.ROWS, self.CTX, cls=self.CACHE_CLS, **self.CACHE_KW
        )
        self.table = self.req_pool.req_to_token
        self.reqs: list[FakeReq] = []
        self.next_rid = 0
        self.shares = isinstance(self.cache, RadixCache) and not self.cache.disable

    def _alloc(self, n):
        slots = self.alloc.alloc(n)
        if slots is None:
            self.cache.evict(n - self.alloc.available_size())
            slots = self.alloc.alloc(n)
        return slots

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=10), chunk=st.integers(1, 4), max_new=st.integers(1, 4)
    )
    def admit(self, prompt, chunk, max_new):
        if self.req_pool.available_size() == 0:
            return
        # At least one prompt token is always computed, so the last one is never matched.
        m = self.cache.match_prefix(prompt[:-1])
        row = self.req_pool.alloc(1)[0]
        self.cache.inc_lock_ref(m.last_node)
        n = len(m.device_indices)
        self.table[row, :n] = m.device_indices
        req = FakeReq(
            self.next_rid,
            row,
            list(prompt),
            fill_ids=list(prompt[:n]),
            prefix_indices=m.device_indices,
            last_node=m.last_node,
            written=n,
            chunk=chunk,
            max_new=max_new,
        )
        self.next_rid += 1
        self.reqs.append(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def step(self, data):
        """One scheduler iteration: every running request advances once, in a random order."""
        for req in data.draw(st.permutations(list(self.reqs))):
            self._advance(req, data)

    def _advance(self, req: FakeReq, data) -> None:
        row, prompt = req.req_pool_idx, req.origin_input_ids
        if req.written < len(prompt):
            n = min(req.chunk, len(prompt) - req.written)
            slots = self._alloc(n)
            if slots is None:
                return
            self.table[row, req.written : req.written + n] = slots
            req.written += n
            req.fill_ids = prompt[: req.written]
            if req.written < len(prompt):
                self.cache.cache_unfinished_req(req)
                assert len(req.prefix_indices) == req.written
            else:
                req.output_ids.append(data.draw(st.integers(0, 2)))
        elif len(req.output_ids) >= req.max_new:
            self.cache.cache_finished_req(req)
            self.reqs.remove(req)
        else:
            slot = self._alloc(1)
            if slot is None:
                return
            self.table[row, req.written] = slot[0]
            req.written += 1
            req.output_ids.append(data.draw(st.integers(0, 2)))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def abort(self, data):
        # Rare compared with `step`, so requests usually run to completion.
        if data.draw(st.integers(0, 5)) != 5:
            return
        req = self.reqs.pop(data.draw(st.integers(0, len(self.reqs) - 1)))
        self.cache.cache_finished_req(req, kv_len=req.written)

    @invariant()
    def no_leak(self):
        held = [self.cache.all_values().tolist()]
        for r in self.reqs:
            own_from = len(r.prefix_indices) if self.shares else 0
            held.append(self.table[r.req_pool_idx, own_from : r.written].tolist())
            assert self.table[r.req_pool_idx, : len(r.prefix_indices)].tolist() == r.prefix_indices.tolist()
            if self.shares:
                assert path_values(r.last_node) == r.prefix_indices.tolist()
                assert node_path(r.last_node) == tuple(r.origin_input_ids[: len(r.prefix_indices)])
        assert_slots_partition(self.alloc, *held)
        assert self.req_pool.available_size() + len(self.reqs) == self.ROWS
        assert self.cache.evictable_size() + self.cache.protected_size() == self.cache.total_size()
        if self.shares:
            locked = set()
            for r in self.reqs:
                node = r.last_node
                while node is not self.cache.root_node:
                    locked.add(node.id)
                    node = node.parent
            assert self.cache.protected_size() == sum(len(n.key) for n in all_nodes(self.cache) if n.id in locked)


LIFE_SETTINGS = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

TestRadixLifecycle = ReqLifecycle.TestCase
TestRadixLifecycle.settings = LIFE_SETTINGS


class ChunkLifecycle(ReqLifecycle):
    CACHE_CLS = ChunkCache


class DisabledRadixLifecycle(ReqLifecycle):
    CACHE_KW = {"disable": True}


TestChunkLifecycle = ChunkLifecycle.TestCase
TestChunkLifecycle.settings = settings(LIFE_SETTINGS, max_examples=40)
TestDisabledRadixLifecycle = DisabledRadixLifecycle.TestCase
TestDisabledRadixLifecycle.settings = settings(LIFE_SETTINGS, max_examples=40)


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(0, 1), max_size=300), b=st.lists(st.integers(0, 1), max_size=300), start=st.integers(0, 5)
)
def test_common_len_matches_naive(a, b, start):
    start = min(start, len(b))
    naive = 0
    while naive < len(a) and start + naive < len(b) and a[naive] == b[start + naive]:
        naive += 1
    assert _common_len(a, b, start) == naive


# ---- unit tests ---------------------------------------------------------------


def test_split_on_partial_match_keeps_original_id():
    events = []
    cache, _, alloc = make_cache(on_event=events.append)
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    (leaf,) = cache.root_node.children.values()
    leaf_id = leaf.id
    r = cache.match_prefix([1, 2, 3, 9])
    assert r.device_indices.tolist() == slots[:3].tolist()
    head = r.last_node
    assert head.key == [1, 2, 3] and head.id != leaf_id
    assert list(head.children.values()) == [leaf]
    assert leaf.key == [4, 5] and leaf.id == leaf_id and leaf.parent is head
    # Two upserts describe the split: new parent, then the original under it.
    ins = [e for e in events if isinstance(e, CacheInsert)]
    assert [(e.node_id, e.parent_id, e.tokens) for e in ins] == [
        (leaf_id, 0, 5),
        (head.id, 0, 3),
        (leaf_id, head.id, 2),
    ]
    assert cache.total_size() == 5 and cache.evictable_size() == 5
    # A full match through the split returns every slot again.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == slots.tolist()


def test_split_of_locked_node_keeps_lock_on_both_parts():
    cache, _, alloc = make_cache()
    cache.insert([1, 2, 3, 4], alloc.alloc(4))
    r = cache.match_prefix([1, 2, 3, 4])
    assert cache.inc_lock_ref(r.last_node) == -4
    cache.match_prefix([1, 2, 7])  # splits the locked edge
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert cache.evict(10) == 0
    assert cache.dec_lock_ref(r.last_node) == 4
    assert cache.evict(10) == 4
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(r.last_node)


def test_insert_returns_already_cached_prefix():
    cache, _, alloc = make_cache()
    a = alloc.alloc(4)
    assert cache.insert([5, 6, 7, 8], a) == 0
    b = alloc.alloc(6)
    assert cache.insert([5, 6, 7, 8, 9, 10], b) == 4
    assert cache.insert([5, 6], alloc.alloc(2)) == 2
    assert cache.match_prefix([5, 6, 7, 8, 9, 10]).device_indices.tolist() == a.tolist() + b[4:].tolist()
    with pytest.raises(ValueError):
        cache.insert([1, 2], alloc.alloc(3))


def test_insert_copies_value_views():
    # Callers pass views of req_to_token rows, which are rewritten once the row is reused.
    cache, req_pool, alloc = make_cache()
    row = req_pool.alloc(1)[0]
    slots = alloc.alloc(3)
    req_pool.req_to_token[row, :3] = slots
    cache.insert([4, 5, 6], req_pool.req_to_token[row, :3])
    req_pool.req_to_token[row, :3] = 0
    assert cache.match_prefix([4, 5, 6]).device_indices.tolist() == slots.tolist()


def test_cache_finished_req_frees_duplicates_and_row():
    cache, req_pool, alloc = make_cache(pool_size=32, rows=4)
    table = req_pool.req_to_token
    prompt, out = [3, 1, 4, 1, 5], [9, 2]
    reqs = []
    for _ in range(2):  # two identical requests computed concurrently: no sharing at admission
        m = cache.match_prefix(prompt[:-1])
        assert len(m.device_indices) == 0
        row = req_pool.alloc(1)[0]
        n = len(prompt) + len(out) - 1
        table[row, :n] = alloc.alloc(n)
        reqs.append(FakeReq(0, row, prompt, list(out), prefix_indices=m.device_indices, last_node=m.last_node))
    first_kv = table[reqs[0].req_pool_idx, :6].tolist()
    cache.cache_finished_req(reqs[0])
    assert alloc.available_size() == 32 - 12 and req_pool.available_size() == 3
    cache.cache_finished_req(reqs[1])  # all 6 of its slots duplicate the first's
    assert alloc.available_size() == 32 - 6 and req_pool.available_size() == 4
    assert cache.match_prefix(prompt + out).device_indices.tolist() == first_kv
    assert cache.evictable_size() == 6 and cache.protected_size() == 0
    assert_slots_partition(alloc, cache.all_values().tolist())


def test_cache_unfinished_req_chunked_and_duplicate():
    cache, req_pool, alloc = make_cache(pool_size=32, rows=4)
    table = req_pool.req_to_token
    prompt = [7, 7, 8, 8, 9, 9]
    row = req_pool.alloc(1)[0]
    m = cache.match_prefix(prompt[:-1])
    req = FakeReq(0, row, prompt, prefix_indices=m.device_indices, last_node=m.last_node)
    cache.inc_lock_ref(m.last_node)
    mine = alloc.alloc(4)
    table[row, :4] = mine
    req.fill_ids = prompt[:4]
    # Meanwhile another request published the first 3 tokens with its own slots.
    theirs = alloc.alloc(3)
    cache.insert(prompt[:3], theirs)
    cache.cache_unfinished_req(req)
    want = theirs.tolist() + mine[3:].tolist()
    assert req.prefix_indices.tolist() == want
    assert table[row, :4].tolist() == want  # row now points at the tree's slots
    assert node_path(req.last_node) == tuple(prompt[:4]) and req.last_node.lock_ref == 1
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert_slots_partition(alloc, cache.all_values().tolist())  # mine[:3] were freed
    # Second (last) chunk, one output token, finish.
    rest = alloc.alloc(2)
    table[row, 4:6] = rest
    req.fill_ids = prompt
    req.output_ids = [1]
    cache.cache_finished_req(req)
    assert req_pool.available_size() == 4
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    assert cache.match_prefix(prompt).device_indices.tolist() == want + rest.tolist()
    assert_slots_partition(alloc, cache.all_values().tolist())


def test_evict_is_lru_and_frees_through_allocator():
    events = []
    cache, _, alloc = make_cache(pool_size=16, on_event=events.append)
    ids = {}
    for seq in ([1, 1], [2, 2], [3, 3]):
        cache.insert(seq, alloc.alloc(2))
        ids[seq[0]] = cache.root_node.children[seq[0]].id
    cache.match_prefix([1, 1])  # 1 is now the most recent
    assert cache.evict(1) == 2
    assert events[-1] == CacheEvict(node_ids=[ids[2]], tokens=2)
    assert alloc.available_size() == 12
    assert cache.evict(3) == 4
    assert events[-1].node_ids == [ids[3], ids[1]]
    assert cache.total_size() == 0 and alloc.available_size() == 16


def test_evict_makes_parent_a_leaf_and_respects_locks():
    cache, _, alloc = make_cache(pool_size=16)
    cache.insert([1, 2, 3], alloc.alloc(3))
    second = alloc.alloc(3)
    assert cache.insert([1, 2, 4], second) == 2  # [1,2] -> {[3], [4]}
    alloc.free(second[:2])
    cache.insert([5, 6], alloc.alloc(2))
    lock = cache.match_prefix([5, 6]).last_node
    cache.inc_lock_ref(lock)
    assert cache.evict(100) == 4  # both leaves, then their parent
    assert cache.total_size() == 2 and cache.protected_size() == 2
    assert list(cache.root_node.children) == [5]
    assert alloc.available_size() == 14


def test_snapshot_and_pretty_print_with_real_text():
    # Byte-level token ids of real chat prompts sharing a system prompt.
    system = "You are a helpful assistant. Answer briefly.\n"
    questions = ["What is the capital of France?", "What is the boiling point of water?"]
    decode = lambda ids: bytes(ids).decode("utf-8", "replace")
    events = []
    cache, _, alloc = make_cache(pool_size=512, on_event=events.append, decode_text=decode)
    prompts = [list((system + q).encode()) for q in questions]
    for p in prompts:
        cache.insert(p, alloc.alloc(len(p)))
    assert cache.match_prefix(prompts[1]).device_indices.numel() == len(prompts[1])
    assert cache.total_size() == len(prompts[0]) + len(prompts[1]) - len((system + "What is the ").encode())
    snap = cache.snapshot()
    assert snap[0].parent_id == -1 and snap[0].node_id == 0
    seen = {0}
    for n in snap[1:]:
        assert n.parent_id in seen  # parents come first
        seen.add(n.node_id)
    assert len(seen) == len(snap) == 4
    assert sum(n.tokens for n in snap) == cache.total_size()
    shared = next(n for n in snap if n.parent_id == 0)
    assert shared.text.startswith("You are a helpful") and len(shared.text) <= 41
    assert shared.hits == 1
    tree = CacheTree(nodes=snap, evictable_size=cache.evictable_size(), protected_size=cache.protected_size())
    assert decode_json(encode_json(tree)) == tree
    text = cache.pretty_print()
    lines = text.splitlines()
    assert len(lines) == 1 + len(snap)  # header + one line per node
    assert "capital of France" in text and lines[2].startswith("  #")
    assert any(isinstance(e, CacheInsert) and e.text.startswith("You are") for e in events)


def test_long_prompt_match():
    cache, _, alloc = make_cache(pool_size=20000)
    base = [i % 1000 for i in range(8000)]
    cache.insert(base, alloc.alloc(8000))
    probe = base[:5000] + [-1]
    r = cache.match_prefix(probe)
    assert r.device_indices.numel() == 5000 and len(r.last_node.key) == 5000


@pytest.mark.parametrize(
    "make",
    [
        lambda rp, al: ChunkCache(rp, al),
        lambda rp, al: RadixCache(rp, al, disable=True),
    ],
)
def test_no_reuse_caches_free_everything(make):
    req_pool, alloc = ReqToTokenPool(4, 32), TokenToKVPoolAllocator(32)
    cache = make(req_pool, alloc)
    prompt = [1, 2, 3, 4, 5]
    for _ in range(2):
        m = cache.match_prefix(prompt)
        assert m.device_indices.numel() == 0
        assert cache.inc_lock_ref(m.last_node) == 0
        row = req_pool.alloc(1)[0]
        req = FakeReq(0, row, prompt, prefix_indices=m.device_indices, last_node=m.last_node)
        req_pool.req_to_token[row, :3] = alloc.alloc(3)
        req.fill_ids = prompt[:3]
        cache.cache_unfinished_req(req)
        assert req.prefix_indices.tolist() == req_pool.req_to_token[row, :3].tolist()
        req_pool.req_to_token[row, 3:6] = alloc.alloc(3)
        req.output_ids = [7, 8]
        cache.cache_finished_req(req)
        assert alloc.available_size() == 32 and req_pool.available_size() == 4
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.evict(10) == 0 and cache.insert([1], torch.tensor([5])) == 0
    assert cache.snapshot()[0].parent_id == -1 and isinstance(cache.pretty_print(), str)


def test_reset_forgets_everything():
    cache, _, alloc = make_cache()
    cache.insert([1, 2], alloc.alloc(2))
    cache.reset()
    assert cache.total_size() == 0 and cache.match_prefix([1, 2]).device_indices.numel() == 0
    assert len(cache.snapshot()) == 1


def test_lock_and_hit_changes_are_reported_once_per_snapshot():
    """Views republish the tree when locks or hits change, not only on insert/evict: the cache says
    so through `on_event` with one CacheTouch, then stays silent until the next snapshot()."""
    from workbench.core.trace.events import CacheTouch

    events = []
    cache, _, alloc = make_cache(pool_size=32, on_event=events.append)
    cache.insert([1, 2, 3], alloc.alloc(3))
    cache.snapshot()
    del events[:]
    node = cache.match_prefix([1, 2, 3]).last_node  # a hit
    assert events == [CacheTouch(what="hit", node_id=node.id)]
    cache.inc_lock_ref(node)  # silent: already reported
    cache.match_prefix([1, 2])  # (a split: an insert, reported as such)
    assert [type(e) for e in events].count(CacheTouch) == 1
    snap = cache.snapshot()
    assert {n.node_id: n.lock_ref for n in snap}[node.id] == 1
    del events[:]
    cache.dec_lock_ref(node)  # a lock change after the snapshot
    assert events == [CacheTouch(what="lock", node_id=node.id)]
    cache.inc_lock_ref(node)
    assert len(events) == 1
    cache.snapshot()
    cache.inc_lock_ref(cache.root_node)  # the root's permanent lock is not news
    assert len(events) == 1
    assert decode_json(encode_json(events[0])) == events[0]
