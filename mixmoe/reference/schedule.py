"""Loop definition of the block layout (twin of ``mixmoe.schedule.blocks``)."""

from __future__ import annotations


def reference_block_schedule(
    seg_counts: list[int], seg_slots: list[int], block_size: int = 64
) -> dict[str, list[int]]:
    """Walk the segments in order; every segment of c rows yields ceil(c / B) blocks of B rows,
    the last one holding the remainder. Returns plain lists."""
    out: dict[str, list[int]] = {
        "block_slot": [],
        "block_seg": [],
        "block_row_start": [],
        "block_rows": [],
        "src": [],
    }
    row = 0
    for seg, (count, slot) in enumerate(zip(seg_counts, seg_slots, strict=True)):
        start = 0
        while start < count:
            rows = min(block_size, count - start)
            out["block_slot"].append(slot)
            out["block_seg"].append(seg)
            out["block_row_start"].append(row + start)
            out["block_rows"].append(rows)
            for lane in range(block_size):
                out["src"].append(row + start + lane if lane < rows else -1)
            start += block_size
        row += count
    return out
