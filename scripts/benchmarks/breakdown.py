"""Where a step's time goes, read from ``torch.profiler`` events (nothing in hf_zeropp is wrapped or patched).

hf_zeropp opens a profiler range around each call of its all-gather hook (``hf_zeropp.comm.qwz.PROFILER_RANGE``,
qwZ when on, else the plain gather) and of its gradient reduce-scatter hook (``hf_zeropp.comm.qgz.PROFILER_RANGE``,
qgZ when on, else the plain reduce-scatter); its quantization kernels are torch custom ops, so each call shows
as ``hf_zeropp::quantize``, ``hf_zeropp::dequantize``, ``hf_zeropp::swizzle_quantize``,
``hf_zeropp::dequant_reduce_quant`` or ``hf_zeropp::dequant_reduce`` (the plain-torch reference backend opens
ranges with the same names). :func:`profile_steps` records the CPU events of some steps and :func:`attribute`
turns them into the sections the report shows:

* ``gather call`` / ``reduce call``: wall time inside the hook ranges (outermost range of that name);
* ``gather kernels`` / ``reduce kernels``: kernel events inside those ranges (same thread, interval containment;
  only outermost kernel events count, so a kernel that calls another, or an op inside a same-named range, is
  counted once); ``other kernels``: kernel events outside both;
* per kernel name, the same kernel seconds (``kernels``), and the number of events per name (``events``).

:func:`phases` reads where the step waits from FSDP2's own ranges, inside the forward and the backward (the
benchmark worker's ranges around the two passes): ``FSDP::pre_forward`` (a unit's forward waits
for its gather, prefetched or not, and the qwZ dequantize that runs in the gather's wait), ``FSDP::pre_backward``
(the same in backward: hpZ's gather), ``FSDP::post_backward_reduce`` (the gradient reduce-scatter, qgZ's two hops
included, which FSDP2 calls synchronously on CPU) and ``Optimizer.step``. A pass's compute is its time less its waits.

A hf_zeropp whose kernels are not yet visible to the profiler simply yields no kernel events: the call sections
are still right, the kernel sections are 0 and ``events`` shows that no ``hf_zeropp::`` event was seen (the
report then prints "-" for the kernel columns instead of 0).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

KERNEL_PREFIX = "hf_zeropp::"
KERNELS = tuple(KERNEL_PREFIX + name for name in
                ("quantize", "dequantize", "swizzle_quantize", "dequant_reduce_quant", "dequant_reduce"))
SECTIONS = ("gather", "reduce")


def section_ranges() -> dict[str, str]:
    """Profiler range name -> report section, from hf_zeropp's own constants."""
    from hf_zeropp.comm import qgz, qwz

    return {qwz.PROFILER_RANGE: "gather", qgz.PROFILER_RANGE: "reduce"}


def is_kernel(name: str) -> bool:
    """Any op of hf_zeropp's namespace counts as a kernel (the five above today)."""
    return name.startswith(KERNEL_PREFIX)


def profile_steps(run: Callable[[], Any]):
    """Run ``run()`` under a CPU ``torch.profiler.profile`` and return its events (a list of FunctionEvent)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False, profile_memory=False,
                 with_stack=False) as prof:
        run()
    return list(prof.events())


FORWARD_RANGE, BACKWARD_RANGE = "bench::forward", "bench::backward"  # the worker's own, around the two passes
PHASES = {FORWARD_RANGE: "forward", "FSDP::pre_forward": "forward gather waits", BACKWARD_RANGE: "backward",
          "FSDP::pre_backward": "backward gather waits", "FSDP::post_backward_reduce": "gradient reduce",
          "Optimizer.step": "optimizer step"}


def phases(events: Iterable) -> dict[str, float]:
    """Seconds per phase of :data:`PHASES` (range names matched by prefix, FSDP2 adds the unit's name; only the
    outermost range of a phase on a thread counts)."""
    seconds = dict.fromkeys(PHASES.values(), 0.0)
    by_thread: dict[Any, list] = collections.defaultdict(list)
    for event in events:
        phase = next((name for prefix, name in PHASES.items() if event.name.startswith(prefix)), None)
        if phase is not None:
            by_thread[getattr(event, "thread", 0)].append((event.time_range.start, event.time_range.end, phase))
    for spans in by_thread.values():
        open_until: dict[str, float] = {}
        for start, end, phase in sorted(spans, key=lambda span: (span[0], -span[1])):
            if start >= open_until.get(phase, float("-inf")):
                seconds[phase] += (end - start) / 1e6
                open_until[phase] = end
    return seconds


def attribute(events: Iterable, ranges: dict[str, str] | None = None) -> dict[str, dict]:
    """Seconds per section (see the module docstring) from profiler events.

    ``events`` need ``name``, ``thread`` and ``time_range.start`` / ``time_range.end`` in microseconds (what
    ``torch.profiler`` FunctionEvents have); ``ranges`` maps range names to sections (default: hf_zeropp's).
    Returns ``{"seconds": {section: s}, "kernels": {kernel name: s}, "events": {name: count}}`` where seconds always
    has ``gather call``, ``gather kernels``, ``reduce call`` and ``reduce kernels`` (``other kernels`` when any).
    """
    ranges = section_ranges() if ranges is None else ranges
    seconds: dict[str, float] = {f"{section} {part}": 0.0 for section in SECTIONS for part in ("call", "kernels")}
    kernels: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()
    by_thread: dict[Any, list] = collections.defaultdict(list)
    for event in events:
        if event.name in ranges or is_kernel(event.name):
            by_thread[getattr(event, "thread", 0)].append(event)
    for thread_events in by_thread.values():
        # outer before inner: by start, then the longer first; ranges on one thread nest (RecordFunction is a stack)
        thread_events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        stack: list = []  # the events enclosing the current one, outermost first
        for event in thread_events:
            start, end = event.time_range.start, event.time_range.end
            while stack and not (stack[-1].time_range.start <= start and end <= stack[-1].time_range.end):
                stack.pop()
            counts[event.name] += 1
            seconds_spent = (end - start) / 1e6
            if event.name in ranges:
                section = ranges[event.name]
                if not any(ranges.get(outer.name) == section for outer in stack):
                    seconds[f"{section} call"] += seconds_spent
            elif not any(is_kernel(outer.name) for outer in stack):
                section = next((ranges[outer.name] for outer in reversed(stack) if outer.name in ranges), "other")
                seconds[f"{section} kernels"] = seconds.get(f"{section} kernels", 0.0) + seconds_spent
                kernels[event.name] += seconds_spent
            stack.append(event)
    return {"seconds": seconds, "kernels": dict(kernels), "events": dict(counts)}
