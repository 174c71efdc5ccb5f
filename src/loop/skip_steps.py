"""trainer.skip_steps: optimizer steps whose batches are read and dropped untrained.

A loss spike that some batches caused comes back when the run is resumed from a checkpoint before it, since a
resume replays the same batches exactly. Large runs pass over that data instead: PaLM restarted about 100 steps
before a spike and skipped 200-500 batches; Megatron-LM has --skip-train-iteration-range. Here a skipped step
keeps its number: its window of micro-batches is read (the data position moves on as after a trained step), the
LR schedule takes its step (TrainStep.pass_over), and nothing else happens. So every later step trains the
batches, at the rate, that it would have had, and a resume inside or after a range is as exact as any other.
"""

import logging

log = logging.getLogger(__name__)


class SkipSteps:
    def __init__(self, ranges, is_main_process: bool = True):
        """`ranges`: trainer.skip_steps, [first, last] pairs of step numbers as the logs give them (checked by
        src/schema/complete.py: 1 <= first <= last); overlapping or adjacent ones are joined."""
        self.ranges: list[tuple[int, int]] = []
        for first, last in sorted((int(first), int(last)) for first, last in ranges):
            if self.ranges and first <= self.ranges[-1][1] + 1:
                self.ranges[-1] = (self.ranges[-1][0], max(last, self.ranges[-1][1]))
            else:
                self.ranges.append((first, last))
        self.is_main_process = is_main_process
        self.announced: set[tuple[int, int]] = set()

    def covers(self, step: int) -> bool:
        """Whether step number `step` (1 for a run's first) is one to drop; the log says so once per range."""
        for first, last in self.ranges:
            if first <= step <= last:
                if self.is_main_process and (first, last) not in self.announced:
                    log.warning("trainer.skip_steps: steps %d-%d read their batches and drop them untrained (the LR "
                                "schedule moves through them); training again from step %d", step, last, last + 1)
                self.announced.add((first, last))
                return True
        return False
