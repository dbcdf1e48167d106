"""When a batched forward raises: find the request(s) that make it fail, so only they are ended."""

from __future__ import annotations

import logging

from kvserve.engine.sample.acceptance import StepResult
from kvserve.engine.runner import ModelRunner
from kvserve.engine.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)


def execute_isolating_failures(runner: ModelRunner, scheduled: SchedulerOutput) -> StepResult:
    """Prepare and run the step; if the batch raises, run each request alone and fail only those that fail
    alone.

    Re-running is safe: a failed step advanced no request, and its K/V writes
    land in the same slots again. If every request fails alone (a broken
    model), every one fails.
    """
    try:
        runner.begin_step(scheduled)
    except Exception as exc:  # the step's K/V moves or tables are in an unknown state: none of it runs
        log.error("preparing a step of %d requests failed (%s: %s); all of them fail",
                  len(scheduled.scheduled), type(exc).__name__, exc)
        return StepResult(failures={item.request_id: exc for item in scheduled.scheduled})
    try:
        return runner.execute(scheduled)
    except Exception as batch_error:
        if len(scheduled.scheduled) == 1:
            return StepResult(failures={scheduled.scheduled[0].request_id: batch_error})
        log.warning("a batched step of %d requests failed (%s: %s); retrying them one by one to find the culprit",
                    len(scheduled.scheduled), type(batch_error).__name__, batch_error)
    merged = StepResult()
    for item in scheduled.scheduled:
        try:
            merged.merge(runner.execute(SchedulerOutput(scheduled=[item])))
        except Exception as exc:
            merged.failures[item.request_id] = exc
    return merged

