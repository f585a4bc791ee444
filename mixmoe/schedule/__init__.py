"""The 64-row block layout (see ``blocks``)."""

from mixmoe.schedule.blocks import BlockSchedule, build_block_schedule

__all__ = ["BlockSchedule", "build_block_schedule"]
