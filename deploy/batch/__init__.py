"""Batch jobs: an OpenAI-format JSONL file of requests run against the ferry API as the `batch` SLO class.

Mental model: three pieces that meet only at two files. `format` defines the files (input lines
validated up front, output lines in OpenAI's batch output shape, and what an output file says is
already done). `runner` reads IN, skips what OUT already holds, sends the rest over HTTP with
bounded concurrency and appends one flushed line per finished request: it is the whole job, runs
as `python -m deploy.batch.runner` inside a Ray job or in-process (`--local`). `job` submits that
runner through Ray's job submission API and watches OUT grow to draw `progress`.

    ferry batch submit requests.jsonl --out results.jsonl            # a Ray job on the local cluster
    ferry batch submit requests.jsonl --out results.jsonl --local    # the same runner, in-process
"""

from deploy.batch.format import BatchInputError, BatchLine, BatchOutputError, load_done, read_input
from deploy.batch.runner import BatchReport, RunnerConfig, run_batch

__all__ = ["BatchInputError", "BatchLine", "BatchOutputError", "BatchReport", "RunnerConfig", "load_done",
           "read_input", "run_batch"]
