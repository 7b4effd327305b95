"""A stand-in for CUDA's caching allocator counters, for the memory meters' tests on a CPU."""


class FakeCudaAllocator:
    """The caching allocator's counters as ``torch._C`` exposes them (nested stats with a
    peak per stat and pool; a reset sets each peak to its current value). ``inactive_split_bytes``:
    free blocks inside segments still partly in use (``free(trap=True)``), reused by ``reuse``."""

    STATS = ("allocated_bytes", "reserved_bytes", "inactive_split_bytes")

    def __init__(self):
        self.current = dict.fromkeys(self.STATS, 0)
        self.peak = dict.fromkeys(self.STATS, 0)
        self.resets = 0

    def _update(self):
        c = self.current
        c["reserved_bytes"] = max(c["reserved_bytes"], c["allocated_bytes"] + c["inactive_split_bytes"])
        for k in self.STATS:
            self.peak[k] = max(self.peak[k], c[k])

    def alloc(self, n):
        self.current["allocated_bytes"] += n
        self._update()

    def reuse(self, n):
        """Allocate ``n`` bytes out of trapped free space (no new segment)."""
        self.current["inactive_split_bytes"] -= n
        self.current["allocated_bytes"] += n
        self._update()

    def free(self, n, release=False, trap=False):
        self.current["allocated_bytes"] -= n
        if trap:  # its segment stays partly in use: the block cannot go back to the device
            self.current["inactive_split_bytes"] += n
        if release:  # empty_cache: whole free segments only
            self.current["reserved_bytes"] = self.current["allocated_bytes"] + self.current["inactive_split_bytes"]
        self._update()

    def stats(self, device):
        assert device == 0
        one = {k: {"current": self.current[k], "peak": self.peak[k], "allocated": 0, "freed": 0} for k in self.STATS}
        return {k: {"all": dict(v), "large_pool": dict(v)} for k, v in one.items()} | {"num_ooms": 0}

    def reset(self, device):
        assert device == 0
        self.resets += 1
        self.peak = dict(self.current)
