"""The decode schedule of one engine, for the time plan's generation (rlhf_hpc.planning.time_plan):
how many decode steps run with how many sequences and how much KV cache, given the responses'
lengths and the batch the engine holds.

A step's lengths are known only by their mean and their longest (the dry run: ``plan.response_length``
and ``data.max_response_length``; a run: its ``response_length/mean`` and ``/max``). Their spread is
assumed: an exponential truncated at the longest, its rate solved for the mean (a uniform spread when
the mean is half the longest, rising towards the longest above that; every response at the longest
when the mean is). RL rollouts of chat models are spread so: many short answers, a tail that runs to
the cap. The spread matters twice: KV-cache reads grow with the mean of squared lengths, not the
squared mean, and the batch thins as responses finish, leaving the longest ones to decode nearly alone.

A paged engine (vLLM) batches continuously: requests start in their given order as slots free, up to
``batch`` at once. An engine without paging (transformers' ``generate``) runs all its rows as one
batch until the longest is done, finished rows included.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

__all__ = ["DecodeSegment", "decode_segments", "response_lengths"]


def _truncated_exponential_mean(rate: float, longest: float) -> float:
    x = rate * longest
    if abs(x) < 1e-6:
        return longest / 2
    return longest * (1 / x - 1 / math.expm1(x))


def response_lengths(rows: int, mean: float, longest: int) -> list[int]:
    """``rows`` response lengths with ``mean`` on average and ``longest`` the longest: the quantiles of
    an exponential truncated at ``longest`` whose mean is ``mean`` (the rate by bisection)."""
    if rows <= 0:
        return []
    longest = max(int(longest), 1)
    mean = min(max(mean, 1.0), float(longest))
    if rows == 1 or mean >= longest - 0.5:
        return [longest] * rows
    lo, hi = -700.0 / longest, 700.0 / longest  # the mean falls as the rate rises
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _truncated_exponential_mean(mid, longest) > mean else (lo, mid)
    rate = (lo + hi) / 2
    if abs(rate * longest) < 1e-6:
        values = [(i + 0.5) / rows * longest for i in range(rows)]
    else:
        top = -math.expm1(-rate * longest)
        values = [-math.log1p(-(i + 0.5) / rows * top) / rate for i in range(rows)]
    values[-1] = float(longest)  # the step's longest response is the cap (or what a run measured)
    rest = sum(values[:-1])
    if rest > 0:  # the others rescaled so the mean is the given one
        scale = max(mean * rows - longest, 0.0) / rest
        values[:-1] = [min(v * scale, longest) for v in values[:-1]]
    return [max(1, round(v)) for v in values]


@dataclass(frozen=True)
class DecodeSegment:
    """``steps`` decode steps with ``sequences`` in the batch and ``context`` tokens of KV cache in all
    (summed over the sequences; the mean over the segment's steps)."""

    steps: int
    sequences: int
    context: float


def decode_segments(lengths: list[int], prompt: float, batch: int, continuous: bool = True) -> list[DecodeSegment]:
    """The decode steps of responses of ``lengths`` after prompts of ``prompt`` tokens, at most ``batch``
    at once, in segments of a constant batch. ``continuous``: a finished response's slot takes the next
    request at once (vLLM); else the rows run as waves of ``batch`` until each wave's longest is done
    (transformers' ``generate``), finished rows still in the batch. The requests' order is a fixed
    shuffle (a step's responses are not sorted by length)."""
    if not lengths:
        return []
    order = list(lengths)
    random.Random(0).shuffle(order)
    batch = max(1, int(batch))
    segments: list[DecodeSegment] = []
    if not continuous:
        for start in range(0, len(order), batch):
            wave = order[start : start + batch]
            steps = max(wave)
            segments.append(DecodeSegment(steps, len(wave), len(wave) * (prompt + (steps - 1) / 2)))
        return segments
    queue = iter(order[batch:])
    active = [(length, 0) for length in order[:batch]]  # (the step it finishes at, the step it started at)
    heapq.heapify(active)
    started_sum = now = 0
    while active:
        end = active[0][0]
        if end > now:
            b = len(active)
            middle = (now + end - 1) / 2  # (the steps' mean position: the context is exact)
            segments.append(DecodeSegment(end - now, b, b * prompt + b * middle - started_sum))
            now = end
        while active and active[0][0] == now:
            _, start = heapq.heappop(active)
            started_sum -= start
            length = next(queue, None)
            if length is not None:
                heapq.heappush(active, (now + length, now))
                started_sum += now
    return segments
