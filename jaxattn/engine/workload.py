"""A shared-prefix serving workload: multi-turn chats and few-shot prompts behind one
long system prompt (token ids only; no tokenizer needed).

* every request starts with the same ``system`` prompt;
* few-shot requests add the same block of worked examples, then their own question;
* chat ``c`` turn ``t`` is the whole previous turn (prompt + the model's answer) plus a
  new user message; it is queued the moment turn ``t - 1`` finishes, so chats of
  different progress run in the same batches (continuous batching).

This is the traffic a radix cache is for: the system prompt, the examples and every
chat's history are computed once and then served from the cache.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from .progress import ProgressBar

__all__ = ["Record", "Workload", "make_workload", "run_workload"]


@dataclasses.dataclass
class Workload:
    system: list[int]
    examples: list[int]
    questions: list[list[int]]  # one few-shot request each
    chats: list[list[list[int]]]  # per chat, the user message of each turn

    @property
    def num_requests(self) -> int:
        return len(self.questions) + sum(len(c) for c in self.chats)

    def initial_requests(self) -> list[tuple[str, tuple[int, int] | None, list[int]]]:
        """``(kind, chat and turn or None, prompt)`` of the requests queued before any
        answer, in order of submission: the first chat turns interleaved with the few-shot
        requests, as arriving traffic would be (later turns follow their answers)."""
        first = [("chat", (c, 0), self.system + msgs[0]) for c, msgs in enumerate(self.chats)]
        shots = [("few-shot", None, self.system + self.examples + q) for q in self.questions]
        return [r for pair in itertools.zip_longest(first, shots) for r in pair if r is not None]

    def longest_request(self, max_new_tokens: int) -> int:
        """The most tokens one request can reach, its answer included: the last turn of a
        chat whose earlier answers all ran to ``max_new_tokens`` (0 without requests)."""
        shots = [len(self.system) + len(self.examples) + len(q) for q in self.questions]
        turns = [
            len(self.system) + sum(len(m) for m in msgs) + (len(msgs) - 1) * max_new_tokens
            for msgs in self.chats
            if msgs
        ]
        return max(shots + turns, default=-max_new_tokens) + max_new_tokens


@dataclasses.dataclass
class Record:
    kind: str  # "few-shot" or "chat c turn t"
    prompt: list[int]
    output: list[int]
    seed: int
    finish_reason: str  # "stop", "length" or "error"
    error: str | None = None


def make_workload(
    vocab_size: int,
    *,
    seed: int = 0,
    system_tokens: int = 192,
    chats: int = 4,
    turns: int = 3,
    few_shot: int = 8,
    example_tokens: int = 96,
    message_tokens: tuple[int, int] = (8, 32),
) -> Workload:
    """Random token ids for the workload above (``message_tokens``: [low, high) length
    of a user message or few-shot question)."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(0, vocab_size, int(n)).tolist()

    def message():
        return tokens(rng.integers(*message_tokens))

    return Workload(
        system=tokens(system_tokens),
        examples=tokens(example_tokens),
        questions=[message() for _ in range(few_shot)],
        chats=[[message() for _ in range(turns)] for _ in range(chats)],
    )


def run_workload(
    engine,
    workload: Workload,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = False,
) -> list[Record]:
    """Serve the whole workload on ``engine``; return one record per request, in order of
    completion. Request ``i`` (in order of submission) samples with seed ``seed + i``."""
    records: list[Record] = []
    submitted = 0

    def submit(kind, prompt, extra):
        nonlocal submitted
        engine.add_request(
            prompt,
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed + submitted,
            tag=(kind, extra, seed + submitted),
        )
        submitted += 1

    for kind, extra, prompt in workload.initial_requests():
        submit(kind, prompt, extra)
    bar = ProgressBar(workload.num_requests, label="serving", enabled=progress)
    while engine.has_work():
        for seq in engine.step():
            kind, extra, req_seed = seq.tag
            prompt = seq.tokens[: seq.prompt_len]
            label = kind if kind == "few-shot" else f"chat {extra[0]} turn {extra[1]}"
            records.append(
                Record(label, prompt, seq.output, req_seed, seq.finish_reason, seq.error)
            )
            if kind == "chat":
                c, t = extra
                if t + 1 < len(workload.chats[c]):
                    submit("chat", prompt + seq.output + workload.chats[c][t + 1], (c, t + 1))
        if progress:
            # The statistics snapshot costs ~0.2 ms of host time: taken only for the bar.
            stats = engine.stats
            tokens_s = stats["generated_tokens"] / max(stats["time_s"], 1e-9)
            bar.update(
                len(records),
                tokens=stats["generated_tokens"],
                cached=stats["prefix_hit_tokens"],
                tok_s=f"{tokens_s:.0f}",
            )
    if progress:
        bar.close(len(records), tokens=engine.stats["generated_tokens"])
    return records
