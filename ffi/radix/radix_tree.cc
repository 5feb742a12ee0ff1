// The radix prefix tree of jaxattn.radix in C++ (module jaxattn.radix._radix_tree).
//
// jaxattn/radix/python_tree.py is the spec: every operation here returns what it returns, in
// the same order, and evicts in the same order (a differential fuzz test runs both). The
// Python facade (native_tree.py) keeps the public API, the pool and the namespaces; this file
// keeps the tree, the slot ownership mask and the eviction candidates.
//
// Layout: nodes live in one vector and are named by index; a Python handle is (index,
// generation), and freeing a node bumps its generation, so a stale handle is detected instead
// of aliasing the node that reuses the slot. An edge's tokens and slots share one allocation
// (int32 each; token ids must fit in int32). Children are a small vector, plus a hash index by
// first page once a node has many of them (the roots of large trees do).
//
// Eviction keeps its candidates incrementally: every unlocked leaf has exactly one live entry
// in a binary heap, stamped with a number the node also holds. Touching, locking or unlocking
// a leaf, or giving it a child, re-stamps or clears the node, which leaves the old entry stale;
// stale entries are dropped when they reach the top, and the heap is rebuilt from live entries
// once stale ones outnumber them. evict(k leaves) thus costs O(k log n), not O(leaves).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace nb = nanobind;

namespace jaxattn_radix {
namespace {

using i32 = int32_t;
using i64 = int64_t;
using u32 = uint32_t;
using u64 = uint64_t;

constexpr i32 kNone = -1;
// A node switches from scanning its children to a hash index past this many: a scan touches
// one cache line per child, the index costs ~48 bytes per child.
constexpr size_t kIndexFrom = 8;

template <class T>
using Array1 = nb::ndarray<nb::numpy, T, nb::ndim<1>>;

template <class T>
Array1<T> to_numpy(const T* src, size_t n) {
  T* buf = new T[n > 0 ? n : 1];
  if (n) std::memcpy(buf, src, n * sizeof(T));
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return Array1<T>(buf, {n}, owner);
}

[[noreturn]] void raise_assertion(const std::string& msg) {
  PyErr_SetString(PyExc_AssertionError, msg.c_str());
  throw nb::python_error();
}

// A run of integers read from a Python object without copying when it is a C-contiguous 1-D
// int64 buffer; int32 buffers and lists / tuples of ints are widened into `scratch`. Anything
// else raises TypeError, and the facade converts it with the spec's own checks and retries.
class IntRun {
 public:
  IntRun(nb::handle obj, std::vector<i64>& scratch) {
    PyObject* o = obj.ptr();
    if (PyList_Check(o) || PyTuple_Check(o)) {
      Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
      PyObject** items = PySequence_Fast_ITEMS(o);
      scratch.resize(static_cast<size_t>(n));
      for (Py_ssize_t i = 0; i < n; ++i) {
        // Exact ints only: bools and numpy scalars take the facade's conversion path.
        if (!PyLong_CheckExact(items[i])) throw nb::type_error("not a list of ints");
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow) throw nb::type_error("int out of int64 range");
        scratch[static_cast<size_t>(i)] = v;
      }
      data_ = scratch.data();
      size_ = n;
      return;
    }
    if (PyObject_GetBuffer(o, &view_, PyBUF_ND | PyBUF_FORMAT) != 0) {
      PyErr_Clear();
      throw nb::type_error("not a contiguous buffer");
    }
    has_view_ = true;
    const char* f = view_.format ? view_.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    bool is_signed = (f[0] == 'q' || f[0] == 'l' || f[0] == 'i') && f[1] == '\0';
    if (view_.ndim != 1 || !is_signed || (view_.itemsize != 8 && view_.itemsize != 4)) {
      throw nb::type_error("not a 1-D int32/int64 buffer");
    }
    size_ = view_.shape[0];
    if (view_.itemsize == 8) {
      data_ = static_cast<const i64*>(view_.buf);
    } else {
      const i32* src = static_cast<const i32*>(view_.buf);
      scratch.assign(src, src + size_);
      data_ = scratch.data();
    }
  }
  ~IntRun() {
    if (has_view_) PyBuffer_Release(&view_);
  }
  IntRun(const IntRun&) = delete;
  IntRun& operator=(const IntRun&) = delete;

  const i64* data() const { return data_; }
  i64 size() const { return size_; }

 private:
  Py_buffer view_{};
  bool has_view_ = false;
  const i64* data_ = nullptr;
  i64 size_ = 0;
};

// Index of the first position where a (stored) and b (query) differ, or n.
i64 mismatch(const i32* a, const i64* b, i64 n) {
  i64 i = 0;
  // Blocks without an early exit vectorize; the tail finds the exact position.
  for (; i + 16 <= n; i += 16) {
    unsigned diff = 0;
    for (int j = 0; j < 16; ++j) diff |= static_cast<i64>(a[i + j]) != b[i + j];
    if (diff) break;
  }
  for (; i < n; ++i) {
    if (static_cast<i64>(a[i]) != b[i]) return i;
  }
  return n;
}

template <class T>
u64 hash_page(const T* p, i32 n) {
  u64 h = 0x9e3779b97f4a7c15ULL;
  for (i32 i = 0; i < n; ++i) {
    h ^= static_cast<u64>(static_cast<i64>(p[i])) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  }
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  return h;
}

struct Node {
  std::unique_ptr<i32[]> data;  // key[len] then value[len]
  std::vector<i32> kids;
  // First-page hash -> child, for wide nodes. A colliding child is not in the map and is
  // found by the scan of `kids` that follows a mismatch.
  std::unique_ptr<std::unordered_map<u64, i32>> index;
  u64 last_access = 0;
  u64 hit_count = 0;
  u64 id = 0;
  u64 stamp = 0;  // the live heap entry of an evictable leaf; 0: not a candidate
  i64 ns = -1;    // namespace id of a root
  i32 parent = kNone;
  i32 pos_in_parent = 0;  // index in the parent's `kids`: O(1) removal under wide nodes
  i32 lock_ref = 0;
  i32 len = 0;
  u32 gen = 0;
  bool alive = false;
  bool index_collided = false;

  const i32* key() const { return data.get(); }
  const i32* value() const { return data.get() + len; }
};

struct Priority {
  u64 a, b, c;
  bool operator<(const Priority& o) const {
    if (a != o.a) return a < o.a;
    if (b != o.b) return b < o.b;
    return c < o.c;
  }
};

struct Entry {
  Priority prio;
  u64 stamp;
  i32 node;
};

// std heap functions build a max-heap; this order makes it a min-heap by priority.
struct Later {
  bool operator()(const Entry& x, const Entry& y) const { return y.prio < x.prio; }
};

class Tree {
 public:
  Tree(i64 num_slots, i32 page_size, bool lfu)
      : page_(page_size), lfu_(lfu), owned_(static_cast<size_t>(num_slots), 0) {
    if (num_slots < 1) throw nb::value_error("num_slots must be positive");
    if (page_size < 1) throw nb::value_error("page_size must be positive");
    clear();
  }
  Tree(const Tree&) = delete;
  Tree& operator=(const Tree&) = delete;

  // -- structure ---------------------------------------------------------------------------

  void clear() {
    nodes_.clear();
    free_.clear();
    roots_.clear();
    heap_.clear();
    plan_.clear();
    std::fill(owned_.begin(), owned_.end(), 0);
    evictable_ = protected_ = num_nodes_ = num_candidates_ = 0;
    clock_ = 0;
    roots_[0] = new_root(0);
  }

  // Drop every node. Slots recreated afterwards start above every generation an old handle
  // may hold, so all handles taken before go stale.
  void reset() {
    u32 max_gen = next_gen_floor_;
    for (const Node& nd : nodes_) max_gen = std::max(max_gen, nd.gen);
    next_gen_floor_ = max_gen + 1;
    clear();
  }

  i64 page_size() const { return page_; }
  i64 evictable_size() const { return evictable_; }
  i64 protected_size() const { return protected_; }
  i64 num_nodes() const { return num_nodes_; }
  u64 clock() const { return clock_; }

  // -- lookup ------------------------------------------------------------------------------

  // (indices, node, gen, length). A namespace without a root matches nothing and returns the
  // default root, as the spec does.
  nb::tuple match_prefix(i64 ns, nb::handle tokens) {
    IntRun key(tokens, scratch_tokens_);
    i64 n = aligned(key.size());
    auto r = roots_.find(ns);
    if (r == roots_.end()) {
      i32 root = roots_.at(0);
      return nb::make_tuple(to_numpy<i32>(nullptr, 0), root, nodes_[root].gen, 0);
    }
    Walk w = descend(r->second, key.data(), n);
    i32 last = w.last;
    i64 length = w.pos;
    if (w.child != kNone) {
      last = split(w.child, w.m);
      length += w.m;
    }
    touch(last);
    return nb::make_tuple(path_values(last, length), last, nodes_[last].gen, length);
  }

  i64 prefix_len(i64 ns, nb::handle tokens) {
    IntRun key(tokens, scratch_tokens_);
    auto r = roots_.find(ns);
    if (r == roots_.end()) return 0;
    Walk w = descend(r->second, key.data(), aligned(key.size()));
    return w.pos + (w.child != kNone ? w.m : 0);
  }

  // -- insertion ---------------------------------------------------------------------------

  // Returns the cached length, as the spec. `used_pages` (a bool per pool page) checks that
  // the new slots are allocated in the pool; without it `is_allocated(slots) -> bool` does.
  i64 insert(i64 ns, nb::handle tokens, nb::handle indices, nb::handle used_pages,
             i64 pool_page_size, nb::handle is_allocated) {
    IntRun key(tokens, scratch_tokens_);
    IntRun vals(indices, scratch_values_);
    if (vals.size() != key.size()) {
      throw nb::value_error(("indices has " + std::to_string(vals.size()) + " slots for " +
                             std::to_string(key.size()) + " tokens")
                                .c_str());
    }
    i64 n = aligned(key.size());
    auto r = roots_.find(ns);
    Walk w{kNone, 0, kNone, 0};
    if (r != roots_.end()) w = descend(r->second, key.data(), n);
    i64 cached = w.pos + (w.child != kNone ? w.m : 0);
    check_new_slots(vals.data() + cached, n - cached, used_pages, pool_page_size, is_allocated);
    for (i64 i = cached; i < n; ++i) {
      i64 t = key.data()[i];
      if (t < std::numeric_limits<i32>::min() || t > std::numeric_limits<i32>::max()) {
        throw nb::value_error("tokens must fit in int32 for the native tree");
      }
    }
    i32 last = w.last;
    if (r == roots_.end()) {
      if (n == cached) return cached;
      last = new_root(ns);
      roots_[ns] = last;
    }
    if (w.child != kNone) last = split(w.child, w.m);
    if (n > cached) {
      i64 m = n - cached;
      i32 leaf = alloc_node();
      Node& nd = nodes_[leaf];
      nd.len = static_cast<i32>(m);
      nd.data.reset(new i32[2 * m]);
      i32* dst = nd.data.get();
      for (i64 i = 0; i < m; ++i) dst[i] = static_cast<i32>(key.data()[cached + i]);
      for (i64 i = 0; i < m; ++i) {
        i64 s = vals.data()[cached + i];
        dst[m + i] = static_cast<i32>(s);
        owned_[static_cast<size_t>(s)] = 1;
      }
      add_kid(last, leaf);
      ++num_nodes_;
      evictable_ += m;
      update_candidate(last);  // no longer a leaf
      last = leaf;
    }
    touch(last);
    return cached;
  }

  // -- locks -------------------------------------------------------------------------------

  i64 inc_lock_ref(i32 node, u32 gen) {
    check_handle(node, gen);
    i64 delta = 0;
    for (i32 i = node; nodes_[i].parent != kNone; i = nodes_[i].parent) {
      Node& nd = nodes_[i];
      if (nd.lock_ref == 0) {
        evictable_ -= nd.len;
        protected_ += nd.len;
        delta += nd.len;
        nd.lock_ref = 1;
        update_candidate(i);
      } else {
        ++nd.lock_ref;
      }
    }
    return delta;
  }

  i64 dec_lock_ref(i32 node, u32 gen) {
    check_handle(node, gen);
    for (i32 i = node; nodes_[i].parent != kNone; i = nodes_[i].parent) {
      if (nodes_[i].lock_ref == 0) throw nb::value_error("unlocked");
    }
    i64 delta = 0;
    for (i32 i = node; nodes_[i].parent != kNone; i = nodes_[i].parent) {
      Node& nd = nodes_[i];
      if (--nd.lock_ref == 0) {
        evictable_ += nd.len;
        protected_ -= nd.len;
        delta -= nd.len;
        if (nd.kids.empty()) update_candidate(i);
      }
    }
    return delta;
  }

  // -- eviction ----------------------------------------------------------------------------

  // Choose the leaves to free for `num_tokens` and return their slots; nothing changes until
  // commit_evict(), and abort_evict() puts the candidates back (the pool may refuse the slots).
  Array1<i32> plan_evict(i64 num_tokens) {
    plan_.clear();
    popped_.clear();
    std::vector<Entry> exposed;  // parents that become leaves during this plan
    std::unordered_map<i32, i32> kids_left;
    i64 freed = 0;
    while (freed < num_tokens) {
      drop_stale_top();
      bool from_heap;
      if (heap_.empty() && exposed.empty()) break;
      if (heap_.empty()) {
        from_heap = false;
      } else if (exposed.empty()) {
        from_heap = true;
      } else {
        from_heap = heap_.front().prio < exposed.front().prio;
      }
      Entry e;
      if (from_heap) {
        std::pop_heap(heap_.begin(), heap_.end(), Later());
        e = heap_.back();
        heap_.pop_back();
        popped_.push_back(e);
      } else {
        std::pop_heap(exposed.begin(), exposed.end(), Later());
        e = exposed.back();
        exposed.pop_back();
      }
      plan_.push_back(e.node);
      const Node& nd = nodes_[e.node];
      freed += nd.len;
      const Node& p = nodes_[nd.parent];
      if (p.parent == kNone) continue;
      auto it = kids_left.try_emplace(nd.parent, static_cast<i32>(p.kids.size())).first;
      if (--it->second == 0 && p.lock_ref == 0) {
        exposed.push_back(Entry{priority(p), 0, nd.parent});
        std::push_heap(exposed.begin(), exposed.end(), Later());
      }
    }
    size_t total = 0;
    for (i32 i : plan_) total += static_cast<size_t>(nodes_[i].len);
    std::vector<i32> slots;
    slots.reserve(total);
    for (i32 i : plan_) {
      const Node& nd = nodes_[i];
      slots.insert(slots.end(), nd.value(), nd.value() + nd.len);
    }
    planned_tokens_ = freed;
    return to_numpy(slots.data(), slots.size());
  }

  void abort_evict() {
    for (const Entry& e : popped_) {
      heap_.push_back(e);
      std::push_heap(heap_.begin(), heap_.end(), Later());
    }
    popped_.clear();
    plan_.clear();
  }

  // Apply the plan; returns (tokens freed, namespace ids whose roots were dropped).
  nb::tuple commit_evict() {
    std::vector<i64> dropped;
    for (i32 i : plan_) {
      Node& nd = nodes_[i];
      i32 p = nd.parent;
      for (i32 k = 0; k < nd.len; ++k) owned_[static_cast<size_t>(nd.value()[k])] = 0;
      evictable_ -= nd.len;
      --num_nodes_;
      remove_kid(p, i);
      release(nd);
      Node& pn = nodes_[p];
      if (pn.parent == kNone) {
        if (pn.kids.empty() && pn.ns != 0) {
          dropped.push_back(pn.ns);
          roots_.erase(pn.ns);
          release(pn);
        }
      } else if (pn.kids.empty() && pn.lock_ref == 0) {
        update_candidate(p);
      }
    }
    i64 freed = planned_tokens_;
    plan_.clear();
    popped_.clear();
    planned_tokens_ = 0;
    nb::list ns;
    for (i64 d : dropped) ns.append(d);
    return nb::make_tuple(freed, ns);
  }

  // -- handles -----------------------------------------------------------------------------

  bool is_live(i32 node, u32 gen) const {
    return node >= 0 && static_cast<size_t>(node) < nodes_.size() && nodes_[node].alive &&
           nodes_[node].gen == gen;
  }

  // (lock_ref, last_access, hit_count, id, len, number of children)
  nb::tuple node_fields(i32 node, u32 gen) const {
    check_handle(node, gen);
    const Node& nd = nodes_[node];
    return nb::make_tuple(nd.lock_ref, nd.last_access, nd.hit_count, nd.id, nd.len, nd.kids.size());
  }

  Array1<i64> node_key(i32 node, u32 gen) const {
    check_handle(node, gen);
    const Node& nd = nodes_[node];
    std::vector<i64> k(nd.key(), nd.key() + nd.len);
    return to_numpy(k.data(), k.size());
  }

  Array1<i32> node_value(i32 node, u32 gen) const {
    check_handle(node, gen);
    return to_numpy(nodes_[node].value(), static_cast<size_t>(nodes_[node].len));
  }

  // (parent, gen, parent is a root) or None for a root.
  nb::object node_parent(i32 node, u32 gen) const {
    check_handle(node, gen);
    i32 p = nodes_[node].parent;
    if (p == kNone) return nb::none();
    return nb::make_tuple(p, nodes_[p].gen, nodes_[p].parent == kNone);
  }

  nb::list node_children(i32 node, u32 gen) const {
    check_handle(node, gen);
    nb::list out;
    for (i32 c : nodes_[node].kids) out.append(nb::make_tuple(c, nodes_[c].gen));
    return out;
  }

  // [(namespace id, root, gen)]
  nb::list roots() const {
    nb::list out;
    for (const auto& [ns, r] : roots_) out.append(nb::make_tuple(ns, r, nodes_[r].gen));
    return out;
  }

  // [(namespace id, tokens, slots)] for every root-to-leaf path.
  nb::list cached_sequences() const {
    nb::list out;
    std::vector<i64> keys;
    std::vector<i32> vals;
    for (const auto& [ns, root] : roots_) {
      // Iterative DFS; `keys` / `vals` hold the path, cut back on the way up.
      std::vector<std::pair<i32, size_t>> stack{{root, 0}};
      while (!stack.empty()) {
        auto [i, depth] = stack.back();
        stack.pop_back();
        const Node& nd = nodes_[i];
        keys.resize(depth);
        vals.resize(depth);
        keys.insert(keys.end(), nd.key(), nd.key() + nd.len);
        vals.insert(vals.end(), nd.value(), nd.value() + nd.len);
        if (nd.kids.empty() && nd.parent != kNone) {
          out.append(nb::make_tuple(ns, to_numpy(keys.data(), keys.size()),
                                    to_numpy(vals.data(), vals.size())));
        }
        for (i32 c : nd.kids) stack.emplace_back(c, keys.size());
      }
    }
    return out;
  }

  Array1<i64> owned_slots() const {
    std::vector<i64> out;
    for (size_t s = 0; s < owned_.size(); ++s) {
      if (owned_[s]) out.push_back(static_cast<i64>(s));
    }
    return to_numpy(out.data(), out.size());
  }

  // Bytes held by the tree's own structures (allocator overhead not counted).
  i64 memory_bytes() const {
    size_t b = sizeof(Tree) + nodes_.capacity() * sizeof(Node) + free_.capacity() * sizeof(i32) +
               heap_.capacity() * sizeof(Entry) + owned_.capacity() +
               roots_.size() * (sizeof(i64) + sizeof(i32) + 2 * sizeof(void*));
    for (const Node& nd : nodes_) {
      if (!nd.alive) continue;
      b += 2 * sizeof(i32) * static_cast<size_t>(nd.len) + nd.kids.capacity() * sizeof(i32);
      if (nd.index) {
        b += sizeof(*nd.index) + nd.index->bucket_count() * sizeof(void*) +
             nd.index->size() * (sizeof(u64) + sizeof(i32) + 2 * sizeof(void*));
      }
    }
    return static_cast<i64>(b);
  }

  void check_invariants() const {
    i64 evictable = 0, protected_sum = 0, nodes = 0, candidates = 0;
    std::vector<uint8_t> owned(owned_.size(), 0);
    std::unordered_map<u64, Priority> live;  // stamp -> priority of heap entries
    for (const Entry& e : heap_) {
      if (e.node >= 0 && static_cast<size_t>(e.node) < nodes_.size() && nodes_[e.node].alive &&
          nodes_[e.node].stamp == e.stamp) {
        live.emplace(e.stamp, e.prio);
      }
    }
    for (const auto& [ns, root] : roots_) {
      const Node& r = nodes_[root];
      if (!r.alive || r.parent != kNone || r.ns != ns) raise_assertion("bad root");
      if (ns != 0 && r.kids.empty()) raise_assertion("empty namespace root kept");
      std::vector<i32> stack{root};
      while (!stack.empty()) {
        i32 i = stack.back();
        stack.pop_back();
        const Node& nd = nodes_[i];
        if (!nd.alive) raise_assertion("dead node in the tree");
        i64 kid_locks = 0;
        for (size_t k = 0; k < nd.kids.size(); ++k) {
          i32 c = nd.kids[k];
          const Node& cn = nodes_[c];
          if (cn.parent != i || cn.pos_in_parent != static_cast<i32>(k)) {
            raise_assertion("broken parent link");
          }
          if (cn.len <= 0 || cn.len % page_ != 0) raise_assertion("empty or unaligned edge");
          std::vector<i64> page(cn.key(), cn.key() + page_);
          if (find_kid(i, page.data()) != c) raise_assertion("child not found by its key");
          kid_locks += cn.lock_ref;
          if (nd.parent != kNone &&
              (nd.last_access < cn.last_access || nd.hit_count < cn.hit_count)) {
            raise_assertion("a child was accessed after its parent");
          }
          stack.push_back(c);
        }
        if (nd.parent == kNone) {
          if (nd.lock_ref != 0 || nd.stamp != 0) raise_assertion("root locked or a candidate");
          continue;
        }
        ++nodes;
        if (nd.lock_ref < kid_locks) raise_assertion("lock_ref below the children's");
        for (i32 k = 0; k < nd.len; ++k) {
          i32 s = nd.value()[k];
          if (s < 0 || static_cast<size_t>(s) >= owned.size() || owned[s]) {
            raise_assertion("a slot is held by two nodes or out of range");
          }
          owned[s] = 1;
        }
        (nd.lock_ref ? protected_sum : evictable) += nd.len;
        bool candidate = nd.lock_ref == 0 && nd.kids.empty();
        if (candidate != (nd.stamp != 0)) raise_assertion("candidate stamp out of date");
        if (candidate) {
          ++candidates;
          auto it = live.find(nd.stamp);
          if (it == live.end()) raise_assertion("an evictable leaf has no heap entry");
          Priority p = priority(nd);
          if (p < it->second || it->second < p) raise_assertion("heap entry priority stale");
        }
      }
    }
    if (evictable != evictable_ || protected_sum != protected_) raise_assertion("sizes off");
    if (nodes != num_nodes_) raise_assertion("node count off");
    if (candidates != num_candidates_) raise_assertion("candidate count off");
    if (static_cast<size_t>(candidates) != live.size()) raise_assertion("live heap entries off");
    if (owned != owned_) raise_assertion("slot ownership mask out of date");
  }

 private:
  struct Walk {
    i32 last;   // deepest fully matched node
    i64 pos;    // tokens matched through `last`
    i32 child;  // the child whose edge the match ends inside, or kNone
    i64 m;      // tokens matched into that edge
  };

  i64 aligned(i64 n) const { return n - n % page_; }

  Priority priority(const Node& nd) const {
    if (lfu_) return {nd.hit_count, nd.last_access, nd.id};
    return {nd.last_access, nd.id, 0};
  }

  i32 alloc_node() {
    i32 i;
    if (!free_.empty()) {
      i = free_.back();
      free_.pop_back();
    } else {
      i = static_cast<i32>(nodes_.size());
      nodes_.emplace_back();
      nodes_.back().gen = next_gen_floor_;
    }
    Node& nd = nodes_[i];
    nd.alive = true;
    nd.id = next_id_++;
    nd.lock_ref = 0;
    nd.last_access = nd.hit_count = nd.stamp = 0;
    nd.ns = -1;
    nd.parent = kNone;
    nd.index_collided = false;
    return i;
  }

  i32 new_root(i64 ns) {
    i32 r = alloc_node();
    nodes_[r].ns = ns;
    nodes_[r].len = 0;
    nodes_[r].data.reset(new i32[1]);
    return r;
  }

  void release(Node& nd) {
    if (nd.stamp) {
      nd.stamp = 0;
      --num_candidates_;
    }
    nd.data.reset();
    std::vector<i32>().swap(nd.kids);
    nd.index.reset();
    nd.alive = false;
    nd.len = 0;
    ++nd.gen;
    free_.push_back(static_cast<i32>(&nd - nodes_.data()));
  }

  // The facade turns these two messages into the spec's, which name the node.
  void check_handle(i32 node, u32 gen) const {
    if (!is_live(node, gen)) throw nb::value_error("stale");
  }

  bool first_page_equal(i32 c, const i64* page) const {
    const i32* k = nodes_[c].key();
    for (i32 i = 0; i < page_; ++i) {
      if (static_cast<i64>(k[i]) != page[i]) return false;
    }
    return true;
  }

  i32 find_kid(i32 node, const i64* page) const {
    const Node& nd = nodes_[node];
    if (nd.index) {
      auto it = nd.index->find(hash_page(page, page_));
      if (it == nd.index->end()) return kNone;
      if (first_page_equal(it->second, page)) return it->second;
      if (!nd.index_collided) return kNone;
    }
    for (i32 c : nd.kids) {
      if (first_page_equal(c, page)) return c;
    }
    return kNone;
  }

  void index_add(Node& nd, i32 c) {
    auto [it, fresh] = nd.index->emplace(hash_page(nodes_[c].key(), page_), c);
    if (!fresh) nd.index_collided = true;
  }

  void add_kid(i32 node, i32 c) {
    Node& nd = nodes_[node];
    nodes_[c].parent = node;
    nodes_[c].pos_in_parent = static_cast<i32>(nd.kids.size());
    nd.kids.push_back(c);
    if (nd.index) {
      index_add(nd, c);
    } else if (nd.kids.size() > kIndexFrom) {
      nd.index = std::make_unique<std::unordered_map<u64, i32>>();
      for (i32 k : nd.kids) index_add(nd, k);
    }
  }

  void remove_kid(i32 node, i32 c) {
    Node& nd = nodes_[node];
    i32 pos = nodes_[c].pos_in_parent;
    i32 moved = nd.kids.back();
    nd.kids[pos] = moved;
    nodes_[moved].pos_in_parent = pos;
    nd.kids.pop_back();
    if (nd.index) {
      u64 h = hash_page(nodes_[c].key(), page_);
      auto it = nd.index->find(h);
      if (it != nd.index->end() && it->second == c) {
        nd.index->erase(it);
        if (nd.index_collided) {
          // Another child with the same hash (a different page) takes the slot.
          for (i32 k : nd.kids) {
            if (hash_page(nodes_[k].key(), page_) == h) {
              nd.index->emplace(h, k);
              break;
            }
          }
        }
      }
    }
  }

  Walk descend(i32 root, const i64* key, i64 n) const {
    i32 node = root;
    i64 pos = 0;
    while (pos < n) {
      i32 c = find_kid(node, key + pos);
      if (c == kNone) break;
      const Node& cn = nodes_[c];
      i64 avail = std::min<i64>(cn.len, n - pos);
      i64 m = mismatch(cn.key(), key + pos, avail);
      m -= m % page_;
      if (m < cn.len) return Walk{node, pos, c, m};
      node = c;
      pos += m;
    }
    return Walk{node, pos, kNone, 0};
  }

  // Cut `child`'s edge after m tokens; return the new upper node. Both halves get their own
  // copies, so evicting one frees its memory instead of keeping the whole edge alive.
  i32 split(i32 child, i64 m) {
    i32 upper = alloc_node();  // may move nodes_: take references after
    Node& u = nodes_[upper];
    Node& c = nodes_[child];
    i64 rest = c.len - m;
    u.len = static_cast<i32>(m);
    u.data.reset(new i32[2 * m]);
    std::memcpy(u.data.get(), c.key(), m * sizeof(i32));
    std::memcpy(u.data.get() + m, c.value(), m * sizeof(i32));
    std::unique_ptr<i32[]> lower(new i32[2 * rest]);
    std::memcpy(lower.get(), c.key() + m, rest * sizeof(i32));
    std::memcpy(lower.get() + rest, c.value() + m, rest * sizeof(i32));
    u.lock_ref = c.lock_ref;
    u.last_access = c.last_access;
    u.hit_count = c.hit_count;
    i32 p = c.parent;
    u.parent = p;
    u.pos_in_parent = c.pos_in_parent;
    Node& pn = nodes_[p];
    pn.kids[u.pos_in_parent] = upper;
    if (pn.index) {
      // Same first page (m >= page_size), so the same hash: point it at the upper node.
      auto it = pn.index->find(hash_page(c.key(), page_));
      if (it != pn.index->end() && it->second == child) it->second = upper;
    }
    c.data = std::move(lower);
    c.len = static_cast<i32>(rest);
    u.kids.push_back(child);
    c.parent = upper;
    c.pos_in_parent = 0;
    ++num_nodes_;
    return upper;
  }

  // One access to the path root..node: the clock ticks once, as in the spec.
  void touch(i32 node) {
    ++clock_;
    for (i32 i = node; i != kNone; i = nodes_[i].parent) {
      nodes_[i].last_access = clock_;
      ++nodes_[i].hit_count;
    }
    // Only the path's end can be a leaf; its priority changed, so its entry is renewed.
    if (nodes_[node].parent != kNone) update_candidate(node);
  }

  Array1<i32> path_values(i32 node, i64 length) const {
    i32* buf = new i32[length > 0 ? length : 1];
    nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<i32*>(p); });
    i64 end = length;
    for (i32 i = node; nodes_[i].parent != kNone; i = nodes_[i].parent) {
      const Node& nd = nodes_[i];
      end -= nd.len;
      std::memcpy(buf + end, nd.value(), static_cast<size_t>(nd.len) * sizeof(i32));
    }
    return Array1<i32>(buf, {static_cast<size_t>(length)}, owner);
  }

  // Bring the node's heap entry in line with its state: a fresh entry for an evictable leaf
  // (its priority may have changed), none otherwise.
  void update_candidate(i32 i) {
    Node& nd = nodes_[i];
    bool want = nd.parent != kNone && nd.lock_ref == 0 && nd.kids.empty();
    if (!want) {
      if (nd.stamp) {
        nd.stamp = 0;
        --num_candidates_;
      }
      return;
    }
    if (!nd.stamp) ++num_candidates_;
    nd.stamp = ++next_stamp_;
    heap_.push_back(Entry{priority(nd), nd.stamp, i});
    std::push_heap(heap_.begin(), heap_.end(), Later());
    // Stale entries are garbage; once they outnumber live ones, rebuild (amortized O(1)).
    if (heap_.size() > 2 * static_cast<size_t>(num_candidates_) + 64) compact();
  }

  void drop_stale_top() {
    while (!heap_.empty()) {
      const Entry& e = heap_.front();
      const Node& nd = nodes_[e.node];
      if (nd.alive && nd.stamp == e.stamp) return;
      std::pop_heap(heap_.begin(), heap_.end(), Later());
      heap_.pop_back();
    }
  }

  void compact() {
    auto stale = [this](const Entry& e) {
      const Node& nd = nodes_[e.node];
      return !nd.alive || nd.stamp != e.stamp;
    };
    heap_.erase(std::remove_if(heap_.begin(), heap_.end(), stale), heap_.end());
    std::make_heap(heap_.begin(), heap_.end(), Later());
  }

  void check_new_slots(const i64* s, i64 n, nb::handle used_pages, i64 pool_page_size,
                       nb::handle is_allocated) {
    if (n <= 0) return;
    i64 num_slots = static_cast<i64>(owned_.size());
    for (i64 i = 0; i < n; ++i) {
      if (s[i] < 0 || s[i] >= num_slots) {
        throw nb::value_error(
            ("indices must lie in [0, " + std::to_string(num_slots) + ")").c_str());
      }
    }
    // Mark with a second bit of the ownership mask, cleared on every way out.
    constexpr uint8_t kSeen = 2;
    i64 i = 0;
    bool twice = false;
    for (; i < n; ++i) {
      uint8_t& o = owned_[static_cast<size_t>(s[i])];
      if (o & kSeen) {
        twice = true;
        break;
      }
      o |= kSeen;
    }
    for (i64 j = 0; j < i; ++j) owned_[static_cast<size_t>(s[j])] &= ~kSeen;
    if (twice) throw nb::value_error("indices lists a slot twice");
    std::string held;
    int shown = 0;
    for (i64 j = 0; j < n && shown < 8; ++j) {
      if (owned_[static_cast<size_t>(s[j])]) {
        held += (shown++ ? ", " : "") + std::to_string(s[j]);
      }
    }
    if (shown)
      throw nb::value_error(("indices [" + held + "] are already held by the cache").c_str());
    bool allocated = true;
    if (!used_pages.is_none()) {
      Py_buffer v{};
      if (PyObject_GetBuffer(used_pages.ptr(), &v, PyBUF_ND) != 0) throw nb::python_error();
      const uint8_t* used = static_cast<const uint8_t*>(v.buf);
      i64 pages = v.len;
      for (i64 j = 0; j < n && allocated; ++j) {
        i64 page = s[j] / pool_page_size;
        allocated = page < pages && used[page];
      }
      PyBuffer_Release(&v);
    } else {
      allocated = nb::cast<bool>(is_allocated(to_numpy(s, static_cast<size_t>(n))));
    }
    if (!allocated) throw nb::value_error("indices contains slots that are free in the pool");
  }

  i64 page_;
  bool lfu_;
  std::vector<Node> nodes_;
  std::vector<i32> free_;
  std::unordered_map<i64, i32> roots_;
  std::vector<uint8_t> owned_;
  std::vector<Entry> heap_;
  std::vector<i32> plan_;
  std::vector<Entry> popped_;
  std::vector<i64> scratch_tokens_, scratch_values_;
  i64 planned_tokens_ = 0;
  i64 evictable_ = 0, protected_ = 0, num_nodes_ = 0, num_candidates_ = 0;
  u64 clock_ = 0, next_id_ = 0, next_stamp_ = 0;
  u32 next_gen_floor_ = 0;
};

}  // namespace
}  // namespace jaxattn_radix

NB_MODULE(_radix_tree, m) {
  using jaxattn_radix::Tree;
  m.doc() = "The radix prefix tree of jaxattn.radix in C++ (see native_tree.py).";
  nb::class_<Tree>(m, "Tree")
      .def(nb::init<int64_t, int32_t, bool>(), nb::arg("num_slots"), nb::arg("page_size"),
           nb::arg("lfu"))
      .def("reset", &Tree::reset)
      .def_prop_ro("page_size", &Tree::page_size)
      .def_prop_ro("evictable_size", &Tree::evictable_size)
      .def_prop_ro("protected_size", &Tree::protected_size)
      .def_prop_ro("num_nodes", &Tree::num_nodes)
      .def_prop_ro("clock", &Tree::clock)
      .def("match_prefix", &Tree::match_prefix)
      .def("prefix_len", &Tree::prefix_len)
      .def("insert", &Tree::insert, nb::arg("ns"), nb::arg("tokens"), nb::arg("indices"),
           nb::arg("used_pages").none(), nb::arg("pool_page_size"), nb::arg("is_allocated").none())
      .def("inc_lock_ref", &Tree::inc_lock_ref)
      .def("dec_lock_ref", &Tree::dec_lock_ref)
      .def("plan_evict", &Tree::plan_evict)
      .def("abort_evict", &Tree::abort_evict)
      .def("commit_evict", &Tree::commit_evict)
      .def("is_live", &Tree::is_live)
      .def("node_fields", &Tree::node_fields)
      .def("node_key", &Tree::node_key)
      .def("node_value", &Tree::node_value)
      .def("node_parent", &Tree::node_parent)
      .def("node_children", &Tree::node_children)
      .def("roots", &Tree::roots)
      .def("cached_sequences", &Tree::cached_sequences)
      .def("owned_slots", &Tree::owned_slots)
      .def("memory_bytes", &Tree::memory_bytes)
      .def("check_invariants", &Tree::check_invariants);
}
