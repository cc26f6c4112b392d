"""Dataset statistics: what was read, kept, cut, dropped and packed.

Every record that does not reach training is counted under a reason, so that a report can
show that nothing was lost silently.
"""

from __future__ import annotations

import attrs


@attrs.define
class DataStats:
    """Counters of one pass (or of a stream so far); all plain ints, so they checkpoint as JSON."""

    records: int = 0  # valid records tokenized
    bad_records: int = 0  # malformed records skipped (on_bad_record = "skip")
    samples: int = 0  # samples kept for training
    tokens: int = 0  # tokens of the kept samples
    trained_tokens: int = 0  # tokens whose label is trained (targets, after the shift)
    dropped_too_long: int = 0  # longer than max_seq_len under truncation = "drop"
    truncated: int = 0  # cut to max_seq_len under truncation = "truncate"
    dropped_no_trained: int = 0  # would keep no trained token (never trained all-masked)
    empty_assistant_turns: int = 0  # assistant turns with no content, tool calls or reasoning: not trained
    weight_zero_turns: int = 0  # assistant turns the data gives weight 0: context, not trained
    sequences: int = 0  # packed sequences (bins) built
    sequence_capacity: int = 0  # sequences * max_seq_len

    @property
    def dropped(self) -> int:
        return self.dropped_too_long + self.dropped_no_trained

    @property
    def trained_fraction(self) -> float:
        return self.trained_tokens / self.tokens if self.tokens else 0.0

    @property
    def packing_efficiency(self) -> float:
        """Share of the packed sequences' capacity filled by tokens (1.0 = no padding)."""
        return self.tokens / self.sequence_capacity if self.sequence_capacity else 0.0

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)

    def load(self, counters: dict[str, int]) -> None:
        for name, value in counters.items():
            if hasattr(self, name):
                setattr(self, name, int(value))

    def warnings(self) -> list[str]:
        """One line per thing in these counts worth a user's look (``pgs data inspect``, ``pgs validate``)."""
        out = []
        if self.empty_assistant_turns:
            n = self.empty_assistant_turns
            out.append(f"{n} empty assistant turn{'s' if n != 1 else ''} (no content, tool calls or reasoning) "
                       "left untrained; fill or remove them in the data")
        return out

    def summary(self) -> list[tuple[str, str]]:
        """``(name, value)`` rows for a report."""
        return [
            ("records read", f"{self.records}"),
            ("bad records skipped", f"{self.bad_records}"),
            ("samples kept", f"{self.samples}"),
            ("tokens", f"{self.tokens}"),
            ("trained tokens", f"{self.trained_tokens} ({self.trained_fraction:.1%})"),
            ("dropped: too long", f"{self.dropped_too_long}"),
            ("dropped: no trained token", f"{self.dropped_no_trained}"),
            ("truncated", f"{self.truncated}"),
            ("empty assistant turns (not trained)", f"{self.empty_assistant_turns}"),
            ("weight-0 assistant turns (not trained)", f"{self.weight_zero_turns}"),
            ("packed sequences", f"{self.sequences}"),
            ("packing efficiency", f"{self.packing_efficiency:.1%}"),
        ]
