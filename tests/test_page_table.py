"""Functional PageTable: step-by-step differential tests against the host BlockManager,
jit vs eager bit equality, vmap over independent tables, and a jitted decode step against
the same step driven by the host."""

from __future__ import annotations

import copy
import dataclasses
import functools

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, random_normal
from hypothesis import given, settings

from jaxattn import layout as L
from jaxattn import ops
from jaxattn.kv import copy_blocks, write_kv
from jaxattn.paging import BlockManager, NoFreeBlocksError
from jaxattn.paging.page_table import PageTable, Status, check_invariants

# Small enough that random programs run out of blocks, fill tables and share tails often.
N, P, S, M = 10, 3, 6, 4
WATERMARK = 0.2
BATCH = 4
SLOTS = 6  # static length of the slot_mapping queries

FIELDS = ("ref_counts", "free_stack", "num_free", "tables", "lens", "active", "status")


def _traced_once(fn, **jit_kw):
    # Every hypothesis example reuses one compilation; a second trace fails the test.
    return jax.jit(chex.assert_max_traces(fn, n=1), **jit_kw)


JIT = {
    "allocate": _traced_once(PageTable.allocate),
    "append_slot": _traced_once(PageTable.append_slot),
    "append_slot_batch": _traced_once(PageTable.append_slot_batch),
    "append_slots_batch": _traced_once(PageTable.append_slots_batch),
    "fork": _traced_once(PageTable.fork),
    "free": _traced_once(PageTable.free),
    "slot_mapping": _traced_once(PageTable.slot_mapping, static_argnames="length"),
    "can_allocate": _traced_once(PageTable.can_allocate),
}
EAGER = {
    "allocate": PageTable.allocate,
    "append_slot": PageTable.append_slot,
    "append_slot_batch": PageTable.append_slot_batch,
    "append_slots_batch": PageTable.append_slots_batch,
    "fork": PageTable.fork,
    "free": PageTable.free,
    "slot_mapping": PageTable.slot_mapping,
    "can_allocate": PageTable.can_allocate,
}


def fresh():
    return PageTable.init(N, P, S, M, watermark=WATERMARK), BlockManager(N, P, watermark=WATERMARK)


def leaves(state: PageTable) -> dict[str, np.ndarray]:
    return {f: np.asarray(getattr(state, f)) for f in FIELDS}


def assert_same_state(a: PageTable, b: PageTable, where=""):
    for f, x in leaves(a).items():
        y = np.asarray(getattr(b, f))
        assert x.dtype == y.dtype and np.array_equal(x, y), f"{where} field {f}: {x} != {y}"


# --- the host side of the differential test ------------------------------------------


def host_call(fn, *args):
    """(status, result) of a host BlockManager call, its exception mapped to a code."""
    try:
        return Status.OK, fn(*args)
    except NoFreeBlocksError:
        return Status.NO_FREE_BLOCKS, None
    except ValueError as e:
        msg = str(e)
        if "is already allocated" in msg:
            return Status.ACTIVE_SEQ, None
        if "is not allocated" in msg:
            return Status.INACTIVE_SEQ, None
        if "must be >= 0" in msg:
            return Status.INVALID_ARGUMENT, None
        raise


def known(seq) -> bool:
    return 0 <= seq < S


class HostModel:
    """The host BlockManager plus the fixed capacities (max_seqs, max_blocks_per_seq) that
    only the functional table has; every error the host knows comes from the host itself."""

    def __init__(self, bm: BlockManager):
        self.bm = bm

    def allocate(self, seq, n):
        if not known(seq):
            return Status.UNKNOWN_SEQ, None
        if seq not in self.bm and n >= 0 and self.bm.blocks_needed(n) > M:
            return Status.TABLE_FULL, None
        return host_call(self.bm.allocate, seq, n)

    def _table_full(self, seq) -> bool:
        return self.bm.seq_len(seq) % P == 0 and len(self.bm.block_table(seq)) == M

    def append_slot(self, seq):
        if not known(seq):
            return Status.UNKNOWN_SEQ, (-1, -1)
        if seq in self.bm and self._table_full(seq):
            return Status.TABLE_FULL, (-1, -1)
        status, cows = host_call(self.bm.append_slot, seq)
        assert cows is None or len(cows) <= 1
        return status, cows[0] if cows else (-1, -1)

    def append_slot_batch(self, seqs):
        statuses, pairs, seen = [], [], set()
        for seq in seqs:
            if known(seq) and seq in self.bm and seq in seen:
                status, pair = Status.INVALID_ARGUMENT, (-1, -1)
            else:
                status, pair = self.append_slot(seq)
            seen.add(seq)
            statuses.append(status)
            pairs.append(pair)
        return statuses, pairs

    def append_slots_batch(self, seqs, counts):
        """The host's append_slots in batch order, all or nothing over the entries that
        pass the per-entry checks."""
        bm, statuses, valid, seen = self.bm, [], [], set()
        for seq, count in zip(seqs, counts, strict=True):
            if not known(seq):
                status = Status.UNKNOWN_SEQ
            elif seq not in bm:
                status = Status.INACTIVE_SEQ
            elif seq in seen or count < 0:
                status = Status.INVALID_ARGUMENT
            elif bm.blocks_needed(bm.seq_len(seq) + count) > M:
                status = Status.TABLE_FULL
            else:
                status = Status.OK
                valid.append((len(statuses), seq, count))
            seen.add(seq)
            statuses.append(status)
        pairs = [(-1, -1)] * len(statuses)
        trial = copy.deepcopy(bm)
        try:
            for _, seq, count in valid:
                trial.append_slots(seq, count)
        except NoFreeBlocksError:
            for i, _, count in valid:
                if count > 0:
                    statuses[i] = Status.NO_FREE_BLOCKS
            return statuses, pairs
        for i, seq, count in valid:
            orders = bm.append_slots(seq, count)
            if orders:
                pairs[i] = orders[0]
        return statuses, pairs

    def fork(self, parent, child):
        if not (known(parent) and known(child)):
            return Status.UNKNOWN_SEQ, None
        return host_call(self.bm.fork, parent, child)

    def free(self, seq):
        if not known(seq):
            return Status.UNKNOWN_SEQ, None
        return host_call(self.bm.free, seq)

    def slot_mapping(self, seq, start):
        out = np.full(SLOTS, -1, np.int32)
        if known(seq) and seq in self.bm:
            lo, hi = max(start, 0), min(start + SLOTS, self.bm.seq_len(seq))
            if lo < hi:
                out[lo - start : hi - start] = self.bm.slot_mapping(seq, lo, hi)
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        bm = self.bm
        tables = np.full((S, M), -1, np.int32)
        lens = np.zeros(S, np.int32)
        active = np.zeros(S, bool)
        for seq in bm.seq_ids:
            table = bm.block_table(seq)
            tables[seq, : len(table)] = table
            lens[seq], active[seq] = bm.seq_len(seq), True
        free = bm.allocator.free_stack().tolist()  # its order decides the next block
        return dict(
            ref_counts=np.array([bm.ref_count(b) for b in range(N)], np.int32),
            free_stack=np.array(free + [-1] * (N - len(free)), np.int32),
            num_free=np.int32(bm.num_free_blocks),
            tables=tables,
            lens=lens,
            active=active,
        )


# --- random programs -----------------------------------------------------------------

# Drawn op by op against the host's current state, so that most ops hit live sequences
# (and free ids for allocate / fork children) and programs reach a full pool, shared
# tails and full tables; any id, out of range ones included, is still drawn now and then.
OP_NAMES = ["allocate"] * 3 + ["append_slot"] * 2 + ["append_slot_batch"] * 4 + ["fork"] * 3
OP_NAMES += ["append_slots_batch"] * 3
OP_NAMES += ["free", "slot_mapping", "can_allocate"]
any_seq = st.sampled_from([*range(S), -1, S])
# Mostly short prompts, which leave room to fork and grow; sometimes any count.
token_counts = st.one_of(st.integers(0, 2 * P + 1), st.integers(-1, M * P + 2))
starts = st.integers(-2, M * P)


def draw_seq(data, preferred):
    if preferred and data.draw(st.integers(0, 9)) < 8:
        return data.draw(st.sampled_from(preferred))
    return data.draw(any_seq)


def draw_ops(data, bm: BlockManager):
    """One op, or a beam: a live sequence forked into every free id, so that one tail has
    many holders and a batch can run the pool dry between two of them."""
    live = [s for s in range(S) if s in bm]
    if live and data.draw(st.integers(0, 9)) == 0:
        parent = data.draw(st.sampled_from(live))
        return [("fork", parent, child) for child in range(S) if child not in bm]
    return [draw_op(data, bm)]


def draw_op(data, bm: BlockManager, name=None):
    name = name or data.draw(st.sampled_from(OP_NAMES))
    live = [s for s in range(S) if s in bm]
    idle = [s for s in range(S) if s not in bm]
    if name == "allocate":
        return name, draw_seq(data, idle), data.draw(token_counts)
    if name == "append_slot_batch":
        # Mostly distinct live sequences, so that a parent and its forks copy in one step.
        first = data.draw(st.permutations(live)) if data.draw(st.integers(0, 9)) < 8 else []
        return name, [*first, *(draw_seq(data, live) for _ in range(BATCH))][:BATCH]
    if name == "append_slots_batch":
        first = data.draw(st.permutations(live)) if data.draw(st.integers(0, 9)) < 8 else []
        seqs = [*first, *(draw_seq(data, live) for _ in range(BATCH))][:BATCH]
        counts = [
            data.draw(st.one_of(st.integers(0, 2 * P + 1), st.integers(-1, M * P))) for _ in seqs
        ]
        return name, seqs, counts
    if name == "fork":
        return name, draw_seq(data, live), draw_seq(data, idle)
    if name == "slot_mapping":
        return name, draw_seq(data, live), data.draw(starts)
    if name == "can_allocate":
        return name, data.draw(token_counts)
    return name, draw_seq(data, live)


def apply(fns, state, op):
    """(new state, per-entry statuses or None, extra output) of one op on a page table."""
    name, *args = op
    if name == "slot_mapping":
        return state, None, fns[name](state, *args, length=SLOTS)
    if name == "can_allocate":
        return state, None, fns[name](state, *args)
    if name == "append_slot_batch":
        state, pairs, statuses = fns[name](state, np.asarray(args[0], np.int32))
        return state, statuses, pairs
    if name == "append_slots_batch":
        seqs, counts = (np.asarray(a, np.int32) for a in args)
        state, pairs, statuses = fns[name](state, seqs, counts)
        return state, statuses, pairs
    if name == "append_slot":
        state, pair = fns[name](state, *args)
        return state, None, pair
    return fns[name](state, *args), None, None


def check_against_host(host: HostModel, op, state, statuses, extra):
    """Run op on the host too and compare everything the functional op returned."""
    name, *args = op
    where = f"{op}"
    if name == "slot_mapping":
        np.testing.assert_array_equal(extra, host.slot_mapping(*args), err_msg=where)
    elif name == "can_allocate":
        assert bool(extra) == (args[0] >= 0 and host.bm.can_allocate(args[0])), where
    elif name in ("append_slot_batch", "append_slots_batch"):
        want, pairs = getattr(host, name)(*args)
        assert [Status(int(s)) for s in statuses] == want, where
        assert np.asarray(extra).tolist() == [list(p) for p in pairs], where
        first = next((s for s in want if s != Status.OK), Status.OK)
        assert int(state.status) == first, where
    else:
        want, result = getattr(host, name)(*args)
        assert Status(int(state.status)) == want, where
        if name == "append_slot":
            assert tuple(np.asarray(extra).tolist()) == result, where
    got = leaves(state)
    for field, value in host.arrays().items():
        np.testing.assert_array_equal(got[field], value, err_msg=f"{where}: {field}")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_matches_host_block_manager_step_by_step(data):
    state, bm = fresh()
    host = HostModel(bm)
    for _ in range(data.draw(st.integers(10, 50))):
        for op in draw_ops(data, bm):
            state, statuses, extra = apply(JIT, state, op)
            check_against_host(host, op, state, statuses, extra)
            check_invariants(state)
            bm.check_invariants()


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_jit_and_eager_agree_bit_for_bit(data):
    jitted, bm = fresh()
    eager, host = jitted, HostModel(bm)
    for step in range(data.draw(st.integers(10, 30))):
        for op in draw_ops(data, bm):
            jitted, js, jx = apply(JIT, jitted, op)
            eager, es, ex = apply(EAGER, eager, op)
            assert_same_state(jitted, eager, f"step {step} {op}")
            for a, b in ((js, es), (jx, ex)):
                assert (a is None) == (b is None)
                if a is not None:
                    a, b = np.asarray(a), np.asarray(b)
                    assert a.dtype == b.dtype and np.array_equal(a, b), f"step {step} {op}"
            check_against_host(host, op, jitted, js, jx)  # keeps the host in step for drawing


# --- vmap: a stack of independent tables ---------------------------------------------

V = 3
VMAPPED = {
    "allocate": jax.jit(jax.vmap(PageTable.allocate)),
    "append_slot": jax.jit(jax.vmap(PageTable.append_slot)),
    "append_slot_batch": jax.jit(jax.vmap(PageTable.append_slot_batch)),
    "fork": jax.jit(jax.vmap(PageTable.fork)),
    "free": jax.jit(jax.vmap(PageTable.free)),
    "slot_mapping": jax.jit(
        jax.vmap(PageTable.slot_mapping, in_axes=(0, 0, 0, None)), static_argnums=3
    ),
}


def stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_vmap_over_independent_tables(data):
    singles, hosts = zip(*(fresh() for _ in range(V)), strict=True)
    singles, hosts = list(singles), [HostModel(bm) for bm in hosts]
    batched = stack(singles)
    for step in range(data.draw(st.integers(5, 25))):
        # One op for the whole stack (vmap maps one function), its arguments per table.
        name = data.draw(st.sampled_from(sorted(VMAPPED)))
        table_ops = [draw_op(data, h.bm, name) for h in hosts]
        args = zip(*(op[1:] for op in table_ops), strict=True)
        columns = [np.asarray(col, np.int32) for col in args]
        if name == "slot_mapping":
            extras = (VMAPPED[name](batched, *columns, SLOTS),)
        else:
            out = VMAPPED[name](batched, *columns)
            batched, extras = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        for i, op in enumerate(table_ops):
            singles[i], statuses, extra = apply(JIT, singles[i], op)
            where = f"step {step} {op} table {i}"
            assert_same_state(jax.tree.map(lambda x, i=i: x[i], batched), singles[i], where)
            want = [e for e in (extra, statuses) if e is not None]
            for a, b in zip(extras, want, strict=True):
                np.testing.assert_array_equal(a[i], b, err_msg=where)
            check_against_host(hosts[i], op, singles[i], statuses, extra)


# --- unit cases ----------------------------------------------------------------------


def test_init_shapes_and_validation():
    pt = PageTable.init(8, 16, 3, 5, watermark=0.25)
    chex.assert_shape(pt.tables, (3, 5))
    chex.assert_shape((pt.ref_counts, pt.free_stack), (8,))
    assert pt.tables.dtype == jnp.int32 and pt.active.dtype == jnp.bool_
    assert (pt.num_blocks, pt.max_seqs, pt.max_blocks_per_seq) == (8, 3, 5)
    assert pt.watermark_blocks == 2 and int(pt.status) == Status.OK
    # The static fields are part of the tree structure, the arrays are its leaves.
    assert len(jax.tree.leaves(pt)) == len(FIELDS)
    other = PageTable.init(8, 8, 3, 5)
    assert jax.tree.structure(pt) != jax.tree.structure(other)
    check_invariants(pt)
    with pytest.raises(ValueError, match="num_blocks"):
        PageTable.init(0, 16, 3, 5)
    with pytest.raises(TypeError, match="block_size"):
        PageTable.init(8, 16.0, 3, 5)
    with pytest.raises(ValueError, match="watermark"):
        PageTable.init(8, 16, 3, 5, watermark=1.0)
    with pytest.raises(ValueError, match="overflow"):
        PageTable.init(2**20, 2**12, 3, 5)


def _failure_cases():
    pt = PageTable.init(6, 4, 3, 3)
    pt = pt.allocate(0, 5)  # blocks 0, 1
    pt = pt.fork(0, 1)  # shares both; the tail is partial
    full = PageTable.init(6, 4, 3, 2).allocate(0, 8)  # two full blocks: no room to grow
    dry = PageTable.init(2, 4, 3, 3).allocate(0, 6).fork(0, 1)
    small = PageTable.init(4, 4, 3, 4).allocate(0, 5)  # 2 free blocks, room for 4 per table
    return [
        ("allocate unknown seq", pt, lambda s: s.allocate(3, 1), Status.UNKNOWN_SEQ),
        ("allocate negative seq", pt, lambda s: s.allocate(-1, 1), Status.UNKNOWN_SEQ),
        ("allocate active seq", pt, lambda s: s.allocate(0, 1), Status.ACTIVE_SEQ),
        ("allocate negative tokens", pt, lambda s: s.allocate(2, -3), Status.INVALID_ARGUMENT),
        ("allocate over table", pt, lambda s: s.allocate(2, 13), Status.TABLE_FULL),
        ("allocate over pool", small, lambda s: s.allocate(1, 9), Status.NO_FREE_BLOCKS),
        ("allocate no blocks", dry, lambda s: s.allocate(2, 1), Status.NO_FREE_BLOCKS),
        ("append inactive", pt, lambda s: s.append_slot(2)[0], Status.INACTIVE_SEQ),
        ("append unknown", pt, lambda s: s.append_slot(7)[0], Status.UNKNOWN_SEQ),
        ("append table full", full, lambda s: s.append_slot(0)[0], Status.TABLE_FULL),
        ("append cow no blocks", dry, lambda s: s.append_slot(1)[0], Status.NO_FREE_BLOCKS),
        ("fork inactive parent", pt, lambda s: s.fork(2, 2), Status.INACTIVE_SEQ),
        ("fork active child", pt, lambda s: s.fork(0, 1), Status.ACTIVE_SEQ),
        ("fork onto itself", pt, lambda s: s.fork(0, 0), Status.ACTIVE_SEQ),
        ("fork unknown child", pt, lambda s: s.fork(0, 9), Status.UNKNOWN_SEQ),
        ("free inactive", pt, lambda s: s.free(2), Status.INACTIVE_SEQ),
        ("free unknown", pt, lambda s: s.free(-4), Status.UNKNOWN_SEQ),
    ]


@pytest.mark.parametrize("case", _failure_cases(), ids=lambda c: c[0])
def test_failure_sets_status_and_changes_nothing_else(case):
    _, before, op, code = case
    after = op(before)
    assert Status(int(after.status)) == code
    assert_same_state(dataclasses.replace(after, status=before.status), before)


def test_failed_append_returns_no_copy_order():
    dry = PageTable.init(2, 4, 3, 3).allocate(0, 6).fork(0, 1)
    state, pair = dry.append_slot(1)
    assert int(state.status) == Status.NO_FREE_BLOCKS
    assert pair.tolist() == [-1, -1] and pair.dtype == jnp.int32


@pytest.mark.parametrize(
    ("num_blocks", "want_status", "want_pairs"),
    [
        # Plenty of blocks: holders copy in batch order while the tail is still shared; the
        # last holder keeps it (ref count 1 by then) and writes in place.
        (8, [0, 0, 0], [[1, 2], [1, 3], [-1, -1]]),
        # One free block: the first holder copies; the second finds the pool dry, and since
        # the tail is still held by it and the third, the third must copy too and fails.
        (3, [0, 1, 1], [[1, 2], [-1, -1], [-1, -1]]),
        # No free block: nobody copied, so the tail stays shared for every holder.
        (2, [1, 1, 1], [[-1, -1], [-1, -1], [-1, -1]]),
    ],
)
def test_batch_copy_on_write_race(num_blocks, want_status, want_pairs):
    pt = PageTable.init(num_blocks, 4, 4, 3).allocate(0, 6).fork(0, 1).fork(0, 2)
    bm = BlockManager(num_blocks, 4)
    bm.allocate(0, 6), bm.fork(0, 1), bm.fork(0, 2)
    seqs = jnp.array([0, 1, 2], jnp.int32)
    batch, pairs, statuses = pt.append_slot_batch(seqs)
    assert statuses.tolist() == want_status and pairs.tolist() == want_pairs
    host = HostModel(bm)
    want = host.append_slot_batch([0, 1, 2])
    assert [int(s) for s in want[0]] == want_status
    assert [list(p) for p in want[1]] == want_pairs
    # The vectorised step equals the sequential loop of single appends.
    seq_state = pt
    for seq in (0, 1, 2):
        seq_state, _ = seq_state.append_slot(seq)
    assert_same_state(dataclasses.replace(batch, status=seq_state.status), seq_state)
    check_invariants(batch)


def test_batch_repeat_and_status_of_first_failure():
    pt = PageTable.init(8, 4, 4, 3).allocate(0, 3).allocate(1, 4)
    out, pairs, statuses = pt.append_slot_batch(jnp.array([0, 2, 0, 1], jnp.int32))
    assert statuses.tolist() == [0, Status.INACTIVE_SEQ, Status.INVALID_ARGUMENT, 0]
    assert int(out.status) == Status.INACTIVE_SEQ
    assert out.lens[:2].tolist() == [4, 5]  # each listed sequence grew once
    assert (pairs == -1).all()
    with pytest.raises(ValueError, match="seqs"):
        pt.append_slot_batch(jnp.zeros((2, 2), jnp.int32))


def test_free_releases_tail_first_like_the_host():
    pt = PageTable.init(8, 2, 2, 4).allocate(0, 7)  # blocks 0..3
    pt = pt.free(0)
    # Block 0 is released last, so it is on top and handed out first again.
    assert pt.free_stack.tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    pt = pt.allocate(1, 3)
    assert pt.tables[1].tolist() == [0, 1, -1, -1]


def test_block_tables_and_seq_lens_for_kernels():
    pt = PageTable.init(8, 4, 3, 3).allocate(0, 5).allocate(2, 1)
    seqs = jnp.array([2, 1, 0, 9], jnp.int32)
    assert pt.block_tables(seqs).tolist() == [[2, 0, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0]]
    assert pt.block_tables(seqs, pad_value=-1)[0].tolist() == [2, -1, -1]
    assert pt.seq_lens(seqs).tolist() == [1, 0, 5, 0]
    with pytest.raises(ValueError, match="length"):
        pt.slot_mapping(0, 0, -1)


def test_check_invariants_catches_corruption():
    pt = PageTable.init(4, 4, 2, 2).allocate(0, 5)
    check_invariants(pt)
    leaked = dataclasses.replace(pt, ref_counts=pt.ref_counts.at[0].set(2))
    with pytest.raises(AssertionError, match="ref counts"):
        check_invariants(leaked)
    lost = dataclasses.replace(pt, free_stack=pt.free_stack.at[0].set(0))
    with pytest.raises(AssertionError, match="free stack"):
        check_invariants(lost)


# --- one jitted decode step against the host-driven step -----------------------------

HQ, HKV, D = 4, 2, 8
DECODE = dict(num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=5)


def fused_step(pt, k_cache, v_cache, q, k_new, v_new, seqs, *, layout):
    """Bookkeeping, copy-on-write, KV write and attention with no host round trip."""
    pt, cow, status = pt.append_slot_batch(seqs)
    k_cache, v_cache = copy_blocks(k_cache, v_cache, cow[:, 0], cow[:, 1], layout=layout)
    lens = pt.seq_lens(seqs)
    slots = jax.vmap(lambda s, n: pt.slot_mapping(s, n - 1, 1)[0])(seqs, lens)
    # A failed append must not overwrite the sequence's last token.
    slots = jnp.where(status == Status.OK, slots, -1)
    k_cache, v_cache = write_kv(k_cache, v_cache, k_new, v_new, slots, layout=layout)
    out = ops.paged_attention(
        q, k_cache, v_cache, pt.block_tables(seqs), lens, layout=layout, implementation="reference"
    )
    return pt, k_cache, v_cache, out, cow


@functools.partial(jax.jit, static_argnames="layout", donate_argnums=(0, 1))
def host_driven_step(k_cache, v_cache, q, k_new, v_new, src, dst, slots, tables, lens, *, layout):
    k_cache, v_cache = copy_blocks(k_cache, v_cache, src, dst, layout=layout)
    k_cache, v_cache = write_kv(k_cache, v_cache, k_new, v_new, slots, layout=layout)
    out = ops.paged_attention(
        q, k_cache, v_cache, tables, lens, layout=layout, implementation="reference"
    )
    return k_cache, v_cache, out


def host_metadata(bm: BlockManager, seqs):
    """The host loop a scheduler runs each step, and the arrays it ships to the device."""
    cows = [pair for s in seqs for pair in bm.append_slot(s)]
    src = np.full(len(seqs), -1, np.int32)
    dst = np.full(len(seqs), -1, np.int32)
    if cows:
        src[: len(cows)], dst[: len(cows)] = np.asarray(cows, np.int32).T
    lens = np.array([bm.seq_len(s) for s in seqs], np.int32)
    slots = np.concatenate([bm.slot_mapping(s, n - 1, n) for s, n in zip(seqs, lens, strict=True)])
    tables = bm.block_tables(seqs, pad_to=DECODE["max_blocks_per_seq"])
    return cows, src, dst, slots, tables, lens


@pytest.mark.parametrize("layout", ["bshd", "vllm"])
def test_jitted_decode_step_equals_host_driven_step(layout):
    rng = np.random.default_rng(7)
    geometry = (DECODE["num_blocks"], DECODE["block_size"], HKV, D, jnp.float32)
    shape_k, shape_v = (L.cache_shape(layout, kind, *geometry) for kind in "kv")
    # NaN in every slot never written: attention reading one would show up in the output.
    k_cache = jnp.full(shape_k, jnp.nan, jnp.float32)
    v_cache = jnp.full(shape_v, jnp.nan, jnp.float32)
    pt = PageTable.init(**DECODE)
    bm = BlockManager(DECODE["num_blocks"], DECODE["block_size"])
    prompt = 6
    pt = pt.allocate(0, prompt)
    bm.allocate(0, prompt)
    k = random_normal(rng, (prompt, HKV, D), jnp.float32)
    v = random_normal(rng, (prompt, HKV, D), jnp.float32)
    slots = pt.slot_mapping(0, 0, 8)  # a fixed length; the tail is -1 padding
    np.testing.assert_array_equal(slots[:prompt], bm.slot_mapping(0, 0, prompt))
    pad = 8 - prompt
    k8, v8 = (jnp.concatenate([x, jnp.zeros((pad, HKV, D), jnp.float32)]) for x in (k, v))
    k_cache, v_cache = write_kv(k_cache, v_cache, k8, v8, slots, layout=layout)
    for parent, child in ((0, 1), (0, 2)):
        pt = pt.fork(parent, child)
        bm.fork(parent, child)
    fk, fv, hk, hv = k_cache, v_cache, k_cache.copy(), v_cache.copy()
    seqs = [0, 1, 2]

    traces = []

    def one_step(*args):
        traces.append(None)
        return fused_step(*args, layout=layout)

    step = jax.jit(one_step, donate_argnums=(1, 2))
    saw_cow = 0
    for t in range(7):
        if t == 3:  # a fresh beam: drop seq 2, fork the partially filled seq 1 again
            pt, _ = pt.free(2), bm.free(2)
            pt = pt.fork(1, 2)
            bm.fork(1, 2)
        q = random_normal(rng, (len(seqs), HQ, D), jnp.float32)
        kn = random_normal(rng, (len(seqs), HKV, D), jnp.float32)
        vn = random_normal(rng, (len(seqs), HKV, D), jnp.float32)
        pt, fk, fv, out, cow = step(pt, fk, fv, q, kn, vn, jnp.asarray(seqs, jnp.int32))
        cows, src, dst, slots, tables, lens = host_metadata(bm, seqs)
        hk, hv, want = host_driven_step(
            hk, hv, q, kn, vn, src, dst, slots, tables, lens, layout=layout
        )
        assert int(pt.status) == Status.OK
        got_cows = [tuple(p) for p in np.asarray(cow).tolist() if p[1] >= 0]
        assert got_cows == cows, t
        saw_cow += len(cows)
        np.testing.assert_array_equal(pt.block_tables(jnp.asarray(seqs, jnp.int32)), tables)
        np.testing.assert_array_equal(np.asarray(fk), np.asarray(hk))
        np.testing.assert_array_equal(np.asarray(fv), np.asarray(hv))
        assert_close(out, want)
        check_invariants(pt)
    assert saw_cow >= 3  # the forks really made the steps copy
    assert len(traces) == 1  # one compilation serves every step
