"""One request as an engine answered it: its output and the engine's own acceptance counts, with
the same keys whichever engine answered (a key the engine does not report is None). Each engine's
``result()`` fills one :class:`Answer`; the engine phase reads the dict :meth:`Answer.as_dict` gives."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Answer:
    output_ids: list[int]
    prompt_ids: list[int] | None          # the ids the engine rendered (a chat request), else None
    finish_reason: str | None
    completion_tokens: int
    wall_s: float                         # client side, HTTP included
    engine_timing: dict                   # the engine's own timing fields, as it names them
    # τ as the engine counts it: tokens / cycles (vLLM: drafts + accepted over drafts; SGLang:
    # completion tokens over verify steps, the prefill's token included)
    cycles: int | None = None
    tokens: int | None = None
    drafts: int | None = None             # verify steps that had drafts
    draft_tokens: int | None = None       # drafts proposed (SGLang: verify steps × K, verified or not)
    accepted: int | None = None           # draft tokens accepted
    accepted_per_pos: list[int] | None = None   # steps that accepted more than k drafts, k = 0..K-1
    histogram: list[int] | None = None    # steps by drafts accepted, 0..K
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None
    tau: float | None = None              # the engine's own figure
    num_speculative_tokens: int | None = None
    metrics_delta: dict | None = None     # the same counts as the server's metrics moved during the request

    @property
    def tokens_per_s(self) -> float | None:
        return len(self.output_ids) / self.wall_s if self.wall_s > 0 else None

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}
