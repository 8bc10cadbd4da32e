"""`kda.explain(...)`'s report: every backend, chosen or not, and the reasons."""

from __future__ import annotations

from dataclasses import dataclass, field

from kda.dispatch import Decision


@dataclass
class Explanation:
    decision: Decision
    not_requested: list[str] = field(default_factory=list)

    @property
    def chosen(self) -> str | None:
        return None if self.decision.chosen is None else self.decision.chosen.name

    @property
    def ranking(self) -> str:
        """How the usable backends were ordered: the timings used, or why priority decided."""
        if self.decision.requested is not None:
            return "the order the call asked for"
        if self.decision.ranking is not None:
            return self.decision.ranking.describe()
        if sum(seen.usable for seen in self.decision.considered) <= 1:
            return "nothing to rank (at most one usable backend)"
        return "by static priority (no timing table for this GPU near this shape; see `python -m kda.bench --tune`)"

    def rows(self) -> list[tuple[str, str, str]]:
        """(backend, outcome, reasons) for each registered backend."""
        rows = []
        for seen in self.decision.considered:
            if self.decision.chosen is not None and seen.backend == self.decision.chosen.name:
                outcome = "CHOSEN"
            elif seen.usable:
                outcome = f"usable, ranked #{(seen.rank or 0) + 1}"
            else:
                outcome = "rejected"
            detail = "; ".join(f"{name}: {verdict}" for name, verdict in seen.checks.items())
            rows.append((seen.backend, outcome, detail))
        for name in self.not_requested:
            rows.append((name, "not requested", "the call named other backends"))
        return rows

    def __str__(self) -> str:
        spec = self.decision.spec
        what = "auto" if self.decision.requested is None else " -> ".join(self.decision.requested)
        lines = [
            f"kda.explain: {spec.summary()}",
            f"requested: {what}   verification: KDA_VERIFY={self.decision.verify_mode}",
            f"chosen: {self.chosen or 'none (the call would raise BackendSelectionError)'}",
            f"ranking: {self.ranking}",
        ]
        width = max((len(r[0]) for r in self.rows()), default=0)
        for name, outcome, detail in self.rows():
            lines.append(f"  {name:<{width}}  {outcome}")
            if detail:
                lines.append(f"  {'':<{width}}    {detail}")
        return "\n".join(lines)

    __repr__ = __str__
