"""What is live at one rehearsed rank's memory peak: every tracked storage by category and size.

`leantrain rehearse` reports memory by category (params, grads, optimizer, activations, temp) at the steady
step's peak. When the plan and the rehearsal disagree on a category, this lists what the rehearsal counted
there, so the gap can be named (how the interleaved grid row's 1 GiB was found to be FSDP's flat all-gather
buffer filed as an activation, 2026-12-03):

    python scripts/rehearsal_peak.py SPEC [--set key=value ...] [--rank 0] [--top 8]

Categories are torch MemTracker's: PARAM, BUFFER, GRAD, ACT, TEMP, OPT and OTH (the rehearsal's receive and
all-gather buffers, reported under temp in rehearsal.json). It runs the rank in this process at full depth.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any


def peak_storages(spec_path: Path, *, sets: list[str], rank: int) -> tuple[dict[str, Any], collections.Counter]:
    """(rehearsal.json's record of `rank`, a Counter of (category, bytes) → storages live at the peak)."""
    import leantrain.golive.rehearse as rehearse_module
    from leantrain.spec import load_spec

    live: collections.Counter = collections.Counter()
    make_tracker = rehearse_module.step_mem_tracker

    def tracker_listing_its_peak(**kwargs: Any) -> Any:
        tracker = make_tracker(**kwargs)
        update_peak = type(tracker)._update_peak_stats

        def update_peak_listing_storages(self: Any, peak_state: Any) -> None:
            before = dict(self._peak_mem)
            update_peak(self, peak_state)
            if self._peak_mem != before:  # a new peak: what is live now
                live.clear()
                for winfo, _ in list(self._WINFO.values()):
                    live[(str(winfo.reftype).rsplit(".", 1)[-1], winfo.mem_consumed)] += 1

        type(tracker)._update_peak_stats = update_peak_listing_storages
        return tracker

    rehearse_module.step_mem_tracker = tracker_listing_its_peak
    try:
        report = rehearse_module.rehearse(load_spec(spec_path, overrides=sets), ranks=[rank], isolated=False,
                                          depth="full")
    finally:
        rehearse_module.step_mem_tracker = make_tracker
    record = next(r for r in report["ranks"] if r["rank"] == rank)
    return record, live


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--set", dest="sets", action="append", default=[], help="spec override, key=value")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--top", type=int, default=8, help="largest size groups shown per category")
    args = parser.parse_args()
    record, live = peak_storages(args.spec, sets=args.sets, rank=args.rank)
    memory = record["memory_bytes"]
    print(f"rank {args.rank} (stage {record['pipeline_stage']}): " + ", ".join(
        f"{k} {v / 2**30:.3f} GiB" for k, v in memory.items()))
    for category in sorted({c for c, _ in live}):
        groups = sorted(((size, n) for (c, size), n in live.items() if c == category and size > 0),
                        key=lambda g: -g[0] * g[1])
        total = sum(size * n for size, n in groups) / 2**20
        shown = ", ".join(f"{n} × {size / 2**20:.1f} MiB" for size, n in groups[:args.top])
        print(f"{category:6} {total:10.1f} MiB: {shown}")


if __name__ == "__main__":
    main()
