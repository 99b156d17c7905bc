"""The sparsifiers and collectives of one engine, as the table of schemes says, with their state.

``gradsync.schedule.schemes.get(cfg.scheme)`` names the scheme's sparse collective
(``Scheme.collective``), the ``Config`` fields its constructor takes (``collective_options``:
Ok-Topk sizes its buckets from ``density``) with the row's fixed ones (``collective_kwargs``:
Ok-Topk returns NaN sums, to which the engine applies ``Config.nonfinite``) and the
sparsifier it always uses (``sparsifier``: the Gaussian-k scheme runs Gaussian-k, as Ok-Topk's
paper does; Ok-Topk selects locally by threshold reuse, exact every τ′ =
``Config.local_tau_prime`` steps, with the options
``sparsifier_options``/``sparsifier_config`` of its row; a 0 in such a field, or no
``sparsifier`` in the row, means ``Config.sparsifier``).

Every fused buffer (key ``buffer:<job>``) and every per-tensor-sparsified tensor (key: its
name) has its own sparsifier, seeded by the one rule :func:`gradsync.sparsify.seed_for` (config
seed, key, rank); every sparse job has its own collective (key ``job:<job>``), since Ok-Topk
and DenseStream carry state (thresholds, region boundaries) from step to step.
"""

from __future__ import annotations

from typing import Any

from gradsync import collectives, sparsify
from gradsync.engine.config import Config
from gradsync.schedule import schemes

__all__ = ["Components"]


class Components:
    """Sparsifiers and collectives, built on first use and kept with their state."""

    def __init__(self, cfg: Config, rank: int) -> None:
        spec = schemes.get(cfg.scheme)
        self.seed = cfg.seed
        self.rank = rank
        config = {kw: getattr(cfg, f) for kw, f in spec.sparsifier_config}
        if spec.sparsifier is None or any(v == 0 for v in config.values()):
            self.sparsifier_name, self.sparsifier_options = cfg.sparsifier, {}
        else:
            self.sparsifier_name = spec.sparsifier
            self.sparsifier_options = {**dict(spec.sparsifier_options), **config}
        self.collective_name = spec.collective
        self.collective_options = {**dict(spec.collective_kwargs),
                                   **{f: getattr(cfg, f) for f in spec.collective_options}}
        self.sparsifiers: dict[str, sparsify.Sparsifier] = {}
        self.collectives: dict[str, collectives.Collective] = {}
        self._dense: collectives.Collective | None = None

    def new_sparsifier(self, key: str, density: float) -> sparsify.Sparsifier:
        return sparsify.get(self.sparsifier_name, density=density,
                            seed=sparsify.seed_for(self.seed, key, self.rank),
                            **self.sparsifier_options)

    def new_collective(self, density: float | None = None) -> collectives.Collective:
        options = dict(self.collective_options)
        if density is not None and "density" in options:
            options["density"] = density
        # the ranks agree on each buffer's description once, not every step (every rank
        # passes the same buffers: the model and configuration were checked at construction)
        return collectives.get(self.collective_name, check_shapes="changes", **options)

    def sparsifier(self, key: str, density: float) -> sparsify.Sparsifier:
        """The sparsifier of ``key``; a new one when its planned density changed."""
        sp = self.sparsifiers.get(key)
        if sp is None or sp.density != density:
            sp = self.new_sparsifier(key, density)
            self.sparsifiers[key] = sp
        return sp

    def collective(self, key: str, density: float | None = None, name: str | None = None
                   ) -> collectives.Collective:
        """The collective of ``key``; ``density`` (DGC's warm-up) rebuilds one that selects at
        a density of its own (Ok-Topk, SparDL) when it differs; None means
        ``Config.density``. ``name`` ``"dense"``: the stateless all-reduce of a densified
        selection (``engine.jobs.at_density``), not kept."""
        if name == "dense":
            if self._dense is None:
                self._dense = collectives.get("dense", check_shapes="changes")
            return self._dense
        coll = self.collectives.get(key)
        if "density" in self.collective_options:
            want = self.collective_options["density"] if density is None else density
            if coll is not None and getattr(coll, "density", want) != want:
                coll = None
        if coll is None:
            coll = self.new_collective(density)
            self.collectives[key] = coll
        return coll

    def rescale(self, factor: float) -> None:
        """Thresholds kept in the gradients' units, by every sparsifier and collective, follow
        a loss scale that changed by ``factor``."""
        for component in (*self.sparsifiers.values(), *self.collectives.values()):
            component.rescale(factor)

    def state_dict(self) -> dict[str, Any]:
        """Every component's state, and the density each collective that selects on its own
        was built for (DGC's warm-up rebuilds one per period: :meth:`collective`)."""
        return {"sparsifiers": {k: s.state_dict() for k, s in self.sparsifiers.items()},
                "collectives": {k: c.state_dict() for k, c in self.collectives.items()},
                "collective_density": {k: c.density for k, c in self.collectives.items()
                                       if "density" in self.collective_options}}

    def loaded(self, state: dict[str, Any]) -> tuple[dict[str, sparsify.Sparsifier],
                                                     dict[str, collectives.Collective]]:
        """Build every component of ``state`` without changing this object (a bad entry
        raises here, before the engine changes); :meth:`install` puts them in place."""
        sparsifiers = {}
        for k, s in state["sparsifiers"].items():
            sp = self.new_sparsifier(k, s["density"])
            sp.load_state_dict(s)
            sparsifiers[k] = sp
        colls = {}
        built_for = state.get("collective_density", {})  # none before 04f07dc: the target
        for k, s in state.get("collectives", {}).items():  # none in older hook states
            c = self.new_collective(built_for.get(k))
            c.load_state_dict(s)
            colls[k] = c
        return sparsifiers, colls

    def install(self, built: tuple[dict[str, sparsify.Sparsifier],
                                   dict[str, collectives.Collective]]) -> None:
        self.sparsifiers, self.collectives = built
