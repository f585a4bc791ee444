// FlatMap: a small int64-keyed map kept as one vector sorted by key, for the level fill's
// per-expert and per-rank maps (level_fill.cpp: amounts, helped, kept, degrees). Each holds a
// few entries (an expert's holders, a rank's helped experts): a sorted vector iterates in
// std::map's order (ascending key) without a heap node per entry, and an empty one allocates
// nothing. Insertion is O(size), fine at these sizes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace mixmoe_native {

template <class V>
class FlatMap {
 public:
  using Item = std::pair<int64_t, V>;
  using iterator = typename std::vector<Item>::iterator;
  using const_iterator = typename std::vector<Item>::const_iterator;

  iterator begin() { return items_.begin(); }
  iterator end() { return items_.end(); }
  const_iterator begin() const { return items_.begin(); }
  const_iterator end() const { return items_.end(); }
  bool empty() const { return items_.empty(); }
  size_t size() const { return items_.size(); }
  void clear() { items_.clear(); }

  iterator find(int64_t key) {
    auto it = lower(key);
    return it != items_.end() && it->first == key ? it : items_.end();
  }
  const_iterator find(int64_t key) const {
    auto it = lower(key);
    return it != items_.end() && it->first == key ? it : items_.end();
  }
  V& operator[](int64_t key) {  // std::map's: a new key enters with V{}
    auto it = lower(key);
    if (it == items_.end() || it->first != key) it = items_.insert(it, Item{key, V{}});
    return it->second;
  }
  void erase(iterator it) { items_.erase(it); }

  // the entries of a vector of (key, value): std::map::insert's (the first of equal keys wins)
  template <class It>
  void assign(It first, It last) {
    items_.assign(first, last);
    std::stable_sort(items_.begin(), items_.end(),
                     [](const Item& p, const Item& q) { return p.first < q.first; });
    items_.erase(std::unique(items_.begin(), items_.end(),
                             [](const Item& p, const Item& q) { return p.first == q.first; }),
                 items_.end());
  }
  // entries already ascending by key, unique: appended in order (the caller guarantees it)
  void push_back_sorted(int64_t key, V value) { items_.emplace_back(key, value); }

 private:
  iterator lower(int64_t key) {
    return std::lower_bound(items_.begin(), items_.end(), key,
                            [](const Item& p, int64_t k) { return p.first < k; });
  }
  const_iterator lower(int64_t key) const {
    return std::lower_bound(items_.begin(), items_.end(), key,
                            [](const Item& p, int64_t k) { return p.first < k; });
  }
  std::vector<Item> items_;
};

}  // namespace mixmoe_native
