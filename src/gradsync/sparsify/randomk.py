"""Random-k: k positions drawn uniformly without replacement (SSFusion §II baseline, [65]).

Randomness comes from the sparsifier's own seeded ``torch.Generator``: the same seed gives the
same positions on every rank, and the global RNG is never touched.

On the CPU the cost is O(k log k), not O(n): for k ≪ n we draw positions *with* replacement
and keep the first k distinct ones in draw order (sequential sampling: the first k distinct
draws of an i.i.d. uniform stream are a uniform k-subset), topping up when duplicates left
fewer than k. When k is a sizeable fraction of n, a full ``randperm`` is as cheap and is used
instead.

On a GPU that host-side draw (and the copy of k positions to the device) is what costs: it grew
to seconds at 124 M entries and 10 %. There each selection draws on the device instead: one
uniform key per entry from a device generator, and the k smallest keys (``torch.topk``, one
pass as DGC's selection is) are a uniform k-subset. The device generator is seeded from one
draw of the sparsifier's own generator per selection, so that generator's state alone still
fixes every selection (checkpoints need nothing more) and ranks with one seed agree. The
device draw gives other positions than the host draw for the same seed.
"""

from __future__ import annotations

import math

import torch

from gradsync.sparsify import registry
from gradsync.sparsify.base import Sparsifier

# Above this fraction k/n the expected number of draws, n·ln(n/(n−k)), approaches n: randperm.
_RANDPERM_FRACTION = 0.25


def _first_distinct(draws: torch.Tensor) -> torch.Tensor:
    """The distinct values of ``draws`` in order of first occurrence."""
    uniq, inverse = torch.unique(draws, return_inverse=True)
    pos = torch.arange(draws.numel(), dtype=torch.int64)
    first = torch.full((uniq.numel(),), draws.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, pos, reduce="amin")
    return uniq[torch.argsort(first)]


@registry.register("randomk")
class RandomK(Sparsifier):
    def __init__(self, density: float, *, seed: int = 0, device_draws: bool | None = None
                 ) -> None:
        super().__init__(density, seed=seed)
        if device_draws not in (None, True, False):
            raise ValueError(f"randomk: device_draws must be None (on CUDA), True or False, got "
                             f"{device_draws!r}")
        self.device_draws = device_draws

    def _select(self, x: torch.Tensor, k: int, step: int) -> torch.Tensor:
        on_device = (x.device.type == "cuda" if self.device_draws is None
                     else self.device_draws)
        return self._draw_on_device(x, k) if on_device else self._draw_on_host(x, k)

    def _draw_on_device(self, x: torch.Tensor, k: int) -> torch.Tensor:
        seed = int(torch.randint(2**62, (1,), generator=self.generator))
        gen = torch.Generator(device=x.device).manual_seed(seed)
        keys = torch.rand(x.numel(), device=x.device, generator=gen)
        return torch.topk(keys, k, largest=False, sorted=False).indices

    def _draw_on_host(self, x: torch.Tensor, k: int) -> torch.Tensor:
        n = x.numel()
        if k > _RANDPERM_FRACTION * n:
            return torch.randperm(n, generator=self.generator)[:k].to(x.device)
        draws = torch.empty(0, dtype=torch.int64)
        have = 0
        while have < k:
            # Expected distinct values among m more draws ≈ m·(n − have)/n; 10% + 16 slack.
            m = math.ceil((k - have) * n / (n - have) * 1.1) + 16
            draws = torch.cat([draws, torch.randint(n, (m,), generator=self.generator)])
            chosen = _first_distinct(draws)
            have = chosen.numel()
        return chosen[:k].to(x.device)
