"""``fmoe.LoRA``: what a Plan's low-rank adapters are (``fmoe/lora_sites.py``: which matrices
they adapt; ``fmoe/lora.py`` builds and trains them)."""

from __future__ import annotations

import dataclasses

from .checks import check_finite, check_int, fail

TARGETS = ("q", "k", "v", "out", "experts", "shared", "mlp", "q_down", "q_up", "kv_down", "kv_up")


@dataclasses.dataclass(frozen=True)
class LoRA:
    """Low-rank adapters on a Plan's model (``Plan.lora``).

    Attributes:
        rank: ``r``, the adapters' inner width (>= 1).
        alpha: the adapters' output is scaled by ``alpha / rank`` (> 0).
        targets: the matrices adapted, from ``q``, ``k``, ``v``, ``out``, ``experts``,
            ``shared``, ``mlp`` and the latent attention's ``q_down``, ``q_up``,
            ``kv_down``, ``kv_up``.
    """

    rank: int = 16
    alpha: float = 32.0
    targets: tuple = ("q", "k", "v", "out", "experts")

    def __post_init__(self):
        check_int("LoRA.rank", self.rank, 1, builtin=True)
        check_finite("LoRA.alpha", self.alpha, positive=True)
        targets = self.targets
        if isinstance(targets, str) or not isinstance(targets, (tuple, list)) or not targets:
            fail("LoRA.targets", targets, f"a non-empty tuple of names from {TARGETS}")
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or len(set(targets)) != len(targets):
            fail("LoRA.targets", targets, f"each name once, from {TARGETS}"
                 + (f" ({', '.join(map(repr, unknown))} unknown)" if unknown else ""))
        object.__setattr__(self, "targets", tuple(targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
