"""BlockAllocator / BlockManager: unit cases, the beam-search fork scenario, and a stateful
property test against a naive model that also simulates the KV pool's contents."""

from __future__ import annotations

import copy
import pickle

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxattn.paging import (
    BlockAllocator,
    BlockManager,
    NoFreeBlocksError,
    PageAllocator,
    SlotAllocator,
)


def snapshot(m: BlockManager):
    a = m.allocator
    return copy.deepcopy((m._tables, m._lens, a.ref_counts.tolist(), a.free_stack().tolist()))


# --- BlockAllocator ------------------------------------------------------------------


def test_allocator_refcounts_and_free_list():
    a = BlockAllocator(3)
    b0, b1 = a.allocate(), a.allocate()
    assert {b0, b1} <= {0, 1, 2} and b0 != b1
    assert a.num_free == 1 and a.ref_count(b0) == 1
    a.incref(b0)
    a.free(b0)
    assert a.ref_count(b0) == 1 and a.num_free == 1  # still held once
    a.free(b0)
    assert a.ref_count(b0) == 0 and a.num_free == 2
    assert a.allocate() == b0  # most recently freed is reused first


def test_allocator_misuse_raises_and_changes_nothing():
    a = BlockAllocator(2)
    b = a.allocate()
    a.free(b)
    state = (a.ref_counts.tolist(), a.free_stack().tolist())
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    with pytest.raises(ValueError, match="free"):
        a.incref(b)
    with pytest.raises(ValueError, match="block=5"):
        a.free(5)
    with pytest.raises(ValueError, match="block"):
        a.ref_count(-1)
    with pytest.raises(TypeError, match="block"):
        a.free(1.0)
    with pytest.raises(TypeError, match="block"):
        a.incref(True)
    assert (a.ref_counts.tolist(), a.free_stack().tolist()) == state
    a.allocate(), a.allocate()
    with pytest.raises(NoFreeBlocksError):
        a.allocate()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0)


def test_allocator_batches_act_as_their_loops():
    a, b = BlockAllocator(8), BlockAllocator(8)
    got = a.allocate_many(3)
    assert got.dtype == np.int32 and got.tolist() == [b.allocate() for _ in range(3)]
    a.incref_blocks([got[0], got[0]])
    b.incref(int(got[0]))
    b.incref(int(got[0]))
    a.free_blocks([got[1], got[0], got[2]])
    for x in (got[1], got[0], got[2]):
        b.free(int(x))
    assert a.ref_counts.tolist() == b.ref_counts.tolist()
    assert a.free_stack().tolist() == b.free_stack().tolist()
    # A block listed twice loses two references and is released at its second mention.
    a.free_blocks([got[0], got[0]])
    b.free(int(got[0]))
    b.free(int(got[0]))
    assert a.free_stack().tolist() == b.free_stack().tolist()
    a.check_invariants()


def test_allocator_batch_misuse_changes_nothing():
    a = BlockAllocator(4)
    blocks = a.allocate_many(2)
    state = (a.ref_counts.tolist(), a.free_stack().tolist())
    cases = [
        (lambda: a.allocate_many(3), NoFreeBlocksError, "3 blocks wanted"),
        (lambda: a.free_blocks([blocks[0], blocks[0]]), ValueError, "double free"),
        (lambda: a.free_blocks([blocks[0], 7]), ValueError, "outside"),
        (lambda: a.incref_blocks([blocks[0], 3]), ValueError, "is free"),
        (lambda: a.incref_blocks([[1]]), ValueError, "1-D"),
        (lambda: a.free_blocks([0.5]), TypeError, "ints"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()
        assert (a.ref_counts.tolist(), a.free_stack().tolist()) == state, msg
    with pytest.raises(ValueError):
        a.ref_counts[0] = 5  # a read-only view


def test_copies_of_an_allocator_follow_their_own_ref_counts():
    """A deep copy or a pickled copy keeps a live, read-only ref_counts view of its own
    counts (a copied numpy view would be a frozen array: the bug that let a copied block
    manager see a shared tail still shared after its copy-on-write)."""
    alloc = BlockAllocator(4)
    alloc.allocate()
    for twin in (copy.deepcopy(alloc), pickle.loads(pickle.dumps(alloc))):
        block = twin.allocate()
        assert twin.ref_counts[block] == 1 and alloc.ref_count(block) == 0
        twin.incref(block)
        assert twin.ref_counts[block] == 2
        twin.free(block)
        twin.free(block)
        assert twin.ref_counts[block] == 0 and not twin.ref_counts.flags.writeable
    bm = BlockManager(8, 3)
    bm.allocate("a", 4)  # a partial tail
    bm.fork("a", "b")
    trial = copy.deepcopy(bm)
    assert trial.append_slots("a", 1) == [(1, trial.block_table("a")[-1])]  # copy-on-write
    assert trial.append_slots("b", 1) == []  # b now holds its tail alone
    assert bm.block_table("a") == bm.block_table("b") == [0, 1]


def test_slot_view_is_the_allocator_in_slots():
    """The slot protocol over the same ref counts: what the radix cache frees drops only
    its own reference."""
    a = BlockAllocator(4, block_size=3)
    view = a.slots
    assert isinstance(view, SlotAllocator) and isinstance(a, PageAllocator)
    assert view is a.slots and view.num_slots == 12 and view.available == 12
    slots = view.alloc(5)
    assert slots.tolist() == [0, 1, 2, 3, 4] and a.num_free == 2
    a.incref(0)  # a second holder of page 0
    view.free(slots)  # one reference per page touched
    assert a.ref_count(0) == 1 and a.ref_count(1) == 0 and view.available == 9
    assert view.is_allocated([0, 2, 3, 11]).tolist() == [True, True, False, False]
    assert view.alloc(10) is None and a.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        view.free([3])
    with pytest.raises(ValueError, match="lie in"):
        view.free([12])
    view.check_invariants()


# --- BlockManager --------------------------------------------------------------------


def test_allocate_append_and_slot_mapping():
    m = BlockManager(10, 4)
    assert m.allocate("a", 6) == [0, 1]
    assert m.seq_len("a") == 6 and m.num_free_blocks == 8
    assert m.append_slot("a") == [] and m.append_slot("a") == []
    assert m.block_table("a") == [0, 1]  # 8 tokens fill two blocks exactly
    assert m.append_slot("a") == [] and m.block_table("a") == [0, 1, 2]
    np.testing.assert_array_equal(m.slot_mapping("a", 0, 9), np.arange(9))
    np.testing.assert_array_equal(m.slot_mapping("a", 7, 9), [7, 8])
    assert m.slot_mapping("a", 3, 3).shape == (0,)
    assert m.slot_mapping("a", 0, 9).dtype == np.int32
    m.allocate("b", 5)
    m.free("a")
    m.allocate("c", 1)
    # Freed blocks are reused, so slots follow the table, not the allocation order.
    table = m.block_table("b")
    want = [table[t // 4] * 4 + t % 4 for t in range(5)]
    np.testing.assert_array_equal(m.slot_mapping("b", 0, 5), want)
    m.check_invariants()


def test_range_slots_is_token_slots_of_the_range():
    from jaxattn.paging import token_slots
    from jaxattn.paging.slots import range_slots

    rng = np.random.default_rng(1)
    for p in (1, 3, 16):
        table = rng.permutation(40).astype(np.int32)[: int(rng.integers(1, 12))]
        n = len(table) * p
        for start, end in [(0, n), (0, 0), (n, n), *rng.integers(0, n + 1, (20, 2)).tolist()]:
            start, end = min(start, end), max(start, end)
            got = range_slots(table, start, end, p)
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, token_slots(table, np.arange(start, end), p))


def test_block_tables_padding():
    m = BlockManager(16, 4)
    m.allocate(0, 9)
    m.allocate(1, 1)
    m.allocate(2, 0)
    bt = m.block_tables([1, 0, 2])
    assert bt.dtype == np.int32 and bt.shape == (3, 3)
    np.testing.assert_array_equal(bt[1], m.block_table(0))
    np.testing.assert_array_equal(bt[0], [m.block_table(1)[0], 0, 0])
    np.testing.assert_array_equal(bt[2], [0, 0, 0])
    bt = m.block_tables([0, 1], pad_to=6, pad_value=-1)
    assert bt.shape == (2, 6) and (bt[1, 1:] == -1).all()
    with pytest.raises(ValueError, match="pad_to"):
        m.block_tables([0], pad_to=2)
    assert m.block_tables([]).shape == (0, 0)


def test_watermark_reserves_blocks_for_growth():
    m = BlockManager(10, 4, watermark=0.2)  # 2 blocks held back from admission
    assert m.can_allocate(32) and not m.can_allocate(33)
    m.allocate("a", 32)
    assert not m.can_allocate(1)
    assert m.can_append_slot("a")
    m.append_slot("a")  # growth may dip into the reserve
    assert m.num_free_blocks == 1
    with pytest.raises(ValueError, match="watermark"):
        BlockManager(10, 4, watermark=1.0)


def test_misuse_raises_and_changes_nothing():
    m = BlockManager(4, 4)
    m.allocate("a", 5)
    m.fork("a", "b")
    before = snapshot(m)
    cases = [
        (lambda: m.allocate("a", 1), ValueError, "seq_id='a' is already allocated"),
        (lambda: m.allocate("z", 100), NoFreeBlocksError, "needs 25 blocks"),
        (lambda: m.allocate("z", -1), ValueError, "num_tokens"),
        (lambda: m.allocate("z", 2.0), TypeError, "num_tokens"),
        (lambda: m.free("z"), ValueError, "seq_id='z' is not allocated"),
        (lambda: m.append_slot("z"), ValueError, "seq_id='z'"),
        (lambda: m.append_slots("a", 100), NoFreeBlocksError, "needs"),
        (lambda: m.fork("z", "y"), ValueError, "parent_id='z'"),
        (lambda: m.fork("a", "b"), ValueError, "child_id='b' is already allocated"),
        (lambda: m.slot_mapping("a", 0, 6), ValueError, "seq_len=5"),
        (lambda: m.slot_mapping("a", 3, 2), ValueError, "start <= end"),
        (lambda: m.block_tables(["a", "z"]), ValueError, "seq_id='z'"),
        (lambda: m.block_table("z"), ValueError, "seq_id='z'"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn()
        assert snapshot(m) == before, msg
    # Two free blocks are left; a CoW append needs one, a fresh allocation of 9 needs 3.
    assert m.num_free_blocks == 2
    with pytest.raises(NoFreeBlocksError):
        m.allocate("c", 9)
    assert snapshot(m) == before
    m.free("a")
    m.free("b")
    assert m.num_free_blocks == 4
    m.check_invariants()


def test_append_slot_failure_keeps_length():
    m = BlockManager(2, 2)
    m.allocate("a", 2)
    m.fork("a", "b")
    m.append_slot("a")  # full tail -> fresh block, the last one
    before = snapshot(m)
    with pytest.raises(NoFreeBlocksError):
        m.append_slot("b")
    assert snapshot(m) == before and m.seq_len("b") == 2


def test_copy_on_write_of_a_shared_partial_tail():
    m = BlockManager(8, 4)
    m.allocate("p", 6)
    p0, p1 = m.block_table("p")
    m.fork("p", "c")
    assert m.ref_count(p0) == m.ref_count(p1) == 2
    orders = m.append_slot("c")
    assert len(orders) == 1 and orders[0][0] == p1
    new = orders[0][1]
    assert m.block_table("c") == [p0, new] and m.ref_count(p1) == 1 and m.ref_count(new) == 1
    assert m.append_slot("p") == []  # the parent now owns p1 alone: written in place
    assert m.block_table("p") == [p0, p1]
    m.check_invariants()


@pytest.mark.parametrize("block_size", [16, 32])
def test_beam_fork_scenario(block_size):
    """Design notes part 1.2: beam width 4 over a 1024-token prompt."""
    m = BlockManager(256, block_size)
    prompt_blocks = 1024 // block_size
    m.allocate("beam0", 1024)
    free0 = m.num_free_blocks
    for i in range(1, 4):
        m.fork("beam0", f"beam{i}")
    assert m.num_free_blocks == free0  # fork allocates nothing
    assert all(m.ref_count(b) == 4 for b in m.block_table("beam0"))
    # 1024 is a multiple of the block size: the shared tail is full, so the first new
    # token of each beam goes to a fresh block of its own and nothing is copied.
    orders = [m.append_slot(f"beam{i}") for i in range(4)]
    assert orders == [[], [], [], []]
    assert m.num_free_blocks == free0 - 4
    tails = {m.block_table(f"beam{i}")[-1] for i in range(4)}
    assert len(tails) == 4
    # Each beam now writes its own tail; fork two more candidates off beam0 mid-block and
    # let every holder diverge: each one copies exactly one block, except the last holder,
    # which finds the tail no longer shared and keeps it.
    for i in range(4, 8):
        m.fork("beam0", f"beam{i}")
    holders = ["beam0", *[f"beam{i}" for i in range(4, 8)]]
    shared_tail = m.block_table("beam0")[-1]
    free1 = m.num_free_blocks
    copies = [m.append_slot(s) for s in holders]
    assert copies[:-1] == [[(shared_tail, dst)] for [(_, dst)] in copies[:-1]]
    assert copies[-1] == []
    assert m.num_free_blocks == free1 - (len(holders) - 1)
    assert len({m.block_table(s)[-1] for s in holders}) == len(holders)
    for s in holders:  # the prompt blocks are still shared by everyone
        assert m.block_table(s)[:prompt_blocks] == m.block_table("beam1")[:prompt_blocks]
    m.check_invariants()
    for s in list(m.seq_ids):
        m.free(s)
    assert m.num_free_blocks == 256


def test_allocate_after_a_shared_prefix_and_replace_blocks():
    """A table may start with blocks another holder owns (a prefix-cache hit), and swap
    its own blocks for another holder's copy of the same tokens."""
    a = BlockAllocator(8, block_size=2)
    cache_pages = a.allocate_many(2).tolist()  # held by a cache
    m = BlockManager(allocator=a)
    assert m.block_size == 2 and m.num_blocks == 8
    table = m.allocate("s", 7, prefix=cache_pages)
    assert table[:2] == cache_pages and len(table) == 4
    assert [a.ref_count(b) for b in table] == [2, 2, 1, 1]
    m.check_invariants(other_holders={b: 1 for b in cache_pages})
    other = a.allocate()  # e.g. the cache's copy of tokens 4-5
    m.replace_blocks("s", 2, [other])
    assert m.block_table("s")[2] == other and a.ref_count(table[2]) == 0
    assert a.ref_count(other) == 2
    m.check_invariants(other_holders={**{b: 1 for b in cache_pages}, other: 1})
    m.free("s")
    assert a.num_free == 8 - 3  # the cache's pages stay
    cases = [
        (lambda: m.allocate("t", 3, prefix=cache_pages), ValueError, "holds more"),
        (lambda: m.allocate("t", 4, prefix=[0, 0]), ValueError, "twice"),
        (lambda: m.allocate("t", 4, prefix=[5]), ValueError, "is free"),
        (lambda: m.replace_blocks("t", 0, [1]), ValueError, "not allocated"),
        (lambda: BlockManager(9, allocator=a), ValueError, "num_blocks=9"),
        (lambda: BlockManager(), TypeError, "allocator"),
    ]
    for fn, exc, msg in cases:
        before = (a.ref_counts.tolist(), a.free_stack().tolist())
        with pytest.raises(exc, match=msg):
            fn()
        assert (a.ref_counts.tolist(), a.free_stack().tolist()) == before, msg
    m.allocate("t", 6, prefix=cache_pages)
    with pytest.raises(ValueError, match="past the table"):
        m.replace_blocks("t", 2, [other, 1])
    with pytest.raises(ValueError, match="twice"):
        m.replace_blocks("t", 2, [cache_pages[0]])


# --- stateful property test ----------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager with random ops against plain-Python tables and a simulated
    pool: each token gets a unique value written to its slot, copy-on-write orders are
    applied as `copy_blocks` would, and every sequence must read back exactly its tokens.

    A second holder shares the allocator, as a prefix cache does: it takes references on
    full blocks of the tables, drops them, and lends them to new tables (``prefix=``) or
    swaps them into a table (``replace_blocks``)."""

    NUM_BLOCKS, BLOCK_SIZE = 12, 3

    def __init__(self):
        super().__init__()
        self.allocator = BlockAllocator(self.NUM_BLOCKS, block_size=self.BLOCK_SIZE)
        self.m = BlockManager(allocator=self.allocator)
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.cached: dict[int, int] = {}  # block -> references the other holder has
        self.memory = np.full(self.NUM_BLOCKS * self.BLOCK_SIZE, -1, np.int64)
        self.next_seq = 0
        self.next_value = 0

    # model helpers
    def holders(self, block):
        return sum(block in t for t in self.tables.values()) + self.cached.get(block, 0)

    def model_free(self):
        used = set().union(*self.tables.values()) if self.tables else set()
        return set(range(self.NUM_BLOCKS)) - used - set(self.cached)

    def contents(self, block):
        b = self.BLOCK_SIZE
        return self.memory[block * b : (block + 1) * b].tolist()

    def full_blocks(self, seq):
        n = len(self.tokens[seq]) // self.BLOCK_SIZE
        return self.tables[seq][:n]

    @precondition(lambda self: self.tables)
    @rule(idx=st.integers(0, 100))
    def cache_take(self, idx):
        seq = self.pick(idx)
        blocks = [b for b in self.full_blocks(seq) if b not in self.cached]
        self.allocator.incref_blocks(blocks)
        for b in blocks:
            self.cached[b] = 1

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def cache_drop(self, data):
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.cached)), unique=True))
        self.allocator.free_blocks(blocks)
        for b in blocks:
            del self.cached[b]

    @precondition(lambda self: self.cached)
    @rule(data=st.data(), extra=st.integers(0, 5))
    def allocate_after_prefix(self, data, extra):
        prefix = data.draw(st.lists(st.sampled_from(sorted(self.cached)), unique=True))
        n = len(prefix) * self.BLOCK_SIZE + extra
        seq = self.next_seq
        need = -(-extra // self.BLOCK_SIZE)
        if need > len(self.model_free()):
            before = snapshot(self.m)
            with pytest.raises(NoFreeBlocksError):
                self.m.allocate(seq, n, prefix=prefix)
            assert snapshot(self.m) == before
            return
        table = self.m.allocate(seq, n, prefix=prefix)
        assert table[: len(prefix)] == prefix and len(table) == len(prefix) + need
        self.next_seq += 1
        self.tables[seq] = list(table)
        self.tokens[seq] = [v for b in prefix for v in self.contents(b)]
        self.write(seq, len(self.tokens[seq]), n)

    @precondition(lambda self: self.cached and any(self.full_blocks(s) for s in self.tables))
    @rule(data=st.data())
    def replace(self, data):
        seq = data.draw(st.sampled_from([s for s in sorted(self.tables) if self.full_blocks(s)]))
        i = data.draw(st.integers(0, len(self.full_blocks(seq)) - 1))
        options = sorted(set(self.cached) - set(self.tables[seq]))
        if not options:
            return
        block = data.draw(st.sampled_from(options))
        self.m.replace_blocks(seq, i, [block])
        self.tables[seq][i] = block
        b = self.BLOCK_SIZE
        self.tokens[seq][i * b : (i + 1) * b] = self.contents(block)

    def write(self, seq, start, end):
        slots = self.m.slot_mapping(seq, start, end)
        for s in slots:  # never write into a block someone else still reads
            assert self.m.ref_count(int(s) // self.BLOCK_SIZE) == 1
        values = np.arange(self.next_value, self.next_value + end - start)
        self.next_value += end - start
        self.memory[slots] = values
        self.tokens[seq] += values.tolist()

    def pick(self, idx):
        return sorted(self.tables)[idx % len(self.tables)]

    @rule(n=st.integers(0, 14))
    def allocate(self, n):
        seq = self.next_seq
        need = -(-n // self.BLOCK_SIZE)
        if need > len(self.model_free()):
            before = snapshot(self.m)
            with pytest.raises(NoFreeBlocksError):
                self.m.allocate(seq, n)
            assert snapshot(self.m) == before
            return
        free = self.model_free()
        table = self.m.allocate(seq, n)
        assert len(table) == need and set(table) <= free
        self.next_seq += 1
        self.tables[seq], self.tokens[seq] = list(table), []
        self.write(seq, 0, n)

    @precondition(lambda self: self.tables)
    @rule(idx=st.integers(0, 100))
    def append(self, idx):
        seq = self.pick(idx)
        table, length = self.tables[seq], len(self.tokens[seq])
        grow = length % self.BLOCK_SIZE == 0
        cow = not grow and self.holders(table[-1]) > 1
        free = self.model_free()
        if grow + cow > len(free):
            before = snapshot(self.m)
            assert not self.m.can_append_slot(seq)
            with pytest.raises(NoFreeBlocksError):
                self.m.append_slot(seq)
            assert snapshot(self.m) == before
            return
        assert self.m.can_append_slot(seq)
        orders = self.m.append_slot(seq)
        new_table = self.m.block_table(seq)
        if grow:
            assert orders == [] and new_table[:-1] == table and new_table[-1] in free
        elif cow:
            [(src, dst)] = orders
            assert src == table[-1] and dst in free and new_table == [*table[:-1], dst]
        else:
            assert orders == [] and new_table == table
        for src, dst in orders:  # what copy_blocks does on the device
            b = self.BLOCK_SIZE
            self.memory[dst * b : (dst + 1) * b] = self.memory[src * b : (src + 1) * b]
        self.tables[seq] = new_table
        self.write(seq, length, length + 1)

    @precondition(lambda self: self.tables)
    @rule(idx=st.integers(0, 100), n=st.integers(0, 7))
    def append_many(self, idx, n):
        seq = self.pick(idx)
        table, length = self.tables[seq], len(self.tokens[seq])
        grow = -(-(length + n) // self.BLOCK_SIZE) - len(table)
        cow = n > 0 and length % self.BLOCK_SIZE != 0 and self.holders(table[-1]) > 1
        free = self.model_free()
        if grow + cow > len(free):
            before = snapshot(self.m)
            assert not self.m.can_append_slot(seq, n)
            with pytest.raises(NoFreeBlocksError):
                self.m.append_slots(seq, n)
            assert snapshot(self.m) == before
            return
        assert self.m.can_append_slot(seq, n)
        orders = self.m.append_slots(seq, n)
        new_table = self.m.block_table(seq)
        assert len(new_table) == len(table) + grow
        assert set(new_table) - set(table) <= free
        if cow:
            assert orders == [(table[-1], new_table[len(table) - 1])]
        else:
            assert orders == [] and new_table[: len(table)] == table
        b = self.BLOCK_SIZE
        for src, dst in orders:
            self.memory[dst * b : (dst + 1) * b] = self.memory[src * b : (src + 1) * b]
        self.tables[seq] = new_table
        self.write(seq, length, length + n)

    @precondition(lambda self: self.tables)
    @rule(idx=st.integers(0, 100))
    def fork(self, idx):
        parent, child = self.pick(idx), self.next_seq
        free_before = self.m.num_free_blocks
        self.m.fork(parent, child)
        assert self.m.num_free_blocks == free_before
        self.next_seq += 1
        self.tables[child] = list(self.tables[parent])
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tables)
    @rule(idx=st.integers(0, 100))
    def free(self, idx):
        seq = self.pick(idx)
        self.m.free(seq)
        del self.tables[seq], self.tokens[seq]

    @precondition(lambda self: self.tables)
    @rule(idx=st.integers(0, 100), data=st.data())
    def free_handing_over(self, idx, data):
        """The other holder takes over the table's references on a run of its full blocks
        (as a prefix cache does when a finished request's pages enter it)."""
        seq = self.pick(idx)
        table, full = self.tables[seq], len(self.full_blocks(seq))
        before = snapshot(self.m)
        with pytest.raises(ValueError, match="handed_over"):
            self.m.free(seq, handed_over=(0, len(table) + 1))
        assert snapshot(self.m) == before
        start = data.draw(st.integers(0, full))
        stop = data.draw(st.integers(start, full))
        if any(b in self.cached for b in table[start:stop]):
            return
        self.m.free(seq, handed_over=(start, stop))
        for b in table[start:stop]:
            self.cached[b] = 1
        del self.tables[seq], self.tokens[seq]

    @rule(seq=st.integers(-3, -1))
    def misuse(self, seq):
        before = snapshot(self.m)
        with pytest.raises(ValueError):
            self.m.free(seq)
        with pytest.raises(ValueError):
            self.m.fork(seq, 1000)
        if self.tables:
            with pytest.raises(ValueError):
                self.m.fork(seq, next(iter(self.tables)))
            with pytest.raises(ValueError):
                self.m.allocate(next(iter(self.tables)), 1)
        assert snapshot(self.m) == before

    @invariant()
    def matches_model(self):
        self.m.check_invariants(other_holders=self.cached)
        assert self.m.num_free_blocks == len(self.model_free())
        for block in range(self.NUM_BLOCKS):
            assert self.m.ref_count(block) == self.holders(block)
        for seq, table in self.tables.items():
            assert self.m.block_table(seq) == table
            n = len(self.tokens[seq])
            assert self.m.seq_len(seq) == n
            got = self.memory[self.m.slot_mapping(seq, 0, n)]
            assert got.tolist() == self.tokens[seq]
        if self.tables:
            ids = sorted(self.tables)
            bt = self.m.block_tables(ids, pad_to=self.NUM_BLOCKS)
            for row, seq in zip(bt, ids, strict=True):
                assert row[: len(self.tables[seq])].tolist() == self.tables[seq]


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
