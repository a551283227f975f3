"""Per-rank loads in a segment tree: the queries the DP packer and its local search need.

Both run in pure Python on up to thousands of ranks, so every query is O(log R): point update,
the busiest rank, the first rank at or after ``lo`` whose load is at most a threshold, and the
least-loaded rank in a closed range.
"""

from __future__ import annotations

_INF = float("inf")


class LoadTree:
    """Loads of ``size`` ranks, all starting at 0. Ties resolve to the lowest rank."""

    __slots__ = ("_leaf", "_max", "_min", "size")

    def __init__(self, size: int) -> None:
        leaf = 1
        while leaf < size:
            leaf *= 2
        self.size = size
        self._leaf = leaf
        # Padding leaves must never win a query: +inf never has room, -inf is never the busiest.
        self._min = [0.0] * (2 * leaf)
        self._max = [0.0] * (2 * leaf)
        for node in range(leaf + size, 2 * leaf):
            self._min[node] = _INF
            self._max[node] = -_INF
        for node in range(leaf - 1, 0, -1):
            self._min[node] = min(self._min[2 * node], self._min[2 * node + 1])
            self._max[node] = max(self._max[2 * node], self._max[2 * node + 1])

    @classmethod
    def from_loads(cls, loads: list[float]) -> LoadTree:
        tree = cls(len(loads))
        leaf = tree._leaf
        tree._min[leaf : leaf + len(loads)] = loads
        tree._max[leaf : leaf + len(loads)] = loads
        for node in range(leaf - 1, 0, -1):
            tree._min[node] = min(tree._min[2 * node], tree._min[2 * node + 1])
            tree._max[node] = max(tree._max[2 * node], tree._max[2 * node + 1])
        return tree

    def __getitem__(self, rank: int) -> float:
        return self._min[self._leaf + rank]

    def loads(self) -> list[float]:
        return self._min[self._leaf : self._leaf + self.size]

    def add(self, rank: int, amount: float) -> None:
        mins, maxs = self._min, self._max
        node = self._leaf + rank
        value = mins[node] + amount
        mins[node] = maxs[node] = value
        node >>= 1
        while node:
            left, right = 2 * node, 2 * node + 1
            mins[node] = mins[left] if mins[left] <= mins[right] else mins[right]
            maxs[node] = maxs[left] if maxs[left] >= maxs[right] else maxs[right]
            node >>= 1

    def busiest(self) -> int:
        maxs = self._max
        node = 1
        while node < self._leaf:
            node = 2 * node if maxs[2 * node] >= maxs[2 * node + 1] else 2 * node + 1
        return node - self._leaf

    def max_load(self) -> float:
        return self._max[1]

    def first_at_most(self, lo: int, threshold: float) -> int:
        """The first rank >= ``lo`` with load <= ``threshold``, or -1."""
        if lo >= self.size:
            return -1
        mins = self._min
        node = self._leaf + lo
        if mins[node] <= threshold:
            return lo
        while node > 1:
            if not node & 1 and mins[node + 1] <= threshold:
                node += 1
                break
            node >>= 1
        else:
            return -1
        while node < self._leaf:
            node = 2 * node if mins[2 * node] <= threshold else 2 * node + 1
        return node - self._leaf

    def min_in(self, lo: int, hi: int) -> float:
        """The smallest load in ``[lo, hi]``."""
        return self[self.argmin(lo, hi)]

    def argmin(self, lo: int, hi: int) -> int:
        """The least-loaded rank in ``[lo, hi]`` (the lowest such rank on ties)."""
        mins = self._min
        left, right = lo + self._leaf, hi + self._leaf + 1
        best_node, best = -1, _INF
        # Nodes from the left edge come in rank order, those from the right edge in reverse, so
        # keep the right ones aside and scan them last to keep the lowest-rank tie-break.
        right_nodes = []
        while left < right:
            if left & 1:
                if mins[left] < best:
                    best_node, best = left, mins[left]
                left += 1
            if right & 1:
                right -= 1
                right_nodes.append(right)
            left >>= 1
            right >>= 1
        for node in reversed(right_nodes):
            if mins[node] < best:
                best_node, best = node, mins[node]
        if best_node < 0:
            return lo
        node = best_node
        while node < self._leaf:
            node = 2 * node if mins[2 * node] <= best else 2 * node + 1
        return node - self._leaf
